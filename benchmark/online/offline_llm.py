"""The offline figure beside an online level: LLM.generate on the same requests, same engine options."""

from __future__ import annotations

import shlex
import time
from dataclasses import fields

from workload import Request

# SchedulerConfig fields that LLM sets itself or that only a server has
_NOT_FOR_LLM = {
    "model_path",
    "tp_info",
    "dtype",
    "offline_mode",
    "zmq_backend_addr",
    "zmq_detokenizer_addr",
    "distributed_addr",
    "nnodes",
}


def offline_tok_per_s(
    minisgl_args: str, reqs: list[Request], max_running_req: int | None, temperature: float
) -> float:
    """Output tokens/s of LLM.generate on `reqs`, with the engine options `python -m minisgl
    minisgl_args` would use; `max_running_req` (None: the server's) caps the batch as a closed loop of
    that many clients does."""
    from minisgl import LLM, SamplingParams
    from minisgl.server.args import parse_args

    # the server's own parser and mapping, so the offline engine is configured exactly as the served one
    config = parse_args(shlex.split(minisgl_args)).scheduler_config("", "")
    options = {f.name: getattr(config, f.name) for f in fields(config) if f.name not in _NOT_FOR_LLM}
    if max_running_req is not None:
        options["max_running_req"] = min(max_running_req, config.max_running_req)
    llm = LLM(config.model_path, dtype=config.dtype, tp_size=config.tp_info.size, **options)
    try:
        llm.generate([[1] * 8, [2] * 8], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        params = [
            SamplingParams(max_tokens=r.output_len, temperature=temperature, ignore_eos=True, seed=i)
            for i, r in enumerate(reqs)
        ]
        start = time.perf_counter()
        outputs = llm.generate([r.prompt for r in reqs], params)
        seconds = time.perf_counter() - start
    finally:
        llm.shutdown()
    failed = [o["error"] for o in outputs if o["finish_reason"] == "error"]
    if failed:
        raise RuntimeError(f"{len(failed)} offline requests failed, e.g. {failed[0]}")
    return sum(len(o["token_ids"]) for o in outputs) / seconds
