"""The timeline trace (utils/trace.py) against the run it records: a step slice per scheduler step with
the batch the scheduler ran, every request's flow from arrival to its answer, counters that keep the
KV-page accounting, and tracks whose slices nest. Offline, through the chapter's example, and through
a real `python -m minisgl --trace` server driven by the openai client."""

from __future__ import annotations

import glob
import json
import runpy
import sys
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
from test_server import SERVER_ARGS, Server
from tiny import assert_nothing_held, random_prompts

from minisgl.core import Batch, SamplingParams
from minisgl.env import ENV
from minisgl.llm import LLM
from minisgl.utils.trace import TRACE

Event = dict[str, Any]
ENDS = {"answer", "reply", "abort"}  # where a request's flow may end: its answer, or an abort after it


@pytest.fixture(autouse=True)
def _plain_loop_and_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", True)
    monkeypatch.setattr(ENV.DEBUG_CHECK_INTEGRITY, "value", True)


# ---- reading a trace --------------------------------------------------------------------------
def load(path: str) -> list[Event]:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    assert not glob.glob(glob.escape(path) + ".*.part"), "the parts were not merged away"
    assert_well_formed(events)
    return events


def assert_well_formed(events: list[Event]) -> None:
    """Per track, timestamps never go back and slices nest; every flow point lies inside a slice of its track."""
    tracks: dict[tuple[int, int], list[Event]] = defaultdict(list)
    for e in events:
        if e["ph"] != "M":
            tracks[e["pid"], e["tid"]].append(e)
    for track in tracks.values():
        times = [e["ts"] for e in track]
        assert times == sorted(times)
        slices = [e for e in track if e["ph"] == "X"]
        open_ends: list[int] = []
        for s in slices:
            while open_ends and open_ends[-1] <= s["ts"]:
                open_ends.pop()
            assert not open_ends or s["ts"] + s["dur"] <= open_ends[-1], f"{s} overlaps its parent"
            open_ends.append(s["ts"] + s["dur"])
        for p in (e for e in track if e["ph"] in "stf"):
            assert any(s["ts"] < p["ts"] < s["ts"] + s["dur"] for s in slices), f"{p} is in no slice"


def flows(events: list[Event]) -> dict[int, list[Event]]:
    """Flow id -> its points in time order."""
    out: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        if e["ph"] in "stf":
            out[e["id"]].append(e)
    return out


def steps_of(flow: list[Event]) -> list[str]:
    return [p["args"]["step"] for p in flow]


def assert_complete(flow: list[Event]) -> None:
    """From arrival ("s") to an answer or abort ("f", bound to its enclosing slice)."""
    assert [p["ph"] for p in flow] == ["s"] + ["t"] * (len(flow) - 2) + ["f"], steps_of(flow)
    assert flow[0]["args"]["step"] == "arrival" and flow[-1]["args"]["step"] in ENDS, steps_of(flow)
    assert flow[-1]["bp"] == "e"


def process_names(events: list[Event]) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}


def host_steps(events: list[Event]) -> list[Event]:
    """The step slices of the scheduler's host track, in time order."""
    return [
        e for e in events if e["ph"] == "X" and e["name"] in ("prefill", "decode") and "kind" in e["args"]
    ]


def device_steps(events: list[Event]) -> list[Event]:
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    return [e for e in events if e["ph"] == "X" and names.get(e["tid"], "").startswith("device")]


def counters(events: list[Event], name: str) -> list[dict[str, float]]:
    return [e["args"] for e in events if e["ph"] == "C" and e["name"] == name]


def assert_counters_keep_the_page_accounting(events: list[Event], num_pages: int) -> None:
    """What check_integrity asserts after each step: every KV page is free, cached or held."""
    pages = counters(events, "kv pages")
    assert pages and all(p["free"] + p["cached"] + p["held"] == num_pages for p in pages)
    assert counters(events, "requests")[-1] == {"running": 0, "waiting": 0}
    assert pages[-1]["held"] == 0


def record_batches(llm: LLM) -> list[tuple[str, int, int, list[int]]]:
    seen: list[tuple[str, int, int, list[int]]] = []

    def observe(batch: Batch | None) -> None:
        if batch is not None:
            seen.append(
                (batch.phase, batch.size, sum(r.extend_len for r in batch.reqs), [r.uid for r in batch.reqs])
            )

    llm.step_observers.append(observe)
    return seen


