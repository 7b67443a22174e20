"""Priority scheduling: waiting requests are admitted in the order of their priority (SGLang's
--enable-priority-scheduling, higher first; lower first with --schedule-low-priority-values-first or vLLM's
--scheduling-policy priority), ties first come first served; a priority the queue would not keep is refused."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import openai
import pytest
from conftest import Reference
from test_server import SERVER_ARGS, Server, _wait_metrics
from tiny import assert_nothing_held, random_prompts

from minisgl.core import Batch, SamplingParams
from minisgl.env import ENV
from minisgl.llm import LLM
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.prefill import PrefillManager
from minisgl.scheduler.utils import PendingReq
from minisgl.server.args import parse_args

PROMPTS = random_prompts(6, seed=11, min_len=3, max_len=12)
PRIORITIES = [0, 5, 1, 5, -3, 2]


@pytest.fixture(autouse=True)
def _plain_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", True)


def _prefill_order(llm: LLM) -> list[int]:
    order: list[int] = []

    def seen(batch: Batch | None) -> None:
        if batch is not None and batch.phase == "prefill":
            order.extend(r.uid for r in batch.reqs)

    llm.step_observers.append(seen)
    return order


@pytest.mark.parametrize(
    ("low_first", "expected"),
    [(False, [1, 3, 5, 2, 0, 4]), (True, [4, 0, 2, 5, 1, 3])],
)
def test_offline_prompts_are_admitted_by_priority_ties_in_list_order(
    tiny_model: Callable[[str], str],
    hf_reference: Reference,
    make_llm: Callable[..., LLM],
    low_first: bool,
    expected: list[int],
) -> None:
    path = tiny_model("llama")
    llm = make_llm(
        path,
        max_running_req=1,
        cache_type="naive",
        priority_scheduling=True,
        low_priority_values_first=low_first,
    )
    order = _prefill_order(llm)
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True), priority=PRIORITIES)
    assert order == expected
    # the outputs stay in the prompts' order, each the model's own tokens
    assert [o["token_ids"] for o in out] == hf_reference(path, PROMPTS, 4)
    assert_nothing_held(llm)


def test_offline_priority_needs_priority_scheduling_and_one_integer_a_prompt(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM]
) -> None:
    params = SamplingParams(max_tokens=2)
    off = make_llm(tiny_model("llama"), cache_type="naive")
    with pytest.raises(ValueError, match="priority_scheduling=True"):
        off.generate(PROMPTS[:2], params, priority=[1, 0])
    assert off.generate(PROMPTS[:2], params)[0]["finish_reason"] == "length"
    on = make_llm(tiny_model("llama"), cache_type="naive", priority_scheduling=True)
    for bad, words in (
        ([1], "one each"),
        ([1, True], "integer"),
        ([1, 2**63], "integer"),
        ([1, 1.5], "integer"),
    ):
        with pytest.raises(ValueError, match=words):
            on.generate(PROMPTS[:2], params, priority=bad)  # type: ignore[arg-type]
    assert [o["finish_reason"] for o in on.generate(PROMPTS[:2], params, priority=[-(2**63), 2**63 - 1])] == [
        "length",
        "length",
    ]
    assert_nothing_held(on)


def _pending(uid: int, rank: int, chunked: bool = False) -> PendingReq:
    req = PendingReq(uid, [1, 2], SamplingParams(), 0, 4, rank=rank)
    if chunked:
        req.chunked_req = object()  # type: ignore[assignment]
    return req


def test_the_queue_keeps_rank_order_behind_chunked_prefills() -> None:
    manager = PrefillManager(None, None, None, 0)  # type: ignore[arg-type]
    # a request part-way through a chunked prefill holds a row and pages: it goes on first whatever its rank
    manager.pending_list = [_pending(0, 7, chunked=True)]
    for uid, rank in ((1, 0), (2, 0), (3, -5), (4, 3), (5, -5), (6, 0), (7, 3)):
        manager.add_one_req(_pending(uid, rank))
    assert [p.uid for p in manager.pending_list] == [0, 3, 5, 1, 2, 6, 4, 7]


def test_the_config_maps_priorities_to_ranks() -> None:
    off = SchedulerConfig()
    high = SchedulerConfig(priority_scheduling=True)
    low = SchedulerConfig(priority_scheduling=True, low_priority_values_first=True)
    assert [off.queue_rank(p) for p in (-2, 0, 9)] == [0, 0, 0]
    assert [high.queue_rank(p) for p in (-2, 0, 9)] == [2, 0, -9]
    assert [low.queue_rank(p) for p in (-2, 0, 9)] == [-2, 0, 9]
    with pytest.raises(ValueError, match="priority scheduling, which is off"):
        SchedulerConfig(low_priority_values_first=True).validate()


def test_the_command_line_spellings_of_priority_scheduling() -> None:
    sglang = parse_args(["--enable-priority-scheduling"])
    assert (sglang.priority_scheduling, sglang.low_priority_values_first) == (True, False)
    low = parse_args(["--enable-priority-scheduling", "--schedule-low-priority-values-first"])
    assert (low.priority_scheduling, low.low_priority_values_first) == (True, True)
    vllm = parse_args(["--scheduling-policy", "priority"])
    assert (vllm.priority_scheduling, vllm.low_priority_values_first) == (True, True)
    off = parse_args([])
    assert (off.priority_scheduling, off.low_priority_values_first) == (False, False)
    for argv in (
        ["--schedule-low-priority-values-first"],  # orders nothing
        ["--scheduling-policy", "priority", "--enable-priority-scheduling"],  # two orders
    ):
        with pytest.raises(SystemExit):
            parse_args(argv)


# ---- a real server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model: Callable[[str], str]) -> Iterator[Server]:
    args = [a if a != "80" else "1" for a in SERVER_ARGS]  # one request decoded at a time: the rest wait
    s = Server(["--model", tiny_model("llama"), *args, "--enable-priority-scheduling"])
    s.name = s.client().models.list().data[0].id
    yield s
    s.stop()


def test_a_later_request_of_higher_priority_is_served_before_an_earlier_one(server: Server) -> None:
    client = server.client()
    running = client.completions.create(
        model=server.name, prompt="a b c", max_tokens=450, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(running))  # it runs, and holds the only row
    finished: list[str] = []

    def send(label: str, priority: int) -> None:
        # each decodes for tens of steps alone in the one row, so the first to run answers well before the other
        # (with a few steps, a busy machine's thread wake-ups could reorder the two answers)
        client.completions.create(
            model=server.name,
            prompt="x y",
            max_tokens=40,
            extra_body={"ignore_eos": True, "priority": priority},
        )
        finished.append(label)

    threads = [threading.Thread(target=send, args=("early, priority 0", 0))]
    threads[0].start()
    assert _wait_metrics(server, lambda m: m["sglang:num_queue_reqs"] == 1)["sglang:num_queue_reqs"] == 1
    threads.append(threading.Thread(target=send, args=("later, priority 10", 10)))
    threads[1].start()
    both = _wait_metrics(server, lambda m: m["sglang:num_queue_reqs"] == 2)
    assert (both["sglang:num_queue_reqs"], both["sglang:num_running_reqs"]) == (
        2,
        1,
    )  # both wait behind the running one
    rest = sum(1 for _ in running)
    assert rest > 0
    for t in threads:
        t.join(60)
    assert finished == ["later, priority 10", "early, priority 0"]


def test_priorities_are_taken_on_every_route(server: Server) -> None:
    client = server.client()
    chat = client.chat.completions.create(
        model=server.name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"priority": -(2**63)},
    )
    assert chat.choices[0].finish_reason == "length"
    status, got = server.request(
        "POST",
        "/generate",
        b'{"text": "a", "priority": 9223372036854775807, "sampling_params": {"max_new_tokens": 2}}',
    )
    assert status == 200, got
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.name, prompt="a", max_tokens=2, extra_body={"priority": 2**64})
    assert e.value.body["param"] == "priority"  # type: ignore[index]
