"""The CPU kernels for a layer's small ops (RMSNorm with the residual add, rotary, SiLU and its product)
in bf16.

They replace about ten torch launches each in a decode step, and must give what the torch ops give:
they round to bf16 where the torch version rounds, so rotary matches bit for bit and RMSNorm up to
the order of its float32 sum. A bf16 model decodes the same greedy tokens with them
as with the torch ops.
"""

from __future__ import annotations

import pytest
import torch
from tiny import assert_nothing_held, build_model, random_prompts

from minisgl.core import SamplingParams
from minisgl.engine.sample import greedy_tokens
from minisgl.kernel import cpu as cpu_kernels
from minisgl.layers.activation import silu_and_mul
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding, _apply
from minisgl.llm import LLM

LIB = cpu_kernels.library()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler here: the CPU kernels could not be built")


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between a and b in units of bf16's last place."""
    ia = a.contiguous().view(torch.int16).to(torch.int32)
    ib = b.contiguous().view(torch.int16).to(torch.int32)
    return int((ia - ib).abs().max())


@pytest.mark.parametrize("rows,n", [(1, 576), (7, 64), (3, 80)])
def test_rms_norm_with_residual_matches_torch(rows: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows * n)
    x, residual = (torch.randn(rows, n, generator=gen).bfloat16() * 3 for _ in range(2))
    weight = (torch.randn(n, generator=gen) * 0.1 + 1).bfloat16()
    y, new_residual = cpu_kernels.rms_norm_bf16(LIB, x, residual, weight, 1e-5)
    assert torch.equal(new_residual, x + residual)
    assert bf16_ulps(y, torch_rms_norm(x + residual, weight, 1e-5)) <= 1


def test_rms_norm_reads_a_strided_view_and_keeps_its_shape() -> None:
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 4 * 32 + 100, generator=gen).bfloat16()
    q = qkv[:, : 4 * 32].view(5, 4, 32)
    weight = torch.randn(32, generator=gen).bfloat16()
    y, same = cpu_kernels.rms_norm_bf16(LIB, q, None, weight, 1e-6)
    assert y.shape == (5, 4, 32) and same is q
    assert bf16_ulps(y, torch_rms_norm(q, weight, 1e-6)) <= 1


@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((4, 4), 48)])
def test_rotary_in_place_equals_the_torch_rotation(heads: tuple[int, int], head_dim: int) -> None:
    hq, hk = heads
    rotary = RotaryEmbedding(head_dim, 300, 10000.0, None)
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(4, (hq + 2 * hk) * head_dim, generator=gen).bfloat16() * 2
    q, k, v = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    q, k = q.view(4, hq, head_dim), k.view(4, hk, head_dim)
    v_before = v.clone()
    positions = torch.tensor([0, 1, 150, 299])
    cos, sin = rotary.cos_sin[positions].to(torch.bfloat16).unsqueeze(1).chunk(2, dim=-1)
    want_q, want_k = _apply(q, cos, sin), _apply(k, cos, sin)
    got_q, got_k = cpu_kernels.rotary_bf16(LIB, positions, q, k, rotary.cos_sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    # rotated where they lie, and v beside them untouched
    assert got_q.data_ptr() == q.data_ptr() and torch.equal(v, v_before)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_greedy_tokens_are_those_of_the_torch_ops(
    arch: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = build_model(str(tmp_path / arch), arch)
    prompts = random_prompts(3, seed=5)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)

    def run() -> list[list[int]]:
        llm = LLM(folder, dtype="bfloat16", device="cpu", max_running_req=4, cache_type="naive")
        try:
            out = [o["token_ids"] for o in llm.generate(prompts, params)]
            assert_nothing_held(llm)
        finally:
            llm.shutdown()
        return out

    with_kernels = run()
    monkeypatch.setattr(cpu_kernels, "elementwise_lib", lambda x: None)
    assert with_kernels == run()


def test_a_norm_over_mixed_dtypes_keeps_torch_promotion() -> None:
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64, generator=torch.Generator().manual_seed(3)).bfloat16()
    x = torch.randn(2, 64).bfloat16()
    residual = torch.randn(2, 64)
    y, new_residual = norm.forward_with_residual(x, residual)
    assert y.dtype == new_residual.dtype == torch.float32
    assert torch.equal(new_residual, x + residual)


@pytest.mark.parametrize("rows,n", [(1, 5), (3, 16), (2, 17), (4, 49152), (5, 1003)])
@pytest.mark.parametrize("values", ["random", "ties", "nan", "-inf", "strided"])
def test_greedy_argmax_picks_what_torch_argmax_picks(rows: int, n: int, values: str) -> None:
    gen = torch.Generator().manual_seed(rows + n)
    if values == "ties":  # few distinct values: the first of equal maxima, across lanes and the tail
        x = torch.randint(0, 3, (rows, n), generator=gen).float()
    elif values == "-inf":
        x = torch.full((rows, n), float("-inf"))
    else:
        x = torch.randn(rows, n, generator=gen)
    if values == "nan":  # torch counts NaN as the largest: the first NaN wins
        x[:, n // 2] = float("nan")
        x[:, n - 1] = float("nan")
    if values == "strided":  # rows of a wider buffer, as the logits of a prefill's last tokens are
        x = torch.randn(rows, n + 9, generator=gen)[:, :n]
    assert torch.equal(greedy_tokens(x), torch.argmax(x, dim=-1).to(torch.int32))


@pytest.mark.parametrize("rows,n", [(1, 1536), (64, 1536), (3, 40)])
def test_silu_and_mul_matches_the_torch_ops(rows: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows + n)
    x = (torch.randn(rows, 2 * n, generator=gen) * 4).bfloat16()
    # the ends of the range: exp overflowing to inf (silu -0), underflowing to 0 (silu = gate), and NaN
    x[0, :6] = torch.tensor([-200.0, -90.0, 90.0, 200.0, float("nan"), 0.0])
    gate, up = x.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = cpu_kernels.silu_and_mul_bf16(LIB, x)
    assert got.shape == (rows, n) and torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    assert bf16_ulps(got[finite], want[finite]) <= 1
    # a last-bit difference is a rare tie of the rounding, not the rule
    assert (got[finite] == want[finite]).float().mean() > 0.99
    assert torch.equal(silu_and_mul(x).view(torch.int16), got.view(torch.int16))
