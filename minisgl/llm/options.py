"""LLM()'s options under vLLM's and SGLang's names too, as the server's command line takes them
(server/args.py): `LLM(model=..., tensor_parallel_size=2, max_model_len=4096, enforce_eager=True)` means what it
means to a vLLM user. A name that is none of them, or one LLM sets itself, is a TypeError listing the options."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

# their name -> ours (SchedulerConfig's field, or LLM's own argument)
RENAMED = {
    "model": "model_path",
    "tensor_parallel_size": "tp_size",
    "tp": "tp_size",
    "max_model_len": "max_seq_len_override",
    "context_length": "max_seq_len_override",
    "max_seq_len": "max_seq_len_override",
    "max_num_seqs": "max_running_req",
    "max_running_requests": "max_running_req",
    "max_num_batched_tokens": "max_extend_tokens",
    "chunked_prefill_size": "max_extend_tokens",
    "block_size": "page_size",
    "num_pages": "num_page_override",
    "mem_fraction_static": "gpu_memory_utilization",
    "enable_priority_scheduling": "priority_scheduling",
    "schedule_low_priority_values_first": "low_priority_values_first",
}
# their switch -> (our field, the value each setting of it means)
SWITCHES: dict[str, tuple[str, dict[bool, Any]]] = {
    "enforce_eager": ("cuda_graph_max_bs", {True: 0}),
    "disable_cuda_graph": ("cuda_graph_max_bs", {True: 0}),
    "enable_prefix_caching": ("cache_type", {True: "radix", False: "naive"}),
    "disable_radix_cache": ("cache_type", {True: "naive", False: "radix"}),
    "trust_remote_code": ("", {False: None}),  # minisgl runs its own model code only
}
# their options minisgl has otherwise: where to say instead
ELSEWHERE = {"seed": "minisgl seeds each request: pass SamplingParams(seed=...)"}
# what LLM sets itself
_OWN = ("tp_info", "offline_mode", "zmq_backend_addr", "zmq_detokenizer_addr", "distributed_addr", "nnodes")


def llm_options(kwargs: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """`kwargs` under our names (`names`: the options there are), each given once."""
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # our name -> the name it was given by
    for name, value in kwargs.items():
        if name in ELSEWHERE:
            raise TypeError(f"LLM() does not take {name!r}: {ELSEWHERE[name]}")
        if name in SWITCHES:
            ours, meaning = SWITCHES[name]
            if not isinstance(value, bool) or value not in meaning:
                takes = " or ".join(str(v) for v in meaning)
                why = (
                    "minisgl runs its own model code only"
                    if name == "trust_remote_code"
                    else "it is a switch"
                )
                raise ValueError(f"{name}={value!r} is not taken ({why}): it takes {takes}")
            if not ours:
                continue
            value = meaning[value]
        else:
            ours = RENAMED.get(name, name)
            if ours not in names or ours in _OWN:
                theirs = ", ".join(sorted([*RENAMED, *SWITCHES]))
                raise TypeError(
                    f"LLM() has no option {name!r}; its options are {', '.join(n for n in names if n not in _OWN)}, "
                    f"and vLLM's and SGLang's names {theirs}"
                )
        put_once(out, given, ours, name, value, "LLM()", TypeError)
    return out


def put_once(
    out: dict[str, Any],
    given: dict[str, str],
    ours: str,
    name: str,
    value: Any,
    what: str,
    error: type[Exception],
) -> None:
    """out[ours] = value, given as `name` (recorded in `given`); a second name for the same `ours` is an `error`."""
    if ours in given:
        raise error(f"{what} got {given[ours]!r} and {name!r}, which set the same option ({ours}); pass one")
    given[ours] = name
    out[ours] = value


def option_names() -> list[str]:
    """LLM's own arguments and SchedulerConfig's fields."""
    from minisgl.scheduler.config import SchedulerConfig

    return list(dict.fromkeys(["model_path", "dtype", "tp_size", *(f.name for f in fields(SchedulerConfig))]))