# ---- offline ----------------------------------------------------------------------------------
def test_offline_trace_records_every_step_request_and_counter(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM], tmp_path: Any
) -> None:
    path = str(tmp_path / "run.json")
    # three rows and a 32-token prefill budget: requests wait, long prompts are chunked
    llm = make_llm(
        tiny_model("llama"), max_running_req=3, max_extend_tokens=32, trace=path, enable_mixed_chunk=False
    )
    batches = record_batches(llm)
    prompts = random_prompts(6, seed=1, min_len=4, max_len=50)
    too_long = [5] * 600
    first = llm.generate([*prompts, too_long], SamplingParams(max_tokens=5, ignore_eos=True))
    first_batches = list(batches)

    def abort_2(batch: Batch | None) -> None:
        if batch is not None and batch.is_decode and any(r.uid == 2 for r in batch.reqs):
            llm.abort(2)

    # the same prompts again: their prefixes come from the cache; one is aborted while it decodes
    llm.step_observers.append(abort_2)
    second = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    assert_nothing_held(llm)
    num_pages = llm.cache_manager.num_pages
    llm.shutdown()
    events = load(path)

    names = process_names(events)
    assert list(names.values()) == ["offline LLM"]
    # one step slice per step, with the batch the scheduler ran, and its time on the device
    steps = host_steps(events)
    assert [
        (s["args"]["kind"], s["args"]["batch_size"], s["args"]["tokens"], s["args"]["uids"]) for s in steps
    ] == batches
    assert [s["args"]["step"] for s in steps] == list(range(1, len(batches) + 1))
    device = device_steps(events)
    assert [(d["name"], d["args"]["step"], d["dur"]) for d in device] == [
        (s["name"], s["args"]["step"], s["args"]["device_us"]) for s in steps
    ]
    assert all(s["args"]["prepare_us"] > 0 for s in steps)
    assert any(s["args"]["chunked"] for s in steps if s["args"]["kind"] == "prefill")
    assert sum(s["args"]["cached_tokens"] for s in steps[: len(first_batches)]) == 0
    assert sum(s["args"]["cached_tokens"] for s in steps[len(first_batches) :]) > 0  # the second call's hits

    # every request of both calls: one complete flow, its chunks as the steps ran them
    all_flows = sorted(flows(events).values(), key=lambda f: f[0]["ts"])
    assert len(all_flows) == len(first) + len(second)
    calls = [first_batches] * len(first) + [batches[len(first_batches) :]] * len(second)
    for flow, out, call in zip(all_flows, [*first, *second], calls):
        assert_complete(flow)
        s = steps_of(flow)
        assert s.count("answer") == 1 and flow[s.index("answer")]["args"]["detail"] == out["finish_reason"]
        if out["finish_reason"] == "error":
            assert s == ["arrival", "refused", "answer"]
            continue
        # queued, each chunk, the last chunk ("prefill"), then the first token
        uid = flow[0]["args"]["uid"]
        prefills = [b for b in call if b[0] == "prefill" and uid in b[3]]
        assert s[: 3 + len(prefills)] == [
            "arrival",
            "queued",
            *["chunk"] * (len(prefills) - 1),
            "prefill",
            "first token",
        ]
        if out["finish_reason"] == "abort":
            assert s[-2:] == ["abort", "answer"]
        else:
            assert s[-2:] == ["finish", "answer"]
    assert [o["finish_reason"] for o in first] == ["length"] * 6 + ["error"]
    assert [o["finish_reason"] for o in second] == ["length"] * 2 + ["abort"] + ["length"] * 3

    assert_counters_keep_the_page_accounting(events, num_pages)
    assert counters(events, "prefix cache")[-1]["hit rate"] > 0
    assert not TRACE.on


def test_tracing_is_off_without_a_path(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ENV.TRACE, "value", "")
    llm = make_llm(tiny_model("llama"), max_running_req=2)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert not TRACE.on


