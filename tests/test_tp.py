"""Tensor parallelism on the CPU (gloo): real rank processes, offline and behind the server.

Greedy float32 tokens at tp=2 must equal transformers' (and so tp=1's); every rank must stay in step
whatever the requests do (sampling without a seed, aborts, stop strings); a rank that dies, a
signal or a bad size must leave no process behind and say what happened.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import Reference
from procs import _descendants, _wait_gone
from tiny import assert_nothing_held, random_prompts

from minisgl.core import SamplingParams
from minisgl.llm import LLM

PROMPTS = random_prompts(6, seed=5, min_len=3, max_len=30)


def tp_llm(folder: str, tp: int = 2, **kwargs: object) -> LLM:
    return LLM(folder, dtype=torch.float32, tp_size=tp, max_running_req=4, **kwargs)


# qwen3-mqa-head-dim has one KV head: at tp=2 both ranks keep (replicate) it. "triton": the CUDA path's layers
# under Triton's interpreter on every rank, the norms folded into q|k|v and gate|up and the residual added by
# rank 0's o and down projections only, before the all-reduce (fewer tokens: the interpreter is slow)
@pytest.mark.parametrize(
    "variant,kernels",
    [
        *(
            (v, "auto")
            for v in ("llama", "qwen3", "qwen2-tied", "qwen3-mqa-head-dim", "qwen3-moe", "qwen3-moe-mixed")
        ),
        ("qwen3", "triton"),
        ("qwen3", "triton-graphs"),
    ],
)
def test_greedy_tokens_at_tp2_equal_transformers(
    variant: str, kernels: str, tiny_model: Callable[[str], str], hf_reference: Reference, monkeypatch
) -> None:
    prompts, steps = PROMPTS, 8
    graphs: dict[str, object] = {}
    if kernels.startswith("triton"):
        from minisgl.env import ENV

        monkeypatch.setenv("MINISGL_KERNELS", "triton")  # the rank processes' (TRITON_INTERPRET: conftest.py)
        monkeypatch.setattr(ENV.KERNELS, "value", "triton")
        prompts, steps = PROMPTS[:3], 4
    if kernels == "triton-graphs":  # every rank replays emulated graphs: the all-reduce inside them
        monkeypatch.setenv("MINISGL_EMULATE_GRAPHS", "1")
        monkeypatch.setattr(ENV.EMULATE_GRAPHS, "value", True)
        graphs = dict(cuda_graph_bs=[4], cuda_graph_max_bs=4, cuda_graph_max_prefill=16)
    folder = tiny_model(variant)
    llm = tp_llm(folder, page_size=4, **graphs)
    try:
        out = llm.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True))
        assert [o["token_ids"] for o in out] == hf_reference(folder, prompts, steps)
        assert_nothing_held(llm)
        assert bool(llm.engine.graph_runner.graphs) == bool(graphs)
    finally:
        llm.shutdown()
    assert not llm._ranks or not llm._ranks.procs


def test_ranks_stay_in_step_through_sampling_aborts_and_stop_strings(
    tiny_model: Callable[[str], str],
) -> None:
    folder = tiny_model("llama")
    llm = tp_llm(folder)
    try:
        # no seed: rank 0 picks one for every rank, or the ranks would sample different tokens
        sampled = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True))
        assert all(len(o["token_ids"]) == 12 for o in sampled)
        text = llm.tokenizer.decode(sampled[0]["token_ids"][3:5])
        stopped = llm.generate(
            PROMPTS[:1], SamplingParams(max_tokens=12, temperature=1.0, seed=7, stop=[text] if text else [])
        )
        assert stopped[0]["finish_reason"] in ("stop", "length")

        def abort_second(batch: object) -> None:
            if batch is not None and getattr(batch, "is_decode", False):
                llm.abort(1)

        llm.step_observers.append(abort_second)
        out = llm.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True))
        llm.step_observers.clear()
        assert out[1]["finish_reason"] == "abort"
        # the ranks agree after all that: greedy again equals a fresh single-rank engine, and again once every
        # rank has emptied its prefix cache (a rank that kept its own would compute other positions)
        again = llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
        assert llm.reset_prefix_cache() and llm.cache_manager.prefix_cache.total_pages == 0
        cold = llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
        assert [o["token_ids"] for o in cold] == [o["token_ids"] for o in again]
        assert all(o["cached_tokens"] == 0 for o in cold) and any(o["cached_tokens"] for o in again)
        assert_nothing_held(llm)
    finally:
        llm.shutdown()
    single = LLM(folder, dtype=torch.float32, max_running_req=4)
    try:
        ref = single.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
    finally:
        single.shutdown()
    assert [o["token_ids"] for o in again] == [o["token_ids"] for o in ref]


def test_ranks_fill_masks_and_sample_constrained_steps_alike(tiny_model: Callable[[str], str]) -> None:
    # every rank fills a constrained batch's masks and samples it at the same point: a rank out of step
    # would hang the broadcast of the tokens, or give other tokens than a single rank
    pytest.importorskip("xgrammar")
    folder = tiny_model("llama")
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
            "required": ["n", "ok"],
            "additionalProperties": False,
        }
    )
    params = [
        SamplingParams(max_tokens=24, json_schema=schema),
        SamplingParams(max_tokens=10, ignore_eos=True),
        SamplingParams(max_tokens=16, regex=r"[0-9]{3}-[0-9]{4}"),
    ] * 2
    outs = []
    for tp in (1, 2):
        llm = tp_llm(folder, tp=tp)
        try:
            outs.append(llm.generate(PROMPTS, params))
            assert_nothing_held(llm)
            assert not llm.grammars.active
        finally:
            llm.shutdown()
    single, ranks = outs
    assert [o["token_ids"] for o in ranks] == [o["token_ids"] for o in single]
    for o in ranks[::3]:
        assert o["finish_reason"] == "length" or set(json.loads(o["text"])) == {"n", "ok"}, o
    for o in ranks[2::3]:
        assert o["finish_reason"] == "stop" and re.fullmatch(r"[0-9]{3}-[0-9]{4}", o["text"]), o


def test_a_size_that_does_not_divide_the_model_fails_before_any_process_starts(
    tiny_model: Callable[[str], str],
) -> None:
    before = _descendants(os.getpid())
    with pytest.raises(
        ValueError, match="tensor-parallel size 3 does not divide the model's 4 attention heads"
    ):
        tp_llm(tiny_model("llama"), tp=3)
    assert _descendants(os.getpid()) == before


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="NCCL notices a lost rank only at its collective timeout (minutes)"
)
def test_a_killed_rank_fails_generate_and_leaves_no_process(tiny_model: Callable[[str], str]) -> None:
    before = _descendants(os.getpid())  # multiprocessing's resource tracker, once it has started
    llm = tp_llm(tiny_model("llama"))
    assert llm._ranks is not None
    follower = llm._ranks.procs[0]

    def kill_at_first_decode(batch: object) -> None:
        if batch is not None and getattr(batch, "is_decode", False) and follower.is_alive():
            os.kill(follower.pid, signal.SIGKILL)
            follower.join()

    llm.step_observers.append(kill_at_first_decode)
    try:
        with pytest.raises(Exception):  # noqa: B017 - gloo reports the lost peer as a RuntimeError or worse
            llm.generate(PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True))
        with pytest.raises(RuntimeError, match="a tensor-parallel rank has stopped"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=2))
    finally:
        llm.shutdown()
    assert _wait_gone(_descendants(os.getpid()) - before) == set()


# ---- the server (its test helpers import the openai client, which a GPU machine may lack) ----------
@pytest.fixture(scope="module")
def model_dir(tiny_model: Callable[[str], str]) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def serving() -> Any:
    return pytest.importorskip("test_server")


def _greedy_completions(server: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    client = server.client()
    out = []
    for p in prompts:
        r = client.completions.create(
            model=client.models.list().data[0].id,
            prompt=p,
            max_tokens=n,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        out.append(r.choices[0].text)
    return out


def test_a_tp2_server_answers_like_tp1_and_stops_every_rank(model_dir: str, serving: Any) -> None:
    texts = {}
    for tp in (1, 2):
        s = serving.Server(["--model", model_dir, "--tp-size", str(tp), *serving.SERVER_ARGS])
        try:
            texts[tp] = _greedy_completions(s, PROMPTS[:3], 8)
            # every rank empties its prefix cache: the same answers, computed again in full
            status, got = s.request("POST", "/flush_cache")
            assert status == 200 and got["freed_pages"] > 0, got
            assert _greedy_completions(s, PROMPTS[:3], 8) == texts[tp]
        finally:
            assert s.stop(signal.SIGTERM) == 0
        assert _wait_gone(s.children) == set()
        if tp == 2:
            assert len(s.children) >= 4  # the scheduler ranks 0 and 1, the tokenizer, and more
    assert texts[1] == texts[2]


def test_a_killed_rank_takes_the_tp2_server_down(model_dir: str, serving: Any) -> None:
    s = serving.Server(["--model", model_dir, "--tp", "2", *serving.SERVER_ARGS])
    rank1 = int(re.search(r"rank 1 \(pid (\d+)\)", s.log).group(1))
    os.kill(rank1, signal.SIGKILL)
    assert s.wait(60) == 1
    assert re.search(r"the scheduler-rank1 process \(pid \d+\) was killed by SIGKILL; shutting down", s.log)
    assert _wait_gone(s.children) == set()


def test_two_nodes_on_one_machine_serve_a_request(model_dir: str, serving: Any) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist = ["--tp", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{port}"]
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "minisgl",
            "--model",
            model_dir,
            *dist,
            "--node-rank",
            "1",
            *serving.SERVER_ARGS,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(node1.stdout or []), daemon=True)
    reader.start()
    try:
        s = serving.Server(["--model", model_dir, *dist, "--node-rank", "0", *serving.SERVER_ARGS])
        try:
            assert len(_greedy_completions(s, PROMPTS[:1], 4)) == 1
        finally:
            s.stop(signal.SIGTERM)
        # rank 0 is gone: node 1's rank ends, and node 1 with it
        assert node1.wait(60) in (0, 1)
    finally:
        if node1.poll() is None:
            node1.kill()
        time.sleep(0.1)
    assert "ready" in "".join(log)


def test_a_tp2_trace_has_every_rank_with_the_same_steps(tiny_model: Callable[[str], str], tmp_path) -> None:
    import json

    path = str(tmp_path / "tp.json")
    llm = tp_llm(tiny_model("llama"), trace=path)
    try:
        llm.generate(PROMPTS, SamplingParams(max_tokens=5, ignore_eos=True))
    finally:
        llm.shutdown()
    events = json.load(open(path))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert sorted(names.values()) == ["offline LLM", "scheduler rank 1"]
    steps = {
        pid: [e["name"] for e in events if e["pid"] == pid and e.get("name") in ("prefill", "decode")]
        for pid in names
    }
    assert len(set(map(tuple, steps.values()))) == 1 and steps[next(iter(steps))]


def test_w8a8_at_tp2_calibrates_on_every_rank_and_follows_the_float_tokens(
    tiny_model: Callable[[str], str], hf_reference: Reference
) -> None:
    # each rank smooths its own shards from one calibration prefill that all ranks run together (its
    # collectives included); the tokens are those of a quantized model, so they follow the float ones
    # only mostly (measured 39 of 48 here; tp=1 w8a8: 20 of 32 on other prompts)
    folder = tiny_model("llama")
    llm = tp_llm(folder, quantization="w8a8")
    try:
        out = llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
        got = [o["token_ids"] for o in out]
        assert all(len(g) == 8 for g in got)
        want = hf_reference(folder, PROMPTS, 8)
        same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
        assert same >= 0.5 * 48, (got, want)
        assert_nothing_held(llm)
    finally:
        llm.shutdown()
