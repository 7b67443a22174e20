"""The start-up warm-up (engine/warmup.py): its steps go through the engine's own path and leave nothing behind.

On CUDA the engine runs it before capturing graphs; here it is called on a CPU engine, where the
same steps run on the torch kernels, to check what it builds and what it clears.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from tiny import random_prompts

from minisgl.core import SamplingParams
from minisgl.engine.engine import ForwardOutput
from minisgl.engine.prepare import ForwardInput
from minisgl.engine.warmup import MIXED, warm_up
from minisgl.llm import LLM


def test_the_warm_up_runs_every_sampling_mode_and_leaves_no_trace(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tiny_model("qwen3-moe")
    llm = make_llm(folder, max_running_req=8, cache_type="naive")
    prompts = random_prompts(5, seed=4, max_len=20)
    params = [
        SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True) for i in range(5)
    ]
    before = [o["token_ids"] for o in llm.generate(prompts, params)]
    engine = llm.engine
    steps: list[tuple[str, int, int]] = []
    forward = engine.forward_batch

    def record(forward_input: ForwardInput) -> ForwardOutput:
        batch = forward_input.batch
        steps.append((batch.phase, batch.size, len(batch.positions)))
        return forward(forward_input)

    with monkeypatch.context() as m:
        m.setattr(engine, "forward_batch", record)
        warm_up(engine)
    # a one-token prefill, the MoE block heights, the sampling modes, and an eager decode step
    assert steps[0] == ("prefill", 1, 1)
    assert ("prefill", len(MIXED), 40) in steps and steps[-1] == ("decode", len(MIXED), len(MIXED))
    assert len(steps) >= 6
    rows = engine.config.max_running_req
    assert not engine.page_table[:rows].any() and not engine.token_pool[:rows].any()
    llm.check_integrity()
    assert [o["token_ids"] for o in llm.generate(prompts, params)] == before
