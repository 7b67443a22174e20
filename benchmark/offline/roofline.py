"""Roofline of the offline workload on one GPU: the ceilings, the kernels, and each phase against its floor.

    python benchmark/offline/roofline.py --model FOLDER --json out.json [--sections ...]
Sections: ceilings (copy bandwidth, bf16 matmul rate), attention (the decode kernel's bandwidth over
tile configurations), fused (fused kernels against their torch versions), sampler, steps (one decode
step at batch 64 and 256 replayed from its CUDA graph, and one 8192-token prefill, each against the
floor its bytes and FLOPs give), e2e (the whole workload with the GPU time of every step recorded, to
tell device time from host time). With the steps section, the decode steps are also drawn against their
floors by batch size (roofline_plot.py) next to the JSON, as a PNG of the same name.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def bench_ms(fn: Callable[[], Any], warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of `fn` on the current stream, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def ceilings() -> dict[str, float]:
    n = 1 << 30  # 2 GiB of bf16 each way, well past the L2
    src = [torch.randn(n, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    dst = torch.empty_like(src[0])
    ms = bench_ms(lambda: dst.copy_(src[0]), iters=10)
    copy_bw = 2 * n * 2 / ms / 1e9  # TB/s, bytes read plus bytes written
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_ms = bench_ms(lambda: a @ b, iters=10)
    return {"copy_tb_s": copy_bw, "matmul_tflops": 2 * 8192**3 / mm_ms / 1e9}


def workload(
    num: int = 256, lo: int = 100, hi: int = 1024, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    from bench import make_workload

    work = make_workload(num, lo, hi, 151936, seed)
    return work.prompts, work.output_lens


def mid_run_contexts(bs: int) -> list[int]:
    """Context lengths of `bs` requests halfway through their outputs: a typical decode step of the workload."""
    prompts, outs = workload()
    return [len(p) + o // 2 for p, o in zip(prompts[:bs], outs[:bs])]


def _attention_batch(hq: int, hk: int, d: int, bs: int, fp8: bool) -> list[dict[str, Any]]:
    from minisgl.kernel import attention as attn

    lens = mid_run_contexts(bs)
    total = sum(lens)
    slots = torch.randperm(total + 64, device="cuda")[:total].to(torch.int32)  # scattered, as pages are
    table = torch.zeros(bs, max(lens), dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(lens):
        table[i, :n] = slots[start : start + n]
        start += n
    k = torch.randn(total + 64, hk, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if fp8:  # an FP8 pool: a byte an element, read with the layer's scales
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        scales = (torch.ones(1, device="cuda"), torch.ones(1, device="cuda"))
    q = torch.randn(bs, hq, d, dtype=torch.bfloat16, device="cuda")
    rows_t = torch.arange(bs, dtype=torch.int32, device="cuda")
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * total * hk * d * k.element_size()
    rows: list[dict[str, Any]] = []
    chosen = attn.decode_config(bs, hk)
    configs = [(64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 2), (128, 4, 3), (128, 4, 4)]
    configs += [(256, 4, 2), (256, 8, 2), (256, 8, 3)]  # an FP8 tile of 256 keys moves a bf16 one's bytes
    for block_n, warps, stages in configs:
        attn.DECODE_CONFIG = attn.DecodeConfig(block_n, warps, stages)
        for splits in (1, 2):
            row: dict[str, Any] = dict(
                bs=bs, hq=hq, fp8=fp8, block_n=block_n, warps=warps, stages=stages, splits=splits
            )
            try:
                ms = bench_ms(
                    lambda s=splits: attn.decode_attention(q, k, v, table, rows_t, seq, s, d**-0.5, *scales)
                )
            except Exception as e:  # a config the compiler refuses (shared memory) is skipped, not fatal
                rows.append(row | {"error": str(e)[:200]})
                continue
            rows.append(
                row | {"us": ms * 1e3, "tb_s": kv_bytes / ms / 1e9, "default": attn.DECODE_CONFIG == chosen}
            )
    attn.DECODE_CONFIG = None
    best = max((r for r in rows if "us" in r), key=lambda r: r["tb_s"])
    used = [r for r in rows if r.get("default") and r["splits"] == attn.decode_splits(bs, hk)]
    print(f"decode attention hq={hq} bs={bs} fp8={fp8}: best {best}; the default {used}", flush=True)
    return rows


def attention(hq: int, hk: int, d: int, batches: tuple[int, ...] = (64, 256)) -> list[dict[str, Any]]:
    return [row for fp8 in (False, True) for bs in batches for row in _attention_batch(hq, hk, d, bs, fp8)]


def _fused_case(t: int, rope: Any) -> list[dict[str, Any]]:
    from minisgl.kernel import activation, norm, rotary

    x = torch.randn(t, 1024, dtype=torch.bfloat16, device="cuda")
    r = torch.randn_like(x)
    w = torch.randn(1024, dtype=torch.bfloat16, device="cuda")
    gu = torch.randn(t, 2 * 3072, dtype=torch.bfloat16, device="cuda")
    qkv = torch.randn(t, 32 * 128, dtype=torch.bfloat16, device="cuda")
    pos = torch.randint(0, 4096, (t,), device="cuda")
    q, k = qkv[:, :2048].view(t, 16, 128), qkv[:, 2048:3072].view(t, 8, 128)

    def torch_norm() -> None:
        s = x + r
        f = s.float()
        w * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)).to(s.dtype)

    def torch_rope() -> None:
        cos, sin = rope.cos_sin[pos].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
        for y in (q, k):
            torch.cat([-y[..., 64:], y[..., :64]], dim=-1) * sin + y * cos

    pairs = {
        "rmsnorm+residual": (lambda: norm.rms_norm_residual(x, r, w, 1e-6), torch_norm),
        "silu_and_mul": (
            lambda: activation.silu_and_mul(gu),
            lambda: torch.nn.functional.silu(gu[:, :3072]) * gu[:, 3072:],
        ),
        "rope q+k": (lambda: rotary.apply_rotary(pos, q, k, rope.cos_sin), torch_rope),
    }
    rows = []
    for name, (ours, ref) in pairs.items():
        rows.append(
            {"op": name, "tokens": t, "triton_us": bench_ms(ours) * 1e3, "torch_us": bench_ms(ref) * 1e3}
        )
        print(rows[-1], flush=True)
    return rows


def fused() -> list[dict[str, Any]]:
    from minisgl.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(128, 4096, 1e6, None).cuda()
    return [row for t in (256, 8192) for row in _fused_case(t, rope)]


def _sampler_case(bs: int) -> dict[str, Any]:
    import minisgl.engine.sample as sample_mod
    from minisgl.engine.sample import BatchSamplingArgs, Sampler

    vocab = 151936
    logits = torch.randn(bs, vocab, device="cuda") * 3
    args = BatchSamplingArgs(
        greedy=False,
        temperatures=torch.full((bs, 1), 0.6, device="cuda"),
        seeds=torch.arange(bs, device="cuda"),
        steps=torch.full((bs,), 100, device="cuda"),
    )
    top_p = BatchSamplingArgs(**{**vars(args), "top_p": torch.full((bs,), 0.9, device="cuda")})
    top_k = BatchSamplingArgs(**{**vars(args), "top_k": torch.full((bs,), 50, device="cuda")})
    both = BatchSamplingArgs(**{**vars(top_k), "top_p": top_p.top_p})
    # near-uniform rows: the 0.9 nucleus holds most of the vocabulary, past the threshold kernel's
    # window, so each row takes its exact search over the whole row (the slow path)
    flat = torch.randn(bs, vocab, device="cuda") * 0.01
    s = Sampler(torch.device("cuda"), vocab)
    row = {
        "bs": bs,
        "fused_us": bench_ms(lambda: s.sample(logits, args)) * 1e3,
        "fused_top_p_us": bench_ms(lambda: s.sample(logits, top_p)) * 1e3,
        "fused_top_k_us": bench_ms(lambda: s.sample(logits, top_k)) * 1e3,
        "fused_top_k_top_p_us": bench_ms(lambda: s.sample(logits, both)) * 1e3,
        "fused_top_p_flat_us": bench_ms(lambda: s.sample(flat, top_p)) * 1e3,
    }
    use = sample_mod.use_triton
    sample_mod.use_triton = lambda x: False  # the torch sampler, on the same GPU
    try:
        row["torch_us"] = bench_ms(lambda: s.sample(logits, args)) * 1e3
        row["torch_top_p_us"] = bench_ms(lambda: s.sample(logits, top_p)) * 1e3
        row["torch_top_k_us"] = bench_ms(lambda: s.sample(logits, top_k)) * 1e3
    finally:
        sample_mod.use_triton = use
    print(row, flush=True)
    return row


def sampler() -> list[dict[str, Any]]:
    return [_sampler_case(bs) for bs in (64, 256)]


def weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def graph_step(eng: Any, bs: int) -> Callable[[], object]:
    """A decode graph's replay with the LM head's product: inside the graph, or after it where the graphs end
    at the final norm (engine/fused_head.py), so that every tree's step covers the same work."""
    graph = eng.graph_runner.graphs[bs]
    head = eng.fused_head
    if head is None:
        return graph.replay
    hidden = eng.graph_runner.outputs[bs]  # the graph's output buffer: its final hidden rows

    def step() -> None:
        graph.replay()
        head.logits(hidden)

    return step


