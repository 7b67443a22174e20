"""One request at a time on a GPU: the time to its first token by prompt length, and its decode rate.

    python benchmark/offline/prefill_latency.py --model ckpt/qwen3-0.6b [--lens 16,128,1024]
        [--cuda-graph-max-prefill N] [--peer transformers] [--spread N] [--json out.json]

Each prompt is new (no prefix shared) and asks for one token; the median of 10 is printed a length. A
prefill step of up to --cuda-graph-max-prefill tokens replays a CUDA graph (the engine's default: 2048;
0: none); a longer one runs eagerly, and at short prompts its time is then the host's launches (about 260
a step on Qwen3-0.6B) more than the GPU's work. The engine's start-up time is printed too. Then one request decodes 128 tokens (CUDA graphs; the
sampling kernels run outside the graph): milliseconds a token.

`--peer transformers` then times transformers' `generate` on the same prompts in the same process
after the engine is shut down (bf16, SDPA attention, the model's default dynamic cache): the first
token as `max_new_tokens=1` greedy, and the decode rate with the same top-k/top-p sampling.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def prompt_of(seed: int, n: int) -> list[int]:
    return [(1000 + 7 * seed + 13 * j) % 30000 + 100 for j in range(n)]


def time_requests(
    name: str,
    first: Callable[[list[int]], Any],
    decode: Callable[[list[int]], Any],
    lens: list[int],
    spread: int = 0,
) -> dict[str, float]:
    """The median first-token time of 10 new prompts a length (`first` asks for one token), then one
    request's milliseconds a token over `decode`'s 129 tokens (its first token's time taken off).
    With `spread`, the i-th prompt of a length is (i * 37) % spread tokens longer: ten different counts."""
    out: dict[str, float] = {}
    seed = 0
    for n in lens:
        times = []
        for i in range(10):
            seed += 1
            prompt = prompt_of(seed, n + (i * 37) % spread if spread else n)
            start = time.perf_counter()
            first(prompt)
            times.append((time.perf_counter() - start) * 1e3)
        out[f"first_token_ms_{n}"] = round(statistics.median(times), 3)
        print(f"{name}: prompt {n}: first token {out[f'first_token_ms_{n}']} ms (median of 10)", flush=True)
    prompt = [(3 + 11 * j) % 30000 + 100 for j in range(16)]
    decode(prompt)  # whatever the first request of this shape compiles or captures
    start = time.perf_counter()
    decode(prompt)
    total = (time.perf_counter() - start) * 1e3
    out["decode_ms_per_token"] = round((total - out.get("first_token_ms_16", 0.0)) / 128, 3)
    print(f"{name}: one request, top-k/top-p: {out['decode_ms_per_token']} ms a token", flush=True)
    return out


def transformers_calls(model: str) -> tuple[Callable[[list[int]], Any], Callable[[list[int]], Any]]:
    """transformers' generate on one prompt: one greedy token, and 129 sampled tokens (top-k 50, top-p 0.9)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    hf.eval()

    def run(prompt: list[int], **kw: Any) -> Any:
        ids = torch.tensor([prompt], device="cuda")
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **kw)
        torch.cuda.synchronize()
        return out

    run(prompt_of(0, 16), max_new_tokens=1, do_sample=False)  # CUDA and cuBLAS start-up, not the request's
    return (
        lambda p: run(p, max_new_tokens=1, do_sample=False),
        lambda p: run(
            p, max_new_tokens=129, min_new_tokens=129, do_sample=True, temperature=0.6, top_k=50, top_p=0.9
        ),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--lens", default="16,128,1024")
    p.add_argument("--cuda-graph-max-prefill", type=int, help="the engine's default when left out")
    p.add_argument("--peer", choices=["none", "transformers"], default="none")
    p.add_argument(
        "--spread",
        type=int,
        default=0,
        help="the ten prompts of a length up to this many tokens longer, each a different count (as users' "
        "prompts are): an eager step's GEMMs then meet row counts new to cuBLAS",
    )
    p.add_argument(
        "--extend-tiles",
        metavar="BLOCK_M,BLOCK_N,WARPS,STAGES,EVEN,LONGEST_FIRST",
        help="force one prefill-attention tile configuration (kernel/attention.py's ExtendConfig)",
    )
    p.add_argument("--json")
    args = p.parse_args()
    from minisgl import LLM, SamplingParams
    from minisgl.env import ENV

    if args.extend_tiles:
        from minisgl.kernel import attention as attn

        bm, bn, warps, stages, even, longest = (int(x) for x in args.extend_tiles.split(","))
        attn.EXTEND_CONFIG = attn.ExtendConfig(bm, bn, warps, stages, bool(even), bool(longest))

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
    lens = [int(x) for x in args.lens.split(",")]
    decode = SamplingParams(max_tokens=129, temperature=0.6, top_p=0.9, top_k=50, ignore_eos=True)
    result |= time_requests(
        "minisgl",
        lambda prompt: llm.generate([prompt], one, use_tqdm=False),
        lambda prompt: llm.generate([prompt], decode, use_tqdm=False),
        lens,
        args.spread,
    )
    llm.shutdown()
    if args.peer == "transformers":
        peer = transformers_calls(args.model)
        result["transformers"] = time_requests("transformers", *peer, lens, args.spread)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
