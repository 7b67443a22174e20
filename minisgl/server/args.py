"""Command-line options of `python -m minisgl`: where to listen, which model, and the engine's options."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from minisgl.env import ENV
from minisgl.tokenizer.reasoning import ALIASES as REASONING_ALIASES
from minisgl.tokenizer.reasoning import FORMATS as REASONING_FORMATS
from minisgl.tokenizer.tool_parser import ALIASES as TOOL_ALIASES
from minisgl.tokenizer.tool_parser import FORMATS
from minisgl.utils.cli import ArgumentParser, add_no_prefix_cache
from minisgl.utils.hf import read_chat_template
from minisgl.utils.kv_cache_dtype import KV_CACHE_DTYPES
from minisgl.utils.quantization import QUANTIZATIONS

if TYPE_CHECKING:
    from minisgl.scheduler.config import SchedulerConfig

DEFAULT_PORT = 30000  # SGLang's


@dataclass
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    model: str | None = None  # None: the embedded default model
    served_model_name: list[str] | None = None  # None: the model's file or folder name
    shell: bool = False
    log_requests: bool = False  # log each request's prompt and output text, not only its figures
    # the engine's options; None leaves the engine's default, which suits the device
    dtype: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    max_running_req: int | None = None
    page_size: int | None = None
    cache_type: str | None = None
    max_extend_tokens: int | None = None
    num_pages: int | None = None
    gpu_memory_utilization: float | None = None  # EngineConfig.gpu_memory_utilization
    max_seq_len: int | None = None
    attention_backend: str | None = None
    cuda_graph_max_bs: int | None = None
    cuda_graph_max_prefill: int | None = None
    tp_size: int = 1
    # several machines (SGLang's names): the ranks spread evenly; node 0 serves HTTP
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port of torch.distributed's rendezvous (node 0 listens)
    trace: str | None = None
    tool_call_parser: str | None = None  # None: told by the model's chat template and architecture
    reasoning_parser: str | None = None  # a thinking model's reasoning in its own field; None: in the content
    chat_template: str | None = (
        None  # the chat template's text (read from --chat-template's file); None: the model's
    )
    # the prefill queue by request priority (SchedulerConfig.priority_scheduling), by SGLang's flags or vLLM's
    # --scheduling-policy priority (lower values first)
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    enable_mixed_chunk: bool | None = None  # SchedulerConfig.enable_mixed_chunk (None: by the device)
    scheduling_policy: str = "fcfs"
    # what the HTTP front end takes from a client (server/guard.py)
    max_request_bytes: int = 4 << 20
    # the request bodies held at once, read or being read and not yet parsed
    max_request_bytes_in_flight: int = 256 << 20
    read_timeout: float = 30.0
    # None: no key; kept out of the repr so that a logged ServerArgs does not show it
    api_key: str | None = field(default=None, repr=False)

    @property
    def model_name(self) -> str:
        """The name clients pass as `model`: the file or folder name without its extensions."""
        if self.model is None:
            from minisgl.models.gguf import DEFAULT_MODEL_FILE

            return DEFAULT_MODEL_FILE.split(".")[0]
        name = os.path.basename(os.path.normpath(self.model))
        return name[: -len(".gguf")] if name.endswith(".gguf") else name

    @property
    def priority_scheduling(self) -> bool:
        return self.enable_priority_scheduling or self.scheduling_policy == "priority"

    @property
    def low_priority_values_first(self) -> bool:
        return self.schedule_low_priority_values_first or self.scheduling_policy == "priority"

    @property
    def model_names(self) -> list[str]:
        """Every name clients may pass as `model`, the one /v1/models reports first first."""
        return list(self.served_model_name) if self.served_model_name else [self.model_name]

    def scheduler_config(self, backend_addr: str, detokenizer_addr: str) -> SchedulerConfig:
        # imported here: they pull in torch, which `--help` must not wait for
        from minisgl.distributed import DistributedInfo
        from minisgl.scheduler.config import SchedulerConfig
        from minisgl.utils.torch_utils import parse_dtype

        options: dict[str, Any] = {
            "max_running_req": self.max_running_req,
            "page_size": self.page_size,
            "cache_type": self.cache_type,
            "max_extend_tokens": self.max_extend_tokens,
            "num_page_override": self.num_pages,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_seq_len_override": self.max_seq_len,
            "attention_backend": self.attention_backend,
            "cuda_graph_max_bs": self.cuda_graph_max_bs,
            "cuda_graph_max_prefill": self.cuda_graph_max_prefill,
            "dtype": parse_dtype(self.dtype) if self.dtype is not None else None,
            "quantization": self.quantization,
            "kv_cache_dtype": self.kv_cache_dtype,
            "priority_scheduling": self.priority_scheduling,
            "low_priority_values_first": self.low_priority_values_first,
            "chat_template": self.chat_template,
            "enable_mixed_chunk": self.enable_mixed_chunk,
        }
        if self.dist_init_addr is not None:
            options["distributed_addr"] = f"tcp://{self.dist_init_addr}"
        elif self.tp_size > 1:
            from minisgl.scheduler.ranks import free_tcp_addr

            options["distributed_addr"] = free_tcp_addr()
        config = SchedulerConfig(
            model_path=self.model,
            tp_info=DistributedInfo(0, self.tp_size),
            nnodes=self.nnodes,
            offline_mode=False,
            zmq_backend_addr=backend_addr,
            zmq_detokenizer_addr=detokenizer_addr,
            **{k: v for k, v in options.items() if v is not None},
        )
        config.validate()
        return config


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m minisgl",
        usage="%(prog)s [serve] [options]\n       %(prog)s generate [options] [PROMPT ...]",
        description="Commands: serve (the default) serves a model with an OpenAI-compatible API, or chats "
        "with it in the terminal (--shell); generate completes prompts offline, without a server "
        "(`%(prog)s generate --help`). MINISGL_LOG_LEVEL=debug shows tracebacks.",
    )
    p.add_argument("--host", default=ServerArgs.host, help="address to listen on (default: %(default)s)")
    p.add_argument(
        "--port",
        type=_non_negative,
        default=DEFAULT_PORT,
        help="port to listen on; 0 picks a free one (default: %(default)s)",
    )
    p.add_argument(
        "--model",
        "--model-path",
        default=None,
        help="a Hugging Face model folder or a .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="the names clients may pass as `model`; /v1/models reports the first first, and the model "
        "path is accepted too (default: the model's file or folder name)",
    )
    p.add_argument(
        "--shell", action="store_true", help="chat in this terminal instead of serving HTTP (default: off)"
    )
    p.add_argument(
        "--log-requests",
        action="store_true",
        help="add each request's prompt and output text to its log line (default: off; the line "
        "has the token counts and times)",
    )
    engine = p.add_argument_group("engine", "left out: the engine's default for the device")
    engine.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and activations (default: auto: bfloat16 on CUDA; on a CPU whichever of the two multiplies faster there, timed at start)",
    )
    engine.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        help="quantization on the CPU: int8 (weights per channel, any checkpoint), w8a8 (the same int8 "
        "weights times activations quantized to int8 per token), gguf (a GGUF "
        "file's own 4-bit/8-bit packing), none (float weights) (default: auto: a GGUF file's packing "
        "beside the float weights where it measures faster)",
    )
    engine.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        help="what the KV cache stores: bf16/bfloat16, or fp8/fp8_e4m3 (FP8 with a scale per layer, "
        "read from the checkpoint's k_scale/v_scale or 1.0; half the memory of bf16, for GPUs) "
        "(default: auto: the model's dtype)",
    )
    # each option also under SGLang's and vLLM's names, where they mean the same
    engine.add_argument(
        "--max-running-req",
        "--max-running-requests",
        "--max-num-seqs",
        type=_positive,
        help="requests decoded at once (default: 256)",
    )
    engine.add_argument("--page-size", "--block-size", type=_positive, help="tokens per KV page (default: 1)")
    engine.add_argument(
        "--cache-type", choices=["radix", "naive"], help="prefix cache; naive: none (default: radix)"
    )
    add_no_prefix_cache(engine)
    engine.add_argument(
        "--max-extend-tokens",
        "--chunked-prefill-size",
        "--max-num-batched-tokens",
        type=_positive,
        help="prompt tokens prefilled per step; a longer prompt is prefilled in chunks (default: 8192)",
    )
    engine.add_argument(
        "--enable-mixed-chunk",
        action="store_true",
        default=None,
        help="a prefill step also decodes the running requests, a token each, so their streams go on while "
        "prompts are computed (SGLang's) (default: on a CPU; off on CUDA, where those steps run without graphs)",
    )
    engine.add_argument(
        "--disable-mixed-chunk",
        dest="enable_mixed_chunk",
        action="store_false",
        default=None,
        help="a step prefills or decodes, never both (the default on CUDA)",
    )
    engine.add_argument("--num-pages", type=_positive, help="KV pages (default: as many as memory allows)")
    engine.add_argument(
        "--gpu-memory-utilization",
        "--mem-fraction-static",
        type=_fraction,
        help="the share of the GPU's memory in use once the KV pool is allocated: the weights and anything else "
        "already there, the pool, and 2 GiB for activations; for a GPU shared with other work (vLLM's meaning) "
        "(default: the pool takes 0.9 of the memory free after the weights)",
    )
    engine.add_argument(
        "--max-seq-len",
        "--context-length",
        "--max-model-len",
        type=_positive,
        help="context length (default: the model's)",
    )
    engine.add_argument(
        "--attention-backend",
        help="attention backend: torch, cpu or triton (default: triton on CUDA, cpu on a CPU with a C compiler, else torch)",
    )
    engine.add_argument(
        "--cuda-graph-max-bs",
        type=_non_negative,
        help="largest batch decoded with a CUDA graph; 0: no graphs (default: 256, or --max-running-req if less)",
    )
    engine.add_argument(
        "--disable-cuda-graph",
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs: --cuda-graph-max-bs 0 (default: off)",
    )
    engine.add_argument(
        "--cuda-graph-max-prefill",
        type=_non_negative,
        help="largest prefill step (in tokens, of up to 8 requests) run from a CUDA graph; 0: none, as with "
        "--cuda-graph-max-bs 0 (default: 2048)",
    )
    dist = p.add_argument_group("tensor parallelism")
    dist.add_argument(
        "--tp-size",
        "--tp",
        "--tensor-parallel-size",
        type=_positive,
        default=1,
        help="tensor-parallel ranks, one scheduler process and one GPU each (default: %(default)s)",
    )
    dist.add_argument(
        "--nnodes",
        type=_positive,
        default=1,
        help="machines the ranks spread over evenly (default: %(default)s)",
    )
    dist.add_argument(
        "--node-rank",
        type=_non_negative,
        default=0,
        help="this machine's place among them; node 0 serves HTTP (default: %(default)s)",
    )
    dist.add_argument(
        "--dist-init-addr",
        metavar="HOST:PORT",
        help="torch.distributed rendezvous on node 0, the same on every node; needed with --nnodes > 1 "
        "(default: a free port on this machine)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted([*FORMATS, *TOOL_ALIASES]),
        help="the format the model writes tool calls in: qwen (vLLM's hermes, SGLang's qwen25), llama3 (vLLM's "
        "llama3_json) or mistral (default: told by its chat template and architecture)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=sorted([*REASONING_FORMATS, *REASONING_ALIASES]),
        help="answer a thinking model's <think> text in reasoning_content, apart from the content (default: "
        "off, the reasoning stays in the content)",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE_OR_TEXT",
        help="the chat template for chat requests instead of the model's: a Jinja file's path, or the template's "
        "text (default: the model's)",
    )
    queue = p.add_argument_group(
        "priority scheduling", "requests wait for prefill in order of their `priority`"
    )
    queue.add_argument(
        "--enable-priority-scheduling",
        action="store_true",
        help="admit waiting requests by their `priority` field, higher values first, ties first come first "
        "served; running requests are not preempted (default: off, first come first served, and a "
        "request with a priority other than 0 is refused)",
    )
    queue.add_argument(
        "--schedule-low-priority-values-first",
        action="store_true",
        help="with --enable-priority-scheduling: lower values first (default: higher first)",
    )
    queue.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default=ServerArgs.scheduling_policy,
        help="vLLM's spelling: priority is --enable-priority-scheduling with lower values first (default: "
        "%(default)s)",
    )
    p.add_argument(
        "--trace",
        metavar="PATH",
        help="write a timeline of the run (Perfetto JSON; docs/trace.md) (default: off)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=_positive,
        default=ServerArgs.max_request_bytes,
        help="largest request body; a larger one is refused with 413 (default: %(default)s)",
    )
    p.add_argument(
        "--max-request-bytes-in-flight",
        type=_positive,
        default=ServerArgs.max_request_bytes_in_flight,
        help="bytes of request bodies held at once, read or being read and not yet parsed; a body that "
        "would pass it is refused with 503 and Retry-After; at least --max-request-bytes "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--read-timeout",
        type=_positive_seconds,
        default=ServerArgs.read_timeout,
        help="seconds a client has to send a request's headers, and again its body (1 s more for every 64 KiB "
        "of body received) (default: %(default)s)",
    )
    p.add_argument(
        "--api-key",
        metavar="KEY",
        default=ENV.API_KEY.value or None,
        help="require `Authorization: Bearer KEY` on every route but /health; also read from "
        "MINISGL_API_KEY (default: no key)",
    )
    return p


def parse_args(argv: list[str]) -> ServerArgs:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.tp_size % ns.nnodes:
        parser.error(f"--tp-size {ns.tp_size} does not spread evenly over --nnodes {ns.nnodes}")
    if ns.node_rank >= ns.nnodes:
        parser.error(f"--node-rank {ns.node_rank} must be below --nnodes {ns.nnodes}")
    if ns.nnodes > 1 and ns.dist_init_addr is None:
        parser.error(
            "--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, the same on every node)"
        )
    if ns.max_request_bytes_in_flight < ns.max_request_bytes:
        parser.error(
            f"--max-request-bytes-in-flight {ns.max_request_bytes_in_flight} is less than --max-request-bytes "
            f"{ns.max_request_bytes}, so a body of the largest size allowed would always be refused; raise "
            "the first or lower the second"
        )
    if ns.schedule_low_priority_values_first and not (
        ns.enable_priority_scheduling or ns.scheduling_policy == "priority"
    ):
        parser.error(
            "--schedule-low-priority-values-first orders priority scheduling; add --enable-priority-scheduling"
        )
    if (
        ns.scheduling_policy == "priority"
        and ns.enable_priority_scheduling
        and not ns.schedule_low_priority_values_first
    ):
        parser.error(
            "--scheduling-policy priority puts lower values first, --enable-priority-scheduling alone higher "
            "ones; pick one (or add --schedule-low-priority-values-first)"
        )
    if ns.disable_cuda_graph:
        if ns.cuda_graph_max_bs or ns.cuda_graph_max_prefill:
            parser.error(
                "--disable-cuda-graph turns off the graphs --cuda-graph-max-bs/-prefill size; pick one"
            )
        ns.cuda_graph_max_bs = 0
    if ns.tool_call_parser is not None:
        ns.tool_call_parser = TOOL_ALIASES.get(ns.tool_call_parser, ns.tool_call_parser)
    if ns.chat_template is not None:
        try:
            ns.chat_template = read_chat_template(ns.chat_template)
        except ValueError as e:
            parser.error(f"--chat-template: {e}")
    if ns.api_key is not None and not ns.api_key.strip():
        parser.error("--api-key is empty; pass a key, or leave the option out to serve without one")
    names = {f.name for f in fields(ServerArgs)}
    return ServerArgs(**{k: v for k, v in vars(ns).items() if k in names})
