"""Prefill steps padded for their CUDA graph (engine/prefill_graph.py) give the tokens of unpadded ones.

Without a GPU the padding itself is tested: the engine runs the CUDA path's layer code in Triton's
interpreter (MINISGL_KERNELS=triton), every prefill step padded with empty requests and padding tokens
as a graph's replay would be, eagerly. On a GPU the graphs are captured and replayed.
"""

from __future__ import annotations

import pytest
import torch
from interpreter import CUDA, DEVICE
from tiny import random_prompts

from minisgl.core import Batch, SamplingParams
from minisgl.engine.prefill_graph import MAX_REQS, PrefillGraphRunner, default_token_counts, rounded_tokens
from minisgl.env import ENV


def test_token_counts_double_up_to_the_largest() -> None:
    assert default_token_counts(2048) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert default_token_counts(100) == [16, 32, 64, 100]
    assert default_token_counts(600) == [16, 32, 64, 128, 256, 512, 600]
    assert default_token_counts(8) == [8]
    assert default_token_counts(0) == []
    # None (the configuration's default) is 2,048 tokens on CUDA; nothing on the CPU
    cuda = PrefillGraphRunner(torch.device("cuda"), None, None, lambda: torch.zeros(1), 0)  # type: ignore[arg-type]
    assert cuda.max_tokens == 2048 and cuda.token_counts == default_token_counts(2048)
    cpu = PrefillGraphRunner(torch.device("cpu"), None, None, lambda: torch.zeros(1), 0)  # type: ignore[arg-type]
    assert cpu.token_counts == [] and not cpu.enabled


def _pad_every_prefill(llm, monkeypatch: pytest.MonkeyPatch, counts: list[int]) -> list[tuple[int, int]]:
    """Every prefill step of up to MAX_REQS requests padded to the next of `counts` (as if graphs of those
    token counts were captured), run eagerly; returns (tokens, padded) of each padded step."""
    engine = llm.engine
    runner: PrefillGraphRunner = engine.prefill_graphs
    # the CPU engine keeps no scratch page: the padding tokens get a slot of the pool's last page, which
    # these short prompts never reach
    scratch = (engine.num_pages - 1) * engine.page_size
    engine.page_table[runner.dummy_table_idx].fill_(scratch)
    runner.token_counts = counts
    padded: list[tuple[int, int]] = []

    def padded_tokens(batch: Batch) -> int:
        if not batch.is_prefill or batch.size > runner.max_reqs:
            return 0
        tokens = sum(r.extend_len for r in batch.reqs)
        n = next((c for c in counts if c >= tokens), 0)
        if n:
            padded.append((tokens, n))
        return n

    monkeypatch.setattr(runner, "padded_tokens", padded_tokens)
    return padded


@pytest.mark.skipif(CUDA, reason="the GPU test below captures real graphs")
@pytest.mark.parametrize("variant,page_size", [("qwen3", 16), ("llama", 1)])
def test_padded_prefill_gives_the_tokens_of_transformers(
    variant: str, page_size: int, tiny_model, hf_reference, make_llm, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ENV.KERNELS, "value", "triton")
    folder = tiny_model(variant)
    # 10 prompts with max_running_req 4: prefill steps of 1-4 requests, and later ones beside running decodes
    prompts = random_prompts(10, seed=7, min_len=18, max_len=30)
    llm = make_llm(folder, page_size=page_size, max_running_req=4, device=DEVICE.type)
    padded = _pad_every_prefill(llm, monkeypatch, [16, 64, 128])
    out = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert [o["token_ids"] for o in out] == hf_reference(folder, prompts, 4)
    assert any(n > tokens for tokens, n in padded), "no step was padded: the test tested nothing"
    # a prompt that shares a cached prefix: the padded step's queries attend over the cached pages too
    shared = [prompts[0] + [5, 6, 7]]
    again = llm.generate(shared, SamplingParams(max_tokens=4, ignore_eos=True))
    assert again[0]["cached_tokens"] > 0
    assert [o["token_ids"] for o in again] == hf_reference(folder, shared, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("variant", ["qwen3", "llama", "qwen3-moe"])
def test_prefill_graphs_give_the_tokens_of_transformers(
    variant: str, tiny_model, hf_reference, make_llm, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tiny_model(variant)
    llm = make_llm(folder, device="cuda", page_size=16, max_running_req=16, cuda_graph_max_prefill=64)
    runner: PrefillGraphRunner = llm.engine.prefill_graphs
    assert sorted(runner.graphs) == [16, 32, 64]
    replayed: list[int] = []
    replay = runner.replay

    def counted(batch: Batch) -> torch.Tensor:
        replayed.append(batch.padded_tokens)
        return replay(batch)

    monkeypatch.setattr(runner, "replay", counted)
    # one request alone, then 3 together, then more than MAX_REQS together (eager), some over 64 tokens
    sets = [
        random_prompts(1, seed=1, max_len=12),
        random_prompts(3, seed=2, max_len=20),
        random_prompts(MAX_REQS + 3, seed=3, max_len=6),
        random_prompts(2, seed=4, min_len=40, max_len=60),
    ]
    for prompts in sets:
        out = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
        assert [o["token_ids"] for o in out] == hf_reference(folder, prompts, 5)
    assert replayed and set(replayed) <= {16, 32, 64}
    shared = [sets[3][0][:30] + [9, 8, 7, 6]]
    again = llm.generate(shared, SamplingParams(max_tokens=5, ignore_eos=True))
    assert again[0]["cached_tokens"] > 0
    assert [o["token_ids"] for o in again] == hf_reference(folder, shared, 5)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_prefill_graphs_off(tiny_model, make_llm) -> None:
    llm = make_llm(tiny_model("qwen3"), device="cuda", max_running_req=4, cuda_graph_max_prefill=0)
    assert not llm.engine.prefill_graphs.graphs
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0]["token_ids"]) == 2


