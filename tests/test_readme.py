"""The README's offline example runs as written on the default model: a change to LLM's interface that the README
does not follow fails here, not in a newcomer's first minute."""

from __future__ import annotations

import contextlib
import io
import os
import re

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _offline_example() -> str:
    text = open(README, encoding="utf-8").read()
    found = re.search(r"Offline, many prompts at once:\s*```python\n(.*?)```", text, re.S)
    assert found, "the README's offline example is gone"
    return found.group(1)


def test_the_offline_example_runs_as_written() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_offline_example(), "README.md", "exec"), {})
    printed = out.getvalue()
    assert "Paris" in printed.splitlines()[-1], printed  # the chat line, greedy on the default model
    assert printed.count("length") + printed.count("stop") >= 2, printed  # each prompt's finish_reason
