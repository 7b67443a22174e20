"""The host's grammar work in one step of a batch of constrained requests, on the default model's tokenizer:
every matcher accepting its request's token, then the batch's masks filled by one call.

Under the overlap loop this work runs while the device computes the next step's model (the sampling
waits for the masks, the model does not); without the split the device waited for it, and for the
rest of the step's results, every step. Each request follows a JSON schema asking for a list of at
least 8 people; each step every row takes a random token its mask allows (seeded), as a sampler would.
    python benchmark/offline/mask_fill.py --steps 64
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from types import SimpleNamespace

import numpy as np

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo", "Lima"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"people": {"type": "array", "items": PERSON, "minItems": 8}},
        "required": ["people"],
    }
)


def allowed(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids whose bit is set in one mask row."""
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--batch-sizes", default="1,8,32,64,128")
    args = p.parse_args()

    from minisgl.constrained.grammar import GrammarManager
    from minisgl.core import SamplingParams
    from minisgl.utils.hf import eos_token_ids, load_hf_config, load_tokenizer, resolve_model_path

    model_dir = resolve_model_path(None)
    tokenizer = load_tokenizer(model_dir)
    hf_config = load_hf_config(model_dir)
    vocab_size = int(hf_config.vocab_size)
    eos = sorted(eos_token_ids(model_dir, hf_config, tokenizer))
    params = SamplingParams(max_tokens=args.steps, json_schema=SCHEMA)
    print(f"vocabulary {vocab_size}: a mask row is {(vocab_size + 31) // 32 * 4} bytes")
    print(f"{'batch':>5} {'accept ms':>9} {'fill ms':>8} {'step ms':>8} {'per request us':>14}")
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        manager = GrammarManager(tokenizer, vocab_size, eos)
        reqs = [SimpleNamespace(uid=uid) for uid in range(batch_size)]
        for r in reqs:
            manager.add(r.uid, params)
        rng = random.Random(0)
        mask = manager.fill_masks(reqs)  # waits for the (one, cached) compile
        accepts, fills = [], []
        for _ in range(args.steps):
            assert mask is not None
            tokens = [int(rng.choice(allowed(mask[i].numpy(), vocab_size))) for i in range(batch_size)]
            start = time.perf_counter()
            for r, token in zip(reqs, tokens):
                manager.accept(r.uid, token)
            middle = time.perf_counter()
            mask = manager.fill_masks(reqs)
            end = time.perf_counter()
            accepts.append(middle - start)
            fills.append(end - middle)
        manager.close()
        accept, fill = statistics.median(accepts) * 1e3, statistics.median(fills) * 1e3
        per_request = (accept + fill) * 1e3 / batch_size
        print(f"{batch_size:>5} {accept:>9.3f} {fill:>8.3f} {accept + fill:>8.3f} {per_request:>14.1f}")


if __name__ == "__main__":
    main()