def test_the_server_flag_reaches_the_engine_config() -> None:
    from minisgl.server.args import parse_args

    config = parse_args(["--cuda-graph-max-prefill", "64"]).scheduler_config("ipc://b", "ipc://d")
    assert config.cuda_graph_max_prefill == 64
    assert parse_args([]).scheduler_config("ipc://b", "ipc://d").cuda_graph_max_prefill is None
    with pytest.raises(SystemExit):
        parse_args(["--cuda-graph-max-prefill", "-1"])


def test_a_negative_limit_is_refused() -> None:
    from minisgl.engine.config import EngineConfig

    with pytest.raises(ValueError, match="cuda_graph_max_prefill=-5 is invalid"):
        EngineConfig(cuda_graph_max_prefill=-5).validate()


def test_which_steps_replay_a_graph() -> None:
    """The choice of graph by the step alone: a prefill of at most MAX_REQS requests and the largest
    token count, without prompt logprobs; the next token count up; otherwise 0 (eager)."""

    def req(n: int, **params) -> object:
        from minisgl.core import Req

        return Req(
            input_ids=list(range(n)),
            table_idx=0,
            cached_len=0,
            output_len=4,
            uid=0,
            sampling_params=SamplingParams(**params),
            cache_handle=None,
            seed=0,
        )

    runner = PrefillGraphRunner(torch.device("cpu"), 0, None, lambda: torch.zeros(1), 99)  # type: ignore[arg-type]
    runner.token_counts = default_token_counts(512)
    runner.graphs = dict.fromkeys(runner.token_counts)  # as if captured
    runner.max_tokens = 512

    def prefill(*reqs: object) -> Batch:
        return Batch(reqs=list(reqs), phase="prefill")  # type: ignore[arg-type]

    assert runner.padded_tokens(prefill(req(5))) == 16
    assert runner.padded_tokens(prefill(req(16))) == 16
    assert runner.padded_tokens(prefill(req(17), req(30))) == 64
    assert runner.padded_tokens(prefill(req(300), req(212))) == 512
    assert runner.padded_tokens(prefill(req(300), req(213))) == 0  # over the largest graph
    assert runner.padded_tokens(prefill(*[req(1) for _ in range(MAX_REQS + 1)])) == 0
    assert runner.padded_tokens(prefill(req(5), req(5, prompt_logprobs=1))) == 0
    assert runner.padded_tokens(Batch(reqs=[req(1)], phase="decode")) == 0
    batch = prefill(req(5), req(6))
    runner.pad_batch(batch)
    assert batch.padded_tokens == 16 and batch.size == 2 and batch.padded_size == MAX_REQS
    assert all(r.extend_len == 0 and r.table_idx == 99 for r in batch.padded_reqs[2:])
    assert runner.can_use(batch)


