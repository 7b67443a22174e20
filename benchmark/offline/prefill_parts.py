"""A workload prefill step's attention, SiLU and rotary kernels, each way the engine can run them, on one GPU.

    python benchmark/offline/prefill_parts.py [--json out.json]

For the Qwen3-0.6B and Llama-3-8B shapes, one layer at 8,192 tokens (the workload's prefill steps: prompts
of 100-1,024 tokens, `random.seed(0)`'s first ones, and one 8,192-token prompt): the engine's Triton extend
kernel against torch's flash kernel (FlashAttention-2 with variable lengths, `aten._flash_attention_forward`)
on each request's K/V gathered from the pool into contiguous tensors (with and without building the
gather's slots, which a step would do once for all its layers), SiLU with its row scale by programs of
1,024 columns or a program a row, and the rotary kernel (row scale, K/V stored) in three programs a token or
one. Medians of CUDA-event timings, ms. The flash path lives here only: it measured slower than the extend
kernel (docs/benchmarks.md, "Prefill's row-scaled kernels, and torch's flash kernel").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from roofline import bench_ms  # noqa: E402

from minisgl.attention.base import KVDestination  # noqa: E402
from minisgl.kernel import activation  # noqa: E402
from minisgl.kernel.attention import extend_attention  # noqa: E402
from minisgl.kernel.rotary import apply_rotary  # noqa: E402
from minisgl.layers.rotary import RotaryEmbedding  # noqa: E402


@dataclass
class VarlenMetadata:
    cu_q: torch.Tensor  # [B + 1] int32: where each request's queries start in the packed q, then the total
    cu_k: torch.Tensor  # [B + 1] int32: the same for the gathered K/V (each request's whole context)
    slots: torch.Tensor  # [sum of contexts] int64: the pool slot of every context token, request by request
    max_q: int
    max_k: int


def varlen_metadata(
    page_table: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, q_lens: list[int], ctx_lens: list[int]
) -> VarlenMetadata:
    """rows, lens: [B] int32 on the device (each request's page-table row and context length after the step);
    q_lens, ctx_lens: the same counts on the host. One host-to-device copy and a few small kernels a step."""
    cu_q, cu_k = [0], [0]
    for nq, nk in zip(q_lens, ctx_lens):
        cu_q.append(cu_q[-1] + nq)
        cu_k.append(cu_k[-1] + nk)
    device = page_table.device
    cu = torch.tensor([cu_q, cu_k], dtype=torch.int32, pin_memory=device.type == "cuda")
    cu = cu.to(device, non_blocking=True)
    total = cu_k[-1]
    # token j of the gathered context is position j - cu_k[b] of request b, in row rows[b] of the page table
    row_of = torch.repeat_interleave(rows.long(), lens.long(), output_size=total)
    start_of = torch.repeat_interleave(cu[1, :-1].long(), lens.long(), output_size=total)
    pos = torch.arange(total, device=device) - start_of
    slots = page_table[row_of, pos].long()
    return VarlenMetadata(cu[0], cu[1], slots, max(q_lens), max(ctx_lens))


def varlen_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: VarlenMetadata, scale: float
) -> torch.Tensor:
    """q: [T, Hq, D] packed by request (this step's queries); k_cache, v_cache: the layer's pool [slots, Hk, D]
    with this step's K/V already stored. -> [T, Hq, D], causal over each request's whole context."""
    k = k_cache.index_select(0, meta.slots)
    v = v_cache.index_select(0, meta.slots)
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k, 0.0, True, False, scale=scale
    )[0]
    return out


SHAPES = {"qwen3-0.6b": (16, 8, 128, 1024, 3072), "llama3-8b": (32, 8, 128, 4096, 14336)}


def workload_step(tokens: int = 8192) -> list[int]:
    random.seed(0)
    lens, total = [], 0
    while total < tokens:
        n = min(random.randint(100, 1024), tokens - total)
        lens.append(n)
        total += n
    return lens


def attention_case(hq: int, hk: int, d: int, lens: list[int]) -> dict[str, float]:
    dev, dt = torch.device("cuda"), torch.bfloat16
    t = sum(lens)
    slots = t + 64
    k_cache = torch.randn(slots, hk, d, device=dev, dtype=dt)
    v_cache = torch.randn(slots, hk, d, device=dev, dtype=dt)
    perm = torch.randperm(slots, device=dev)[:t].to(torch.int32)
    table = torch.zeros(len(lens), max(lens), dtype=torch.int32, device=dev)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    for i, (s, n) in enumerate(zip(starts, lens)):
        table[i, :n] = perm[s : s + n]
    rows = torch.arange(len(lens), dtype=torch.int32, device=dev)
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    q_starts = torch.tensor(starts, dtype=torch.int32, device=dev)
    q = torch.randn(t, hq, d, device=dev, dtype=dt)
    scale = d**-0.5

    def extend() -> torch.Tensor:
        return extend_attention(q, k_cache, v_cache, table, rows, seq, q_starts, seq, max(lens), scale)

    def flash() -> torch.Tensor:
        return varlen_attention(q, k_cache, v_cache, meta, scale)

    def flash_and_metadata() -> torch.Tensor:
        return varlen_attention(q, k_cache, v_cache, varlen_metadata(table, rows, seq, lens, lens), scale)

    def gather() -> None:
        k_cache.index_select(0, meta.slots)
        v_cache.index_select(0, meta.slots)

    meta = varlen_metadata(table, rows, seq, lens, lens)
    torch.testing.assert_close(flash().float(), extend().float(), atol=2e-2, rtol=2e-2)
    return {
        "extend kernel": bench_ms(extend),
        "flash, gather included": bench_ms(flash),
        "flash and its metadata": bench_ms(flash_and_metadata),
        "gather alone": bench_ms(gather),
    }


def silu_case(hidden: int, inter: int, t: int = 8192) -> dict[str, float]:
    x = torch.randn(t, 2 * inter, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
    out = {}
    for label, whole in (("programs of 1024 columns", 1 << 30), ("a program a row", 1024)):
        activation.ROWS_WHOLE = whole
        out[label] = bench_ms(lambda: activation.silu_and_mul(x, (h, 1e-6)))
    activation.ROWS_WHOLE = 1024
    return out


def rotary_case(hq: int, hk: int, d: int, hidden: int, t: int = 8192) -> dict[str, float]:
    dev, dt = torch.device("cuda"), torch.bfloat16
    qkv = torch.randn(t, (hq + 2 * hk) * d, device=dev, dtype=dt)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
    h = torch.randn(t, hidden, device=dev, dtype=dt)
    cos_sin = RotaryEmbedding(d, t, 10000.0, None).cos_sin.to(dev)
    pos = torch.arange(t, device=dev)
    cache = torch.zeros(t, hk, d, device=dev, dtype=dt)
    one = torch.ones(1, device=dev)
    dest = KVDestination(cache, cache.clone(), torch.arange(t, device=dev), one, one)
    return {
        f"{'three programs' if split else 'one program'} a token": bench_ms(
            lambda split=split: apply_rotary(pos, q, k, cos_sin, None, v, dest, split, (h, 1e-6))
        )
        for split in (True, False)
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results: dict = {}
    for name, (hq, hk, d, hidden, inter) in SHAPES.items():
        res = {
            "attention, workload step": attention_case(hq, hk, d, workload_step()),
            "attention, one 8192-token prompt": attention_case(hq, hk, d, [8192]),
            "silu, 8192 rows": silu_case(hidden, inter),
            "rotary with row scale and K/V store, 8192 tokens": rotary_case(hq, hk, d, hidden),
        }
        results[name] = res
        for part, timed in res.items():
            print(f"{name} {part}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in timed.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
