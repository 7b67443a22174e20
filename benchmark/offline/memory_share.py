"""`gpu_memory_utilization` on a GPU: the share of the device's memory in use once an engine has started (weights, KV
pool, graphs) against the share asked for, and a few requests answered.

    python benchmark/offline/memory_share.py --model FOLDER [--shares 0.3,0.6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def one(model: str, share: float) -> dict[str, float]:
    import torch

    from minisgl import LLM, SamplingParams

    llm = LLM(model, gpu_memory_utilization=share)
    out = llm.generate(["The capital of France is"] * 4, SamplingParams(max_tokens=8, ignore_eos=True))
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {
        "asked": share,
        "in_use": 1 - free / total,
        "kv_pages": float(llm.engine.num_pages),
        "answers": float(sum(len(o["token_ids"]) for o in out)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--shares", default="0.3,0.6")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.model, args.one)))
        return
    rows = []
    for share in (
        float(s) for s in args.shares.split(",")
    ):  # a fresh process each: the memory is the engine's
        res = subprocess.run(
            [sys.executable, __file__, "--model", args.model, "--one", str(share)],
            capture_output=True,
            text=True,
        )
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
        row = json.loads(lines[-1]) if lines else {"asked": share, "error": res.stderr[-400:]}
        print(row, flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
