"""Draw a minisgl trace (MINISGL_TRACE / --trace) as a timeline PNG, for where Perfetto is not at hand.

One row per track (API server, tokenizer worker, scheduler host, device), slices coloured by what
they are (nested slices drawn thinner inside their parent), each request's flow as a line through
its points, and the scheduler's counters below. Needs matplotlib.

    python examples/plot_trace.py run.json -o run.png [--window 0 500]  # ms since the first arrival
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

COLORS = {
    "prefill": "#e8710a",
    "decode": "#1a73e8",
    "prepare": "#9aa0a6",
    "forward": "#34a853",
    "launch": "#34a853",
    "results": "#a142f4",
    "tokenize": "#f9ab00",
    "detokenize": "#12b5cb",
    "arrival": "#d93025",
    "queued": "#d93025",
}
OTHER = "#5f6368"
ORDER = ("API server", "tokenizer worker", "scheduler", "offline LLM")


def load(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return json.load(f)["traceEvents"]


def tracks(events: list[dict[str, Any]]) -> list[tuple[int, int, str]]:
    """(pid, tid, label) of every track with slices: processes in the order data flows, host before device."""
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    used = {(e["pid"], e["tid"]) for e in events if e["ph"] == "X"}

    def rank(key: tuple[int, int]) -> tuple[int, bool]:
        name = procs.get(key[0], "")
        first = next((i for i, p in enumerate(ORDER) if name.startswith(p)), len(ORDER))
        return first, threads.get(key, "").startswith("device")

    out = []
    for key in sorted(used, key=rank):
        thread = threads.get(key, "")
        label = thread.split(" (")[0] if thread.startswith("device") else procs.get(key[0], str(key[0]))
        out.append((*key, label))
    return out


def depths(slices: list[dict[str, Any]]) -> list[int]:
    """How deep each slice (in time order, parents first) nests on its track."""
    out, ends = [], []
    for s in slices:
        while ends and ends[-1] <= s["ts"]:
            ends.pop()
        out.append(len(ends))
        ends.append(s["ts"] + s["dur"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("-o", "--output", default=None, help="the PNG (default: the trace's name with .png)")
    p.add_argument(
        "--window", nargs=2, type=float, metavar=("START_MS", "END_MS"), help="draw only this span"
    )
    p.add_argument("--title", default=None)
    args = p.parse_args()
    events = load(args.trace)
    # time 0 is the first request's arrival: a server's start-up comes long before it
    t0 = min([e["ts"] for e in events if e["ph"] == "s"] or [e["ts"] for e in events if "ts" in e])
    lo, hi = args.window if args.window else (-5.0, float("inf"))

    def ms(ts: float) -> float:
        return (ts - t0) / 1000

    rows = tracks(events)
    row_of = {(pid, tid): i for i, (pid, tid, _) in enumerate(rows)}
    fig, (ax, ax_req, ax_cache) = plt.subplots(
        3,
        1,
        sharex=True,
        figsize=(16, 1.1 * len(rows) + 4.2),
        gridspec_kw={"height_ratios": [1.1 * len(rows), 1.6, 1.6]},
    )
    by_track: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X" and ms(e["ts"] + e["dur"]) >= lo and ms(e["ts"]) <= hi:
            by_track[e["pid"], e["tid"]].append(e)
    end_ms = max(ms(e["ts"] + e.get("dur", 0)) for e in events if "ts" in e)
    span = min(hi, end_ms) - lo
    for key, slices in by_track.items():
        y = len(rows) - 1 - row_of[key]
        for s, depth in zip(slices, depths(slices)):
            height = 0.7 if depth == 0 else 0.3
            bottom = y - 0.35 if depth == 0 else y - 0.33
            ax.broken_barh(
                [(ms(s["ts"]), max(s["dur"] / 1000, span / 4000))],
                (bottom, height),
                facecolors=COLORS.get(s["name"], OTHER),
                edgecolor="white",
                linewidth=0.3,
                zorder=2 + depth,
            )
            a = s.get("args", {})
            if "batch_size" in a and s["dur"] / 1000 > span / 60:
                ax.text(
                    ms(s["ts"] + s["dur"] / 2),
                    y + 0.12 if depth == 0 else y,
                    f"{a['batch_size']}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                    zorder=6,
                )
    # each request's flow: a line through its points, one colour per request
    flows: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["ph"] in "stf":
            flows[e["id"]].append(e)
    cmap = plt.get_cmap("tab10")
    for fid, points in flows.items():
        xs = [ms(p["ts"]) for p in points]
        ys = [len(rows) - 1 - row_of[p["pid"], p["tid"]] + 0.3 for p in points]
        ax.plot(xs, ys, "-o", color=cmap(fid % 10), linewidth=0.9, markersize=2.5, alpha=0.8, zorder=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([label for _, _, label in reversed(rows)])
    ax.set_ylim(-0.6, len(rows) - 0.4)
    shown = sorted({s["name"] for sl in by_track.values() for s in sl if s["name"] in COLORS})
    handles = [Patch(color=COLORS[n], label=n) for n in shown]
    handles.append(plt.Line2D([], [], color=cmap(1), marker="o", markersize=3, label="a request's flow"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(args.title or f"minisgl trace: {args.trace.rsplit('/', 1)[-1]}  (numbers: batch size)")
    ax.grid(axis="x", alpha=0.3)

    def counter(name: str) -> tuple[list[float], dict[str, list[float]]]:
        times, series = [], defaultdict(list)
        for e in events:
            if e["ph"] == "C" and e["name"] == name:
                times.append(ms(e["ts"]))
                for k, v in e["args"].items():
                    series[k].append(v)
        return times, series

    times, series = counter("requests")
    for k, values in series.items():
        ax_req.step(times, values, where="post", label=k)
    ax_req.set_ylabel("requests")
    ax_req.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax_req.grid(alpha=0.3)
    times, series = counter("prefix cache")
    ax_cache.step(times, [100 * v for v in series.get("hit rate", [])], where="post", color="#188038")
    ax_cache.set_ylabel("cache hit %", color="#188038")
    pages_t, pages = counter("kv pages")
    twin = ax_cache.twinx()
    twin.step(pages_t, pages.get("held", []), where="post", color="#9334e6", label="held")
    twin.step(pages_t, pages.get("cached", []), where="post", color="#9aa0a6", label="cached")
    twin.set_ylabel("KV pages")
    twin.legend(loc="upper left", bbox_to_anchor=(1.04, 1.0), fontsize=8, frameon=False)
    ax_cache.grid(alpha=0.3)
    ax_cache.set_xlabel("ms since the first arrival")
    ax_cache.set_xlim(lo, min(hi, end_ms))
    fig.tight_layout()
    out = args.output or args.trace.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
