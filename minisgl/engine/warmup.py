"""The start-up warm-up: a few tiny steps that reach every kernel variant a workload reaches, so that the
first request runs at full speed instead of waiting for compilation.

On a CPU there is no Triton, but a process's first steps still pay once for what later steps reuse
(oneDNN's bf16 matmul kernels, the C kernels' library, the C decode step's tables): a first 32-token
prompt of the default model took 314 ms to prefill against 35 ms for the next one, and its first
request ran at 157 tok/s against 230. The warm-up's 0.4 s at start takes that off the first request.
On CUDA:

Triton compiles a kernel once per combination of its constexpr values, its dtypes, and what it
specialises the other arguments on: an integer equal to 1 or divisible by 16, a pointer aligned to
16 bytes. The variants a workload reaches, and where each is compiled:
- the model in a prefill (extend attention, rotary with the KV store, norms, activation): one step compiles
  them for every length, as no argument of theirs depends on the token count, but for two layouts: from
  ROWS_WHOLE tokens (minisgl/kernel/__init__.py) SiLU runs a program a row and the rotary kernel a program a
  token, so one step of that many too; the MoE kernel's row block height follows the tokens per expert,
  so one step per height (`_prefill_lengths`);
- prefill attention by prompt shape: where steps of fresh prompts take their own kernel (kernel/fresh_attention.py,
  TritonAttnBackend.fresh_prefill), the long prompts' step above compiles it, so one step with a cached prefix
  and more than SHORT_QUERIES new tokens compiles the extend kernel's long tiles, and, where the prefill budget and
  the model's length allow a prompt of LONG_QUERIES tokens, one fresh step that long its own long tiles
  (`_attention_steps`);
- the model in decode: each graph batch size is run once before its capture (GraphRunner.capture);
  batches that run eagerly (all of them without graphs, or those above the largest graph) pick the
  attention kernels' tiles, splits and order by their size, so one eager step here runs for each
  variant among those sizes (`attn_backend.decode_variant`), and of 1 and 16 rows;
- mixed steps (EngineConfig.enable_mixed_chunk): a prefill step's last rows decode through the decode kernels,
  eagerly whatever the graphs, at 1 to max_running_req - 1 rows (a prompt takes a row), so one mixed step for
  each decode variant among those counts (`_mixed_decode_sizes`);
- sampling: greedy, temperature only, and the filtered path (top-k, top-p, min-p thresholds), beside
  penalties, logit_bias, min_tokens and logprobs (torch ops, but their first call allocates too); where the
  decode graphs end at the final norm (engine/fused_head.py), the fused LM head and sampling for each band of
  batch sizes, and the LM head's product at each graph size;
- cuBLAS: a product of a row count new to the process costs the host 200-310 us (its kernel chosen) against
  27-36 for a seen one, 25-35 ms for an eager prefill step's 112 (docs/benchmarks.md, "A burst of short
  prompts on a GPU"). Eager prefill steps are padded to a few counts (prefill_graph.rounded_tokens), and the
  prefill graphs' capture runs those up to the largest graph; the products of the counts above it, up to the
  prefill budget, run here once each on the first layer's weights (`_warm_products`).
Batch sizes add no variants: the per-row buffers are padded to keep every pointer 16-byte aligned
(sample.Sampler, TritonAttnBackend.prepare_metadata), and counts that vary are left unspecialised.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.prefill_graph import rounded_counts
from minisgl.kernel import ROWS_WHOLE
from minisgl.layers.linear import LinearRowParallel, QuantizableLinear

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine

# one request per sampling mode: every kernel of the sampling path runs in one batch
MIXED = [
    SamplingParams(),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.7, top_k=20),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=0.7, min_p=0.1),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, presence_penalty=0.5),
    SamplingParams(repetition_penalty=1.1, logit_bias={1: -2.0}, logprobs=2, min_tokens=4),
]


def _prefill_lengths(engine: Engine) -> list[int]:
    """Token counts of the plain prefill steps: one token, a few, on CUDA the row count from which SiLU and
    the rotary kernel change layout, and on MoE models one step for each row block height of the fused
    kernel (kernel/moe.py: moe_config picks it from tokens per expert)."""
    mc = engine.model_config
    lengths = [1, 17]
    if engine.device.type == "cuda":
        lengths.append(ROWS_WHOLE)
    if mc.num_experts and mc.num_experts_per_tok:
        for per_expert in (17, 65):
            lengths.append(-(-per_expert * mc.num_experts // mc.num_experts_per_tok))
    return lengths


def _attention_steps(engine: Engine) -> list[tuple[int, int]]:
    """(prompt tokens, of which cached) of the steps that reach prefill attention's variants by prompt shape where
    fresh prompts take their own kernel (`_prefill_lengths`' longest step is then fresh): a cached prefix before
    more than SHORT_QUERIES new tokens, and a fresh prompt of LONG_QUERIES where the budget and the model allow."""
    if not getattr(engine.attn_backend, "fresh_prefill", False):
        return []
    # imported here: the Triton kernels' modules need Triton, which a CPU install may lack
    from minisgl.kernel.fresh_attention import LONG_QUERIES

    steps = [(ROWS_WHOLE, ROWS_WHOLE // 2)]
    budget = getattr(engine.config, "max_extend_tokens", None) or DEFAULT_PREFILL_BUDGET
    # `_requests` keeps a slot a table row free for the decode step: a prompt that long must fit beside them
    slots = engine.num_pages * engine.page_size - engine.config.max_running_req
    if min(budget, engine.max_seq_len - 2, slots) >= LONG_QUERIES:
        steps.append((LONG_QUERIES, 0))
    return steps


def _warm_attention(engine: Engine) -> None:
    """The steps of `_attention_steps`, each request's first tokens taken as its cached prefix."""
    steps = _attention_steps(engine)
    if not steps:
        return
    from minisgl.kernel.attention import SHORT_QUERIES  # needs Triton, as above

    for total, cached in steps:
        reqs = _requests(engine, total, [SamplingParams()])
        for r in reqs:  # each keeps more than SHORT_QUERIES new tokens where it can
            r.cached_len = min(
                cached * len(r.input_ids) // total, max(0, len(r.input_ids) - SHORT_QUERIES - 1)
            )
        _step(engine, reqs, "prefill")


def _requests(
    engine: Engine, total: int, params: list[SamplingParams], after: list[Req] | None = None
) -> list[Req]:
    """Requests of `total` prompt tokens over table rows 0, 1, ... (or the rows after those of `after`, in the
    slots after theirs), each at most a row long, with the sampling parameters taken in turn; their page-table
    rows point at the pool's first slots."""
    after = after or []
    first = len(after)
    used = sum(len(r.input_ids) + 1 for r in after)
    longest = engine.max_seq_len - 2  # room for the decode step after the prefill
    rows = engine.config.max_running_req - first
    slots = engine.num_pages * engine.page_size - used
    total = min(total, rows * longest, slots - rows)
    count = max(len(params), -(-total // longest))
    count = min(count, rows, max(1, total))
    reqs, placed = [], 0
    for i in range(first, first + count):
        n = max(1, min(longest, (total - placed) // (first + count - i)))
        placed += n
        reqs.append(
            Req(
                input_ids=[0] * n,
                table_idx=i,
                cached_len=0,
                output_len=2,
                uid=-2 - i,
                sampling_params=params[i % len(params)],
                cache_handle=None,
                seed=i,
            )
        )
        # n prompt slots and one for the decode step; the pool is empty, any slot is free to write
        engine.page_table[i, : n + 1] = torch.arange(used, used + n + 1, dtype=torch.int32)
        used += n + 1
    return reqs


def _eager_decode_sizes(engine: Engine) -> list[int]:
    """Decode batch sizes that run without a graph: one for each variant of the attention backend's decode
    kernels, and 1 and 16 rows (the split-K GEMM takes its rows as an integer, which Triton specialises
    when it equals 1 or divides by 16; it serves up to 16 rows)."""
    if engine.device.type != "cuda":
        return []  # nothing is compiled per batch size on a CPU
    runner = engine.graph_runner
    graphs = runner.enabled and engine.attn_backend.supports_cuda_graphs
    lo, hi = (runner.max_bs + 1 if graphs else 1), engine.config.max_running_req
    sizes: dict[object, int] = {}
    for bs in range(lo, hi + 1):
        sizes.setdefault(engine.attn_backend.decode_variant(bs), bs)
    return sorted(set(sizes.values()) | {bs for bs in (1, 16) if lo <= bs <= hi})


def _mixed_decode_sizes(engine: Engine) -> list[int]:
    """Decode-row counts of mixed steps, one for each variant of the attention backend's decode kernels: a
    prefill step's decode rows run them without a graph, at 1 to max_running_req - 1 rows."""
    if not (
        engine.device.type == "cuda"
        and engine.config.enable_mixed_chunk
        and engine.attn_backend.splits_mixed_steps
    ):
        return []
    sizes: dict[object, int] = {}
    for bs in range(1, engine.config.max_running_req):
        sizes.setdefault(engine.attn_backend.decode_variant(bs), bs)
    return sorted(sizes.values())


# more padded counts than this (a tiny MINISGL_PREFILL_ROUND) are left to the first steps
MAX_WARM_COUNTS = 64
DEFAULT_PREFILL_BUDGET = 8192  # the scheduler's default max_extend_tokens, for an engine built without one


def _eager_prefill_counts(engine: Engine) -> list[int]:
    """The token counts eager prefill steps are padded to that the prefill graphs' capture does not run: above
    the largest graph, up to the prefill budget (the scheduler's max_extend_tokens where the config has one)."""
    runner = engine.prefill_graphs
    if engine.device.type != "cuda" or not runner.eager_round:
        return []
    budget = getattr(engine.config, "max_extend_tokens", None) or DEFAULT_PREFILL_BUDGET
    counts = [n for n in rounded_counts(budget, runner.eager_round) if n > runner.max_tokens]
    return counts if len(counts) <= MAX_WARM_COUNTS else []


def _warm_products(engine: Engine, counts: list[int]) -> None:
    """Each of the first decoder layer's dense projections at each row count of `counts`, as its forward calls
    it (the row-parallel ones with and without the residual added in place): cuBLAS chooses each product's
    kernel once, here. The inputs are zeros; what they write is thrown away."""
    layers = next(
        (m.layers for m in engine.model.modules() if isinstance(getattr(m, "layers", None), nn.ModuleList)),
        None,
    )
    if not layers or not counts:
        return
    rows = max(counts)
    inputs: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def zeros(width: int, dtype: torch.dtype) -> torch.Tensor:
        # one buffer a width: each product's rows are contiguous, as a step's are
        if (width, dtype) not in inputs:
            inputs[width, dtype] = torch.zeros(rows, width, dtype=dtype, device=engine.device)
        return inputs[width, dtype]

    seen: set[tuple[type, tuple[int, ...]]] = set()
    for module in layers[0].modules():
        if not isinstance(module, QuantizableLinear) or module.weight is None:
            continue
        key = (type(module), tuple(module.weight.shape))
        if key in seen:
            continue
        seen.add(key)
        out_width, in_width = module.weight.shape
        dtype = module.weight.dtype
        for n in counts:
            x = zeros(in_width, dtype)[:n]
            module(x)
            if isinstance(module, LinearRowParallel):
                module(x, residual=zeros(out_width, dtype)[:n])


def _step(engine: Engine, reqs: list[Req], phase: str) -> None:
    batch = Batch(reqs=reqs, phase=phase)  # type: ignore[arg-type]
    engine.forward_batch(engine.prepare_batch(batch, eos_token_ids=(0,)))
    for r in reqs:
        r.complete_one()


@torch.inference_mode()
def warm_up(engine: Engine) -> None:
    """Run the warm-up steps through the engine's own prepare and forward, then clear what they wrote."""
    for total in _prefill_lengths(engine):
        _step(engine, _requests(engine, total, [SamplingParams()]), "prefill")
    _warm_attention(engine)
    temperature_only = _requests(engine, 40, [SamplingParams(temperature=0.7)] * 3)
    _step(engine, temperature_only, "prefill")
    mixed = _requests(engine, 40, MIXED)
    _step(engine, mixed, "prefill")
    # eager decode: graphs are captured after the warm-up, so this runs without them
    _step(engine, mixed, "decode")
    for bs in _eager_decode_sizes(engine):
        reqs = _requests(engine, bs, [SamplingParams()] * bs)
        _step(engine, reqs, "prefill")
        _step(engine, reqs, "decode")
    for bs in _mixed_decode_sizes(engine):
        decode = _requests(engine, bs, [SamplingParams()] * bs)
        _step(engine, decode, "prefill")
        # the prompt first, the decode rows last: Batch.num_decode_rows
        _step(engine, _requests(engine, 3, [SamplingParams()], after=decode) + decode, "prefill")
    _warm_products(engine, _eager_prefill_counts(engine))
    if engine.fused_head is not None:
        engine.fused_head.warm(
            engine.model_config.hidden_size, engine.config.dtype, engine.graph_runner.bs_list
        )
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    rows = engine.config.max_running_req
    engine.page_table[:rows].zero_()
    engine.token_pool[:rows].zero_()
