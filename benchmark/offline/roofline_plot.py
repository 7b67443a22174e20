"""Draw roofline.py's decode steps as a PNG: the measured step time of each batch size against its floor.

The floor of a step is the longer of its bytes (weights plus the batch's KV cache) over the copy
bandwidth and its FLOPs over the matmul rate, both measured in the same run (roofline.py's ceilings).
Both axes are logarithmic; the label over each point is measured / floor. Needs matplotlib.

    python benchmark/offline/roofline_plot.py roofline.json -o roofline.png
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def decode_rows(result: dict[str, Any]) -> list[tuple[int, float, float]]:
    """(batch size, measured ms, floor ms) of every decode step roofline.py measured, by batch size."""
    rows = []
    for key, step in result.get("steps", {}).items():
        if key.startswith("decode_bs"):
            floor = max(step["bandwidth_floor_ms"], step["flop_floor_ms"])
            rows.append((int(key.removeprefix("decode_bs")), step["graph_step_ms"], floor))
    return sorted(rows)


def plot(result: dict[str, Any], path: str) -> list[tuple[int, float, float]]:
    """Writes the PNG; returns the rows drawn."""
    rows = decode_rows(result)
    if not rows:
        raise ValueError("no decode steps in this result: run roofline.py with the steps section")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    sizes = [r[0] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(sizes, [r[1] for r in rows], "o-", color="#1a73e8", label="measured (CUDA graph replay)")
    ax.plot(sizes, [r[2] for r in rows], "s--", color="#5f6368", label="floor (bytes or FLOPs)")
    # the ratio and tick at powers of two and the largest batch: the steps measured every 16 rows above 32 would
    # print over each other on a log axis
    labelled = [s for s in sizes if s & (s - 1) == 0 or s == sizes[-1]]
    for bs, ms, floor in rows:
        if bs in labelled:
            ax.annotate(
                f"{ms / floor:.2f}x", (bs, ms), textcoords="offset points", xytext=(-4, 6), ha="right"
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_xticks(labelled, [str(s) for s in labelled])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("step time (ms)")
    ceil = result.get("ceilings", {})
    ax.set_title(
        f"{result.get('model', 'decode step')} on {result.get('device', '?')}: "
        f"{ceil.get('copy_tb_s', 0):.2f} TB/s, {ceil.get('matmul_tflops', 0):.0f} TFLOP/s",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="roofline.py's --json output")
    p.add_argument("-o", "--output", default="roofline.png")
    args = p.parse_args()
    with open(args.json) as f:
        rows = plot(json.load(f), args.output)
    for bs, ms, floor in rows:
        print(f"batch {bs:>4}: {ms:7.3f} ms, floor {floor:7.3f} ms, {ms / floor:.2f}x")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
