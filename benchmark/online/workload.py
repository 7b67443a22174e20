"""The requests of the online benchmark: prompts (text or token ids) and a synthetic arrival trace.

The trace stands in for a recorded one such as ShareGPT's, so that it needs no download and every
rate replays exactly the same requests:
- arrivals: a Poisson process; the gaps are drawn once at rate 1 and divided by the rate, so rate r
  replays the same order of requests r times faster (rate inf sends them all at once);
- input lengths: lognormal, median 200 tokens (sigma 1.0), cut to [4, 2048];
- output lengths: lognormal, median 150 tokens (sigma 0.8), cut to [4, 1024].
ShareGPT's conversations, tokenized by a Llama tokenizer, have prompts of a few hundred tokens with
a long tail and answers of about the same size, which these medians and tails follow; every number
is an option, and `TraceSpec.describe()` says which were used.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

WORDS = (
    "the of and to in is was for on are with as his they be at one have this from or had by hot word but what "
    "some we can out other were all there when up use your how said an each she which do their time if will way "
    "about many then them write would like so these her long make thing see him two has look more day could go "
    "come did number sound no most people my over know water than call first who may down side been now find "
    "any new work part take get place made live where after back little only round man year came show every good "
    "me give our under name very through just form sentence great think say help low line differ turn cause much "
    "mean before move right boy old too same tell does set three want air well also play small end put home read "
    "hand port large spell add even land here must big high such follow act why ask men change went light kind"
).split()


@dataclass
class Request:
    prompt: str | list[int]
    output_len: int
    # seconds after the start at which the request is sent, at rate 1 (0 in a closed loop)
    arrival: float = 0.0


@dataclass
class TraceSpec:
    input_median: float = 200.0
    input_sigma: float = 1.0
    input_max: int = 2048
    output_median: float = 150.0
    output_sigma: float = 0.8
    output_max: int = 1024
    min_len: int = 4

    def describe(self) -> str:
        return (
            f"Poisson arrivals; input tokens lognormal(median {self.input_median:g}, sigma {self.input_sigma:g}) "
            f"in [{self.min_len}, {self.input_max}], output tokens lognormal(median {self.output_median:g}, "
            f"sigma {self.output_sigma:g}) in [{self.min_len}, {self.output_max}]"
        )


def _lognormal_len(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma))))


def text_prompt(rng: random.Random, words: int) -> str:
    """`words` random common words: about one token each for the BPE vocabularies of chat models."""
    return " ".join(rng.choice(WORDS) for _ in range(words))


def id_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    # ids below 10,000 as the offline benchmark draws them: ordinary tokens of any real vocabulary
    top = min(10000, vocab - 1)
    return [rng.randint(0, top) for _ in range(length)]


def fixed_requests(
    num: int, lo: int, hi: int, output_len: int, seed: int, vocab: int | None
) -> list[Request]:
    """The closed-loop workload: prompts of U[lo, hi] tokens (token ids when `vocab` is given, else
    words) and `output_len` new tokens each."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n = rng.randint(lo, hi)
        out.append(Request(id_prompt(rng, n, vocab) if vocab else text_prompt(rng, n), output_len))
    return out


def make_trace(num: int, spec: TraceSpec, seed: int, vocab: int | None) -> list[Request]:
    """`num` requests of the synthetic trace, arrivals at rate 1 (see the module's docstring)."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(num):
        t += rng.expovariate(1.0)
        n_in = _lognormal_len(rng, spec.input_median, spec.input_sigma, spec.min_len, spec.input_max)
        n_out = _lognormal_len(rng, spec.output_median, spec.output_sigma, spec.min_len, spec.output_max)
        prompt = id_prompt(rng, n_in, vocab) if vocab else text_prompt(rng, n_in)
        out.append(Request(prompt, n_out, t))
    return out


def send_times(requests: list[Request], rate: float) -> list[float]:
    """Seconds after the start at which each request is sent at `rate` requests/s (inf: all at once)."""
    if math.isinf(rate):
        return [0.0] * len(requests)
    return [r.arrival / rate for r in requests]