def test_eager_prefill_steps_round_their_tokens() -> None:
    """A step that runs eagerly keeps its requests and has its tokens padded to the graphs' counts (doubling from
    16 to eager_round, then its multiples), except a mixed step (decode rows after its prompts) and one asking for
    prompt logprobs; a rounded count that equals a graph's does not replay it (its metadata holds MAX_REQS
    requests)."""
    from minisgl.core import Req

    def req(n: int, cached: int = 0, **params) -> Req:
        return Req(
            input_ids=list(range(cached + n)),
            table_idx=0,
            cached_len=cached,
            output_len=4,
            uid=0,
            sampling_params=SamplingParams(**params),
            cache_handle=None,
            seed=0,
        )

    # the graphs' counts, continued past the largest graph: a step pads alike whether graphs run or not
    counts = default_token_counts(2048)
    assert all(rounded_tokens(t, 256) == next(c for c in counts if c >= t) for t in range(1, 2049))
    assert rounded_tokens(2049, 256) == 2304 and rounded_tokens(8192, 256) == 8192
    assert rounded_tokens(100, 64) == 128 and rounded_tokens(65, 64) == 128 and rounded_tokens(40, 64) == 64

    # where graphs run, with a backend that takes padding tokens, and only with a scratch row to send them to
    class Padding:
        takes_padded_prefill = True

    def eager_round(backend: object, scratch_row: bool) -> int:
        cuda = torch.device("cuda")
        return PrefillGraphRunner(cuda, 0, backend, lambda: torch.zeros(1), 99, scratch_row).eager_round  # type: ignore[arg-type]

    assert eager_round(Padding(), True) == ENV.PREFILL_ROUND.value == 256
    assert eager_round(Padding(), False) == 0  # a padding token's K/V would land in a request's slot
    assert eager_round(object(), True) == 0
    runner = PrefillGraphRunner(torch.device("cpu"), 0, None, lambda: torch.zeros(1), 99)  # type: ignore[arg-type]
    runner.token_counts = default_token_counts(512)
    runner.graphs = dict.fromkeys(runner.token_counts)
    runner.max_tokens = 512
    assert runner.eager_round == 0  # on a CPU without emulated graphs: nothing is padded
    runner.eager_round = 256

    def padded(*reqs: Req) -> Batch:
        batch = Batch(reqs=list(reqs), phase="prefill")
        runner.pad_batch(batch)
        return batch

    many = padded(*[req(30) for _ in range(MAX_REQS + 1)])  # 270 tokens, too many requests for a graph
    assert many.padded_tokens == 512 and many.padded_size == MAX_REQS + 1
    assert not runner.can_use(many)  # 512 is a graph's count, but this step is eager
    assert padded(req(300), req(300)).padded_tokens == 768  # over the largest graph
    assert padded(req(512), req(512)).padded_tokens == 1024  # a multiple already
    assert padded(req(5)).padded_tokens == 16  # a graph's padding first
    assert padded(*[req(1) for _ in range(MAX_REQS + 1)]).padded_tokens == 16  # the graphs' counts below 256
    assert padded(*[req(10) for _ in range(MAX_REQS + 1)]).padded_tokens == 128
    assert padded(*[req(30) for _ in range(MAX_REQS)], req(30, prompt_logprobs=1)).padded_tokens == 0
    # a mixed step: its last request is past its prompt (decoding one token)
    decoding = req(5)
    decoding.complete_one()  # its prompt computed, one token sampled: it decodes
    assert padded(*[req(30) for _ in range(MAX_REQS)], decoding).padded_tokens == 0
    runner.eager_round = 0
    assert padded(*[req(30) for _ in range(MAX_REQS + 1)]).padded_tokens == 0


@pytest.mark.skipif(CUDA, reason="on a GPU the default rounding runs in the graph test above")
def test_rounded_eager_prefill_gives_the_tokens_of_transformers(
    tiny_model, hf_reference, make_llm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps of more requests than a graph takes, their tokens rounded up with padding tokens on the scratch
    slot, through the CUDA path's layer code (Triton's interpreter): transformers' tokens."""
    monkeypatch.setattr(ENV.KERNELS, "value", "triton")
    folder = tiny_model("qwen3")
    prompts = random_prompts(MAX_REQS + 4, seed=11, min_len=5, max_len=20)
    llm = make_llm(folder, page_size=1, max_running_req=16, device=DEVICE.type)
    engine = llm.engine
    runner: PrefillGraphRunner = engine.prefill_graphs
    engine.page_table[runner.dummy_table_idx].fill_(engine.num_pages - 1)  # as _pad_every_prefill
    monkeypatch.setattr(runner, "eager_round", 64)
    rounded: list[int] = []
    pad_batch = runner.pad_batch

    def recorded(batch: Batch) -> None:
        pad_batch(batch)
        if batch.is_prefill:
            rounded.append(batch.padded_tokens - sum(r.extend_len for r in batch.reqs))

    monkeypatch.setattr(runner, "pad_batch", recorded)
    out = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert [o["token_ids"] for o in out] == hf_reference(folder, prompts, 4)
    assert rounded and max(rounded) > 0, "no step was padded: the test tested nothing"


def test_static_inputs_start_on_the_scratch_slot_and_take_a_steps_inputs() -> None:
    """The graphs' input buffers: a capture binds the first n of each, a replay copies a step's into them
    and leaves the rest as they were (padding tokens keep the scratch slot)."""
    from minisgl.engine.prefill_graph import StaticInputs

    inputs = StaticInputs(8, scratch=77, device=torch.device("cpu"))
    assert inputs.out_loc.tolist() == [77] * 8
    captured = Batch(reqs=[], phase="prefill")
    inputs.bind(captured, 4)
    step = Batch(reqs=[], phase="prefill")
    step.input_ids = torch.tensor([5, 6, 7], dtype=torch.int32)
    step.positions = torch.tensor([0, 1, 2])
    step.out_loc = torch.tensor([10, 11, 12])
    inputs.load(step, 3)
    assert captured.input_ids.tolist() == [5, 6, 7, 0]
    assert captured.positions.tolist() == [0, 1, 2, 0]
    assert captured.out_loc.tolist() == [10, 11, 12, 77]
    assert captured.input_ids.data_ptr() == inputs.input_ids.data_ptr()  # views, as a graph reads them
