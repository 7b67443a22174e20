"""Sampling: greedy limits, per-request seeds, the sampled distribution, the support filters and the penalties."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from conftest import Reference
from tiny import assert_nothing_held, hf_greedy, random_prompts
from transformers import LogitsProcessor, LogitsProcessorList

from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.sample import BatchSamplingArgs, PenaltyArgs, Sampler, apply_penalties, sampling_probs
from minisgl.llm import LLM

PROMPTS = random_prompts(6, seed=2, min_len=3, max_len=30)
CPU = torch.device("cpu")


@pytest.fixture
def llama(tiny_model: Callable[[str], str]) -> str:
    return tiny_model("llama")


# ---- through the engine ----------------------------------------------------------------------------


def test_top_k_1_with_temperature_is_greedy(
    llama: str, hf_reference: Reference, make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(llama, max_running_req=4, cache_type="naive")
    params = [
        SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=s, ignore_eos=True) for s in range(6)
    ]
    out = llm.generate(PROMPTS, params)
    assert [o["token_ids"] for o in out] == hf_reference(llama, PROMPTS, 10)


def test_a_greedy_request_stays_greedy_beside_sampled_ones(
    llama: str, hf_reference: Reference, make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(llama, max_running_req=6, cache_type="naive")
    sampled = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True)
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    out = llm.generate(PROMPTS, [greedy if i % 2 else sampled for i in range(len(PROMPTS))])
    ref = hf_reference(llama, PROMPTS, 10)
    assert [out[i]["token_ids"] for i in (1, 3, 5)] == [ref[i] for i in (1, 3, 5)]
    assert [out[i]["token_ids"] for i in (0, 2, 4)] != [ref[i] for i in (0, 2, 4)]  # those really sampled


def test_the_same_seed_gives_the_same_tokens_alone_and_in_any_batch(
    llama: str, make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(llama, max_running_req=3, cache_type="naive")
    prompt = PROMPTS[0]
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)

    alone = llm.generate([prompt], params)[0]["token_ids"]
    others = [
        SamplingParams(max_tokens=n, temperature=0.8, seed=s, top_k=20, ignore_eos=True)
        for n, s in [(4, 1), (20, 2), (9, None), (1, 3)]
    ]
    batch = llm.generate(
        [PROMPTS[1], PROMPTS[2], prompt, PROMPTS[3], PROMPTS[4]], others[:2] + [params] + others[2:]
    )
    assert batch[2]["token_ids"] == alone
    # the same request twice in one batch, and once more with another seed
    twins = llm.generate(
        [prompt, PROMPTS[5], prompt, prompt],
        [params, others[1], params, SamplingParams(**{**vars(params), "seed": 1235})],
    )
    assert twins[0]["token_ids"] == twins[2]["token_ids"] == alone
    assert twins[3]["token_ids"] != alone
    assert llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]["token_ids"] != alone


def test_a_decode_steps_noise_is_that_of_the_sampled_tokens_position_as_in_a_prefill(
    llama: str, make_llm: Callable[..., LLM]
) -> None:
    """The noise counter of a sampled token is its position: a decode step takes it from the step's write
    columns, a prefill from its last position + 1; the same seed then draws the same token either way."""
    llm = make_llm(llama, max_running_req=8, cache_type="naive")
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    out = llm.generate([PROMPTS[0]], params)[0]["token_ids"]
    # token k + 1 again, as the first token of a prompt that ends with the first k
    one = SamplingParams(max_tokens=1, temperature=1.0, seed=7, ignore_eos=True)
    firsts = llm.generate([PROMPTS[0] + out[:k] for k in range(1, 8)], one)
    assert [f["token_ids"][0] for f in firsts] == out[1:]


def test_the_same_seed_gives_the_same_tokens_in_a_new_engine(
    llama: str, make_llm: Callable[..., LLM]
) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True)
    first = make_llm(llama, max_running_req=4, cache_type="naive")
    before = [o["token_ids"] for o in first.generate(PROMPTS, params)]
    first.shutdown()
    second = make_llm(llama, max_running_req=2, cache_type="naive")
    assert [o["token_ids"] for o in second.generate(PROMPTS, params)] == before


def test_any_64_bit_integer_is_a_seed_and_a_wider_one_is_refused(
    llama: str, make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(llama, max_running_req=2, cache_type="naive")
    params = [
        SamplingParams(max_tokens=6, temperature=1.0, seed=s, ignore_eos=True)
        for s in (-5, -(2**63), 2**63 - 1, 2**63, 2**64 - 1)
    ]
    out = llm.generate([PROMPTS[0]] * len(params), params)
    assert all(o["finish_reason"] == "length" and len(o["token_ids"]) == 6 for o in out)
    again = llm.generate([PROMPTS[0]] * len(params), params)
    assert [o["token_ids"] for o in again] == [o["token_ids"] for o in out]
    # a seed folds into signed 64 bits: 2**64 - 1 is the seed -1
    minus_one = SamplingParams(max_tokens=6, temperature=1.0, seed=-1, ignore_eos=True)
    assert llm.generate([PROMPTS[0]], minus_one)[0]["token_ids"] == out[4]["token_ids"]
    for wide in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match="seed"):
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=6, seed=wide))
    assert_nothing_held(llm)


# ---- the sampled distribution ------------------------------------------------------------------------

LOGITS = torch.tensor([1.2, -0.3, 0.4, 2.0, -1.0, 0.9, 0.0, 1.6])
# chi-square critical value for 7 degrees of freedom at significance 0.001
CHI2_CRITICAL_DF7 = 24.322


def _draw(logits: torch.Tensor, temperature: float, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    n = len(seeds)
    args = BatchSamplingArgs(
        greedy=False, temperatures=torch.full((n, 1), temperature), seeds=seeds, steps=steps
    )
    tokens = Sampler(CPU, len(logits)).sample(logits.expand(n, -1).clone(), args)
    return torch.bincount(tokens.long(), minlength=len(logits)).double()


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


N_DRAWS = 20000


@pytest.mark.parametrize(
    "how",
    ["one seed over many steps", "many seeds at one step"],
)
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.8])
def test_temperature_sampling_follows_softmax_of_logits_over_t(how: str, temperature: float) -> None:
    n = N_DRAWS
    if how == "one seed over many steps":
        seeds, steps = torch.full((n,), 20240611), torch.arange(n) + 7
    else:
        seeds, steps = torch.arange(n) * 7919 + 1, torch.full((n,), 42)
    counts = _draw(LOGITS, temperature, seeds, steps)

    assert _chi_square(counts, torch.softmax(LOGITS / temperature, -1)) < CHI2_CRITICAL_DF7
    # the test can tell: the same draws are far from the distribution at another temperature
    assert _chi_square(counts, torch.softmax(LOGITS / (temperature * 1.25), -1)) > 5 * CHI2_CRITICAL_DF7


# ---- the support: top_k, top_p, min_p -----------------------------------------------------------------

# token probabilities; sorted: 1 (.30), 3 (.20), 4 (.16), 6 (.14), 7 (.11), 0 (.04), 5 (.03), 2 (.02)
PROBS = torch.tensor([0.04, 0.30, 0.02, 0.20, 0.16, 0.03, 0.14, 0.11])
SUPPORT_CASES: dict[str, tuple[SamplingParams, set[int]]] = {
    "no filter": (SamplingParams(temperature=1.0), set(range(8))),
    "top_k=2": (SamplingParams(temperature=1.0, top_k=2), {1, 3}),
    "top_k=4": (SamplingParams(temperature=1.0, top_k=4), {1, 3, 4, 6}),
    "top_k=-1 is off": (SamplingParams(temperature=1.0, top_k=-1), set(range(8))),
    "top_p=0.6": (SamplingParams(temperature=1.0, top_p=0.6), {1, 3, 4}),
    "top_p=0.85": (SamplingParams(temperature=1.0, top_p=0.85), {1, 3, 4, 6, 7}),
    "min_p=0.5": (SamplingParams(temperature=1.0, min_p=0.5), {1, 3, 4}),
    "min_p=0.2": (SamplingParams(temperature=1.0, min_p=0.2), {1, 3, 4, 6, 7}),
    # top_p sees the top-k tokens renormalised: .375, .25, .20, .175
    "top_k=4 then top_p=0.6": (SamplingParams(temperature=1.0, top_k=4, top_p=0.6), {1, 3}),
    # the filters see the tempered distribution: at T=0.5 it is .47, .21, .13, .10, ...
    "T=0.5 then top_p=0.6": (SamplingParams(temperature=0.5, top_p=0.6), {1, 3}),
    "T=0.5 then min_p=0.4": (SamplingParams(temperature=0.5, min_p=0.4), {1, 3}),
}


def _sample_with(params: list[SamplingParams], logits: torch.Tensor, seeds: list[int]) -> list[int]:
    """Sample one token per request, each with its own params, through Sampler.prepare as the engine does."""
    reqs = [
        Req(
            input_ids=[5, 6, 7],
            table_idx=0,
            cached_len=0,
            output_len=1,
            uid=i,
            sampling_params=p,
            cache_handle=None,
            seed=s,
        )
        for i, (p, s) in enumerate(zip(params, seeds))
    ]
    sampler = Sampler(CPU, len(logits))
    batch = Batch(reqs=reqs, phase="decode")
    batch.positions = torch.tensor([r.device_len - 1 for r in reqs])  # as Engine.prepare_batch sets them
    args = sampler.prepare(batch, torch.zeros((1, 8), dtype=torch.int32))
    return sampler.sample(logits.expand(len(reqs), -1).clone(), args).tolist()


def test_top_k_top_p_and_min_p_keep_exactly_their_tokens_each_on_its_own_row() -> None:
    per_case = 3000
    params = [p for p, _ in SUPPORT_CASES.values() for _ in range(per_case)]
    tokens = _sample_with(params, PROBS.log(), seeds=list(range(len(params))))
    supports = {name: set(tokens[i * per_case : (i + 1) * per_case]) for i, name in enumerate(SUPPORT_CASES)}
    assert supports == {name: support for name, (_, support) in SUPPORT_CASES.items()}


def test_top_k_1_with_temperature_takes_the_most_likely_token() -> None:
    logits = torch.tensor([0.5, 0.1, 0.45, -2.0, 0.49])
    tokens = _sample_with([SamplingParams(temperature=2.0, top_k=1)] * 500, logits, seeds=list(range(500)))
    assert set(tokens) == {0}


def test_filtered_sampling_follows_the_renormalised_distribution() -> None:
    kept = [1, 3, 4, 6]
    n = 12000
    tokens = _sample_with([SamplingParams(temperature=1.0, top_k=4)] * n, PROBS.log(), seeds=list(range(n)))
    counts = Counter(tokens)
    observed = torch.tensor([counts[t] for t in kept], dtype=torch.float64)
    expected = PROBS[kept] / PROBS[kept].sum()
    # chi-square critical value for 3 degrees of freedom at significance 0.001
    assert _chi_square(observed, expected) < 16.266


# ---- penalties -------------------------------------------------------------------------------------------


def _penalty_args(
    prompt: list[int], output: list[int], width: int, presence: float, frequency: float, repetition: float
) -> PenaltyArgs:
    """One request's penalty inputs as the sampler builds them: its tokens, padded with 0 to `width`."""
    pad = width - len(prompt) - len(output)
    is_token = torch.tensor([True] * (len(prompt) + len(output)) + [False] * pad)
    return PenaltyArgs(
        tokens=torch.tensor([prompt + output + [0] * pad]),
        is_output=torch.tensor([[False] * len(prompt) + [True] * len(output) + [False] * pad]),
        is_token=is_token[None, :],
        presence=torch.tensor([[presence]]),
        frequency=torch.tensor([[frequency]]),
        repetition=torch.tensor([[repetition]]),
    )


