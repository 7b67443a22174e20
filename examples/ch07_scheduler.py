"""Chapter 7: the offline interface running 5 requests, printing the batch scheduled each step.

To see only the skeleton, overlap scheduling is off and the naive cache is used (no prefix reuse).
Usage: python examples/ch07_scheduler.py [MODEL] [--trace PATH]  (a Hugging Face folder or a .gguf
file; without one, the embedded default model). With --trace, the same run is also written as a
timeline to open in Perfetto (docs/trace.md).
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minisgl.core import SamplingParams
from minisgl.env import ENV
from minisgl.llm import LLM

parser = argparse.ArgumentParser(description="the scheduler running five requests")
parser.add_argument("model", nargs="?", default=None, help="default: the embedded default model")
parser.add_argument("--trace", default=None, help="also write the run's timeline (Perfetto JSON) here")
args = parser.parse_args()
ENV.DISABLE_OVERLAP_SCHEDULING.value = True
llm = LLM(
    args.model,
    dtype=torch.float32,
    max_running_req=8,
    num_page_override=1024,
    max_seq_len_override=512,
    cache_type="naive",
    trace=args.trace,
)


def traced(b):
    if b is not None:
        detail = ", ".join(f"uid{r.uid}:{r.extend_len}" for r in b.reqs)
        print(f"  {b.phase:<7} bs={b.size}  tokens={len(b.positions):<3} [{detail}]")


llm.step_observers.append(traced)
prompts = [
    "The capital of France is",
    "List three prime numbers:",
    "def fibonacci(n):",
    "1 + 1 =",
    "Once upon a time,",
]
lengths = [6, 2, 5, 1, 4]  # the requests have different max_tokens: the short ones finish and leave first
print("the scheduling trace:")
outputs = llm.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])
# the reference reads the very folder minisgl loaded (a GGUF file is converted to one first)
tok = AutoTokenizer.from_pretrained(llm.engine.model_dir)
hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=torch.float32)
for p, n, o in zip(prompts, lengths, outputs):
    ids = tok(p, return_tensors="pt").input_ids
    ref = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, ids.shape[1] :].tolist()
    print(f"{p!r:<30} -> {o['text']!r:<32} matches HF: {o['token_ids'] == ref}")
llm.shutdown()
