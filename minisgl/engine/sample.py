"""Sampling the next token of every request of a batch, on the device, in one pass.

Randomness comes from a counter-based hash of (request seed, position, token id), not from a
generator's state: the same seed gives the same tokens whatever else shares the batch, and the
step has no hidden state to carry (which also keeps it graph- and overlap-friendly).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minisgl.constrained.grammar import apply_token_mask
from minisgl.core import Batch, Req
from minisgl.kernel import cpu as cpu_kernels
from minisgl.kernel import triton_everywhere, use_triton
from minisgl.utils.torch_utils import pin

_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # splitmix64 multipliers, as signed int64
_M2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
# the repetition penalty divides or multiplies logits: within these bounds they stay finite in float32
REPETITION_PENALTY_CLAMP = (1e-3, 1e3)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def hash_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform (0, 1) noise of shape [B, V], a pure function of (seed, step, token id)."""
    vocab = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    x = (seeds * _GOLDEN + steps * _M2)[:, None] + vocab[None, :] * _M1
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    x = x ^ _shr(x, 31)
    return (_shr(x, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


@dataclass
class BatchSamplingArgs:
    greedy: bool  # every request greedy and unpenalised: a plain argmax
    temperatures: torch.Tensor | None = None  # [B, 1]; 0 rows are greedy
    top_k: torch.Tensor | None = None  # [B] (float32 from the sampler); vocab size where off
    top_p: torch.Tensor | None = None  # [B]
    min_p: torch.Tensor | None = None  # [B]
    seeds: torch.Tensor | None = None  # [B] int64
    steps: torch.Tensor | None = None  # [B] int64
    penalty: PenaltyArgs | None = None
    top_logprobs: int | None = None  # the most top log-probabilities a request asks for; None: none asks
    token_mask: torch.Tensor | None = None  # [B, ceil(V/32)] int32 bits of allowed tokens; None: no grammar
    bias: LogitBias | None = None  # logit_bias, and the stop ids min_tokens holds back; None: none
    prompt: PromptLogprobArgs | None = None  # a prefill's prompt logprobs; None: no request asks


@dataclass
class PromptLogprobArgs:
    """Which prompt positions of a prefill get log-probabilities: those whose next token is a prompt token."""

    targets: torch.Tensor  # [P] the prompt token at each such position + 1, on the device
    counts: list[int]  # positions per request of the batch, in order (0: it does not ask)
    top: int  # the most top log-probabilities a request of the batch asks for


@dataclass
class LogitBias:
    """A sparse add on the logits: logits[rows[i], cols[i]] += values[i] (-inf bans a token)."""

    rows: torch.Tensor  # [N] int64
    cols: torch.Tensor  # [N] int64
    values: torch.Tensor  # [N] float32

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        # out of place: the logits may be a CUDA graph's output buffer
        return logits.index_put((self.rows, self.cols), self.values, accumulate=True)


@dataclass
class LogprobsOutput:
    """Log-probabilities from the raw logits (before penalties and temperature, as OpenAI reports them)."""

    token_logprobs: torch.Tensor  # [B] of the sampled tokens
    top_logprobs: torch.Tensor  # [B, k], most likely first
    top_ids: torch.Tensor  # [B, k]

    def to(self, device: str, non_blocking: bool) -> LogprobsOutput:
        tensors = (self.token_logprobs, self.top_logprobs, self.top_ids)
        return LogprobsOutput(*(t.to(device, non_blocking=non_blocking) for t in tensors))


@dataclass
class PromptLogprobsOutput:
    """Log-probabilities of prompt tokens from the logits of the positions before them."""

    token_logprobs: torch.Tensor  # [P]
    ranks: torch.Tensor  # [P] 1 + the tokens more likely than the prompt's
    top_logprobs: torch.Tensor  # [P, k]
    top_ids: torch.Tensor  # [P, k]
    counts: list[int]  # PromptLogprobArgs.counts

    def to(self, device: str, non_blocking: bool) -> PromptLogprobsOutput:
        tensors = (self.token_logprobs, self.ranks, self.top_logprobs, self.top_ids)
        return PromptLogprobsOutput(*(t.to(device, non_blocking=non_blocking) for t in tensors), self.counts)


@dataclass
class PenaltyArgs:
    tokens: torch.Tensor  # [B, L] every token of the request so far, padded with 0
    is_output: torch.Tensor  # [B, L] bool: a generated token (not prompt, not padding)
    is_token: torch.Tensor  # [B, L] bool: not padding
    presence: torch.Tensor  # [B, 1]
    frequency: torch.Tensor  # [B, 1]
    repetition: torch.Tensor  # [B, 1]
    # the token-pool rows of the batch: `tokens` is read again from the pool at sampling time (gather)
    rows: torch.Tensor | None = None

    def gather(self, token_pool: torch.Tensor) -> None:
        """Read the tokens from the pool now. Under overlap the batch is prepared on the scheduler's stream
        while the previous step, which writes the newest token of each row, still runs on the engine's:
        read at preparation, that token could be stale. Called on the engine's stream, just before sampling,
        the read comes after that write."""
        if self.rows is not None:
            width = self.tokens.shape[1]
            self.tokens = torch.where(self.is_token, token_pool[self.rows, :width].to(torch.int64), 0)


@dataclass
class _RowParams:
    """What the sampler derives from the requests of a batch alone, kept while the same requests decode."""

    reqs: list[Req]  # the very objects: uids restart with each offline generate call
    greedy: bool
    penalised: bool
    top_logprobs: int | None
    # on the device, views of one packed copy made once: [B, 1] temperatures (0: greedy), then top_k, top_p
    # and min_p, each only if some request of the batch uses it (the CPU filters skip what no row uses)
    temperatures: torch.Tensor | None
    filters: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
    seeds: torch.Tensor | None
    # some request has a logit_bias or a min_tokens (held-back stop ids): the bias is built each step
    biased: bool


class Sampler:
    def __init__(self, device: torch.device, vocab_size: int) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self._rows: _RowParams | None = None

    def _to(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, pin_memory=pin(self.device)).to(
            self.device, non_blocking=True
        )

    def prepare(
        self,
        batch: Batch,
        token_pool: torch.Tensor,
        eos_token_ids: Sequence[int] = (),
        steps: torch.Tensor | None = None,
    ) -> BatchSamplingArgs:
        """Sampling arguments of the batch; `token_pool` holds every request's tokens (for penalties);
        `eos_token_ids` are held back, with each request's stop ids, until it has min_tokens tokens.
        `batch.positions` (and in a prefill `batch.last_indices`) must be on the device already; `steps`, the
        position of each row's sampled token ([B] int64 on the device), where the caller has it."""
        args = self._prepare(batch, token_pool, steps)
        assert self._rows is not None
        if self._rows.biased:
            args.bias = self._prepare_bias(batch, eos_token_ids)
        return args

    def _row_params(self, batch: Batch) -> _RowParams:
        """The per-row parameters, built and copied once per batch composition: a decode batch keeps its
        requests for many steps, and then a step costs no host work and no copy for them."""
        reqs = batch.reqs
        last = self._rows
        # list equality compares the requests by identity (Req has no __eq__), in C: a step of 256 rows paid
        # 30 us for the same check as a generator
        if last is not None and last.reqs == reqs:
            return last
        params = [r.sampling_params for r in reqs]
        penalised = any(p.has_penalty for p in params)
        # computed only when a request of the batch asks: it costs a log_softmax over the vocabulary
        top_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        greedy = all(p.is_greedy for p in params) and not penalised
        packed = seeds = None
        v = self.vocab_size
        uses = (
            any(0 < p.top_k < v for p in params),
            any(p.top_p < 1.0 for p in params),
            any(p.min_p > 0.0 for p in params),
        )
        if not greedy:
            # one pinned buffer, one asynchronous copy: no host wait, whatever the device is doing;
            # rows padded to 4 floats keep every row 16-byte aligned, so Triton compiles one kernel
            # for any batch size (it specialises pointer arguments on that alignment)
            pad = [0.0] * (-len(params) % 4)
            packed = self._to(
                [
                    [p.temperature if not p.is_greedy else 0.0 for p in params] + pad,
                    [p.top_k if 0 < p.top_k < v else v for p in params] + pad,
                    [p.top_p for p in params] + pad,
                    [p.min_p for p in params] + pad,
                ],
                torch.float32,
            )[:, : len(params)]
            seeds = self._to([r.seed for r in reqs], torch.int64)
        biased = any(p.logit_bias or p.min_tokens > 0 for p in params)
        temperatures = packed[0][:, None] if packed is not None else None
        filters = tuple(packed[i + 1] if packed is not None and used else None for i, used in enumerate(uses))
        self._rows = _RowParams(
            reqs=list(reqs),
            greedy=greedy,
            penalised=penalised,
            top_logprobs=top_logprobs,
            temperatures=temperatures,
            filters=filters,
            seeds=seeds,
            biased=biased,
        )
        return self._rows

    def _prepare(
        self, batch: Batch, token_pool: torch.Tensor, steps: torch.Tensor | None
    ) -> BatchSamplingArgs:
        rows = self._row_params(batch)
        if rows.greedy:
            return BatchSamplingArgs(greedy=True, top_logprobs=rows.top_logprobs)
        # the noise counter is the position of the token drawn, device_len: one past the last input's
        if steps is None:
            last = batch.positions[batch.last_indices] if batch.is_prefill else batch.positions[: batch.size]
            steps = last.to(torch.int64) + 1
        top_k, top_p, min_p = rows.filters
        args = BatchSamplingArgs(
            greedy=False,
            temperatures=rows.temperatures,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seeds=rows.seeds,
            steps=steps,
            top_logprobs=rows.top_logprobs,
        )
        if rows.penalised:
            args.penalty = self._prepare_penalty(batch, token_pool)
        return args

    def _prepare_bias(self, batch: Batch, eos_token_ids: Sequence[int]) -> LogitBias | None:
        rows: list[int] = []
        cols: list[int] = []
        values: list[float] = []
        for i, r in enumerate(batch.reqs):
            p = r.sampling_params
            for token, bias in p.logit_bias.items():
                rows.append(i)
                cols.append(token)
                values.append(bias)
            # device_len - prompt_len tokens are generated before this step's sample
            if r.device_len - r.prompt_len < p.min_tokens:
                stops = [*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)]
                # a stop id beyond the vocabulary can never be sampled: nothing to hold back
                held = [t for t in stops if t < self.vocab_size]
                rows += [i] * len(held)
                cols += held
                values += [-math.inf] * len(held)
        if not rows:
            return None
        return LogitBias(
            self._to(rows, torch.int64), self._to(cols, torch.int64), self._to(values, torch.float32)
        )

    def _prepare_penalty(self, batch: Batch, token_pool: torch.Tensor) -> PenaltyArgs:
        reqs = batch.reqs
        # at sampling time the request's known tokens are the pool row up to device_len (the inputs of this step)
        lens = [r.device_len for r in reqs]
        width = max(lens)
        pos = torch.arange(width, device=self.device)
        rows = self._to([r.table_idx for r in reqs], torch.int64)
        len_t = self._to(lens, torch.int64)
        prompt_t = self._to([r.prompt_len for r in reqs], torch.int64)
        is_token = pos[None, :] < len_t[:, None]
        params = [r.sampling_params for r in reqs]
        # on CUDA the tokens are read at sampling time (PenaltyArgs.gather), so not here as well
        lazy = self.device.type == "cuda"
        tokens = (
            torch.empty((len(reqs), width), dtype=torch.int64, device=self.device)
            if lazy
            else torch.where(is_token, token_pool[rows, :width].to(torch.int64), 0)
        )
        return PenaltyArgs(
            tokens=tokens,
            is_output=is_token & (pos[None, :] >= prompt_t[:, None]),
            is_token=is_token,
            presence=self._to([[p.presence_penalty] for p in params], torch.float32),
            frequency=self._to([[p.frequency_penalty] for p in params], torch.float32),
            repetition=self._to([[p.repetition_penalty] for p in params], torch.float32),
            rows=rows if lazy else None,
        )

    def sample(self, logits: torch.Tensor, args: BatchSamplingArgs) -> torch.Tensor:
        """logits: [B, V] float32 -> next token ids [B] int32."""
        if args.bias is not None:
            logits = args.bias.apply(logits)
        if args.token_mask is not None:
            logits = apply_token_mask(logits, args.token_mask)
        if args.greedy:
            return greedy_tokens(logits)
        if args.penalty is not None:
            logits = apply_penalties(logits, args.penalty)
        assert args.temperatures is not None and args.seeds is not None and args.steps is not None
        if use_triton(logits):
            from minisgl.kernel.sampling import sample

            filters = (args.top_k, args.top_p, args.min_p)
            return sample(logits, args.temperatures, args.seeds, args.steps, *filters)
        argmax = torch.argmax(logits, dim=-1)
        probs = sampling_probs(logits, args)
        # exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws token i with probability p_i
        noise = -torch.log(hash_uniform(args.seeds, args.steps, logits.shape[-1]))
        # a token of probability 0 is never drawn: its noise can be 0 (U rounds to 1), and 0 / 0 would win
        sampled = torch.argmax(torch.where(probs > 0, probs / noise, 0.0), dim=-1)
        return torch.where(args.temperatures[:, 0] > 0, sampled, argmax).to(torch.int32)

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, k: int) -> LogprobsOutput:
        """logits: [B, V] as the model produced them; tokens: [B] sampled -> their and the top-k log-probabilities."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(1, tokens.to(torch.int64)[:, None])[:, 0]
        top = logprobs.topk(k, dim=-1)
        return LogprobsOutput(chosen, top.values, top.indices)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax over each row as int32; on the CPU the C kernel's (4-5x faster on one thread)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1:
        lib = cpu_kernels.library() if not triton_everywhere() else None
        if lib is not None:
            return cpu_kernels.argmax_rows(lib, logits)
    return torch.argmax(logits, dim=-1).to(torch.int32)


def prompt_logprobs(logits: torch.Tensor, args: PromptLogprobArgs) -> PromptLogprobsOutput:
    """logits: [P, V] of the asked prompt positions -> the next prompt token's log-probability, rank and top-k."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, args.targets[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top = logprobs.topk(args.top, dim=-1)
    return PromptLogprobsOutput(chosen[:, 0], ranks, top.values, top.indices, args.counts)


