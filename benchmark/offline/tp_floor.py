"""The memory floor of the upstream offline workload's decode at tensor parallelism N, dense or MoE.

    python benchmark/offline/tp_floor.py llama3-8b --tp 1 2
    python benchmark/offline/tp_floor.py qwen3-30b-a3b --tp 2
Decode is bound by the bytes each step reads: each rank reads its share of the weights and of the KV
cache. For a mixture of experts a step reads only the experts its tokens are routed to: with b tokens
each picking k of E experts (taken as uniform, which random weights come close to), a layer touches
E * (1 - (1 - k/E)^b) distinct experts on average. The batch at each step follows the workload's output
lengths (every request admitted at once, as the engine does with 256 rows). Bandwidth: the H200's
measured copy rate (4.3 TB/s). Prefill is counted by its FLOPs at the measured bf16 matmul rate.
Nothing here runs on a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

COPY_TB_S = 4.3  # H200, device-to-device copy, bytes read plus written (docs/benchmarks.md)
MATMUL_TFLOPS = 780.0  # H200, 8192^3 bf16 on random data
BYTES = 2  # bf16


def model_bytes(cfg: dict) -> tuple[float, float, float]:
    """(bytes of the weights every token reads, bytes of one expert of one layer, KV bytes per token)."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim", h // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    attn = h * (q + 2 * kv) + q * h
    heads = cfg["vocab_size"] * h * (1 if cfg.get("tie_word_embeddings") else 2)
    if "num_experts" in cfg:
        expert = 3 * h * cfg["moe_intermediate_size"] * BYTES
        dense = (layers * (attn + h * cfg["num_experts"]) + heads) * BYTES  # the router is read by all
    else:
        expert = 0.0
        dense = (layers * (attn + 3 * h * cfg["intermediate_size"]) + heads) * BYTES
    kv_per_token = layers * 2 * kv * BYTES
    return dense, expert, kv_per_token


def decode_floor_s(cfg: dict, prompt_lens: list[int], output_lens: list[int], tp: int) -> float:
    dense, expert, kv_per_token = model_bytes(cfg)
    layers, e, k = cfg["num_hidden_layers"], cfg.get("num_experts", 0), cfg.get("num_experts_per_tok", 0)
    total = 0.0
    for step in range(max(output_lens)):
        live = [(p, o) for p, o in zip(prompt_lens, output_lens) if o > step]
        b = len(live)
        touched = e * (1 - (1 - k / e) ** b) if e else 0.0
        context = sum(p + step for p, _ in live)
        step_bytes = dense + layers * touched * expert + context * kv_per_token
        total += step_bytes / tp / (COPY_TB_S * 1e12)
    return total


def prefill_floor_s(cfg: dict, prompt_lens: list[int], tp: int) -> float:
    dense, expert, _ = model_bytes(cfg)
    active = dense + cfg["num_hidden_layers"] * cfg.get("num_experts_per_tok", 0) * expert
    flops = 2 * (active / BYTES) * sum(prompt_lens)
    return flops / tp / (MATMUL_TFLOPS * 1e12)


def main() -> None:
    from bench import make_workload
    from random_checkpoint import SHAPES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--num-requests", type=int, default=256)
    args = p.parse_args()
    cfg = SHAPES[args.shape][1]
    work = make_workload(args.num_requests, 100, 1024, cfg["vocab_size"], 0)
    prompt_lens = [len(x) for x in work.prompts]
    out_tokens = sum(work.output_lens)
    dense, expert, kv = model_bytes(cfg)
    print(
        f"{args.shape}: {dense / 1e9:.2f} GB read by every step, {expert / 1e6:.1f} MB per expert, "
        f"{kv / 1e3:.1f} KB of KV per token; {out_tokens} output tokens"
    )
    for tp in args.tp:
        d, pf = decode_floor_s(cfg, prompt_lens, work.output_lens, tp), prefill_floor_s(cfg, prompt_lens, tp)
        print(
            f"tp={tp}: decode floor {d:.2f} s + prefill floor {pf:.2f} s = {d + pf:.2f} s "
            f"({out_tokens / (d + pf):,.0f} output tok/s)"
        )


if __name__ == "__main__":
    main()
