"""profile_summary.py: py-spy's collapsed stacks of the server's processes, a share for each thread."""

from __future__ import annotations

import os
import sys
import tarfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmark", "online"))

from profile_summary import load, report  # noqa: E402

STACKS = """\
thread (0x1);<module> (minisgl/__main__.py:52);Runner.run (asyncio/runners.py:118) 90
thread (0x1);<module> (minisgl/__main__.py:52);create_app.<locals>.completions (minisgl/server/api_server.py:739);dumps (json/__init__.py:231) 10
thread (0x2);Thread._bootstrap (threading.py:1030);wait (multiprocessing/connection.py:1136);_PollLikeSelector.select (selectors.py:415) 100
not a stack line
"""


def test_each_thread_gets_its_waiting_loop_and_minisgl_shares(tmp_path) -> None:
    (tmp_path / "profile_42.txt").write_text(STACKS)
    (tmp_path / "profile_pids.txt").write_text("42 python -m minisgl --model m\n")
    archive = tmp_path / "profile.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for name in ("profile_42.txt", "profile_pids.txt"):
            tar.add(tmp_path / name, arcname=name)
    main, watcher = load([str(archive)])
    assert main.name == "pid 42 python -m minisgl --model m thread (0x1)"
    assert (main.samples, main.in_loop, main.waiting) == (100, 90, 0)
    assert main.inclusive["create_app.<locals>.completions (minisgl/server/api_server.py:739)"] == 10
    assert (watcher.samples, watcher.waiting, watcher.in_loop) == (100, 100, 0)
    assert "waiting   0.0%, in the event loop's C code  90.0%" in report(main)