def steps(
    model_dir: str, ceil: dict[str, float], kv: str = "auto", graph_bs: list[int] | None = None
) -> dict[str, Any]:
    """Every captured decode graph timed (`graph_bs`: only those batch sizes), then a prefill step."""
    from minisgl import LLM, SamplingParams
    from minisgl.kernel.attention import decode_order

    llm = LLM(
        model_dir, max_running_req=256, cache_type="naive", max_seq_len_override=2056, kv_cache_dtype=kv,
        cuda_graph_bs=graph_bs,
    )  # fmt: skip
    eng = llm.engine
    mc = eng.model_config
    w_bytes = weight_bytes(eng.model)
    params = w_bytes // 2
    per_token_kv = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * (1 if kv.startswith("fp8") else 2)
    bw = ceil["copy_tb_s"] * 1e12
    flops_rate = ceil["matmul_tflops"] * 1e12
    out: dict[str, Any] = {"weight_bytes": w_bytes, "kv_bytes_per_token": per_token_kv}
    gr, be = eng.graph_runner, eng.attn_backend
    for bs in sorted(gr.graphs):  # every captured batch size: the plot's points
        lens = mid_run_contexts(bs)
        slots = torch.randperm(eng.num_pages * eng.page_size, device="cuda")[: sum(lens)].to(torch.int32)
        start = 0
        for i, n in enumerate(lens):
            eng.page_table[i, :n] = slots[start : start + n]
            start += n
        be.graph_meta[0, :bs] = torch.arange(bs, dtype=torch.int32, device="cuda")
        be.graph_meta[1, :bs] = torch.tensor(lens, dtype=torch.int32, device="cuda")
        if be.graph_meta.shape[0] == 3:  # graphs captured with MINISGL_DECODE_LONGEST_FIRST
            be.graph_meta[2, :bs] = torch.tensor(decode_order(lens), dtype=torch.int32, device="cuda")
        # the graph reads its rows, positions and slots from its static inputs and gathers its token ids
        rows, positions, out_loc = gr.inputs.views(bs)
        rows.copy_(torch.arange(bs, device="cuda"))
        positions.copy_(torch.tensor(lens, device="cuda") - 1)
        eng.token_pool[rows, positions] = torch.randint(
            0, mc.vocab_size, (bs,), device="cuda", dtype=torch.int32
        )
        out_loc.copy_(eng.page_table[rows, positions].to(torch.int64))
        with torch.cuda.stream(eng.stream):
            step_ms = bench_ms(graph_step(eng, bs), iters=30)
        kv = sum(lens) * per_token_kv
        floor_ms = (w_bytes + kv) / bw * 1e3
        flops = 2 * params * bs + 4 * sum(lens) * mc.num_qo_heads * mc.head_dim * mc.num_layers
        out[f"decode_bs{bs}"] = {
            "mean_context": sum(lens) / bs,
            "graph_step_ms": step_ms,
            "bytes": w_bytes + kv,
            "kv_bytes": kv,
            "bandwidth_floor_ms": floor_ms,
            "flop_floor_ms": flops / flops_rate * 1e3,
            "x_floor": step_ms / floor_ms,
        }
        print(f"decode step bs={bs}: {out[f'decode_bs{bs}']}", flush=True)
    eng.page_table[:256].zero_()
    eng.token_pool[:256].zero_()
    # one prefill step of 8 prompts x 1024 tokens (the budget is 8192 tokens); max_tokens=1 ends it there
    rng = random.Random(1)
    prompts = [[rng.randrange(10000) for _ in range(1024)] for _ in range(8)]
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    llm.generate(prompts, one)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        llm.generate(prompts, one)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    pre_ms = sorted(times)[2] * 1e3
    tokens = 8 * 1024
    attn_flops = 4 * 8 * (1024 * 1025 // 2) * mc.num_qo_heads * mc.head_dim * mc.num_layers
    layer_params = sum(p.numel() for p in eng.model.model.layers.parameters())
    flops = 2 * layer_params * tokens + attn_flops
    flops += 2 * mc.vocab_size * mc.hidden_size * 8  # the LM head, for the last token of each prompt
    out["prefill_8x1024"] = {
        "ms": pre_ms,
        "tokens_per_s": tokens / pre_ms * 1e3,
        "flops": flops,
        "flop_floor_ms": flops / flops_rate * 1e3,
        "bandwidth_floor_ms": (w_bytes + tokens * per_token_kv) / bw * 1e3,
        "x_floor": pre_ms / (flops / flops_rate * 1e3),
    }
    print(f"prefill: {out['prefill_8x1024']}", flush=True)
    llm.shutdown()
    return out


def e2e(model_dir: str, num: int, kv: str = "auto") -> dict[str, Any]:
    """The bench.py run of minisgl with a CUDA event pair around every step: device time against wall time."""
    from minisgl import LLM, SamplingParams

    prompts, outs = workload(num)
    llm = LLM(
        model_dir, max_running_req=256, cache_type="naive", max_seq_len_override=2056, kv_cache_dtype=kv
    )
    params = [
        SamplingParams(max_tokens=n, temperature=0.6, ignore_eos=True, seed=i) for i, n in enumerate(outs)
    ]
    llm.generate([p[:16] for p in prompts[:4]], SamplingParams(max_tokens=8, ignore_eos=True))
    forward = llm.engine.forward_batch
    events: list[tuple[str, int, Any, Any]] = []

    def timed(forward_input: Any) -> Any:
        batch = forward_input.batch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = forward(forward_input)
        end.record()
        events.append((batch.phase, batch.size, start, end))
        return result

    llm.engine.forward_batch = timed
    t0 = time.perf_counter()
    results = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    torch.cuda.synchronize()
    produced = sum(len(r["token_ids"]) for r in results)
    gpu = {"prefill": 0.0, "decode": 0.0}
    count = {"prefill": 0, "decode": 0}
    for phase, _, s, e in events:
        gpu[phase] += s.elapsed_time(e) / 1e3
        count[phase] += 1
    llm.shutdown()
    row = {
        "requests": num,
        "output_tokens": produced,
        "wall_s": wall,
        "tokens_per_s": produced / wall,
        "gpu_prefill_s": gpu["prefill"],
        "gpu_decode_s": gpu["decode"],
        "prefill_steps": count["prefill"],
        "decode_steps": count["decode"],
    }
    print(f"e2e: {row}", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--sections", default="ceilings,attention,fused,sampler,steps,e2e")
    p.add_argument("--e2e-requests", type=int, default=256)
    p.add_argument("--attention-batches", default="64,256", help="batch sizes of the attention section")
    p.add_argument("--kv-cache-dtype", default="auto", help="the engine's KV cache in steps and e2e")
    args = p.parse_args()
    sections = args.sections.split(",")
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": os.path.basename(os.path.normpath(args.model)),
    }
    result["ceilings"] = ceilings()
    torch.cuda.empty_cache()
    print(f"ceilings: {result['ceilings']}", flush=True)
    save(result, args.json)
    if "attention" in sections:
        batches = tuple(int(b) for b in args.attention_batches.split(","))
        result["attention_qwen3_0.6b"] = attention(16, 8, 128, batches)
        if args.attention_batches == "64,256":  # the default: the Llama-3-8B heads too
            result["attention_llama3_8b"] = attention(32, 8, 128, (256,))
        save(result, args.json)
    if "fused" in sections:
        result["fused"] = fused()
    if "sampler" in sections:
        result["sampler"] = sampler()
    save(result, args.json)
    with torch.inference_mode():  # the graphs' static buffers are inference tensors
        if "steps" in sections:
            result["steps"] = steps(args.model, result["ceilings"], args.kv_cache_dtype)
            save(result, args.json)
            from roofline_plot import plot

            plot(result, os.path.splitext(args.json)[0] + ".png")
        if "e2e" in sections:
            result["e2e"] = e2e(args.model, args.e2e_requests, args.kv_cache_dtype)
            save(result, args.json)


def save(result: dict[str, Any], path: str) -> None:
    """Written after every section, so a failure later keeps what was measured."""
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
