"""The extend_sweep.py configuration with the least time relative to the engine's, summed over the cases,
as prefill_latency.py's --extend-tiles takes it.

    python benchmark/offline/extend_pick.py sweep.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main() -> None:
    rows = json.load(open(sys.argv[1]))
    engine = {r["case"]: r["ms"] for r in rows if r["config"] == "engine"}
    score: dict[tuple, float] = defaultdict(float)
    seen: dict[tuple, int] = defaultdict(int)
    for r in rows:
        if isinstance(r["config"], list) and "ms" in r and r.get("max_diff", 0) <= 0.05:
            key = tuple(r["config"])
            score[key] += r["ms"] / engine[r["case"]]
            seen[key] += 1
    best = min((k for k in score if seen[k] == len(engine)), key=lambda k: score[k])
    print(",".join(map(str, best)))


if __name__ == "__main__":
    main()
