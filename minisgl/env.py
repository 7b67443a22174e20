"""ENV: every environment switch of minisgl in one place, read from MINISGL_* variables.

Each switch is an object with a mutable `.value`, so tests and examples can flip it in code
(`ENV.DISABLE_OVERLAP_SCHEDULING.value = True`) as well as from the shell.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(name: str, raw: str) -> bool:
    low = raw.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


@dataclass
class EnvVar(Generic[T]):
    name: str
    default: T
    help: str
    value: T = field(init=False)

    def __post_init__(self) -> None:
        raw = os.environ.get(self.name)
        if raw is None:
            self.value = self.default
        elif isinstance(self.default, bool):
            self.value = _parse_bool(self.name, raw)  # type: ignore[assignment]
        elif isinstance(self.default, int):
            self.value = int(raw)  # type: ignore[assignment]
        else:
            self.value = raw  # type: ignore[assignment]

    def __bool__(self) -> bool:
        return bool(self.value)


class _Env:
    def __init__(self) -> None:
        self.DISABLE_OVERLAP_SCHEDULING = EnvVar(
            "MINISGL_DISABLE_OVERLAP_SCHEDULING", False, "run the plain loop even on CUDA"
        )
        self.DEBUG_CHECK_INTEGRITY = EnvVar(
            "MINISGL_DEBUG_CHECK_INTEGRITY", False, "assert the KV page accounting after every step"
        )
        self.LOG_LEVEL = EnvVar("MINISGL_LOG_LEVEL", "INFO", "logging level of the minisgl logger")
        self.CACHE_DIR = EnvVar(
            "MINISGL_CACHE_DIR",
            os.path.join(os.path.expanduser("~"), ".cache", "minisgl"),
            "where converted GGUF checkpoints, the built CPU kernels, the CUDA kernels' cubins (NVRTC's) and a CPU "
            "engine's quantized layers are kept",
        )
        self.CPU_THREADS = EnvVar(
            "MINISGL_CPU_THREADS",
            0,
            "torch intra-op threads (0: torch's choice on CPU, 1 for a CUDA engine's host work)",
        )
        self.DISABLE_CPU_KERNELS = EnvVar(
            "MINISGL_DISABLE_CPU_KERNELS", False, "use torch ops instead of the C kernels built for the CPU"
        )
        self.CPU_INT8_ACTIVATIONS = EnvVar(
            "MINISGL_CPU_INT8_ACTIVATIONS",
            True,
            "packed weights on a CPU with AVX512-VNNI multiply activations rounded to int8 in blocks of 32 "
            "(minisgl's C kernel, llama.cpp's numbers); 0: torch's weight-only kernels, bf16 activations",
        )
        self.KERNELS = EnvVar(
            "MINISGL_KERNELS",
            "auto",
            "auto (the Triton kernels on CUDA, torch and C kernels elsewhere) or triton (the Triton kernels, "
            "attention and MoE backends on any device; on a CPU through Triton's interpreter, TRITON_INTERPRET=1, "
            "slow: for tests and launch counts of the CUDA path)",
        )
        self.SEPARATE_KV_STORE = EnvVar(
            "MINISGL_SEPARATE_KV_STORE",
            False,
            "store K/V in a launch of their own instead of from the rotary kernel (to measure that fusion)",
        )
        self.CPU_COMPILE = EnvVar(
            "MINISGL_CPU_COMPILE",
            False,
            "compile the CPU decode step with torch.compile (inductor); its first steps compile for a while",
        )
        self.CPU_W8A8_BATCHES = EnvVar(
            "MINISGL_CPU_W8A8_BATCHES",
            True,
            "with the default quantization of a GGUF model, prompts and batches of more than 4 rows run W8A8 "
            "(smoothed int8 activations times int8 weights) where the start-up timing finds it faster than "
            "bf16; 0: the float weights",
        )
        self.CPU_ONEDNN_WEIGHTS = EnvVar(
            "MINISGL_CPU_ONEDNN_WEIGHTS",
            True,
            "hold a CPU model's bf16 linear weights in oneDNN's blocked layout (0: plain, copied by oneDNN "
            "at every call)",
        )
        self.SKINNY_GEMM = EnvVar(
            "MINISGL_SKINNY_GEMM",
            True,
            "on CUDA, 16-bit matmuls of up to 16 rows with outputs no wider than their inputs by minisgl's "
            "split-K Triton GEMM (kernel/gemm.py); 0: cuBLAS",
        )
        self.CUDA_GEMM_ROWS = EnvVar(
            "MINISGL_CUDA_GEMM_ROWS",
            8,
            "on a Hopper GPU, bf16 matmuls of up to this many rows (at most 16) by minisgl's CUDA GEMM "
            "(kernel/cuda/gemm.py), which reads its weights before it waits for its input where a graph edge "
            "into it is programmatic (MINISGL_GRAPH_PDL; with it a decode step of 1-8 rows 5-9% faster on an "
            "H100); 0: the split-K Triton GEMM or cuBLAS",
        )
        self.DECODE_LONGEST_FIRST = EnvVar(
            "MINISGL_DECODE_LONGEST_FIRST",
            32,
            "in decode batches of at least this many rows, the Triton decode attention starts its programs "
            "longest context first (kernel/attention.py's decode_order), so that on uneven contexts the last "
            "wave is short (faster from 32 rows on an H200, slower at 16; docs/benchmarks.md); 0: never",
        )
        self.DECODE_CUDA = EnvVar(
            "MINISGL_DECODE_CUDA",
            True,
            "with the Triton attention backend on CUDA, decode attention by the CUDA C++ kernel "
            "(minisgl/kernel/cuda/decode.cu, compiled by NVRTC on first use) where it applies: a bf16 "
            "query, head dim 128, 1, 2 or 4 query heads a KV head (15-25% faster on an FP8 pool on an H200; "
            "docs/benchmarks.md); 0: the Triton kernel everywhere",
        )
        self.DECODE_TENSOR_CORES = EnvVar(
            "MINISGL_DECODE_TENSOR_CORES",
            True,
            "with MINISGL_DECODE_CUDA over an FP8 or bf16 pool and 2, 4 or 8 query heads a KV head, decode "
            "attention by the tensor-core kernel (minisgl/kernel/cuda/decode_tc.cu; on an H200 FP8 25-30% less "
            "time than Triton's kernel at 64-256 rows and 3-12% less than decode.cu's, bf16 5-14% less than "
            "Triton's and 0-12% less than decode.cu's; docs/benchmarks.md); 0: those kernels",
        )
        self.TC_DECODE_ROPE = EnvVar(
            "MINISGL_TC_DECODE_ROPE",
            128,
            "in decode batches above MINISGL_FUSED_DECODE_ROPE rows and up to this many that take the tensor-core "
            "decode kernel, rotate q and k (and Qwen3's q/k norm, a folded norm's row scale) and store K/V inside it "
            "(decode_tc.cu's `_rope` kernels): the rotary kernel's launch a layer goes (faster up to 128 rows on an "
            "H100, slower at 256; docs/benchmarks.md); 0: never",
        )
        self.FRESH_PREFILL = EnvVar(
            "MINISGL_FRESH_PREFILL",
            -1,
            "a prefill step whose requests are all fresh (no cached prefix), one of them longer than 128 tokens, takes "
            "its attention over the step's own q|k|v rows, read by the tensor memory accelerator "
            "(minisgl/kernel/fresh_attention.py) instead of the extend kernel's gathers through the page table "
            "(docs/benchmarks.md); -1: on a Hopper GPU or later, 1: wherever the Triton backend runs, 0: never",
        )
        self.FUSED_SAMPLING = EnvVar(
            "MINISGL_FUSED_SAMPLING",
            128,
            "on CUDA with one rank, a decode graph's batch of up to this many rows, all sampling from the whole "
            "vocabulary at a temperature or greedily (no filter, penalty, bias, grammar or logprobs), takes the LM "
            "head and the sampling in one kernel (minisgl/kernel/lm_sample.py): its float32 logits are never "
            "written (on an H100 12-25% less time than the two launches at 1-128 rows, level at 256; "
            "docs/benchmarks.md); 0: never",
        )
        self.QUANT_CACHE = EnvVar(
            "MINISGL_QUANT_CACHE",
            True,
            "keep a CPU engine's quantized layers under MINISGL_CACHE_DIR/quant after its first start-up and build "
            "them from there at the next (minisgl/models/quant_cache.py: seconds of every start of the default "
            "model); 0: quantize at every start",
        )
        self.PREFILL_ROUND = EnvVar(
            "MINISGL_PREFILL_ROUND",
            256,
            "where prefill CUDA graphs can run (engine/prefill_graph.py), pad the tokens of an eager prefill "
            "step as a graph's are (16, 32, ... doubling up to this many, then a multiple of it): cuBLAS picks its "
            "kernels once a row count, and a count new to the process costs the host more a product than one "
            "it has seen (docs/benchmarks.md); 0: no padding",
        )
        self.MIXED_DECODE_SPLIT = EnvVar(
            "MINISGL_MIXED_DECODE_SPLIT",
            True,
            "with the Triton attention backend, a mixed step's decode rows (--enable-mixed-chunk) through the "
            "decode kernels, eagerly; 0: through the extend kernel with the step's prompts",
        )
        self.FUSED_DECODE_ROPE = EnvVar(
            "MINISGL_FUSED_DECODE_ROPE",
            16,
            "in decode batches of up to this many rows with the Triton attention backend, rotate q and k "
            "(and Qwen3's q/k norm) and store K/V inside the decode attention kernel: one launch a layer "
            "fewer (faster up to 16 rows on an H200, slower from 64; docs/benchmarks.md); 0: never",
        )
        self.FOLD_NORMS = EnvVar(
            "MINISGL_FOLD_NORMS",
            True,
            "where the Triton kernels run (CUDA), fold each decoder layer's RMSNorm weights into the q|k|v and "
            "gate|up projections after them: the rotary and SiLU kernels apply the 1 / rms and the residual "
            "adds go into the o and down projections' epilogues, two launches a layer fewer "
            "(docs/benchmarks.md); 0: the norms as in the checkpoint",
        )
        self.DIRECT_LAUNCH = EnvVar(
            "MINISGL_DIRECT_LAUNCH",
            True,
            "launch the compiled Triton kernels through minisgl's launcher (kernel/launch.py: Triton's own "
            "specialisation, a quarter less host time a launch on an H200 machine); 0: Triton's own call",
        )
        self.GRAPH_PDL = EnvVar(
            "MINISGL_GRAPH_PDL",
            "own",
            "a regular expression of kernel names: in the captured CUDA graphs, each kernel-to-kernel edge into a "
            "kernel so named becomes programmatic (it may start while the kernel before it runs; only kernels "
            "that wait on the device for their inputs may be named: engine/graph_edges.py); 'own': this "
            "project's kernels (graph_edges.OWN_WAITERS); empty: none",
        )
        self.GRAPH_PDL_ROWS = EnvVar(
            "MINISGL_GRAPH_PDL_ROWS",
            8,
            "MINISGL_GRAPH_PDL's edges only in the CUDA graphs whose products take at most this many rows (a "
            "decode graph's requests, a prefill graph's tokens), of a model whose products are short "
            "(engine/graph_edges.py's short_products)",
        )
        self.PDL_KERNELS = EnvVar(
            "MINISGL_PDL_KERNELS",
            2,
            "on a Hopper GPU, the kernels of a decode step begin by waiting for their inputs on the device (1), and "
            "then let the next kernel launch (2), for graph edges made programmatic (MINISGL_GRAPH_PDL); 0: neither",
        )
        self.EMULATE_GRAPHS = EnvVar(
            "MINISGL_EMULATE_GRAPHS",
            False,
            "on a CPU, decode and prefill graphs whose replay runs the captured forward again on the static "
            "buffers a CUDA graph reads (engine/graph.py's ReplayedForward): the graph runners' inputs, padding "
            "and scratch slots checked without a GPU; for tests, slower than no graphs",
        )
        self.MOE_BACKEND = EnvVar(
            "MINISGL_MOE_BACKEND",
            "auto",
            "MoE backend: auto (triton on CUDA, torch elsewhere), torch, triton",
        )
        self.API_KEY = EnvVar(
            "MINISGL_API_KEY", "", "the key every HTTP route but /health requires (--api-key; empty: none)"
        )
        self.HEALTH_GENERATE_TIMEOUT = EnvVar(
            "MINISGL_HEALTH_GENERATE_TIMEOUT",
            20,
            "seconds /health_generate waits for the engine to generate before it answers 503 (SGLang's 20)",
        )
        self.TRACE = EnvVar(
            "MINISGL_TRACE", "", "write a timeline trace (Perfetto / Chrome JSON) of the run to this path"
        )


ENV = _Env()
