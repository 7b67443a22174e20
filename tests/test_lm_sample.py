"""The LM head and sampling in one kernel (kernel/lm_sample.py) against the LM head's product then the sampling
kernel, on tiny shapes: in Triton's interpreter without a GPU, compiled on one."""

from __future__ import annotations

import pytest
import torch
from interpreter import CUDA, DEVICE

from minisgl.engine.sample import hash_uniform
from minisgl.kernel.lm_sample import LMSampleConfig, default_config, lm_head_sample
from minisgl.kernel.sampling import sample_tokens

# the interpreter's products of bf16 tiles are wrong (Triton 3.9), so without a GPU the tiles are float32
DTYPE = torch.bfloat16 if CUDA else torch.float32


def _rows(bs: int, k: int, vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(bs, k, generator=g).to(DTYPE)
    # a padded weight, as a vocabulary-parallel head leaves it: rows past the vocabulary are never drawn
    weight = (torch.randn(vocab + 5, k, generator=g) * 0.3).to(DTYPE)
    weight[vocab:] = 100.0
    temps = torch.tensor([0.0, 0.6, 1.0, 1.5, 0.3, 0.0, 2.0, 0.7, 0.0, 1.0][:bs], dtype=torch.float32)
    seeds = torch.tensor([1, 2, 3, 2**62, -5, 7, 11, 13, 17, 19][:bs], dtype=torch.int64)
    steps = torch.tensor([10, 11, 0, 5, 999, 3, 1, 2, 4, 8][:bs], dtype=torch.int64)
    return tuple(t.to(DEVICE) for t in (hidden, weight, temps, seeds, steps))


def _margins(
    logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """Each row's gap between its best and second-best score, in the sampling kernel's base-2 units."""
    noise = -torch.log2(-torch.log2(hash_uniform(seeds, steps, logits.shape[-1])))
    scaled = logits / torch.where(temps > 0, temps, 1.0)[:, None] * 1.4426950408889634 + noise
    score = torch.where(temps[:, None] > 0, scaled, logits)
    top2 = score.topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


CONFIGS = [None, LMSampleConfig(16, 32, 32, 4, 2), LMSampleConfig(32, 64, 64, 4, 2)]


@pytest.mark.parametrize("bs, k, vocab", [(1, 64, 300), (6, 96, 1000), (10, 128, 777)])
@pytest.mark.parametrize("config", CONFIGS)
def test_fused_sampling_draws_what_the_product_then_the_sampler_draw(
    bs: int, k: int, vocab: int, config: LMSampleConfig | None
) -> None:
    hidden, weight, temps, seeds, steps = _rows(bs, k, vocab, seed=bs * k)
    got = lm_head_sample(hidden, weight, vocab, temps, seeds, steps, config)
    logits = (hidden.float() @ weight[:vocab].float().T).contiguous()
    want = sample_tokens(logits, temps, seeds, steps)
    # float32 sums in another order: a row may only differ where its two best scores nearly tie
    close = _margins(logits.cpu(), temps.cpu(), seeds.cpu(), steps.cpu()) < 1e-3
    differ = (got.cpu() != want.cpu()) & ~close
    assert not differ.any(), (got.tolist(), want.tolist())
    assert int(got.max()) < vocab


def test_every_row_tile_and_vocabulary_tile_is_merged() -> None:
    """Greedy rows whose winners lie in every vocabulary tile, two row tiles, the last ones partial."""
    bs, k, vocab = 20, 32, 200
    hidden = torch.zeros(bs, k, dtype=DTYPE)
    weight = torch.zeros(vocab, k, dtype=DTYPE)
    want = [(37 * r + 11) % vocab for r in range(bs)]
    for r in range(bs):
        hidden[r, r] = 1.0
        weight[want[r], r] = 2.0  # row r's only positive logit
    zeros = torch.zeros(bs, dtype=torch.int64, device=DEVICE)
    got = lm_head_sample(
        hidden.to(DEVICE),
        weight.to(DEVICE),
        vocab,
        zeros.float(),
        zeros,
        zeros,
        LMSampleConfig(16, 32, 32, 4, 2),
    )
    assert got.cpu().tolist() == want


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="the engine's tiles on the real vocabulary need a GPU")
@pytest.mark.parametrize("bs", [1, 16, 64, 256])
def test_default_tiles_on_a_real_vocabulary(bs: int) -> None:
    g = torch.Generator().manual_seed(bs)
    k, vocab = 1024, 151936
    hidden = torch.randn(bs, k, generator=g).to(torch.bfloat16).to(DEVICE)
    weight = (torch.randn(vocab, k, generator=g) * 0.05).to(torch.bfloat16).to(DEVICE)
    temps = torch.where(torch.arange(bs) % 3 == 0, 0.0, 0.6).to(DEVICE)
    seeds = torch.arange(bs, dtype=torch.int64).to(DEVICE)
    steps = torch.full((bs,), 7, dtype=torch.int64).to(DEVICE)
    got = lm_head_sample(hidden, weight, vocab, temps, seeds, steps, default_config(bs))
    logits = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    want = sample_tokens(logits, temps, seeds, steps)
    close = _margins(logits, temps, seeds, steps) < 1e-3
    assert not ((got != want) & ~close).any()


def test_only_batches_that_need_no_logits_take_the_fused_head() -> None:
    from minisgl.engine.fused_head import plain_rows
    from minisgl.engine.sample import BatchSamplingArgs

    t = torch.zeros(2)
    assert plain_rows(BatchSamplingArgs(greedy=True))
    assert plain_rows(BatchSamplingArgs(greedy=False, temperatures=t, seeds=t, steps=t))
    needs_logits = [
        dict(top_k=t),
        dict(top_p=t),
        dict(min_p=t),
        dict(top_logprobs=2),
        dict(token_mask=t),
        dict(bias=object()),
        dict(penalty=object()),
        dict(prompt=object()),
    ]
    for extra in needs_logits:
        assert not plain_rows(BatchSamplingArgs(greedy=False, temperatures=t, **extra)), extra
