"""Where the host's time goes for one request at a time: cProfile over `LLM.generate` calls.

    python benchmark/offline/host_profile.py [--model ckpt/qwen3-0.6b] [--device cuda] [--len 16]
        [--max-tokens 1] [--requests 20] [--out DIR]

At one request the first token's time is the host's (a 1,024-token prompt's first token takes no longer
than a 16-token one's on an H200): the scheduler's loop, the batch's preparation, and one Python call a
kernel launch. This runs `--requests` one-request generate calls after three to warm up, prints their
median wall time, then the same calls under cProfile, and prints (and writes under --out) the functions
that take the most time by their own time and with what they call.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def print_tables(prof: cProfile.Profile, top: int, out: str | None, name: str) -> None:
    """The profile's `top` functions by their own time and with what they call, printed and, with `out`, written
    there as NAME_tottime.txt and NAME_cumulative.txt."""
    for sort in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(top)
        text = buf.getvalue()
        print(f"== by {sort}\n{text}")
        if out:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, f"{name}_{sort}.txt"), "w") as f:
                f.write(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint folder (default: the embedded default model)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--len", type=int, default=16, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--top", type=int, default=40, help="rows of each table")
    p.add_argument("--out", help="a folder for the tables and the raw profile")
    args = p.parse_args()
    from minisgl import LLM, SamplingParams

    llm = LLM(args.model, device=args.device, max_running_req=8)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    seed = [0]

    def one() -> float:
        seed[0] += 1
        prompt = [(1000 + 7 * seed[0] + 13 * j) % 30000 + 100 for j in range(args.len)]
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return (time.perf_counter() - start) * 1e3

    for _ in range(3):
        one()
    wall = [one() for _ in range(args.requests)]
    print(
        f"{args.len} prompt tokens, {args.max_tokens} output: {statistics.median(wall):.2f} ms a request (median)"
    )
    prof = cProfile.Profile()
    prof.enable()
    profiled = [one() for _ in range(args.requests)]
    prof.disable()
    print(f"under cProfile: {statistics.median(profiled):.2f} ms a request (median)")
    llm.shutdown()
    print_tables(prof, args.top, args.out, "host_profile")
    if args.out:
        prof.dump_stats(os.path.join(args.out, "host_profile.prof"))


if __name__ == "__main__":
    main()
