"""bf16 linear weights held in oneDNN's blocked layout (CPU): the products are F.linear's to the bit, a
packed model decodes the tokens of the plain one, and each layer keeps the copies its batches read."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_quant import _forwarding
from tiny import random_prompts

from minisgl.core import SamplingParams
from minisgl.env import ENV
from minisgl.layers.linear import LinearReplicated, linear_onednn, onednn_packing_supported, pack_onednn
from minisgl.layers.quant import Int8Weight
from minisgl.models import onednn_pack

pytestmark = pytest.mark.skipif(not onednn_packing_supported(), reason="oneDNN bf16 is not available here")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (960, 576), (576, 1536), (100, 72), (33, 40)])
def test_a_packed_weight_multiplies_as_f_linear_bit_for_bit(n: int, k: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    packed = pack_onednn(w)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 3, 17, 64, 300):
            x = torch.randn(rows, k, generator=gen).bfloat16()
            assert torch.equal(linear_onednn(x, packed), F.linear(x, w)), rows
    finally:
        torch.set_num_threads(saved)


def _tokens(llm, prompts: list[list[int]]) -> list[list[int]]:
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    return [o["token_ids"] for o in out]


@pytest.mark.parametrize("variant", ["llama", "qwen2-tied", "qwen3"])
def test_a_bf16_model_in_onednns_layout_decodes_the_plain_models_tokens(
    tiny_model, make_llm, monkeypatch, variant: str
) -> None:
    folder = tiny_model(variant)
    # batches of 1 to 10 rows, prompts of 1 to 40 tokens: every row count the layers branch on
    prompts = random_prompts(10, seed=3)
    monkeypatch.setattr(ENV.CPU_ONEDNN_WEIGHTS, "value", False)
    plain = make_llm(folder, dtype=torch.bfloat16, max_running_req=10)
    assert plain.engine.model.model.layers[0].mlp.down_proj.packed is None
    want = _tokens(plain, prompts)
    plain.shutdown()

    monkeypatch.setattr(ENV.CPU_ONEDNN_WEIGHTS, "value", True)
    llm = make_llm(folder, dtype=torch.bfloat16, max_running_req=10)
    layer = llm.engine.model.model.layers[0].mlp.down_proj
    # a small model keeps its plain weights too, for the C kernel's one- and two-row steps
    assert layer.packed is not None and layer.weight is not None
    assert _tokens(llm, prompts) == want
    llm.shutdown()

    # past the size where both copies are kept, the packed one serves every batch alone
    monkeypatch.setattr(onednn_pack, "KEEP_PLAIN_BYTES", 0)
    alone = make_llm(folder, dtype=torch.bfloat16, max_running_req=10)
    layer = alone.engine.model.model.layers[0].mlp.down_proj
    assert layer.packed is not None and layer.weight is None
    assert _tokens(alone, prompts) == want


def test_a_float32_model_keeps_its_plain_weights(tiny_model, make_llm) -> None:
    llm = make_llm(tiny_model("llama"))
    layer = llm.engine.model.model.layers[0].mlp.down_proj
    assert layer.packed is None and layer.weight is not None


def test_a_layer_with_a_quantized_copy_drops_its_plain_weight_and_serves_the_same_rows() -> None:
    gen = torch.Generator().manual_seed(5)
    layer = LinearReplicated(128, 96).bfloat16()
    layer.weight.data.copy_(torch.randn(96, 128, generator=gen))
    float_weight = layer.weight.data.clone()
    layer.quantize_(Int8Weight.from_float(float_weight.float()), keep_float=True, max_rows=4)
    assert "1 linear layers" in onednn_pack.pack_model(layer)
    # the quantized copy serves one and two rows, so nothing reads the plain one any more
    assert layer.weight is None and layer.packed is not None
    for rows in (1, 4, 5, 64):
        x = torch.randn(rows, 128, generator=gen).bfloat16()
        want = layer.qweight.matmul(x) if rows <= 4 else F.linear(x, float_weight)
        assert torch.equal(layer(x), want), rows
    # a prompt of one row takes the float weight, packed now
    x = torch.randn(1, 128, generator=gen).bfloat16()
    with _forwarding("prefill"):
        assert torch.equal(layer(x), F.linear(x, float_weight))