def sampling_probs(logits: torch.Tensor, args: BatchSamplingArgs) -> torch.Tensor:
    """The distribution each row draws from (after penalties): tempered, filtered, normalised.

    Greedy rows (temperature 0) are left at temperature 1; the sampler takes their argmax instead.
    """
    assert args.temperatures is not None
    temps = args.temperatures
    logits = logits / torch.where(temps > 0, temps, 1.0)
    logits = filter_logits(logits, args.top_k, args.top_p, args.min_p)
    return torch.softmax(logits, dim=-1)


def apply_penalties(logits: torch.Tensor, pen: PenaltyArgs) -> torch.Tensor:
    """OpenAI presence/frequency penalties over generated tokens; repetition penalty (HF style) over all."""
    counts = torch.zeros_like(logits).scatter_add_(1, pen.tokens, pen.is_output.to(logits.dtype))
    seen = torch.zeros_like(logits).scatter_add_(1, pen.tokens, pen.is_token.to(logits.dtype)) > 0
    logits = logits - pen.frequency * counts - pen.presence * (counts > 0).to(logits.dtype)
    repetition = pen.repetition.clamp(*REPETITION_PENALTY_CLAMP)
    rep = torch.where(logits > 0, logits / repetition, logits * repetition)
    return torch.where(seen, rep, logits)


def filter_logits(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, min_p: torch.Tensor | None
) -> torch.Tensor:
    """Set to -inf every token outside each row's top-k, top-p nucleus and min-p floor."""
    neg_inf = torch.finfo(logits.dtype).min
    if min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < floor, neg_inf)
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        drop |= rank >= top_k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, neg_inf)
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        # keep a token while the mass before it is below top_p: the first token always stays
        drop |= (torch.cumsum(probs, dim=-1) - probs) >= top_p[:, None]
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, neg_inf))