LOGITS_6 = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]])


def test_frequency_penalty_lowers_each_generated_token_once_per_occurrence() -> None:
    args = _penalty_args(
        prompt=[1, 4], output=[2, 2, 3], width=8, presence=0.0, frequency=0.5, repetition=1.0
    )
    out = apply_penalties(LOGITS_6.clone(), args)
    # token 2 was generated twice, token 3 once; prompt tokens and padding (token 0) are not penalised
    assert out.tolist() == [[2.0, -2.0, 0.0, -1.5, 0.5, 3.0]]


def test_presence_penalty_lowers_each_generated_token_once() -> None:
    args = _penalty_args(
        prompt=[1, 4], output=[2, 2, 3], width=8, presence=0.5, frequency=0.0, repetition=1.0
    )
    out = apply_penalties(LOGITS_6.clone(), args)
    assert out.tolist() == [[2.0, -2.0, 0.5, -1.5, 0.5, 3.0]]


def test_negative_frequency_and_presence_penalties_raise_generated_tokens() -> None:
    args = _penalty_args(prompt=[1], output=[2, 2], width=4, presence=-0.5, frequency=-0.25, repetition=1.0)
    out = apply_penalties(LOGITS_6.clone(), args)
    assert out.tolist() == [[2.0, -2.0, 2.0, -1.0, 0.5, 3.0]]


