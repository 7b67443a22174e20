"""The C kernel of packed weights times int8 activation blocks (minisgl/kernel/cpu/qlinear.c).

Against references in torch: the activations' rounding exactly (codes and scales), the products within
float32 summation order, for every shape the kernel cuts differently (one pair of blocks, whole chunks of
four blocks and an odd pair at the end; rows of activations alone, in twos and beyond eight; output
columns not a multiple of four). Where the machine has no AVX512-VNNI the same entry points run plain
loops, so these tests check those there. And a model packed with it greedy-decodes exactly as
transformers does with the same weights and each linear layer's input rounded the same way.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny import build_model

from minisgl.core import SamplingParams
from minisgl.kernel import cpu as cpu_kernels
from minisgl.kernel.cpu import qlinear
from minisgl.layers.linear import QuantizableLinear
from minisgl.layers.quant import Int4Weight, Int8Weight, q8_kernels

LIB = cpu_kernels.library()
pytestmark = pytest.mark.skipif(LIB is None, reason="the CPU kernels could not be built here")


def _q4_weight(n: int, k: int, seed: int) -> tuple[qlinear.Q4Pack, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    # scales and offsets that float16 holds exactly, so the float weight below is what the kernel reads
    scale = (torch.rand(n, k // 32, generator=gen) * 0.02).half().float()
    offset = (-torch.rand(n, k // 32, generator=gen) * 0.15).half().float()
    w = codes.float() * scale.repeat_interleave(32, 1) + offset.repeat_interleave(32, 1)
    return qlinear.pack_q4(codes, scale, offset), w


def _i8_weight(n: int, k: int, seed: int) -> tuple[qlinear.I8Pack, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=gen).to(torch.int8)
    scale = torch.rand(n, generator=gen) * 0.01
    return qlinear.pack_i8(q, scale), q.float() * scale[:, None]


SHAPES = [(4, 64), (7, 128), (33, 192), (960, 576), (12, 1536)]


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_products_equal_the_reference_of_rounded_activations(
    n: int, k: int, rows: int, dtype: torch.dtype
) -> None:
    assert LIB is not None
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3).to(dtype)
    x[0, :32] = 0  # a block of zeros: scale 0, codes 0
    for pack, w, matmul in (
        (*_q4_weight(n, k, 1), qlinear.linear_q4),
        (*_i8_weight(n, k, 2), qlinear.linear_i8),
    ):
        got = matmul(LIB, x, pack)  # type: ignore[operator]
        assert got.dtype == dtype and got.shape == (rows, n)
        want = qlinear.linear_q8_reference(x, w)
        # float32 sums in another order; a bf16 output is one rounding more
        tol = (1e-5 if dtype == torch.float32 else 2**-8) * want.abs().max().item()
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=0)


def test_strided_rows_are_read_in_place() -> None:
    assert LIB is not None
    pack, w = _q4_weight(8, 128, 3)
    wide = torch.randn(3, 256)
    got = qlinear.linear_q4(LIB, wide[:, 64:192], pack)
    torch.testing.assert_close(
        got.double(), qlinear.linear_q8_reference(wide[:, 64:192], w), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_the_activations_round_exactly_as_the_reference(dtype: torch.dtype) -> None:
    assert LIB is not None
    x = (torch.randn(5, 192) * torch.logspace(-3, 2, 192)).to(dtype)
    x[1, 64:96] = 0
    got = qlinear.quantize_q8_blocks(LIB, x)
    codes, d = qlinear.q8_blocks_reference(x)
    torch.testing.assert_close(got.q.float(), codes, atol=0, rtol=0)
    torch.testing.assert_close(got.dx, d, atol=0, rtol=0)
    torch.testing.assert_close(got.sx, d * codes.reshape(5, -1, 32).sum(-1), rtol=1e-6, atol=0)
    # each pair's scales spread: lanes 0-7 the first block's, 8-15 the second's
    torch.testing.assert_close(got.dxe, d.reshape(5, -1, 2).repeat_interleave(8, dim=2), atol=0, rtol=0)
    assert got.q.abs().max() <= 127


def test_packing_round_trips_and_refuses_shapes_the_kernel_cannot_take() -> None:
    codes = torch.randint(0, 16, (5, 320))
    pack = qlinear.pack_q4(codes, torch.ones(5, 10), torch.zeros(5, 10))
    assert pack.qs.shape == (5, 160)
    torch.testing.assert_close(qlinear.unpack_q4(pack).long(), codes, atol=0, rtol=0)
    with pytest.raises(ValueError, match="multiple of 64"):
        qlinear.pack_q4(torch.zeros(2, 96, dtype=torch.long), torch.ones(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="multiple of 64"):
        qlinear.pack_i8(torch.zeros(2, 96, dtype=torch.int8), torch.ones(2))


def test_the_weights_use_the_kernel_where_it_is_the_fast_path() -> None:
    w = torch.randn(16, 128) * 0.05
    int4, int8 = Int4Weight.from_float(w), Int8Weight.from_float(w)
    fast = q8_kernels() is not None
    assert (int4.pack is not None) == fast and (int8.pack is not None) == fast
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    for weight in (int4, int8):
        got = weight.matmul(x).float()
        want = x.float() @ weight.dequantize().t()
        torch.testing.assert_close(got, want, atol=0.05 * want.abs().max().item(), rtol=0)


def _reference_with_rounded_inputs(
    folder: str, llm: Any, prompts: list[list[int]], tokens: int
) -> list[list[int]]:
    """transformers' greedy tokens with the engine's dequantized weights, every linear layer's input
    rounded to int8 blocks as the kernel rounds it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    weights: dict[str, torch.Tensor] = {}
    for name, module in llm.engine.model.named_modules():
        if not isinstance(module, QuantizableLinear) or module.qweight is None:
            continue
        assert getattr(module.qweight, "pack", None) is not None, name  # the kernel serves every layer
        w = module.qweight.dequantize()
        parent, _, leaf = name.rpartition(".")
        if leaf in parts:
            weights |= {f"{parent}.{p}": piece for p, piece in zip(parts[leaf], w.split(module.local_sizes))}
        else:
            weights[name] = w

    def round_blocks(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0]
        codes, d = qlinear.q8_blocks_reference(x.reshape(-1, x.shape[-1]))
        return ((codes.reshape(*d.shape, 32) * d[..., None]).reshape(x.shape), *args[1:])

    modules = dict(model.named_modules())
    assert set(weights) <= set(modules), set(weights) - set(modules)
    with torch.no_grad():
        for name, w in weights.items():
            modules[name].weight.copy_(w)
            modules[name].register_forward_pre_hook(round_blocks)
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        y = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=tokens, min_new_tokens=tokens,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        out.append(y[0, len(ids) :].tolist())
    return out


@pytest.mark.skipif(
    q8_kernels() is None, reason="packed weights use torch's kernels on a CPU without AVX512-VNNI"
)
@pytest.mark.parametrize("quantization", ["int8"])
def test_a_packed_model_decodes_as_transformers_with_the_same_rounding(
    tmp_path, make_llm, quantization: str
) -> None:
    # hidden 128 and MLP 192: a whole chunk of four blocks and an odd pair, in every layer's K
    folder = build_model(str(tmp_path), "llama", hidden_size=128, intermediate_size=192, head_dim=32)
    prompts = [[5, 9, 14, 3], [40, 41, 42], [7] * 9, [100, 7, 3, 55, 21]]
    llm = make_llm(folder, dtype=torch.float32, quantization=quantization, max_running_req=4)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = [o["token_ids"] for o in llm.generate(prompts, params)]
    assert got == _reference_with_rounded_inputs(folder, llm, prompts, 12)
