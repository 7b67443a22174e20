"""The floor of a CPU workload: the fastest any engine could run it on this machine, step by step.

A step (one prefill of every prompt, then one decode step a token) takes at least the longer of
  - reading its bytes: every weight of the GGUF file once (the smallest format the engines run) plus
    the K and V of every running request's context (2 bytes a value, as minisgl's bf16 and
    llama.cpp's f16 caches), at the memory bandwidth measured here;
  - its matmul FLOPs: 2 x the weights of the matmuls (layers and LM head) a token, plus attention's
    4 x context x heads x head_dim a layer a token, at the best matmul rate measured here
    (bf16 or float32, whichever this CPU runs faster).
The sum over steps is the floor; its rate (tokens / floor) is the ceiling a figure is compared with.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class Machine:
    bytes_per_s: float
    flops: float

    def describe(self) -> str:
        return f"memory read {self.bytes_per_s / 1e9:.1f} GB/s, matmul {self.flops / 1e9:.0f} GFLOP/s"


@dataclass
class ModelCost:
    weight_bytes: int  # every tensor of the file, read once a step
    matmul_params: int  # weights a token multiplies (2-D tensors; a tied embedding counts as the LM head)
    layers: int
    qo_heads: int
    kv_heads: int
    head_dim: int

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


def _best_seconds(fn: object, iters: int) -> float:
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best


def measure_machine() -> Machine:
    """Best of several runs on the current torch threads: a 256 MB read and a 512x1024x3072 matmul."""
    big = torch.ones(64 * 1024 * 1024, dtype=torch.float32)
    read = big.numel() * 4 / _best_seconds(big.sum, 5)
    rates = []
    for dtype in (torch.bfloat16, torch.float32):
        a, b = torch.randn(512, 1024, dtype=dtype), torch.randn(1024, 3072, dtype=dtype)
        rates.append(2 * 512 * 1024 * 3072 / _best_seconds(lambda a=a, b=b: a @ b, 5))
    return Machine(read, max(rates))


def gguf_cost(path: str, layers: int, qo_heads: int, kv_heads: int, head_dim: int) -> ModelCost:
    from gguf import GGUFReader

    tensors = GGUFReader(path).tensors
    return ModelCost(
        weight_bytes=sum(int(t.n_bytes) for t in tensors),
        matmul_params=sum(int(t.n_elements) for t in tensors if len(t.shape) == 2),
        layers=layers,
        qo_heads=qo_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
    )


def floor_seconds(m: Machine, c: ModelCost, prompt_lens: list[int], output_lens: list[int]) -> float:
    """All requests admitted at once and prefilled in one step, then decoded together, each ending at its
    own length (the first output token comes from the prefill)."""
    attn = 4 * c.layers * c.qo_heads * c.head_dim  # FLOPs a token a context position

    def step(tokens: int, context: int, attention_pairs: int) -> float:
        read = c.weight_bytes + context * c.kv_bytes_per_token
        flops = 2 * c.matmul_params * tokens + attn * attention_pairs
        return max(read / m.bytes_per_s, flops / m.flops)

    # prefill: causal attention over each prompt, about p^2 / 2 pairs
    total = step(sum(prompt_lens), sum(prompt_lens), sum(p * p // 2 for p in prompt_lens))
    for k in range(1, max(output_lens)):
        context = sum(p + k for p, n in zip(prompt_lens, output_lens, strict=True) if n > k)
        if context:
            running = sum(n > k for n in output_lens)
            total += step(running, context, context)
    return total