def test_repetition_penalty_pushes_every_seen_token_towards_unlikely() -> None:
    # seen: 1 and 4 in the prompt, 2 and 3 generated; 0 only as padding and 5 never
    args = _penalty_args(prompt=[1, 4], output=[2, 3], width=7, presence=0.0, frequency=0.0, repetition=2.0)
    out = apply_penalties(LOGITS_6.clone(), args)
    # positive logits are divided and negative ones multiplied, so each seen token becomes less likely
    assert out.tolist() == [[2.0, -4.0, 0.5, -2.0, 0.25, 3.0]]
    probs_before, probs_after = torch.softmax(LOGITS_6, -1)[0], torch.softmax(out, -1)[0]
    assert all(probs_after[t] < probs_before[t] for t in (1, 2, 3, 4))


def test_repetition_penalty_below_one_favours_seen_tokens() -> None:
    args = _penalty_args(prompt=[1], output=[2], width=2, presence=0.0, frequency=0.0, repetition=0.5)
    out = apply_penalties(LOGITS_6.clone(), args)
    assert out.tolist() == [[2.0, -1.0, 2.0, -1.0, 0.5, 3.0]]


class _OpenAIPenalties(LogitsProcessor):
    """The OpenAI frequency/presence penalties over generated tokens, as a transformers logits processor."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def _hf_penalised(folder: str, prompt: list[int], params: SamplingParams) -> list[int]:
    """transformers' greedy tokens under a request's penalties (the OpenAI ones through a logits processor)."""
    openai = _OpenAIPenalties(len(prompt), params.frequency_penalty, params.presence_penalty)
    return hf_greedy(
        folder,
        [prompt],
        params.max_tokens,
        repetition_penalty=params.repetition_penalty,
        logits_processor=LogitsProcessorList([openai]),
    )[0]


def test_penalised_greedy_tokens_equal_transformers_beside_unpenalised_requests(
    llama: str, hf_reference: Reference, make_llm: Callable[..., LLM]
) -> None:
    candidates = random_prompts(40, seed=2, min_len=3, max_len=30)
    greedy = hf_reference(llama, candidates, 16)
    # prompts whose greedy run repeats its newest token at once, and the same with the prompt ending in it:
    # a penalty that misses the newest token (just generated, or the last of the prompt) shows there
    first_repeat = [next((k for k in range(1, 16) if r[k] == r[k - 1]), None) for r in greedy]
    repeats = [(p, k, r) for p, k, r in zip(candidates, first_repeat, greedy) if k is not None][:2]
    assert len(repeats) == 2
    penalised = [p for p, _, _ in repeats] + [p + r[:k] for p, k, r in repeats]
    # one penalty kind a request: transformers applies the repetition penalty before custom processors
    rep = SamplingParams(max_tokens=16, repetition_penalty=1.6, ignore_eos=True)
    openai = SamplingParams(max_tokens=16, frequency_penalty=1.5, presence_penalty=0.5, ignore_eos=True)
    plain = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = penalised * 2 + candidates[:2]
    params = [rep] * len(penalised) + [openai] * len(penalised) + [plain] * 2
    llm = make_llm(llama, max_running_req=4, cache_type="naive")
    out = [o["token_ids"] for o in llm.generate(prompts, params)]

    assert out == [_hf_penalised(llama, p, sp) for p, sp in zip(prompts, params)]
    # the penalties changed what greedy picks where it repeated a penalised token; the OpenAI ones skip
    # prompt tokens, so the prompts that end in the repeated token may keep their greedy run under them
    changed = [o != u for o, u in zip(out, hf_reference(llama, prompts, 16))]
    assert changed[:6] == [True] * 6 and changed[-2:] == [False, False]


# ---- numerically hostile parameters ---------------------------------------------------------------------

# values at and past the edges of what SamplingParams.validate accepts (every one of them is accepted)
EXTREMES: dict[str, list[float]] = {
    "temperature": [0.0, 1e-300, 1e-40, 9.9e-6, 1e-5, 0.7, 1.0, 50.0, 1e30, 1.7e308],
    "top_k": [-1, 0, 1, 2, 7, 2**63 - 1],
    "top_p": [1e-300, 1e-8, 0.5, 1.0],
    "min_p": [0.0, 1e-300, 0.5, 1.0],
    "presence_penalty": [-2.0, 0.0, 2.0],
    "frequency_penalty": [-2.0, 0.0, 2.0],
    "repetition_penalty": [1e-300, 1e-40, 1e-3, 0.5, 1.0, 1e3, 1.7e308],
}


def test_no_accepted_parameters_give_nan_probabilities_or_an_impossible_token() -> None:
    gen = random.Random(0)
    rows, vocab = 800, 64
    params = [SamplingParams(**{k: gen.choice(v) for k, v in EXTREMES.items()}) for _ in range(rows)]
    for p in params:
        p.validate()
    tokens = torch.randint(0, vocab, (rows, 8), generator=torch.Generator().manual_seed(1))
    reqs = []
    for i, p in enumerate(params):
        req = Req(
            input_ids=tokens[i].tolist(),
            table_idx=i,
            cached_len=0,
            output_len=1,
            uid=i,
            sampling_params=p,
            cache_handle=None,
            seed=i,
        )
        req.prompt_len = 5  # the last 3 tokens are generated ones, for the presence and frequency penalties
        reqs.append(req)
    # logits as large as a model's get, some rows far larger
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(2)) * 30
    logits[::7] *= 1e3
    sampler = Sampler(CPU, vocab)
    batch = Batch(reqs=reqs, phase="decode")
    batch.positions = torch.full((rows,), 7)
    args = sampler.prepare(batch, tokens.to(torch.int32))
    assert args.penalty is not None and args.temperatures is not None

    penalised = apply_penalties(logits, args.penalty)
    assert torch.isfinite(penalised).all()
    probs = sampling_probs(penalised, args)
    assert torch.isfinite(probs).all()
    assert torch.allclose(probs.sum(-1), torch.ones(rows), atol=1e-4)
    out = sampler.sample(logits.clone(), args).long()
    sampled = args.temperatures[:, 0] > 0
    assert (probs[sampled].gather(1, out[sampled, None]) > 0).all()
    assert torch.equal(out[~sampled], penalised[~sampled].argmax(-1))
    # the greedy rows are those below the temperature floor (or top_k=1), and they are not few
    assert (~sampled).sum() > rows // 10
    assert all(p.is_greedy == (not s) for p, s in zip(params, sampled.tolist()))


def test_a_temperature_below_1e_5_is_greedy() -> None:
    logits = torch.tensor([0.5, 0.1, 0.45, -2.0, 0.49])
    for t in (1e-300, 1e-40, 9.9e-6):
        assert SamplingParams(temperature=t).is_greedy
        assert set(_sample_with([SamplingParams(temperature=t)] * 200, logits, seeds=list(range(200)))) == {0}
    assert not SamplingParams(temperature=1e-5).is_greedy


def test_penalty_tokens_are_read_again_from_the_pool_at_sampling_time() -> None:
    """Under overlap the previous step writes the newest token after the batch was prepared: gather
    reads the pool again, so that token counts (on CUDA the engine calls it on its own stream)."""
    pool = torch.tensor([[5, 1, 0, 0], [7, 7, 0, 0]], dtype=torch.int32)
    args = _penalty_args(prompt=[5], output=[1, 3], width=4, presence=0.0, frequency=1.0, repetition=1.0)
    args.rows = torch.tensor([0])
    pool[0, 2] = 3  # the step in flight writes token 3 at position 2 after preparation
    args.tokens = torch.zeros_like(args.tokens)  # what a read before that write could have seen
    args.gather(pool)
    assert args.tokens.tolist() == [[5, 1, 3, 0]]
    logits = apply_penalties(torch.zeros(1, 8), args)
    assert logits[0, 3].item() == -1.0 and logits[0, 1].item() == -1.0 and logits[0, 5].item() == 0.0
