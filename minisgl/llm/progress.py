"""How far a generate call has got: its progress bar, and what it hands back when Ctrl-C stops it."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minisgl.message import DetokenizeMsg


class GenerateProgress:
    """A tqdm bar of finished prompts with the input and output tokens per second, as vLLM's LLM shows.

    The LLM calls `update` with every result message; `enabled=None` shows the bar only when stderr is
    a terminal, so logs and pipes get no carriage-return noise.
    """

    def __init__(self, total: int, enabled: bool | None = None) -> None:
        if enabled is None:
            enabled = sys.stderr.isatty()
        self.bar: Any = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="Processed prompts", unit="prompt", dynamic_ncols=True)
        self.finished: set[int] = set()
        self.input_tokens = self.output_tokens = 0
        self.start = self.shown = time.perf_counter()

    def update(self, msg: DetokenizeMsg) -> None:
        if self.bar is None:
            return
        self.input_tokens += msg.prompt_tokens
        self.output_tokens += int(msg.next_token >= 0)
        # a request can be answered twice (an abort racing its finish): it is counted once
        if msg.finished and msg.uid not in self.finished:
            self.finished.add(msg.uid)
            self.bar.update(1)
        self._show()

    def add_tokens(self, n: int) -> None:
        """n output tokens that end nothing (a step's plain tokens, TokenStepMsg)."""
        if self.bar is None:
            return
        self.output_tokens += n
        self._show()

    def _show(self) -> None:
        now = time.perf_counter()
        if now - self.shown >= self.bar.mininterval:
            self.shown = now
            elapsed = max(now - self.start, 1e-9)
            self.bar.set_postfix_str(
                f"est. speed input: {self.input_tokens / elapsed:.2f} toks/s, "
                f"output: {self.output_tokens / elapsed:.2f} toks/s"
            )

    def close(self) -> None:
        """Leave the bar as it stands; later updates change nothing."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a generate call; `outputs` has every prompt's output, in order.

    A request that finished keeps its text and finish reason; the others end with finish_reason
    "abort" and the tokens they had generated. Being a KeyboardInterrupt, it stops a script as
    Ctrl-C always does unless the caller catches it to keep what finished.
    """

    def __init__(self, outputs: list[dict[str, Any]]) -> None:
        for out in outputs:
            if out["finish_reason"] is None:  # still waiting to be scheduled: aborted too
                out["finish_reason"] = "abort"
        self.outputs = outputs
        self.num_finished = sum(o["finish_reason"] != "abort" for o in outputs)
        super().__init__(f"generation interrupted: {self.num_finished} of {len(outputs)} prompts finished")
