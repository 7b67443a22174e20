"""A decode step's GEMMs with the kernels before them, with and without the L2 prefetch (kernel/prefetch.py).

    python benchmark/offline/l2_prefetch.py [--rows 1,8,16,64,128,256]

For the Qwen3-0.6B shape, every layer: RMSNorm -> q|k|v, o, RMSNorm -> gate|up, SiLU -> down, each layer its
own weights (none stays in L2 from one step to the next, as in a real step), captured in one CUDA graph
and replayed. Three ways: no prefetch; the norms and SiLU asking the next GEMM's weight into L2; and every
layer reading layer 0's weights ("hot"), the most that L2-resident weights could give. Prints ms a step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from skinny_gemm import graph_ms  # noqa: E402

from minisgl.kernel.activation import silu_and_mul  # noqa: E402
from minisgl.kernel.norm import rms_norm_residual  # noqa: E402

LAYERS, HIDDEN, QKV, Q, INTER = 28, 1024, 4096, 2048, 3072


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,16,64,128,256")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02

    layers = [
        {
            "qkv": rand(QKV, HIDDEN),
            "o": rand(HIDDEN, Q),
            "gate_up": rand(2 * INTER, HIDDEN),
            "down": rand(HIDDEN, INTER),
        }
        for _ in range(LAYERS)
    ]
    norm_w = torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16)
    out: dict = {"device": torch.cuda.get_device_name(dev), "rows": {}}
    for m in [int(r) for r in args.rows.split(",")]:
        x0, r0 = rand(m, HIDDEN), rand(m, HIDDEN)

        def run(prefetch: bool, hot: bool, x0: torch.Tensor = x0, r0: torch.Tensor = r0) -> None:
            x, res = x0, r0
            for i in range(LAYERS):
                w = layers[0 if hot else i]
                h, res = rms_norm_residual(x, res, norm_w, 1e-6, w["qkv"] if prefetch else None)
                qkv = F.linear(h, w["qkv"])
                x = F.linear(qkv[:, :Q], w["o"])
                h, res = rms_norm_residual(x, res, norm_w, 1e-6, w["gate_up"] if prefetch else None)
                act = silu_and_mul(F.linear(h, w["gate_up"]), w["down"] if prefetch else None)
                x = F.linear(act, w["down"])

        row = {
            "off_ms": graph_ms(lambda: run(False, False)),
            "prefetch_ms": graph_ms(lambda: run(True, False)),
            "hot_ms": graph_ms(lambda: run(False, True)),
            "off_again_ms": graph_ms(lambda: run(False, False)),
        }
        out["rows"][m] = row
        print(
            f"rows {m:4d}: off {row['off_ms']:.3f} ms ({row['off_again_ms']:.3f} again), "
            f"prefetch {row['prefetch_ms']:.3f}, hot weights {row['hot_ms']:.3f}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
