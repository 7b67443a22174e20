"""vLLM's add_special_tokens for a text prompt (completions): the tokenizer's BOS and the like as `encode` adds
them, or not. The server's side is in tests/test_api_fields.py."""

from __future__ import annotations

from typing import Any

import pytest
from tiny import build_tokenizer

from minisgl.core import SamplingParams
from minisgl.message.frontend import TokenizeMsg
from minisgl.scheduler.check import RequestLimits
from minisgl.tokenizer.tokenize import TokenizeManager


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny tokenizer made to put its BOS first, as Llama's does."""
    from tokenizers.processors import TemplateProcessing

    tok = build_tokenizer(str(tmp_path_factory.mktemp("tok")))
    bos = tok.bos_token
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.convert_tokens_to_ids(bos))]
    )
    return tok


def test_a_text_prompt_takes_the_bos_unless_told_not_to(tokenizer: Any) -> None:
    manager = TokenizeManager(tokenizer, RequestLimits(512, len(tokenizer), 100_000, 1))
    params = [SamplingParams(max_tokens=1)]
    with_bos = manager.tokenize(TokenizeMsg(params, text="hello world"))
    without = manager.tokenize(TokenizeMsg(params, text="hello world", add_special_tokens=False))
    assert with_bos == [tokenizer.bos_token_id, *without]
    assert without == tokenizer.encode("hello world", add_special_tokens=False)
