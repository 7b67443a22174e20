"""Command-line options of `python -m minisgl`: where to listen, which model, and the engine's options."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, fields
from typing import Any

from minisgl.distributed import DistributedInfo
from minisgl.scheduler.config import SchedulerConfig
from minisgl.utils.torch_utils import parse_dtype

DEFAULT_PORT = 30000  # SGLang's


@dataclass
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    model: str | None = None  # None: the embedded default model
    shell: bool = False
    # the engine's options; None leaves the engine's default, which suits the device
    dtype: str | None = None
    max_running_req: int | None = None
    page_size: int | None = None
    cache_type: str | None = None
    max_extend_tokens: int | None = None
    num_pages: int | None = None
    max_seq_len: int | None = None
    attention_backend: str | None = None
    cuda_graph_max_bs: int | None = None
    tp_size: int = 1
    # what the HTTP front end takes from a client (server/guard.py)
    max_request_bytes: int = 4 << 20
    read_timeout: float = 30.0

    @property
    def model_name(self) -> str:
        """The name clients pass as `model`: the file or folder name without its extensions."""
        if self.model is None:
            from minisgl.models.gguf import DEFAULT_MODEL_FILE

            return DEFAULT_MODEL_FILE.split(".")[0]
        name = os.path.basename(os.path.normpath(self.model))
        return name[: -len(".gguf")] if name.endswith(".gguf") else name

    def scheduler_config(self, backend_addr: str, detokenizer_addr: str) -> SchedulerConfig:
        options: dict[str, Any] = {
            "max_running_req": self.max_running_req,
            "page_size": self.page_size,
            "cache_type": self.cache_type,
            "max_extend_tokens": self.max_extend_tokens,
            "num_page_override": self.num_pages,
            "max_seq_len_override": self.max_seq_len,
            "attention_backend": self.attention_backend,
            "cuda_graph_max_bs": self.cuda_graph_max_bs,
            "dtype": parse_dtype(self.dtype) if self.dtype is not None else None,
        }
        config = SchedulerConfig(
            model_path=self.model,
            tp_info=DistributedInfo(0, self.tp_size),
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


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minisgl",
        description="Serve a model with an OpenAI-compatible API (or chat with it: --shell). "
        "`python -m minisgl generate ...` runs offline generation instead.",
    )
    p.add_argument("--host", default=ServerArgs.host, help="address to listen on (default: %(default)s)")
    p.add_argument(
        "--port",
        type=_non_negative,
        default=DEFAULT_PORT,
        help="port (0 picks a free one; default: %(default)s)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="a Hugging Face model folder or a .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--shell", action="store_true", help="chat in this terminal instead of serving HTTP")
    engine = p.add_argument_group("engine", "left out: the engine's default for the device")
    engine.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="weights and activations"
    )
    engine.add_argument("--max-running-req", type=_positive, help="requests decoded at once")
    engine.add_argument("--page-size", type=_positive, help="tokens per KV page")
    engine.add_argument("--cache-type", choices=["radix", "naive"], help="prefix cache (naive: none)")
    engine.add_argument("--max-extend-tokens", type=_positive, help="prompt tokens prefilled per step")
    engine.add_argument("--num-pages", type=_positive, help="KV pages (default: as many as memory allows)")
    engine.add_argument("--max-seq-len", type=_positive, help="context length (default: the model's)")
    engine.add_argument("--attention-backend", help="attention backend name (default: auto)")
    engine.add_argument("--cuda-graph-max-bs", type=_non_negative, help="largest CUDA-graph batch (0: none)")
    engine.add_argument("--tp-size", type=_positive, default=1, help="tensor parallel size (only 1 for now)")
    p.add_argument(
        "--max-request-bytes",
        type=_positive,
        default=ServerArgs.max_request_bytes,
        help="largest request body; a larger one is refused with 413 (default: %(default)s)",
    )
    p.add_argument(
        "--read-timeout",
        type=_positive_seconds,
        default=ServerArgs.read_timeout,
        help="seconds a client has to send a request's headers, and again its body (default: %(default)s)",
    )
    return p


def parse_args(argv: list[str]) -> ServerArgs:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.tp_size != 1:
        parser.error(f"--tp-size {ns.tp_size}: the server runs one scheduler for now; use --tp-size 1")
    names = {f.name for f in fields(ServerArgs)}
    return ServerArgs(**{k: v for k, v in vars(ns).items() if k in names})
