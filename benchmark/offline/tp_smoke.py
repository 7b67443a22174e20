"""A quick tensor-parallel check on CUDA: a tiny model at tp=2 with and without CUDA graphs, each step
timed, and the stacks of a stuck run dumped, so a hang says where it is."""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))


def main() -> None:
    from tiny import build_variant, random_prompts

    from minisgl import LLM, SamplingParams

    faulthandler.dump_traceback_later(float(os.environ.get("DUMP_AFTER_S", "40")), exit=True)
    folder = build_variant(tempfile.mkdtemp(), "llama")
    prompts = random_prompts(4, seed=1, max_len=20)
    for graphs in (0, None):
        start = time.perf_counter()
        llm = LLM(folder, dtype=torch.float32, tp_size=2, max_running_req=4, cuda_graph_max_bs=graphs)
        print(f"graphs={graphs}: built in {time.perf_counter() - start:.1f} s", flush=True)
        out = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        print(f"graphs={graphs}: generated {[len(o['token_ids']) for o in out]}", flush=True)
        llm.shutdown()


if __name__ == "__main__":
    main()
