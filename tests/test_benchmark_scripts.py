"""Every benchmark script with a command line still starts: its imports resolve and `--help` answers.

The scripts reach into the engine (its modules, their names), and nothing else runs them here: a rename
in the engine broke one silently before. One subprocess runs each script's main with `--help` (argparse
exits 0 before any work), so torch is imported once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

# run inside the child: each script as __main__ with --help, the outcome of each as JSON
RUNNER = """
import json, runpy, sys, traceback
results = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    try:
        runpy.run_path(path, run_name="__main__")
        results[path] = "returned without printing its help"
    except SystemExit as e:
        results[path] = None if e.code in (0, None) else f"exit {e.code}"
    except BaseException:
        results[path] = traceback.format_exc(limit=3)
print("RESULTS" + json.dumps(results))
"""


def scripts() -> list[str]:
    found = []
    for folder in ("benchmark/offline", "benchmark/online"):
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            path = os.path.join(folder, name)
            if not name.endswith(".py"):
                continue
            source = open(os.path.join(ROOT, path)).read()
            if "argparse" in source and 'if __name__ == "__main__":' in source:
                found.append(path)
    return found


def test_every_benchmark_script_answers_help() -> None:
    paths = scripts()
    assert len(paths) >= 30  # the offline and online scripts with a command line
    env = dict(os.environ, PYTHONPATH=os.path.abspath(ROOT), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, *paths], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULTS")), None)
    assert line is not None, done.stderr[-3000:]
    failed = {path: why for path, why in json.loads(line[len("RESULTS") :]).items() if why}
    assert not failed, failed
