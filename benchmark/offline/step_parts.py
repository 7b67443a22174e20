"""What a decode step would take without one kind of its small kernels: the ceiling of fusing them away.

    python benchmark/offline/step_parts.py --model FOLDER --drop norms --json norms.json
    python benchmark/offline/step_parts.py --compare none.json norms.json silu.json rotary.json

Before fusing a kind of kernel into its neighbours (the norms into the GEMMs after them, SiLU into a GEMM,
the rotary kernel into attention), its largest possible gain is the step without it. `--drop` patches the
model's layers before the engine captures its decode graphs, then times every captured batch size as
`roofline.py --sections steps` does (graph replays on the workload's contexts halfway):
  none    the engine as it is;
  norms   every layer's two RMSNorms (and their residual adds) launch nothing (with MINISGL_FOLD_NORMS=0:
          folded into the projections, the default on CUDA, there are no norm launches to drop);
  silu    silu(gate) * up launches nothing (the down projection reads the gate half in place);
  rotary  the rotary kernel (q/k norm, rotation, K/V store) launches nothing, inside attention too;
  rope-serial  not a part dropped but the rotary kernel as it was before 2026-12-03, one program a token
          doing q, k and v in turn instead of three side by side (a negative saving is what the split gains).
The outputs are meaningless with a part dropped; the kernels left read and write what they did, so their
time is what it was. `--compare` prints each dropped part's saving by batch size against the first file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def drop(part: str) -> None:
    """Patch the layers so that `part` launches nothing (before the engine is built)."""
    if part == "none":
        return
    if part == "norms":
        from minisgl.layers.norm import RMSNorm

        def no_norm(self: RMSNorm, x: object, residual: object) -> tuple[object, object]:
            return x, x if residual is None else residual

        RMSNorm.forward_with_residual = no_norm  # type: ignore[method-assign,assignment]
    elif part == "silu":
        import minisgl.models.llama as llama

        llama.silu_and_mul = lambda x: x.narrow(-1, 0, x.shape[-1] // 2)  # type: ignore[attr-defined]
    elif part == "rotary":
        from minisgl.attention.triton_backend import TritonAttnBackend
        from minisgl.layers.rotary import RotaryEmbedding

        RotaryEmbedding.forward = lambda self, positions, q, k, v=None, dest=None: (q, k)  # type: ignore[method-assign]
        RotaryEmbedding.forward_with_qk_norm = (  # type: ignore[method-assign]
            lambda self, positions, q, k, q_norm, k_norm, v=None, dest=None: (q, k)
        )
        TritonAttnBackend.fuses_decode_rope = lambda self, batch, q: False  # type: ignore[method-assign]
    elif part == "rope-serial":
        from functools import partial

        import minisgl.kernel.rotary as rotary

        rotary.apply_rotary = partial(rotary.apply_rotary, split=False)  # type: ignore[assignment]
    else:
        raise SystemExit(f"--drop {part!r}: one of none, norms, silu, rotary, rope-serial")


def compare(paths: list[str]) -> None:
    runs = {os.path.splitext(os.path.basename(p))[0]: json.load(open(p))["steps"] for p in paths}
    base_name, base = next(iter(runs.items()))
    sizes = sorted(int(k[len("decode_bs") :]) for k in base if k.startswith("decode_bs"))
    print(f"decode graph step, ms ({base_name}) and what each dropped part saves:")
    for bs in sizes:
        ms = base[f"decode_bs{bs}"]["graph_step_ms"]
        parts = ", ".join(
            f"{name} -{ms - run[f'decode_bs{bs}']['graph_step_ms']:.3f}"
            for name, run in runs.items()
            if name != base_name and f"decode_bs{bs}" in run
        )
        print(f"  bs={bs:3d}: {ms:.3f}; {parts}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--drop", default="none")
    ap.add_argument("--json", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument(
        "--graph-bs", default=None, help="comma-separated decode graph sizes (default: the engine's)"
    )
    ap.add_argument(
        "--compare", nargs="+", default=None, help="JSON files of this script, the first the base"
    )
    args = ap.parse_args()
    if args.compare:
        compare(args.compare)
        return
    if not args.model or not args.json:
        raise SystemExit("--model and --json are needed to measure (or --compare FILES)")
    import torch
    from roofline import ceilings, steps

    drop(args.drop)
    result = {"drop": args.drop, "device": torch.cuda.get_device_name(), "ceilings": ceilings()}
    torch.cuda.empty_cache()
    with torch.inference_mode():  # the graphs' static buffers are inference tensors
        graph_bs = [int(b) for b in args.graph_bs.split(",")] if args.graph_bs else None
        result["steps"] = steps(args.model, result["ceilings"], args.kv_cache_dtype, graph_bs)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
