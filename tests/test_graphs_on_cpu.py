"""The CUDA graph runners' data flow without a GPU: MINISGL_EMULATE_GRAPHS on a CPU, the CUDA path's kernels under
Triton's interpreter (MINISGL_KERNELS=triton). A replay runs the captured forward again on the captured batch,
whose tensors are the static buffers, so a step input that misses them gives wrong tokens as on a GPU.
On a GPU the real graphs run instead (tests/test_gpu.py, tests/test_prefill_graph.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from interpreter import CUDA
from tiny import random_prompts

from minisgl.core import SamplingParams
from minisgl.engine.graph import DecodeGraphInputs, GraphRunner, ReplayedForward, graphs_possible
from minisgl.engine.prefill_graph import PrefillGraphRunner
from minisgl.env import ENV

pytestmark = pytest.mark.skipif(CUDA, reason="a GPU runs real graphs (tests/test_gpu.py)")

# decode batches of 1-3 requests all replay the graph of 4 (padding rows); a prefill of these prompts
# (at most 3 x 10 tokens) replays the graph of 16 or 32 tokens
GRAPHS = dict(cuda_graph_bs=[4], cuda_graph_max_bs=4, cuda_graph_max_prefill=32)


def _count_replays(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    counts = {"decode": 0, "prefill": 0}
    for name, cls in (("decode", GraphRunner), ("prefill", PrefillGraphRunner)):
        replay = cls.replay

        def counted(self: Any, batch: Any, replay: Any = replay, name: str = name) -> torch.Tensor:
            counts[name] += 1
            return replay(self, batch)

        monkeypatch.setattr(cls, "replay", counted)
    return counts


def _run(make_llm: Any, folder: str, prompts: list[list[int]], page_size: int) -> list[list[int]]:
    llm = make_llm(folder, page_size=page_size, max_running_req=4, device="cpu", **GRAPHS)
    runner = llm.engine.graph_runner
    assert list(runner.graphs) == [4] and all(isinstance(g, ReplayedForward) for g in runner.graphs.values())
    assert list(llm.engine.prefill_graphs.graphs) == [32, 16]
    # lengths 5, 3 and 6: the batch shrinks from 3 to 1 row, each step padded to 4
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (5, 3, 6)]
    return [o["token_ids"] for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("page_size", [1, 4])
def test_emulated_graphs_give_the_greedy_tokens_of_transformers(
    page_size: int, tiny_model, hf_reference, make_llm, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ENV.KERNELS, "value", "triton")
    monkeypatch.setattr(ENV.EMULATE_GRAPHS, "value", True)
    replays = _count_replays(monkeypatch)
    folder = tiny_model("qwen3")
    prompts = random_prompts(3, seed=7, min_len=4, max_len=10)
    tokens = _run(make_llm, folder, prompts, page_size)
    want = hf_reference(folder, prompts, 6)
    assert tokens == [w[:n] for w, n in zip(want, (5, 3, 6))]
    # the prompts' prefill, then a decode step a token but the first
    assert replays["prefill"] == 1 and replays["decode"] == 5


def test_an_input_that_misses_the_static_buffers_is_caught(
    tiny_model, hf_reference, make_llm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The emulation has teeth: a replay that leaves the positions of the capture in place (a step's
    positions never copied in) no longer gives transformers' tokens."""
    monkeypatch.setattr(ENV.KERNELS, "value", "triton")
    monkeypatch.setattr(ENV.EMULATE_GRAPHS, "value", True)
    load = DecodeGraphInputs.load

    def load_without_positions(self: DecodeGraphInputs, batch: Any) -> None:
        bs = batch.padded_size
        q = bs + bs % 2
        kept = self.packed[q : q + bs].clone()
        load(self, batch)
        self.packed[q : q + bs].copy_(kept)

    monkeypatch.setattr(DecodeGraphInputs, "load", load_without_positions)
    folder = tiny_model("qwen3")
    prompts = random_prompts(3, seed=7, min_len=4, max_len=10)
    tokens = _run(make_llm, folder, prompts, 1)
    want = hf_reference(folder, prompts, 6)
    assert tokens != [w[:n] for w, n in zip(want, (5, 3, 6))]


def test_graphs_are_emulated_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert not graphs_possible(cpu)
    monkeypatch.setattr(ENV.EMULATE_GRAPHS, "value", True)
    assert graphs_possible(cpu) and not graphs_possible(torch.device("meta"))
