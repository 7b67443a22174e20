"""One request at a time on a GPU: the time to its first token by prompt length, and its decode rate.

    python benchmark/offline/prefill_latency.py --model ckpt/qwen3-0.6b [--lens 16,128,1024]
        [--cuda-graph-max-prefill N] [--json out.json]

Each prompt is new (no prefix shared) and asks for one token; the median of 10 is printed a length. A
prefill step of up to --cuda-graph-max-prefill tokens replays a CUDA graph (the engine's default: 2048;
0: none); a longer one runs eagerly, and at short prompts its time is then the host's launches (about 260
a step on Qwen3-0.6B) more than the GPU's work. The engine's start-up time is printed too. Then one request decodes 128 tokens (CUDA graphs; the
sampling kernels run outside the graph): milliseconds a token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--lens", default="16,128,1024")
    p.add_argument("--cuda-graph-max-prefill", type=int, help="the engine's default when left out")
    p.add_argument("--json")
    args = p.parse_args()
    from minisgl import LLM, SamplingParams
    from minisgl.env import ENV

    start = time.perf_counter()
    llm = LLM(
        args.model, device="cuda", max_running_req=8, cuda_graph_max_prefill=args.cuda_graph_max_prefill
    )
    startup = time.perf_counter() - start
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    result: dict[str, object] = {
        "direct_launch": bool(ENV.DIRECT_LAUNCH.value),
        "prefill_graph_tokens": sorted(llm.engine.prefill_graphs.graphs),
        "startup_s": round(startup, 2),
    }
    print(f"engine start-up {startup:.1f} s; prefill graphs {result['prefill_graph_tokens']}", flush=True)
    seed = 0
    for n in (int(x) for x in args.lens.split(",")):
        times = []
        for _ in range(10):
            seed += 1
            prompt = [(1000 + 7 * seed + 13 * j) % 30000 + 100 for j in range(n)]
            start = time.perf_counter()
            llm.generate([prompt], one, use_tqdm=False)
            times.append((time.perf_counter() - start) * 1e3)
        result[f"first_token_ms_{n}"] = round(statistics.median(times), 3)
        print(f"prompt {n}: first token {result[f'first_token_ms_{n}']} ms (median of 10)", flush=True)
    decode = SamplingParams(max_tokens=129, temperature=0.6, top_p=0.9, top_k=50, ignore_eos=True)
    prompt = [(3 + 11 * j) % 30000 + 100 for j in range(16)]
    llm.generate([prompt], decode, use_tqdm=False)  # the graphs of this batch size replayed once
    start = time.perf_counter()
    llm.generate([prompt], decode, use_tqdm=False)
    total = (time.perf_counter() - start) * 1e3
    result["decode_ms_per_token"] = round((total - result["first_token_ms_16"]) / 128, 3)
    print(f"one request, top-k/top-p: {result['decode_ms_per_token']} ms a token", flush=True)
    llm.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
