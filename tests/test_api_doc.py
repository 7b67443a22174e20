"""docs/api.md is the API's field table: every field a request model accepts must be in it, so a
field added to the server without a word in the table fails here."""

from __future__ import annotations

import os
import re

import pytest

from minisgl.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerateRequest,
    GenerateSamplingParams,
)
from minisgl.server.responses import ResponsesRequest
from minisgl.server.tokens_api import DetokenizeRequest, TokenizeRequest

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "api.md")


def _section(title: str) -> str:
    text = open(DOC).read()
    start = text.index(title)
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _documented(section: str) -> set[str]:
    """Every `name` written in backticks in the section's table rows (dotted names give each part)."""
    names: set[str] = set()
    for row in (line for line in section.splitlines() if line.startswith("|")):
        for name in re.findall(r"`([^`]+)`", row):
            names.update(re.split(r"[.\[\]]+", name))
    return names


@pytest.mark.parametrize(
    ("title", "models"),
    [
        ("## Chat completions", [ChatCompletionRequest, ChatMessage]),
        ("## Completions", [CompletionRequest]),
        ("## Responses", [ResponsesRequest]),
        ("## SGLang", [GenerateRequest, GenerateSamplingParams]),
        ("## Tokens", [TokenizeRequest, DetokenizeRequest]),
    ],
)
def test_every_field_a_request_accepts_is_in_the_api_table(title: str, models: list[type]) -> None:
    documented = _documented(_section(title))
    for model in models:
        missing = sorted(set(model.model_fields) - documented)
        assert not missing, f"{model.__name__} accepts {missing}, which docs/api.md's '{title}' table lacks"
