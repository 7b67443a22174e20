"""Whether a run's decode steps wait on the host or on the device, by batch size, from its timeline trace.

    python benchmark/offline/trace_steps.py run.json [--buckets 16,32,64,128,192,256] [--json out.json]

For each range of decode batch sizes: the steps in it, the host's time a step (its `decode` slice: prepare and
launch, then its `results` slice), the host's own work in the results slice (after the device finished the step)
and the host's busy time (prepare, launch and that work), the device's time a step (`device_us`, CUDA events) and
the period between the starts of consecutive steps on the device. A device that is the bound runs its steps back
to back (the period equals its time); the gap between them is time it waited for the host to queue the next step.

Then the whole run on the device's clock (`timeline`): from the first arrival (an offline run: the `generate`
call) to the last answer, the device's time in prefill and in decode steps, and its idle time before the first
step, between steps (by the kind of the step that follows), and after the last step.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any

DEVICE_TID = 1 << 30  # minisgl/utils/trace.py: the device track's thread id, added to the scheduler's pid


def load(path: str) -> list[dict[str, Any]]:
    data = json.load(open(path))
    return data["traceEvents"] if isinstance(data, dict) else data


def step_rows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row a decode step: batch, host slices' microseconds, device start and time."""
    host: dict[int, dict[str, Any]] = {}
    results: dict[int, tuple[float, float]] = {}  # the results slice's begin and end
    device: dict[int, tuple[float, float]] = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        args = e.get("args") or {}
        step = args.get("step")
        if step is None:
            continue
        if e["name"] == "results":
            results[step] = (e["ts"], e["ts"] + e["dur"])
        elif e["name"] == "decode":
            if e["tid"] >= DEVICE_TID:
                device[step] = (e["ts"], e["ts"] + e["dur"])
            else:
                host[step] = {"step": step, "batch": args["batch_size"], "host_us": e["dur"]} | {
                    k: args[k] for k in ("prepare_us", "launch_us", "forward_us", "device_us") if k in args
                }
    rows = []
    for step in sorted(host):
        r = host[step]
        if step in results:
            begin, end = results[step]
            r["host_us"] += end - begin
            if step in device:
                # the results slice first waits for the device to finish the step: the rest is the host's own
                # work, which with prepare and launch is the host's busy time a step
                r["results_us"] = end - max(begin, device[step][1])
                r["host_busy_us"] = r.get("prepare_us", 0.0) + r.get("launch_us", 0.0) + r["results_us"]
        if step in device:
            r["device_ts"] = device[step][0]
        rows.append(r)
    starts = [r for r in rows if "device_ts" in r]
    for a, b in zip(starts, starts[1:]):
        if b["step"] == a["step"] + 1:
            a["period_us"] = b["device_ts"] - a["device_ts"]
    return rows


def summarise(rows: list[dict[str, Any]], buckets: list[int]) -> list[dict[str, Any]]:
    groups: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[next((b for b in buckets if r["batch"] <= b), buckets[-1])].append(r)
    out = []
    lo = 0
    for b in buckets:
        g = groups.get(b, [])
        timed = [r for r in g if "period_us" in r and "device_us" in r]
        if g:
            mean = lambda key, rs=g: sum(r.get(key, 0.0) for r in rs) / len(rs)  # noqa: E731
            row = {
                "batches": f"{lo + 1}-{b}",
                "steps": len(g),
                "host_us": mean("host_us"),
                "prepare_us": mean("prepare_us"),
                "launch_us": mean("launch_us"),
                "results_us": mean("results_us"),
                "host_busy_us": mean("host_busy_us"),
                "device_us": mean("device_us"),
                "period_us": mean("period_us", timed) if timed else None,
                "device_idle_us": (
                    sum(r["period_us"] - r["device_us"] for r in timed) / len(timed) if timed else None
                ),
            }
            out.append(row)
        lo = b
    return out


def timeline(events: list[dict[str, Any]]) -> dict[str, float]:
    """Where the run's wall time is on the device: busy by step kind, idle before, between and after the steps
    (seconds). Idle between steps is charged to the kind of the step that follows it."""
    slices = [e for e in events if e.get("ph") == "X"]
    arrivals = [e["ts"] for e in slices if e["name"] == "arrival"]
    # a request's last flow point: `answer` offline, `reply` from the server
    answers = [e["ts"] for e in events if (e.get("args") or {}).get("step") in ("answer", "reply")]
    steps = sorted(
        (e for e in slices if e["tid"] >= DEVICE_TID and e["name"] in ("prefill", "decode")),
        key=lambda e: e["ts"],
    )
    if not arrivals or not answers or not steps:
        return {}
    begin, end = min(arrivals), max(answers)
    out: dict[str, float] = defaultdict(float)
    out["wall_s"] = end - begin
    out["idle_before_first_step_s"] = steps[0]["ts"] - begin
    out["idle_after_last_step_s"] = end - (steps[-1]["ts"] + steps[-1]["dur"])
    prev_end = steps[0]["ts"]
    for e in steps:
        kind = e["name"]
        out[f"{kind}_steps"] += 1
        out[f"{kind}_busy_s"] += e["dur"]
        out[f"idle_before_{kind}_s"] += max(0.0, e["ts"] - prev_end)
        prev_end = e["ts"] + e["dur"]
    return {k: v if k.endswith("_steps") else v / 1e6 for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--buckets", default="16,32,64,128,192,256")
    p.add_argument("--json")
    args = p.parse_args()
    events = load(args.trace)
    rows = step_rows(events)
    table = summarise(rows, sorted(int(b) for b in args.buckets.split(",")))
    print(
        f"{'batches':>9} {'steps':>6} {'host':>8} {'prepare':>8} {'launch':>8} {'results':>8} {'busy':>8} "
        f"{'device':>8} {'period':>8} {'idle':>7}"
    )
    for r in table:
        fmt = lambda v: f"{v:8.0f}" if v is not None else f"{'-':>8}"  # noqa: E731
        print(
            f"{r['batches']:>9} {r['steps']:6d} {fmt(r['host_us'])} {fmt(r['prepare_us'])} {fmt(r['launch_us'])} "
            f"{fmt(r['results_us'])} {fmt(r['host_busy_us'])} {fmt(r['device_us'])} {fmt(r['period_us'])} "
            f"{fmt(r['device_idle_us'])[1:]}"
        )
    total_device = sum(r.get("device_us", 0.0) for r in rows)
    total_period = sum(r.get("period_us", 0.0) for r in rows)
    print(
        f"decode: {len(rows)} steps, device {total_device / 1e6:.3f} s, device periods {total_period / 1e6:.3f} s"
    )
    whole = timeline(events)
    if whole:
        print(
            f"timeline: wall {whole['wall_s']:.3f} s; device busy in prefill {whole.get('prefill_busy_s', 0.0):.3f} s "
            f"({int(whole.get('prefill_steps', 0))} steps), in decode {whole.get('decode_busy_s', 0.0):.3f} s; idle "
            f"before the first step {whole['idle_before_first_step_s']:.3f} s, before prefill steps "
            f"{whole.get('idle_before_prefill_s', 0.0):.3f}, before decode steps {whole.get('idle_before_decode_s', 0.0):.3f}, "
            f"after the last step {whole['idle_after_last_step_s']:.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "buckets": table,
                    "device_s": total_device / 1e6,
                    "period_s": total_period / 1e6,
                    "timeline": whole,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
