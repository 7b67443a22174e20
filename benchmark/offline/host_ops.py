"""The torch calls and copies the scheduler's host makes in one decode step, part by part, on the CUDA path's code.

    python benchmark/offline/host_ops.py [--requests 16] [--page-size 1] [--top-p] [--graphs] [--model DIR] [--json out.json]

Beside a GPU each torch call costs the host microseconds whatever its size (10-20 us on the H200 machine's CPU:
`host_steps.py`), and a decode step's host work is mostly such calls around a graph replay; how many there are
is a property of the code, the same on any machine. This counts them without a GPU: like `launch_count.py` it
takes the CUDA path's kernels under Triton's interpreter on CPU tensors (MINISGL_KERNELS=triton,
TRITON_INTERPRET=1), on a random one-layer Qwen3-0.6B-shaped checkpoint (or `--model`), and counts in the second decode step:

- every torch op that reaches the dispatcher (views and allocations too: each is a call the host pays for),
- every Triton launch,
- every host-to-device copy (`to_device_async`; beside CUDA each is also a pin_memory call, not counted here),

in the parts the scheduler runs: the KV pages (`allocate_paged`), `engine.prepare_batch`, the launch
(`engine.forward_batch`, less the model's forward, which a CUDA graph replays in one call) and the results
(`_process_last_data`). With `--graphs` the decode step replays a graph of its batch size (on a CPU an emulated
one, MINISGL_EMULATE_GRAPHS): the replay's own calls (its inputs' copies, the attention metadata's, the
replay itself, counted as one call) are counted in the launch, what the graph runs is not.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from launch_count import _count_triton_launches, print_counts  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("MINISGL_KERNELS", "triton")
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is imported

PARTS = [
    ("cache_manager", "allocate_paged", "KV pages"),
    ("engine", "prepare_batch", "engine.prepare_batch"),
    ("engine", "forward_batch", "launch (less the model)"),
    ("scheduler", "_process_last_data", "results"),
]


class OpCounter(TorchDispatchMode):
    """Counts the torch ops run inside it under `scope` (None: not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.scope: str | None = None
        self.counts: dict[str, Counter[str]] = {}
        self.paused = 0  # inside the model's forward (a graph replay beside a GPU): not counted
        self.inside_triton = 0  # inside a Triton launch: the interpreter's torch calls are not the host's

    def add(self, kind: str) -> None:
        if self.scope is not None and not self.paused and not self.inside_triton:
            self.counts.setdefault(self.scope, Counter())[kind] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.add(f"torch {func.overloadpacket.__name__}")
        return func(*args, **(kwargs or {}))


def count(
    model_dir: str, requests: int, page_size: int, top_p: bool, graphs: bool
) -> dict[str, Counter[str]]:
    import minisgl.attention.triton_backend as backend_mod
    import minisgl.engine.prepare as prepare_mod
    import minisgl.scheduler.cache as cache_mod
    from minisgl import LLM, SamplingParams
    from minisgl.engine.graph import Graph
    from minisgl.env import ENV

    ENV.EMULATE_GRAPHS.value = graphs
    llm = LLM(
        model_dir,
        dtype="bfloat16",
        max_running_req=requests,
        page_size=page_size,
        cuda_graph_bs=[requests] if graphs else None,
        cuda_graph_max_bs=requests if graphs else 0,
        cuda_graph_max_prefill=0,
    )
    counter = OpCounter()
    _count_triton_launches(lambda: counter)
    steps = [0]
    owners = {"cache_manager": llm.cache_manager, "engine": llm.engine, "scheduler": llm}

    def wrap(obj: Any, name: str, label: str) -> None:
        f = getattr(obj, name)

        def g(*a: Any, **k: Any) -> Any:
            decode = steps[0] == 2 and counter.scope is None
            if decode:
                counter.scope = label
            try:
                return f(*a, **k)
            finally:
                if decode:
                    counter.scope = None

        setattr(obj, name, g)

    for owner, name, label in PARTS:
        wrap(owners[owner], name, label)

    def copies(module: Any) -> None:
        to_device = module.to_device_async

        def counted(t: torch.Tensor, device: torch.device) -> torch.Tensor:
            counter.add("host-to-device copy")
            return to_device(t, device)

        module.to_device_async = counted

    for module in (prepare_mod, cache_mod, backend_mod):
        copies(module)
    model_forward = llm.engine.model.forward

    def uncounted_forward(*a: Any, **k: Any) -> Any:
        counter.paused += 1
        try:
            return model_forward(*a, **k)
        finally:
            counter.paused -= 1

    llm.engine.model.forward = uncounted_forward

    class CountedGraph:
        """A captured graph (CUDA's or an emulated one) whose replay counts as one call and nothing inside."""

        def __init__(self, graph: Graph) -> None:
            self.graph = graph

        def replay(self) -> None:
            counter.add("graph replay")
            counter.paused += 1
            try:
                self.graph.replay()
            finally:
                counter.paused -= 1

        def pool(self) -> Any:
            return self.graph.pool()

    runner = llm.engine.graph_runner
    runner.graphs = {bs: CountedGraph(g) for bs, g in runner.graphs.items()}
    schedule = llm._schedule_next_batch

    def step() -> Any:
        out = schedule()
        if out is not None and out.batch.is_decode:
            steps[0] += 1
        return out

    llm._schedule_next_batch = step
    ids = [[3 + (7 * i + j) % 300 for j in range(24)] for i in range(requests)]
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.7)
    if top_p:
        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.7, top_k=50, top_p=0.9)
    with counter:
        llm.generate(ids, params, use_tqdm=False)
    llm.shutdown()
    return counter.counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--top-p", action="store_true", help="top-k 50 / top-p 0.9 (the filters' launches)")
    p.add_argument(
        "--model",
        help="a checkpoint folder (default: a random one-layer Qwen3-0.6B shape; the counts do "
        "not depend on the model's size, only the interpreter's time does)",
    )
    p.add_argument(
        "--graphs", action="store_true", help="the decode step replays a graph (emulated on a CPU)"
    )
    p.add_argument("--json", help="write the counts here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        from random_checkpoint import build

        model = args.model or build("qwen3-0.6b", tmp, layers=1)
        counts = count(model, args.requests, args.page_size, args.top_p, args.graphs)
    total = sum(sum(c.values()) for c in counts.values())
    graphs = ", a graph's replay" if args.graphs else ""
    print(
        f"a decode step of {args.requests} requests, page size {args.page_size}{graphs}: {total} host calls"
    )
    print_counts(counts, [label for _, _, label in PARTS], "calls", args.json)


if __name__ == "__main__":
    main()
