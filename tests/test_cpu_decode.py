"""The C decode step (models/cpu_decode.py, kernel/cpu/layer.c) decodes what the module-by-module path does.

Two engines on the same weights and requests, one with the C step and one with it switched off; four
requests of different lengths running together, so steps of four, three, two and one rows. On the
default model (bf16, its Q4_1 layers packed) and on a tiny GQA model packed as int8, whose hidden size
and MLP give each kernel its odd shapes. Where a part has no C kernel (float32 here) it is not taken.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny import assert_nothing_held, build_model, random_prompts

from minisgl.core import SamplingParams
from minisgl.layers.quant import q8_kernels
from minisgl.llm import LLM
from minisgl.models.cpu_decode import CpuDecodeLayers

pytestmark = pytest.mark.skipif(
    q8_kernels() is None, reason="the C decode step needs the int8-activation kernels (AVX512-VNNI)"
)

# lengths that end at different steps, so the batch shrinks from four rows to one
PARAMS = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 20, 28, 36)]


def _tokens(path: str | None, fused: bool, **kwargs: Any) -> list[list[int]]:
    llm = LLM(path, max_running_req=4, **kwargs)
    try:
        model = llm.engine.model.model
        if not fused:
            model.cpu_decode = None  # decided: the module path
        prompts = random_prompts(4, seed=5, min_len=6, max_len=30)
        out = [o["token_ids"] for o in llm.generate(prompts, PARAMS)]
        assert_nothing_held(llm)
        assert isinstance(model.cpu_decode, CpuDecodeLayers) == fused
        return out
    finally:
        llm.shutdown()


def test_the_default_model_decodes_the_same_tokens_with_the_c_step() -> None:
    assert _tokens(None, fused=True) == _tokens(None, fused=False)


def test_a_gqa_model_packed_as_int8_decodes_the_same_tokens(tmp_path) -> None:
    # hidden 128 (a chunk of four blocks), MLP 192 (a chunk and an odd pair), 4 query heads on 2 KV heads
    folder = build_model(str(tmp_path), "llama", hidden_size=128, intermediate_size=192, head_dim=32)
    kwargs = dict(dtype=torch.bfloat16, quantization="int8")
    assert _tokens(folder, fused=True, **kwargs) == _tokens(folder, fused=False, **kwargs)


def test_a_float32_model_keeps_the_module_path(tmp_path) -> None:
    folder = build_model(str(tmp_path), "llama", hidden_size=128, intermediate_size=192, head_dim=32)
    llm = LLM(folder, dtype=torch.float32, quantization="int8", max_running_req=4)
    try:
        llm.generate([[5, 6, 7]], PARAMS[0])
        assert llm.engine.model.model.cpu_decode is None
    finally:
        llm.shutdown()
