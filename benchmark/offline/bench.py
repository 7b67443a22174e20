"""Offline throughput: minisgl against transformers on the same weights and requests, in one run.

The workload is the upstream one (mini-sglang's and nano-vllm's bench.py): random token prompts,
input and output lengths uniform in [min_len, max_len], random.seed(0), ignore_eos. Defaults are
the full workload (256 requests, [100, 1024]); scale it down on a CPU, e.g.
    python benchmark/offline/bench.py --num-requests 64 --min-len 32 --max-len 256
The peer on CPU is transformers' static batched `generate` (float32 and bf16); on CUDA it is
transformers' continuous batching (benchmark/offline/peer_cuda.py). `--top-k`, `--top-p` and `--min-p`
add filters to the sampling (both sides). `--repeat N` runs the workload N times in one process: the
first run, right after `LLM()` with nothing before it, shows what a fresh process pays (compilation the
start-up warm-up missed); the median of the others is the warm figure compared with the peer.
`--kv-cache-dtype fp8_e4m3` runs minisgl with an FP8 KV cache (docs/benchmarks.md, "FP8 KV cache").

`--scenarios 1,16,64,prefill500,upstream` runs fixed scenarios on the CPU instead of the workload and
prints one table with every engine, interleaved, and each scenario's floor (see scenarios.py):
N streams (N requests of 32 random prompt tokens, 128 new tokens each, greedy, all at once),
prefillN (one N-token prompt, one new token: prompt tokens/s) and upstream (the workload above as
scaled by --num-requests/--min-len/--max-len, greedy), each the median of --repeat runs. With
`--llamacpp model` (llama-cpp-python installed) llama.cpp runs the same GGUF file, all streams batched:
    python benchmark/offline/bench.py --threads 1 --repeat 3 --num-requests 64 --min-len 32 --max-len 256 \
        --scenarios 1,16,64,prefill500,upstream --llamacpp model
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

import torch

from minisgl.utils.kv_cache_dtype import KV_CACHE_DTYPES


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Result:
    name: str
    seconds: float
    output_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def make_workload(num: int, lo: int, hi: int, vocab: int, seed: int) -> Workload:
    random.seed(seed)
    top = min(10000, vocab - 1)
    prompts = [[random.randint(0, top) for _ in range(random.randint(lo, hi))] for _ in range(num)]
    output_lens = [random.randint(lo, hi) for _ in range(num)]
    return Workload(prompts, output_lens)


def run_minisgl(
    args: argparse.Namespace, work: Workload, trace: str | None = None
) -> tuple[list[Result], str]:
    """`--repeat` runs of the workload in one fresh LLM, nothing run before the first: it pays whatever
    the start-up warm-up left to compile. Returns the first run, then the median of the later ones."""
    from statistics import median

    from minisgl import LLM, SamplingParams

    if args.decode_tiles:
        from minisgl.kernel import attention as attn

        keys, warps, stages, even, *regs = (int(x) for x in args.decode_tiles.split(","))
        attn.DECODE_CONFIG = attn.DecodeConfig(keys, warps, stages, bool(even), regs[0] if regs else None)
    if args.decode_programs:
        from minisgl.kernel import attention as attn

        attn.TARGET_PROGRAMS = args.decode_programs
    start = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_running_req=args.max_running_req,
        tp_size=args.tp_size,
        kv_cache_dtype=args.kv_cache_dtype,
        page_size=args.page_size,
        cache_type="naive",  # random prompts share nothing; the benchmark measures the engine, not the cache
        max_seq_len_override=max(2 * args.max_len + 8, 64),
        trace=trace,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        enable_mixed_chunk={"auto": None, "on": True, "off": False}[args.mixed_chunk],
    )
    print(f"LLM() ready in {time.perf_counter() - start:.1f} s (start-up, warm-up included)", flush=True)
    params = [
        SamplingParams(
            max_tokens=n,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            ignore_eos=True,
            seed=i,
        )
        for i, n in enumerate(work.output_lens)
    ]
    seconds = []
    for _ in range(args.repeat or 1):
        start = time.perf_counter()
        outputs = llm.generate(work.prompts, params)
        seconds.append(time.perf_counter() - start)
        produced = sum(len(o["token_ids"]) for o in outputs)
        assert produced == work.output_tokens, (
            f"minisgl produced {produced} tokens, expected {work.output_tokens}"
        )
    model_dir = llm.engine.model_dir
    dtype = str(llm.engine.config.dtype).removeprefix("torch.")
    kv = str(llm.engine.kv_dtype).removeprefix("torch.")
    llm.shutdown()
    tp = f", tp={args.tp_size}" if args.tp_size > 1 else ""
    kv = f", kv {kv}" if kv != dtype else ""
    name = f"minisgl ({dtype}{kv}{tp}{', traced' if trace else ''})"
    results = [Result(f"{name}, first run", seconds[0], work.output_tokens)]
    if len(seconds) > 1:
        later = f"runs 2-{len(seconds)} median" if len(seconds) > 2 else "run 2"
        results.append(Result(f"{name}, {later}", median(seconds[1:]), work.output_tokens))
    return results, model_dir


def run_hf_static(
    model_dir: str, work: Workload, dtype: torch.dtype, batch: int, args: argparse.Namespace
) -> Result:
    """transformers `generate` over batches of `batch` requests, left-padded; each batch runs to its longest output."""
    from hf_static import generate_static
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    filters = dict(top_k=max(args.top_k, 0), top_p=args.top_p, min_p=args.min_p or None)
    sample = (
        dict(do_sample=True, temperature=args.temperature, **filters)
        if args.temperature > 0
        else dict(do_sample=False)
    )
    order = sorted(range(len(work.prompts)), key=lambda i: len(work.prompts[i]))  # less padding: a fair peer
    start = time.perf_counter()
    for b in range(0, len(order), batch):
        idx = order[b : b + batch]
        new = max(work.output_lens[i] for i in idx)
        generate_static(model, [work.prompts[i] for i in idx], new, **sample)
    elapsed = time.perf_counter() - start
    name = f"transformers generate ({str(dtype).removeprefix('torch.')}, batch {batch})"
    return Result(name, elapsed, work.output_tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2-135M-Instruct)"
    )
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--temperature", type=float, default=0.6, help="the workload's sampling (--scenarios are greedy)"
    )
    p.add_argument("--top-k", type=int, default=-1, help="the workload's top_k (-1: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="the workload's top_p (1: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="the workload's min_p (0: off)")
    p.add_argument("--device", default=None, choices=[None, "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--max-running-req", type=int, default=256)
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="minisgl's KV cache: auto (the model's dtype), bf16, or fp8_e4m3 (half the bytes a token)",
    )
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (GPUs) for minisgl")
    p.add_argument("--page-size", type=int, default=1, help="minisgl's KV page size (slots a page)")
    p.add_argument(
        "--mixed-chunk",
        default="auto",
        choices=["auto", "on", "off"],
        help="minisgl's mixed steps (enable_mixed_chunk): auto, the engine's default for the device (on a CPU, "
        "off on CUDA)",
    )
    p.add_argument(
        "--decode-tiles",
        default=None,
        metavar="KEYS,WARPS,STAGES,EVEN[,MAXNREG]",
        help="GPU: force one decode-attention tile configuration for every batch (e.g. 128,4,3,1; a fifth "
        "number caps the kernel's registers a thread, 0: the compiler's choice)",
    )
    p.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=None,
        metavar="N",
        help="GPU: decode graphs up to N rows (0: none, larger batches eager; default: the engine's)",
    )
    p.add_argument(
        "--decode-programs",
        type=int,
        default=0,
        metavar="N",
        help="GPU: split decode contexts until a batch makes about N attention programs (the engine: "
        "kernel/attention.py's TARGET_PROGRAMS)",
    )
    p.add_argument("--peer", default="auto", choices=["auto", "none"], help="run the transformers peer")
    p.add_argument("--peer-dtypes", default="float32,bfloat16", help="CPU peer dtypes, comma separated")
    p.add_argument("--peer-batch", type=int, default=0, help="CPU peer batch size (0: all requests at once)")
    p.add_argument(
        "--peer-requests", type=int, default=0, help="CUDA peer: the first N requests only (0: all)"
    )
    p.add_argument(
        "--scenarios",
        default=None,
        help="comma separated: N (N streams, 128 new tokens each) or prefillN; e.g. 1,16,64,prefill500",
    )
    p.add_argument(
        "--formats",
        default="auto",
        help="scenarios: minisgl weight formats, comma separated: a quantization (auto, none, int8, w8a8, gguf), "
        "optionally @FILE for another model file, e.g. none,int8,gguf,gguf@model.Q4_K.gguf",
    )
    p.add_argument(
        "--llamacpp",
        default=None,
        help="scenarios: GGUF files to run with llama-cpp-python as a peer, comma separated ('model': the "
        "file minisgl loads)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="scenarios: runs of each (the median is reported; default 3); the workload: runs in one "
        "process (default 1), the first reported apart from the median of the others",
    )
    p.add_argument("--json", default=None, help="write the results to this file")
    p.add_argument(
        "--trace",
        default=None,
        metavar="PATH",
        help="run minisgl again with its timeline trace written to PATH, and print what tracing costs",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads for minisgl and the peer (0: torch's choice)",
    )
    args = p.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.device = device

    from minisgl.models.config import ModelConfig
    from minisgl.utils.hf import load_hf_config, resolve_model_path

    vocab = ModelConfig.from_hf(load_hf_config(resolve_model_path(args.model))).vocab_size
    if args.scenarios:
        if device != "cpu":
            p.error(
                "--scenarios measures the CPU engines; run it with --device cpu or on a machine without a GPU"
            )
        unused = {
            "--trace": args.trace,
            "--tp-size": args.tp_size > 1,
            "--page-size": args.page_size != 1,
            "--decode-tiles": args.decode_tiles,
            "--decode-programs": args.decode_programs,
            "--peer-batch": args.peer_batch,
            "--peer-requests": args.peer_requests,
            "--kv-cache-dtype": args.kv_cache_dtype not in (None, "auto"),
            "--top-k": args.top_k != -1,
            "--top-p": args.top_p != 1.0,
            "--min-p": args.min_p != 0.0,
            "--max-running-req": args.max_running_req != 256,  # a scenario runs all its streams at once
        }
        if any(unused.values()):
            p.error(f"--scenarios does not take {', '.join(k for k, v in unused.items() if v)}")
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from scenarios import run_scenarios

        run_scenarios(args, vocab)
        return
    work = make_workload(args.num_requests, args.min_len, args.max_len, vocab, args.seed)
    print(
        f"workload: {len(work.prompts)} requests, lengths U[{args.min_len}, {args.max_len}], seed {args.seed}: "
        f"{work.input_tokens} prompt tokens, {work.output_tokens} output tokens; device {device}"
    )
    filters = [
        f"{k} {v}"
        for k, v, off in (("top_k", args.top_k, -1), ("top_p", args.top_p, 1.0), ("min_p", args.min_p, 0.0))
        if v != off
    ]
    print(f"sampling: temperature {args.temperature}{''.join(', ' + f for f in filters)}")
    runs, model_dir = run_minisgl(args, work)
    for r in runs:
        print(f"{r.name:<48} {r.seconds:8.2f} s {r.tokens_per_s:10.1f} output tok/s", flush=True)
    # the figure compared with the peer: warm runs where there are some
    ours = runs[-1]
    results: list[Result] = [ours]
    if args.trace:
        traced = run_minisgl(args, work, trace=args.trace)[0][-1]
        print(f"{traced.name:<48} {traced.seconds:8.2f} s {traced.tokens_per_s:10.1f} output tok/s")
        print(
            f"tracing costs {100 * (traced.seconds / ours.seconds - 1):+.1f}% of the untraced time",
            flush=True,
        )
    if args.peer != "none":
        if device == "cuda":
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from peer_cuda import run_peer

            n = args.peer_requests or len(work.prompts)
            seconds = run_peer(
                model_dir,
                work.prompts[:n],
                work.output_lens[:n],
                args.temperature,
                args.top_k,
                args.top_p,
                args.min_p,
            )
            subset = f", first {n} requests" if n < len(work.prompts) else ""
            name = f"transformers generate_batch (bf16, paged{subset})"
            results.append(Result(name, seconds, sum(work.output_lens[:n])))
            r = results[-1]
            print(f"{r.name:<48} {r.seconds:8.2f} s {r.tokens_per_s:10.1f} output tok/s", flush=True)
        else:
            for name in args.peer_dtypes.split(","):
                dtype = torch.float32 if name == "float32" else torch.bfloat16
                batch = args.peer_batch or len(work.prompts)
                results.append(run_hf_static(model_dir, work, dtype, batch, args))
                r = results[-1]
                print(f"{r.name:<48} {r.seconds:8.2f} s {r.tokens_per_s:10.1f} output tok/s", flush=True)
        best = max(results[1:], key=lambda r: r.tokens_per_s)
        print(f"minisgl / best peer ({best.name}): {ours.tokens_per_s / best.tokens_per_s:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "input_tokens": work.input_tokens,
                    "output_tokens": work.output_tokens,
                    "results": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results],
                    "minisgl_runs": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in runs],
                    "traced": asdict(traced) | {"tokens_per_s": traced.tokens_per_s} if args.trace else None,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
