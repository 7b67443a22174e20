"""What `LLM.generate` and `LLM.chat` return: a dict a completion (SGLang's offline shape, the keys below) that
also reads as vLLM's RequestOutput, so that both peoples' scripts run unchanged:

    out["text"], out["token_ids"], out["finish_reason"]             # SGLang's (and this project's) keys
    out.outputs[0].text, out.prompt, out.prompt_token_ids            # vLLM's attributes

One difference stays: with `n=k` a prompt has k outputs in a row (SGLang's shape), each with its one completion in
`outputs` (its `index` the choice's), where vLLM gives one RequestOutput with k completions. Log-probabilities are
{token id: float} dicts, where vLLM has Logprob objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CompletionOutput:
    """vLLM's CompletionOutput fields: one completion of a prompt."""

    index: int  # the choice of the prompt (0 .. n-1)
    text: str
    token_ids: list[int]
    # the sum of the chosen tokens' log-probabilities, where logprobs were asked for
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None  # "stop", "length", "abort", or "error"
    # the stop string or stop_token_ids id that ended it; None for EOS or a length
    stop_reason: int | str | None

    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput(dict):  # type: ignore[type-arg]
    """One completion's output as a dict (text, token_ids, finish_reason, stop_reason, error, prompt_tokens,
    cached_tokens, prompt_logprobs, logprobs) with vLLM's RequestOutput attributes over it."""

    def __init__(
        self,
        fields: dict[str, Any],
        request_id: int,
        prompt: str | None,
        prompt_token_ids: list[int],
        index: int,
    ) -> None:
        super().__init__(fields)
        self.request_id = str(request_id)
        self.prompt = prompt  # None where the prompt was given as token ids, as in vLLM
        self.prompt_token_ids = prompt_token_ids
        self.index = index

    @property
    def outputs(self) -> list[CompletionOutput]:
        logprobs = self["logprobs"]
        cumulative = None
        if logprobs is not None:
            cumulative = sum(lp[t] for t, lp in zip(self["token_ids"], logprobs) if t in lp)
        return [
            CompletionOutput(
                self.index, self["text"], self["token_ids"], cumulative, logprobs, self["finish_reason"],
                self["stop_reason"],
            )
        ]  # fmt: skip

    @property
    def finished(self) -> bool:
        return self["finish_reason"] is not None

    @property
    def prompt_logprobs(self) -> list[dict[int, float] | None] | None:
        return self["prompt_logprobs"]

    @property
    def num_cached_tokens(self) -> int:
        return self["cached_tokens"]
