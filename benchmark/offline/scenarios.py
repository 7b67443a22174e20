"""CPU scenarios: minisgl, transformers and llama.cpp on the same requests, interleaved, in one table.

Scenarios: "N" (N streams: N prompts of 32 random tokens, 128 new tokens each, all at once; output
tokens/s), "prefillN" (one N-token prompt, one new token; prompt tokens/s) and "upstream" (the upstream
workload as scaled by --num-requests/--min-len/--max-len, all requests at once; output tokens/s).
Every engine is loaded once and kept; each repeat runs every scenario on every engine in turn, the
engines' order rotated each repeat, so load from elsewhere on the machine falls on all of them alike.
Greedy, never stopping at EOS. Each cell is the median of the repeats, with the lowest and highest.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from statistics import median

import torch

# an engine's run: prompts and output lengths -> seconds, or None when it cannot run them
Runner = Callable[[list[list[int]], list[int]], "float | None"]


@dataclass
class Engine:
    name: str
    kind: str  # "minisgl", "transformers" or "llama.cpp"
    run: Runner
    close: Callable[[], None]


def scenario_requests(name: str, args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    if name == "upstream":
        from bench import make_workload

        work = make_workload(args.num_requests, args.min_len, args.max_len, vocab, args.seed)
        return work.prompts, work.output_lens
    rng = random.Random(0)
    top = min(10000, vocab - 1)
    if name.startswith("prefill"):
        return [[rng.randint(0, top) for _ in range(int(name.removeprefix("prefill")))]], [1]
    n = int(name)
    return [[rng.randint(0, top) for _ in range(32)] for _ in range(n)], [128] * n


def counted_tokens(name: str, prompts: list[list[int]], output_lens: list[int]) -> int:
    """What a scenario's rate counts: prompt tokens for a prefill, output tokens otherwise."""
    return sum(len(p) for p in prompts) if name.startswith("prefill") else sum(output_lens)


def label(name: str) -> str:
    if name.startswith("prefill"):
        return f"{name} (prompt tok/s)"
    if name == "upstream":
        return "upstream workload"
    return f"{name} stream{'s' if name != '1' else ''}"


def minisgl_engine(spec: str, args: argparse.Namespace, streams: int, longest: int) -> Engine:
    from minisgl import LLM, SamplingParams

    # QUANTIZATION or QUANTIZATION@FILE: the weight format, and another model file if named
    quantization, _, path = spec.partition("@")
    llm = LLM(
        path or args.model,
        dtype=args.dtype,
        quantization=quantization,
        device="cpu",
        max_running_req=max(streams, 4),
        cache_type="naive",  # random prompts share nothing: the benchmark measures the engine, not the cache
        max_seq_len_override=longest + 8,
    )
    llm.generate([[1] * 16] * 2, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    dtype = str(llm.engine.config.dtype).removeprefix("torch.")
    where = f" {os.path.basename(path).split('.')[-2]}" if path else ""

    def run(prompts: list[list[int]], output_lens: list[int]) -> float:
        params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in output_lens]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        made = sum(len(o["token_ids"]) for o in outputs)
        if made != sum(output_lens):
            raise RuntimeError(f"minisgl produced {made} tokens, expected {sum(output_lens)}")
        return seconds

    return Engine(f"minisgl ({dtype}, {quantization}{where})", "minisgl", run, llm.shutdown)


def transformers_engine(model_dir: str, dtype_name: str) -> Engine:
    from hf_static import generate_static
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if dtype_name == "float32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()

    def run(prompts: list[list[int]], output_lens: list[int]) -> float:
        """One left-padded static batch; it runs to its longest output, and only the asked tokens count."""
        start = time.perf_counter()
        generate_static(model, prompts, max(output_lens), do_sample=False)
        return time.perf_counter() - start

    return Engine(f"transformers ({dtype_name})", "transformers", run, lambda: None)


def llamacpp_engine(path: str, streams: int, longest: int) -> Engine:
    from llamacpp_peer import LlamaCppPeer

    peer = LlamaCppPeer(path, streams, longest + 8, 2048, torch.get_num_threads())
    name = f"llama.cpp ({os.path.basename(path).split('.')[-2]})"
    return Engine(name, "llama.cpp", peer.run, peer.close)


