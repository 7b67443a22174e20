"""Kernel launches per prefill step, per decode step and per decoder layer of the CUDA path, by kind.

    python benchmark/offline/launch_count.py [--shape qwen3-0.6b] [--layers N] [--model FOLDER] [--json out.json]

Runs without a GPU: with no CUDA device it sets MINISGL_KERNELS=triton and TRITON_INTERPRET=1, so the
engine takes the CUDA path's layer code (Triton norm, rotary, KV store, activation, attention and
sampling kernels) under Triton's interpreter on CPU tensors. On a GPU it counts the real eager path
(CUDA graphs off, so decode launches are seen one by one; a graph replays the same kernels).

Counted: every launch of a `@triton.jit` kernel by name, and every torch op that would launch a CUDA
kernel (aten ops seen through a dispatch mode, less views and allocations, which launch nothing).
Torch ops run inside a Triton launch (the interpreter's own copies) are not counted. A step is one
call of Engine.forward_batch (the model and sampling); the host-to-device copies of prepare_batch
come before it and are not counted. The per-layer figure is that of layer 1 (layer 0's norm has no
residual to add yet).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if not torch.cuda.is_available():
    os.environ.setdefault("MINISGL_KERNELS", "triton")
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is imported

# ops that allocate or reinterpret memory without a kernel (views are told by their schema)
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "lift_fresh", "detach", "set_", "resize_"}


def _launches_kernel(func: Any) -> bool:
    return not func.is_view and func.overloadpacket.__name__ not in _NO_KERNEL


class LaunchCounter(TorchDispatchMode):
    """Counts the launches of the code run inside it; `scope` names where they are added."""

    active: LaunchCounter | None = None

    def __init__(self) -> None:
        super().__init__()
        # the first prefill and the first decode step are kept: later steps repeat them
        self.counts: dict[str, Counter[str]] = {}
        self.scopes: list[str] = []
        self.inside_triton = 0

    def add(self, kind: str) -> None:
        for scope in self.scopes:
            self.counts.setdefault(scope, Counter())[kind] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.inside_triton and _launches_kernel(func):
            self.add(f"torch {func.overloadpacket.__name__}")
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> LaunchCounter:
        LaunchCounter.active = self
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        LaunchCounter.active = None
        super().__exit__(*exc)


def _count_triton_launches(active: Callable[[], Any] = lambda: LaunchCounter.active) -> None:
    """Wrap the launch of every Triton kernel (compiled and interpreted) so the counter `active()` gives (one
    with `add(kind)` and an `inside_triton` depth, under which its torch calls are the kernel's) sees it."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def wrap(run: Callable[..., Any]) -> Callable[..., Any]:
        def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
            counter = active()
            if counter is None or kwargs.get("warmup"):
                return run(fn, *args, **kwargs)
            counter.add(f"triton {fn.__name__}")
            counter.inside_triton += 1
            try:
                return run(fn, *args, **kwargs)
            finally:
                counter.inside_triton -= 1

        return counted

    for cls in (JITFunction, InterpretedFunction):
        cls.run = wrap(cls.run)


def count(model_dir: str, prompts: int, prompt_len: int, page_size: int) -> dict[str, Counter[str]]:
    from minisgl import LLM, SamplingParams

    _count_triton_launches()
    llm = LLM(
        model_dir,
        dtype="bfloat16",
        max_running_req=prompts,
        cache_type="naive",
        page_size=page_size,
        max_seq_len_override=prompt_len + 8,
        # room for every prompt at once: one prefill step takes them all
        num_page_override=prompts * (-(-(prompt_len + 8) // page_size)),
        cuda_graph_max_bs=0,
    )
    engine = llm.engine
    counter = LaunchCounter()
    step_of = engine.forward_batch

    def counted_step(forward_input: Any) -> Any:
        scope = "prefill step" if forward_input.batch.is_prefill else "decode step"
        if scope in counter.counts:
            return step_of(forward_input)
        counter.scopes = [scope]
        with counter:
            return step_of(forward_input)

    engine.forward_batch = counted_step

    def enter_layer(*_: Any) -> None:
        # "prefill step" -> "prefill layer"
        counter.scopes.append(counter.scopes[0].replace("step", "layer"))

    def leave_layer(*_: Any) -> None:
        counter.scopes.pop()

    layer = engine.model.model.layers[1]
    layer.register_forward_pre_hook(enter_layer)
    layer.register_forward_hook(leave_layer)
    ids = [[3 + (7 * i + j) % 1000 for j in range(prompt_len)] for i in range(prompts)]
    # two new tokens: one prefill step, then one decode step of the whole batch
    llm.generate(ids, SamplingParams(max_tokens=2, ignore_eos=True))
    llm.shutdown()
    return counter.counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint folder; default: a random one of --shape")
    p.add_argument("--shape", default="qwen3-0.6b", help="a random_checkpoint.py shape")
    p.add_argument(
        "--layers", type=int, default=None, help="fewer layers than the shape (said in the output)"
    )
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--json", help="write the counts here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from random_checkpoint import build

            model_dir = build(args.shape, tmp, layers=args.layers)
        counts = count(model_dir, args.prompts, args.prompt_len, args.page_size)
    device = "cuda" if torch.cuda.is_available() else "cpu (Triton interpreter)"
    print(
        f"model {args.model or args.shape}, layers {args.layers or 'all'}, {device}, "
        f"{args.prompts} prompts x {args.prompt_len} tokens, page size {args.page_size}"
    )
    print_counts(
        counts, ["prefill layer", "prefill step", "decode layer", "decode step"], "launches", args.json
    )


def print_counts(
    counts: dict[str, Counter[str]], scopes: list[str], unit: str, json_path: str | None
) -> None:
    """Each scope's total and its kinds, most first; with json_path, the counts also go there."""
    for scope in scopes:
        kinds = counts.get(scope, Counter())
        print(f"{scope}: {sum(kinds.values())} {unit}")
        for kind, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"    {n:4d}  {kind}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({scope: dict(kinds) for scope, kinds in counts.items()}, f, indent=1)


if __name__ == "__main__":
    main()
