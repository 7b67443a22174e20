"""Qwen3-MoE: routing, the torch MoE backend, the loader's expert shards, and which layers are sparse.

That whole models give transformers' greedy tokens is checked with the other architectures
(test_models.py, the qwen3-moe variants of tiny.VARIANTS); the Triton backend is checked against the
torch one in test_triton_kernels.py and test_gpu.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import minisgl.models.qwen3_moe as qwen3_moe
from minisgl.distributed import DistributedInfo
from minisgl.layers.moe import MoeExperts
from minisgl.models import ModelConfig, create_model
from minisgl.models.qwen3_moe import SparseMoeBlock
from minisgl.models.weight import load_weights
from minisgl.moe import create_moe_backend
from minisgl.moe.torch_backend import TorchMoeBackend

E, TOP_K, H, INTER = 8, 2, 32, 24


def moe_config(**overrides: object) -> ModelConfig:
    fields: dict = dict(
        architecture="Qwen3MoeForCausalLM",
        num_layers=4,
        hidden_size=H,
        intermediate_size=48,
        num_qo_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        qk_norm=True,
        num_experts=E,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=INTER,
        norm_topk_prob=True,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def checkpoint_block(seed: int = 0) -> dict[str, torch.Tensor]:
    """One sparse block's tensors under their Hugging Face names (relative to the block)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {"gate.weight": torch.randn(E, H, generator=g)}
    for e in range(E):
        tensors[f"experts.{e}.gate_proj.weight"] = torch.randn(INTER, H, generator=g) * 0.2
        tensors[f"experts.{e}.up_proj.weight"] = torch.randn(INTER, H, generator=g) * 0.2
        tensors[f"experts.{e}.down_proj.weight"] = torch.randn(H, INTER, generator=g) * 0.2
    return tensors


def loaded_block(tensors: dict[str, torch.Tensor], **overrides: object) -> SparseMoeBlock:
    block = SparseMoeBlock(moe_config(**overrides))
    load_weights(block, iter(tensors.items()))
    return block


def per_token_loop(
    x: torch.Tensor, router_logits: torch.Tensor, tensors: dict[str, torch.Tensor], renormalize: bool
) -> torch.Tensor:
    """Qwen3-MoE written out for one token at a time, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        probs = torch.softmax(router_logits[t].double(), dim=-1)
        chosen = sorted(range(E), key=lambda e: -probs[e].item())[:TOP_K]
        total = sum(probs[e] for e in chosen) if renormalize else 1.0
        xt = x[t].double()
        for e in chosen:
            gate = tensors[f"experts.{e}.gate_proj.weight"].double() @ xt
            up = tensors[f"experts.{e}.up_proj.weight"].double() @ xt
            y = tensors[f"experts.{e}.down_proj.weight"].double() @ (F.silu(gate) * up)
            out[t] += probs[e] / total * y
    return out


@pytest.fixture
def tp_rank(monkeypatch: pytest.MonkeyPatch) -> Callable[[int, int], None]:
    """tp_rank(rank, size): build the next layers as that tensor-parallel rank; undone when the test ends."""

    def set_rank(rank: int, size: int) -> None:
        monkeypatch.setattr("minisgl.distributed.info._TP_INFO", DistributedInfo(rank, size))

    return set_rank


@pytest.mark.parametrize("num_tokens", [1, 3, 37])
@pytest.mark.parametrize("renormalize", [True, False])
def test_torch_backend_equals_a_per_token_loop(num_tokens: int, renormalize: bool) -> None:
    tensors = checkpoint_block()
    block = loaded_block(tensors, norm_topk_prob=renormalize)
    assert isinstance(block.experts.backend, TorchMoeBackend)
    x = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(num_tokens))
    out = block(x)
    expected = per_token_loop(x, x @ tensors["gate.weight"].T, tensors, renormalize)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_two_ranks_partial_sums_equal_the_unsharded_block(tp_rank, monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = checkpoint_block(seed=1)
    x = torch.randn(19, H, generator=torch.Generator().manual_seed(2))
    full = loaded_block(tensors)(x)
    # each rank's output before the all-reduce
    monkeypatch.setattr(qwen3_moe, "all_reduce", lambda y: y)
    partials = []
    for rank in (0, 1):
        tp_rank(rank, 2)
        block = loaded_block(tensors)
        assert block.experts.gate_up_proj.shape == (E, INTER, H)  # half of gate and half of up
        assert block.experts.down_proj.shape == (E, H, INTER // 2)
        partials.append(block(x))
    assert not torch.allclose(partials[0], full, atol=1e-3)
    torch.testing.assert_close(partials[0] + partials[1], full, rtol=1e-5, atol=1e-5)


def test_tensor_parallel_size_must_divide_moe_intermediate_size(tp_rank) -> None:
    tp_rank(0, 5)
    with pytest.raises(ValueError, match="moe_intermediate_size 24 does not split over 5"):
        MoeExperts(E, H, INTER, TOP_K, renormalize=True)


def test_a_checkpoint_without_one_experts_projection_is_refused() -> None:
    tensors = checkpoint_block()
    del tensors["experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*experts\.gate_up_proj\[3\]#1"):
        loaded_block(tensors)


def test_a_checkpoint_with_more_experts_than_the_config_is_refused() -> None:
    tensors = checkpoint_block()
    tensors[f"experts.{E}.down_proj.weight"] = torch.zeros(H, INTER)
    with pytest.raises(ValueError, match=f"expert {E} is beyond the model's {E} experts"):
        loaded_block(tensors)


@pytest.mark.parametrize(
    "num_layers, decoder_sparse_step, mlp_only_layers",
    [(3, 1, []), (4, 2, []), (4, 2, [3]), (5, 1, [0, 2]), (6, 3, [5])],
)
def test_sparse_layers_are_those_transformers_builds(
    num_layers: int, decoder_sparse_step: int, mlp_only_layers: list[int]
) -> None:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    hf_config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=H,
        intermediate_size=48,
        moe_intermediate_size=INTER,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=E,
        num_experts_per_tok=TOP_K,
        decoder_sparse_step=decoder_sparse_step,
        mlp_only_layers=mlp_only_layers,
        architectures=["Qwen3MoeForCausalLM"],
    )
    theirs = [
        type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock"
        for layer in AutoModelForCausalLM.from_config(hf_config).model.layers
    ]
    ours = [
        isinstance(layer.mlp, SparseMoeBlock)
        for layer in create_model(ModelConfig.from_hf(hf_config)).model.layers
    ]
    assert ours == theirs


def test_moe_backend_is_torch_on_a_cpu_unless_named() -> None:
    assert isinstance(create_moe_backend("auto", torch.device("cpu")), TorchMoeBackend)
    assert isinstance(create_moe_backend("torch", torch.device("cpu")), TorchMoeBackend)
    with pytest.raises(ValueError, match="MoE backend 'cutlass' is unknown; use one of auto, torch, triton"):
        create_moe_backend("cutlass", torch.device("cpu"))