def run_scenarios(args: argparse.Namespace, vocab: int) -> None:
    from cpu_floor import floor_seconds, gguf_cost, measure_machine

    from minisgl.models.config import ModelConfig
    from minisgl.utils.hf import find_model, load_hf_config, resolve_model_path

    names = args.scenarios.split(",")
    work = {n: scenario_requests(n, args, vocab) for n in names}
    streams = max(len(p) for p, _ in work.values())
    longest = max(len(p) + n for ps, ns in work.values() for p, n in zip(ps, ns, strict=True))
    model_file = find_model(args.model)
    model_dir = resolve_model_path(args.model)
    print(f"threads {torch.get_num_threads()}; load average {os.getloadavg()}", flush=True)

    engines = [minisgl_engine(spec, args, streams, longest) for spec in args.formats.split(",")]
    if args.peer != "none":
        engines += [transformers_engine(model_dir, d) for d in args.peer_dtypes.split(",")]
    for spec in args.llamacpp.split(",") if args.llamacpp else []:
        engines.append(llamacpp_engine(model_file if spec == "model" else spec, streams, longest))

    seconds: dict[str, dict[str, list[float]]] = {n: {e.name: [] for e in engines} for n in names}
    loads = [os.getloadavg()[0]]
    for rep in range(args.repeat):
        order = engines[rep % len(engines) :] + engines[: rep % len(engines)]
        for n in names:
            for e in order:
                t = e.run(*work[n])
                if t is not None:
                    seconds[n][e.name].append(t)
                    rate = counted_tokens(n, *work[n]) / t
                    print(f"run {rep + 1} {n:<11} {e.name:<36} {rate:10.1f} tok/s ({t:.2f} s)", flush=True)
        loads.append(os.getloadavg()[0])
        print(f"load average after run {rep + 1}: {os.getloadavg()}", flush=True)
    for e in engines:
        e.close()

    floors: dict[str, float] = {}
    if model_file.endswith(".gguf"):
        cfg = ModelConfig.from_hf(load_hf_config(model_dir))
        cost = gguf_cost(model_file, cfg.num_layers, cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim)
        machine = measure_machine()
        print(
            f"floor: {machine.describe()} ({torch.get_num_threads()} threads); {cost.weight_bytes / 1e6:.0f} MB "
            f"of weights, {cost.matmul_params / 1e6:.0f}M matmul weights a token",
            flush=True,
        )
        floors = {}
        for n, (prompts, output_lens) in work.items():
            floor = floor_seconds(machine, cost, [len(p) for p in prompts], output_lens)
            floors[n] = counted_tokens(n, prompts, output_lens) / floor
    print_table(names, engines, work, seconds, floors)
    print(f"load average (1 min) before and after each run: {' '.join(f'{x:.1f}' for x in loads)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"loads": loads, "seconds": seconds, "floor_tok_per_s": floors}, f, indent=2)


def print_table(
    names: list[str],
    engines: list[Engine],
    work: dict[str, tuple[list[list[int]], list[int]]],
    seconds: dict[str, dict[str, list[float]]],
    floors: dict[str, float],
) -> None:
    def rates(n: str, e: Engine) -> list[float]:
        return sorted(counted_tokens(n, *work[n]) / t for t in seconds[n][e.name])

    ours = [e for e in engines if e.kind == "minisgl"]
    kinds = [k for k in ("transformers", "llama.cpp") if any(e.kind == k for e in engines)]
    head = [e.name for e in engines] + (["floor (ceiling)"] if floors else [])
    head += [f"best minisgl / best {k}" for k in kinds]
    print()
    print("| scenario | " + " | ".join(head) + " |")
    print("|---" * (len(head) + 1) + "|")
    for n in names:
        cells = []
        for e in engines:
            r = rates(n, e)
            spread = f" ({r[0]:.1f}-{r[-1]:.1f})" if len(r) > 1 else ""
            cells.append(f"{median(r):.1f}{spread}" if r else "n/a")
        if floors:
            cells.append(f"{floors[n]:.1f}")
        best_ours = max((median(rates(n, e)) for e in ours if rates(n, e)), default=None)
        for k in kinds:
            best = max((median(rates(n, e)) for e in engines if e.kind == k and rates(n, e)), default=None)
            cells.append(f"{best_ours / best:.2f}x" if best and best_ours else "n/a")
        print(f"| {label(n)} | " + " | ".join(cells) + " |")
