"""The LM head and temperature sampling in one kernel (minisgl/kernel/lm_sample.py) against the engine's two
launches (cuBLAS's float32 logits, then `sample_tokens`), on one GPU.

    python benchmark/offline/lm_sample.py [--models qwen3-0.6b,llama3-8b] [--rows 1,16,64,128,256] [--json out.json]

For each vocabulary shape and row count: the two launches, each alone and together, and the fused kernel at every
tile of the sweep, each first checked against the two launches (the same token on every row whose two best
scores are more than 1e-3 apart; float32 sums in another order may swap a near tie). Timed as 20 launches in one
CUDA graph, the median of 10 replays (`sampler_variants.graph_us`), us a launch; the weight is read from DRAM
every time (151,936 x 1,024 bf16 is 311 MB, far past L2). Half the rows greedy, half at temperature 0.6.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sampler_variants import graph_us  # noqa: E402

from minisgl.engine.sample import hash_uniform  # noqa: E402
from minisgl.kernel.lm_sample import LMSampleConfig, default_config, lm_head_sample  # noqa: E402
from minisgl.kernel.sampling import sample_tokens  # noqa: E402

SHAPES = {"qwen3-0.6b": (151936, 1024), "llama3-8b": (128256, 4096)}


def sweep(rows: int) -> list[LMSampleConfig]:
    m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    cands = [
        LMSampleConfig(m, n, k, w, s)
        for n in (64, 128, 256)
        for k in (64, 128)
        for w in (4, 8)
        for s in (3, 4)
    ]
    if rows >= 128:
        cands += [LMSampleConfig(128, n, 64, w, s) for n in (64, 128) for w in (4, 8) for s in (3, 4)]
    # a tile's shared memory: stages x (rows + cols) x depth x 2 bytes, at most what an H100 program can have
    return [c for c in cands if c.stages * (c.rows + c.cols) * c.depth * 2 <= 200 * 1024]


def close_rows(
    logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    noise = -torch.log2(-torch.log2(hash_uniform(seeds, steps, logits.shape[-1])))
    scaled = logits / torch.where(temps > 0, temps, 1.0)[:, None] * 1.4426950408889634 + noise
    top2 = torch.where(temps[:, None] > 0, scaled, logits).topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]) < 1e-3


def run_rows(name: str, weight: torch.Tensor, rows: int, full: bool, g: torch.Generator) -> dict:
    vocab, k = SHAPES[name]
    hidden = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    temps = torch.where(torch.arange(rows, device="cuda") % 2 == 0, 0.0, 0.6).float()
    seeds = torch.arange(rows, dtype=torch.int64, device="cuda") * 7 + 1
    steps = torch.full((rows,), 5, dtype=torch.int64, device="cuda")
    logits = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    want = sample_tokens(logits, temps, seeds, steps)
    near = close_rows(logits, temps, seeds, steps)

    def engine() -> torch.Tensor:
        return sample_tokens(torch.mm(hidden, weight.t(), out_dtype=torch.float32), temps, seeds, steps)

    res: dict = {
        "lm_head": graph_us(lambda: torch.mm(hidden, weight.t(), out_dtype=torch.float32)),
        "sample": graph_us(lambda: sample_tokens(logits, temps, seeds, steps)),
        "engine": graph_us(engine),
        "fused": {},
    }
    for cfg in sweep(rows) if full else [default_config(rows)]:
        name_cfg = ",".join(map(str, cfg))
        try:
            got = lm_head_sample(hidden, weight, vocab, temps, seeds, steps, cfg)
        except Exception as e:  # a tile the compiler refuses (shared memory, registers)
            res["fused"][name_cfg] = f"error: {type(e).__name__}"
            continue
        bad = int(((got != want) & ~near).sum())
        t = graph_us(lambda cfg=cfg: lm_head_sample(hidden, weight, vocab, temps, seeds, steps, cfg))
        res["fused"][name_cfg] = {"us": round(t, 2), "wrong": bad, "near": int(near.sum())}
    timed = {c: v["us"] for c, v in res["fused"].items() if isinstance(v, dict) and v["wrong"] == 0}
    best = min(timed, key=timed.__getitem__) if timed else None
    res["best"] = best
    default = ",".join(map(str, default_config(rows)))
    print(
        f"{name} rows={rows}: lm_head {res['lm_head']:.1f} + sample {res['sample']:.1f} = engine "
        f"{res['engine']:.1f} us; fused default {timed.get(default, float('nan')):.1f}, "
        f"best {best} {timed.get(best, float('nan')) if best else float('nan'):.1f} us",
        flush=True,
    )
    return res


def run_shape(name: str, rows_list: list[int], full: bool) -> dict:
    vocab, k = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(vocab, k, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    return {str(rows): run_rows(name, weight, rows, full, g) for rows in rows_list}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen3-0.6b,llama3-8b")
    p.add_argument("--rows", default="1,16,64,128,256")
    p.add_argument("--default-only", action="store_true", help="the default tiles only, no sweep")
    p.add_argument("--json", default="")
    args = p.parse_args()
    result = {
        "device": torch.cuda.get_device_name(),
        "results": {
            m: run_shape(m, [int(r) for r in args.rows.split(",")], not args.default_only)
            for m in args.models.split(",")
        },
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
