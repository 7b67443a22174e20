"""EngineConfig: what the engine needs to build the model, the KV pool and the attention backend."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minisgl.distributed import DistributedInfo


@dataclass
class EngineConfig:
    model_path: str | None = None  # a Hugging Face folder or a .gguf file; None is the embedded default model
    tp_info: DistributedInfo = field(default_factory=lambda: DistributedInfo(0, 1))
    dtype: torch.dtype | None = None  # None: bf16 on CUDA; on a CPU the faster of bf16 and float32 (timed)
    # quantization (CPU): None/"auto", "none", "int8", "w8a8" or "gguf"; see minisgl/models/quantize.py
    quantization: str | None = None
    # the KV pool's dtype: "auto"/None (the model's), "bf16"/"bfloat16", "fp8"/"fp8_e4m3" (minisgl/utils/kv_cache_dtype.py),
    # or a torch dtype; validate() turns a name into the torch dtype
    kv_cache_dtype: str | torch.dtype | None = None
    device: str | None = None  # "cpu" or "cuda"; None picks CUDA where there is one
    max_running_req: int = 256
    num_page_override: int | None = None
    max_seq_len_override: int | None = None
    page_size: int = 1
    memory_ratio: float = 0.9  # share of free GPU memory the KV pool may take
    # vLLM's gpu_memory_utilization (SGLang's mem_fraction_static): the share of the GPU's whole memory in use once
    # the KV pool is allocated (the weights and anything else already there, the pool, 2 GiB for activations and
    # graphs), for GPUs shared with other work; None: memory_ratio of what is free after the weights
    gpu_memory_utilization: float | None = None
    cpu_kv_budget_gib: float = 4.0  # upper bound of the KV pool on a CPU
    attention_backend: str = "auto"
    cuda_graph_max_bs: int | None = None  # None: a default that suits the device; 0 turns graphs off
    cuda_graph_bs: list[int] | None = None
    # prefill steps of up to this many tokens (and 8 requests) replay CUDA graphs (engine/prefill_graph.py);
    # None: 2048 on CUDA; 0 turns them off
    cuda_graph_max_prefill: int | None = None
    # a prefill step also decodes the running requests, a token each (SGLang's --enable-mixed-chunk): their streams
    # go on while prompts are computed, instead of waiting for every prefill step. Off: a step prefills or decodes.
    # None: mixed steps on a CPU, none on CUDA, where they run without graphs and were slower (docs/scheduling.md);
    # the engine resolves it with the device. The scheduler builds those steps; the warm-up compiles their kernels
    enable_mixed_chunk: bool | None = None
    distributed_addr: str = "tcp://127.0.0.1:29517"  # torch.distributed's rendezvous, for tp_info.size > 1
    nnodes: int = 1  # machines the ranks are spread over, evenly

    def validate(self) -> None:
        from minisgl.utils.kv_cache_dtype import resolve_kv_cache_dtype
        from minisgl.utils.quantization import check_quantization

        self.quantization = check_quantization(self.quantization)
        self.kv_cache_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype)
        if self.page_size < 1:
            raise ValueError(f"page_size={self.page_size} is invalid: it must be >= 1")
        if self.max_running_req < 1:
            raise ValueError(f"max_running_req={self.max_running_req} is invalid: it must be >= 1")
        for name in ("memory_ratio", "gpu_memory_utilization"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise ValueError(f"{name}={value!r} is invalid: it must be in (0, 1]")
        if self.num_page_override is not None and self.num_page_override < 1:
            raise ValueError(f"num_page_override={self.num_page_override} is invalid: it must be >= 1")
        if self.cuda_graph_max_prefill is not None and self.cuda_graph_max_prefill < 0:
            raise ValueError(
                f"cuda_graph_max_prefill={self.cuda_graph_max_prefill} is invalid: it must be >= 0 (0: off)"
            )
        if self.max_seq_len_override is not None and self.max_seq_len_override < 2:
            raise ValueError(f"max_seq_len_override={self.max_seq_len_override} is invalid: it must be >= 2")
