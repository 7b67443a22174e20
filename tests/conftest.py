"""Shared fixtures: tiny checkpoints built once per session, their transformers references, and LLMs that are always shut down."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

# without a GPU the Triton kernels run in Triton's interpreter, which counts only if set before any kernel module
# is imported: here, so that a test module run alone (tests/test_tp.py's Triton case) gets it as the suite does
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from tiny import build_variant, hf_greedy

from minisgl.llm import LLM

# the tiny models gain nothing from intra-op threads, and on a busy machine the threads spin against each other
torch.set_num_threads(1)

Reference = Callable[[str, list[list[int]], int], list[list[int]]]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """tiny_model(name) -> the folder of tiny.VARIANTS[name], built the first time it is asked for."""
    folders: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in folders:
            folders[name] = build_variant(str(tmp_path_factory.mktemp(name)), name)
        return folders[name]

    return get


@pytest.fixture(scope="session")
def hf_reference() -> Reference:
    """hf_reference(folder, prompts, n) -> transformers' first n greedy tokens of each prompt, computed once."""
    cache: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def get(folder: str, prompts: list[list[int]], n: int) -> list[list[int]]:
        missing = [p for p in prompts if len(cache.get((folder, tuple(p)), [])) < n]
        for p, ref in zip(missing, hf_greedy(folder, missing, n) if missing else []):
            cache[(folder, tuple(p))] = ref
        return [cache[(folder, tuple(p))][:n] for p in prompts]

    return get


@pytest.fixture
def make_llm() -> Iterator[Callable[..., LLM]]:
    """make_llm(folder, **kwargs) -> a float32 LLM that is shut down when the test ends, whatever happens."""
    built: list[LLM] = []

    def make(folder: str | None, **kwargs: Any) -> LLM:
        kwargs.setdefault("dtype", torch.float32)
        llm = LLM(folder, **kwargs)
        built.append(llm)
        return llm

    yield make
    for llm in built:
        llm.shutdown()