def test_the_chapter_example_writes_its_trace(
    tiny_model: Callable[[str], str], monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    path = str(tmp_path / "ch07.json")
    monkeypatch.setattr(sys, "argv", ["ch07_scheduler.py", tiny_model("qwen3"), "--trace", path])
    runpy.run_path("examples/ch07_scheduler.py", run_name="__main__")
    events = load(path)
    steps = host_steps(events)
    assert [(s["args"]["kind"], s["args"]["batch_size"]) for s in steps] == [("prefill", 5)] + [
        ("decode", n) for n in (4, 3, 3, 2, 1)
    ]
    all_flows = flows(events)
    assert len(all_flows) == 5
    for flow in all_flows.values():
        assert_complete(flow)


# ---- the server -------------------------------------------------------------------------------
def test_server_trace_follows_each_request_through_the_three_processes(
    tiny_model: Callable[[str], str], monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    path = str(tmp_path / "server.json")
    monkeypatch.setenv("MINISGL_DEBUG_CHECK_INTEGRITY", "1")
    server = Server(["--model", tiny_model("llama"), *SERVER_ARGS, "--trace", path])
    try:
        client = server.client()
        model = client.models.list().data[0].id
        usage = []
        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hello world"}],
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        usage.append(chat.usage.completion_tokens)
        stream = client.completions.create(
            model=model,
            prompt="The capital of France is",
            max_tokens=8,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert sum(1 for _ in stream) > 0
        usage.append(8)
        with pytest.raises(Exception, match="prompt tokens"):
            client.completions.create(model=model, prompt="a " * 600, max_tokens=2)
        num_pages = server.metrics()["minisgl_kv_pages_total"]
    finally:
        assert server.stop() == 0
    events = load(path)

    names = process_names(events)
    assert sorted(names.values()) == ["API server", "scheduler rank 0", "tokenizer worker"]
    pid = {name: p for p, name in names.items()}
    all_flows = sorted(flows(events).values(), key=lambda f: f[0]["ts"])
    assert len(all_flows) == 3
    for flow in all_flows:
        assert_complete(flow)
    where = [[(names[p["pid"]], p["args"]["step"]) for p in flow] for flow in all_flows]
    for w in where[:2]:
        assert w[:3] == [
            ("API server", "arrival"),
            ("tokenizer worker", "tokenize"),
            ("scheduler rank 0", "queued"),
        ]
        assert ("scheduler rank 0", "finish") in w and ("tokenizer worker", "detokenize") in w
        assert w[-1] == ("API server", "reply")
    assert where[2] == [("API server", "arrival"), ("API server", "reply")]  # refused by the tokenizer worker

    # each request is in one step per token it was given: its prefill, then its decode steps
    steps = host_steps(events)
    assert all(s["pid"] == pid["scheduler rank 0"] for s in steps)
    for flow, tokens in zip(all_flows, usage):
        uid = flow[0]["args"]["uid"]
        assert sum(uid in s["args"]["uids"] for s in steps) == tokens
    assert len(device_steps(events)) == len(steps)
    assert any(e["name"] == "tokenize" and e["pid"] == pid["tokenizer worker"] for e in events)
    assert any(e["name"] == "detokenize" and e["pid"] == pid["tokenizer worker"] for e in events)
    assert_counters_keep_the_page_accounting(events, num_pages)


def test_the_timeline_summary_adds_the_run_up(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM], tmp_path: Any
) -> None:
    """benchmark/offline/trace_steps.py's timeline: the run's wall time is the device's steps plus its idle time
    before, between and after them, on a synthetic trace with known gaps and on a real one."""
    timeline = runpy.run_path("benchmark/offline/trace_steps.py")["timeline"]
    device = 1 << 30

    def step(name: str, ts: int, dur: int) -> Event:
        return {
            "ph": "X",
            "name": name,
            "ts": ts,
            "dur": dur,
            "pid": 1,
            "tid": device + 1,
            "args": {"step": ts},
        }

    answer = {"ph": "f", "name": "request", "ts": 1_000, "pid": 1, "tid": 1, "args": {"step": "answer"}}
    events = [
        {"ph": "X", "name": "arrival", "ts": 100, "dur": 5, "pid": 1, "tid": 1},
        step("prefill", 150, 200),  # 50 idle before the first step
        step("prefill", 400, 100),  # 50 idle before a prefill
        step("decode", 530, 100),  # 30 idle before a decode
        step("decode", 630, 300),  # back to back
        answer,  # 70 idle after the last step
    ]
    t = timeline(events)
    assert (t["prefill_steps"], t["decode_steps"]) == (2, 2)
    assert t["wall_s"] == pytest.approx(900e-6)
    assert t["prefill_busy_s"] == pytest.approx(300e-6) and t["decode_busy_s"] == pytest.approx(400e-6)
    assert t["idle_before_first_step_s"] == pytest.approx(50e-6)
    assert t["idle_before_prefill_s"] == pytest.approx(50e-6) and t["idle_before_decode_s"] == pytest.approx(
        30e-6
    )
    assert t["idle_after_last_step_s"] == pytest.approx(70e-6)

    # a decode step's host busy time: prepare, launch, and the results slice after the device finished the step
    step_rows = runpy.run_path("benchmark/offline/trace_steps.py")["step_rows"]
    args = {"step": 7, "batch_size": 3, "prepare_us": 40, "launch_us": 25, "device_us": 300}
    rows = step_rows(
        [
            {"ph": "X", "name": "decode", "ts": 1_000, "dur": 65, "pid": 1, "tid": 1, "args": args},
            {
                "ph": "X",
                "name": "decode",
                "ts": 1_050,
                "dur": 300,
                "pid": 1,
                "tid": device + 1,
                "args": {"step": 7},
            },
            {"ph": "X", "name": "results", "ts": 1_200, "dur": 180, "pid": 1, "tid": 1, "args": {"step": 7}},
        ]
    )
    assert rows[0]["results_us"] == 1_380 - 1_350  # it waited for the device until 1,350
    assert rows[0]["host_busy_us"] == 40 + 25 + 30 and rows[0]["host_us"] == 65 + 180

    path = str(tmp_path / "run.json")
    llm = make_llm(tiny_model("llama"), max_running_req=4, trace=path)
    llm.generate(
        random_prompts(6, seed=2, min_len=4, max_len=40), SamplingParams(max_tokens=6, ignore_eos=True)
    )
    llm.shutdown()
    events = load(path)
    t = timeline(events)
    assert t["prefill_steps"] + t["decode_steps"] == len(device_steps(events))
    parts = [v for k, v in t.items() if k.endswith("_busy_s") or k.startswith("idle_")]
    assert all(v >= 0 for v in parts)
    assert sum(parts) == pytest.approx(t["wall_s"], abs=1e-5)
