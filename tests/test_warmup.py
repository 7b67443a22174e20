"""The start-up warm-up (engine/warmup.py): its steps go through the engine's own path and leave nothing behind.

On CUDA the engine runs it before capturing graphs; here it is called on a CPU engine (on any machine), where
the same steps run on the torch kernels, to check what it builds and what it clears.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from tiny import random_prompts

from minisgl.attention.triton_backend import TritonAttnBackend
from minisgl.core import SamplingParams
from minisgl.engine import warmup
from minisgl.engine.engine import ForwardOutput
from minisgl.engine.prepare import ForwardInput
from minisgl.engine.warmup import MIXED, warm_up
from minisgl.kernel.attention import ordered_from
from minisgl.kernel.cuda.decode import VARIANTS, CudaDecode
from minisgl.llm import LLM


def test_the_warm_up_runs_every_sampling_mode_and_leaves_no_trace(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tiny_model("qwen3-moe")
    llm = make_llm(folder, max_running_req=8, cache_type="naive", device="cpu")
    prompts = random_prompts(5, seed=4, max_len=20)
    params = [
        SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True) for i in range(5)
    ]
    before = [o["token_ids"] for o in llm.generate(prompts, params)]
    engine = llm.engine
    steps: list[tuple[str, int, int]] = []
    forward = engine.forward_batch

    def record(forward_input: ForwardInput) -> ForwardOutput:
        batch = forward_input.batch
        steps.append((batch.phase, batch.size, len(batch.positions)))
        return forward(forward_input)

    with monkeypatch.context() as m:
        m.setattr(engine, "forward_batch", record)
        # as on CUDA without graphs: eager decode steps of the sizes that pick the kernels' variants
        m.setattr(warmup, "_eager_decode_sizes", lambda engine: [3, 8])
        warm_up(engine)
    # a one-token prefill, the MoE block heights, the sampling modes, an eager decode step, then one
    # prefill and decode of one-token requests for each size
    assert steps[0] == ("prefill", 1, 1)
    assert ("prefill", len(MIXED), 40) in steps and ("decode", len(MIXED), len(MIXED)) in steps
    assert steps[-4:] == [("prefill", 3, 3), ("decode", 3, 3), ("prefill", 8, 8), ("decode", 8, 8)]
    assert len(steps) >= 6
    rows = engine.config.max_running_req
    assert not engine.page_table[:rows].any() and not engine.token_pool[:rows].any()
    llm.check_integrity()
    assert [o["token_ids"] for o in llm.generate(prompts, params)] == before


def test_with_mixed_steps_the_warm_up_runs_one_for_each_decode_row_count(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a mixed step's decode rows run the decode kernels without a graph: on CUDA each count of them whose kernels
    # differ would compile at its first request; here the steps the warm-up builds for them, on a CPU engine
    folder = tiny_model("qwen3")
    llm = make_llm(folder, max_running_req=8, cache_type="naive", enable_mixed_chunk=True, device="cpu")
    prompts = random_prompts(5, seed=6, max_len=20)
    params = [SamplingParams(max_tokens=6, temperature=0.8, seed=i, ignore_eos=True) for i in range(5)]
    before = [o["token_ids"] for o in llm.generate(prompts, params)]
    engine = llm.engine
    steps: list[tuple[str, int, int, int]] = []
    forward = engine.forward_batch

    def record(forward_input: ForwardInput) -> ForwardOutput:
        batch = forward_input.batch
        steps.append((batch.phase, batch.size, len(batch.positions), batch.num_decode_rows))
        return forward(forward_input)

    with monkeypatch.context() as m:
        m.setattr(engine, "forward_batch", record)
        m.setattr(warmup, "_mixed_decode_sizes", lambda engine: [2, 7])
        warm_up(engine)
    # each count's requests prefilled, then a prompt of 3 tokens with them as its decode rows; 7 leaves one row
    assert steps[-4:] == [
        ("prefill", 2, 2, 0),
        ("prefill", 3, 5, 2),
        ("prefill", 7, 7, 0),
        ("prefill", 8, 10, 7),
    ]
    assert not engine.page_table[:8].any() and not engine.token_pool[:8].any()
    llm.check_integrity()
    assert [o["token_ids"] for o in llm.generate(prompts, params)] == before


def test_mixed_decode_sizes_cover_every_variant_of_the_decode_rows() -> None:
    engine = fake_engine(256, 256, 8, cuda=True)
    assert warmup._mixed_decode_sizes(engine) == []  # type: ignore[arg-type]
    engine.config.enable_mixed_chunk = True
    sizes = warmup._mixed_decode_sizes(engine)  # type: ignore[arg-type]
    variant = engine.attn_backend.decode_variant
    # whatever the graphs: every count of decode rows beside a prompt, one size a variant
    assert {variant(bs) for bs in range(1, 256)} == {variant(bs) for bs in sizes}
    assert len(set(map(variant, sizes))) == len(sizes) and max(sizes) < 256
    # decode rows that go with the prompts through the extend kernel (MINISGL_MIXED_DECODE_SPLIT=0) add no variant
    engine.attn_backend.splits_mixed_steps = False
    assert warmup._mixed_decode_sizes(engine) == []  # type: ignore[arg-type]
    engine.attn_backend.splits_mixed_steps = True
    engine.device = torch.device("cpu")
    assert warmup._mixed_decode_sizes(engine) == []  # type: ignore[arg-type]


def fake_engine(
    max_running_req: int, graphs_max_bs: int, kv_heads: int, cuda: bool = False
) -> SimpleNamespace:
    """What _eager_decode_sizes reads of a CUDA engine with the Triton backend (no GPU needed); `cuda`: with the
    CUDA C++ decode kernel, whose variant follows the batch size too."""
    backend = SimpleNamespace(
        kv_cache=SimpleNamespace(num_kv_heads=kv_heads), supports_cuda_graphs=True, splits_mixed_steps=True
    )
    kernel = SimpleNamespace(variants=VARIANTS)
    kernel.variant = lambda bs: CudaDecode.variant(kernel, bs)  # type: ignore[arg-type]
    backend.cuda_decode = kernel if cuda else None
    backend.tc_decode = None
    backend.ordered = lambda bs: ordered_from(bs, 32)
    backend.tc_rope = lambda bs: TritonAttnBackend.tc_rope(backend, bs)  # type: ignore[arg-type]
    backend.decode_variant = lambda bs: TritonAttnBackend.decode_variant(backend, bs)  # type: ignore[arg-type]
    return SimpleNamespace(
        device=torch.device("cuda"),
        graph_runner=SimpleNamespace(enabled=graphs_max_bs > 0, max_bs=graphs_max_bs),
        config=SimpleNamespace(max_running_req=max_running_req, enable_mixed_chunk=False),
        attn_backend=backend,
    )


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_eager_decode_sizes_cover_every_variant_of_the_eager_batches(kv_heads: int, cuda: bool) -> None:
    sizes = warmup._eager_decode_sizes(fake_engine(256, 0, kv_heads, cuda))  # type: ignore[arg-type]
    variant = fake_engine(256, 0, kv_heads, cuda).attn_backend.decode_variant
    # without graphs every size runs eagerly: each size's variant is one a warmed size has
    assert {variant(bs) for bs in range(1, 257)} == {variant(bs) for bs in sizes}
    assert len(set(map(variant, sizes))) >= len(sizes) - 2  # one a variant, and 1 and 16 rows
    assert 1 in sizes and 16 in sizes and 32 in sizes  # one row, the GEMM's 16, the order from 32
    if kv_heads == 8:
        assert 128 in sizes  # wide tiles from 1,024 programs
    if cuda:
        assert 65 in sizes  # the CUDA kernel's 2 keys a step above SMALL_BATCH rows
    # graphs up to 64 rows: only the larger batches run eagerly
    above = warmup._eager_decode_sizes(fake_engine(256, 64, kv_heads, cuda))  # type: ignore[arg-type]
    assert above and min(above) == 65
    assert {variant(bs) for bs in range(65, 257)} == {variant(bs) for bs in above}
    # graphs for every batch the scheduler forms: nothing runs eagerly
    assert warmup._eager_decode_sizes(fake_engine(256, 256, kv_heads, cuda)) == []  # type: ignore[arg-type]
    # a backend without graph hooks decodes every size eagerly, whatever the graph limit says
    no_hooks = fake_engine(256, 256, kv_heads, cuda)
    no_hooks.attn_backend.supports_cuda_graphs = False
    assert warmup._eager_decode_sizes(no_hooks) == sizes  # type: ignore[arg-type]
    cpu = fake_engine(256, 0, kv_heads, cuda)
    cpu.device = torch.device("cpu")
    assert warmup._eager_decode_sizes(cpu) == []  # type: ignore[arg-type]


def test_prefill_lengths_reach_the_whole_row_layouts_on_cuda() -> None:
    # from ROWS_WHOLE tokens SiLU and the rotary kernel take another layout (another compiled variant): a CUDA
    # warm-up runs a step that long; a CPU, whose torch kernels have no such variants, does not
    from minisgl.kernel import ROWS_WHOLE

    dense = SimpleNamespace(num_experts=0, num_experts_per_tok=0)
    cuda = SimpleNamespace(device=torch.device("cuda"), model_config=dense)
    cpu = SimpleNamespace(device=torch.device("cpu"), model_config=dense)
    assert ROWS_WHOLE in warmup._prefill_lengths(cuda)  # type: ignore[arg-type]
    assert max(warmup._prefill_lengths(cpu)) < ROWS_WHOLE  # type: ignore[arg-type]


def test_the_eager_prefill_counts_above_the_graphs_are_warmed_up_to_the_prefill_budget() -> None:
    def engine(round_to: int, budget: int | None, device: str = "cuda") -> SimpleNamespace:
        config = SimpleNamespace() if budget is None else SimpleNamespace(max_extend_tokens=budget)
        graphs = SimpleNamespace(eager_round=round_to, max_tokens=2048)
        return SimpleNamespace(device=torch.device(device), prefill_graphs=graphs, config=config)

    # every multiple of 256 past the graphs' 2,048 tokens, to the scheduler's budget (8,192 without one)
    assert warmup._eager_prefill_counts(engine(256, 8192)) == list(range(2304, 8193, 256))
    assert warmup._eager_prefill_counts(engine(256, None)) == list(range(2304, 8193, 256))
    assert warmup._eager_prefill_counts(engine(256, 2500)) == [2304, 2560]
    assert warmup._eager_prefill_counts(engine(256, 2048)) == []
    assert warmup._eager_prefill_counts(engine(0, 8192)) == []  # no padding: counts are any
    assert warmup._eager_prefill_counts(engine(1, 8192)) == []  # a count a token: too many to run
    assert warmup._eager_prefill_counts(engine(256, 8192, "cpu")) == []


def test_the_warm_up_runs_each_projection_of_the_first_layer_at_each_count(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    from minisgl.layers.linear import LinearRowParallel, QuantizableLinear

    llm = make_llm(tiny_model("qwen3"), max_running_req=4, cache_type="naive", device="cpu")
    engine = llm.engine
    calls: list[tuple[str, int, bool]] = []
    layers = engine.model.model.layers if hasattr(engine.model, "model") else engine.model.layers
    for name, module in layers[0].named_modules():
        if isinstance(module, QuantizableLinear):
            forward = module.forward

            def spy(x, *args, name=name, forward=forward, **kwargs):  # type: ignore[no-untyped-def]
                calls.append((name, x.shape[0], "residual" in kwargs))
                assert x.is_contiguous()
                return forward(x, *args, **kwargs)

            monkeypatch.setattr(module, "forward", spy)
    warmup._warm_products(engine, [16, 48])
    projections = {name for name, m in layers[0].named_modules() if isinstance(m, QuantizableLinear)}
    rows = {name for name, m in layers[0].named_modules() if isinstance(m, LinearRowParallel)}
    assert rows and projections > rows
    want = {(name, n, False) for name in projections for n in (16, 48)}
    want |= {(name, n, True) for name in rows for n in (16, 48)}
    assert set(calls) == want and len(calls) == len(want)


def test_where_fresh_prompts_take_their_own_kernel_the_warm_up_reaches_both_kernels_long_tiles() -> None:
    # the longest plain step is fresh then, so a step with a cached prefix compiles the extend kernel's long tiles,
    # and a fresh prompt of LONG_QUERIES the fresh kernel's, where the budget, the model and the pool allow one
    from minisgl.kernel import ROWS_WHOLE
    from minisgl.kernel.fresh_attention import LONG_QUERIES

    def engine(fresh: bool, budget: int, max_seq_len: int = 40960, slots: int = 10**6) -> SimpleNamespace:
        return SimpleNamespace(
            attn_backend=SimpleNamespace(fresh_prefill=fresh),
            config=SimpleNamespace(max_extend_tokens=budget, max_running_req=256),
            max_seq_len=max_seq_len,
            num_pages=slots,
            page_size=1,
        )

    prefix = (ROWS_WHOLE, ROWS_WHOLE // 2)
    assert warmup._attention_steps(engine(False, 8192)) == []  # type: ignore[arg-type]
    assert warmup._attention_steps(engine(True, 8192)) == [prefix, (LONG_QUERIES, 0)]  # type: ignore[arg-type]
    assert warmup._attention_steps(engine(True, 4096)) == [prefix]  # type: ignore[arg-type]
    assert warmup._attention_steps(engine(True, 8192, max_seq_len=4096)) == [prefix]  # type: ignore[arg-type]
    assert warmup._attention_steps(engine(True, 8192, slots=5000)) == [prefix]  # type: ignore[arg-type]
    # the pool holds the prompt only beside a free slot for each of the 256 table rows
    assert warmup._attention_steps(engine(True, 8192, slots=8193)) == [prefix]  # type: ignore[arg-type]
    assert warmup._attention_steps(engine(True, 8192, slots=8448)) == [prefix, (LONG_QUERIES, 0)]  # type: ignore[arg-type]
