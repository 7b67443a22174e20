"""Programmatic edges in CUDA graphs: which kernels wait for their inputs on the device, and what the edges save.

    python benchmark/offline/graph_pdl.py [--parts probe,chain,names] [--model FOLDER] [--json out.json]

probe  a Triton kernel that lets its dependents launch at once and writes its output some 50 us later, then a
       consumer of that output, in one graph whose edge between them is made programmatic
       (engine/graph_edges.py): a consumer that waits (griddepcontrol.wait) reads the new values, one that does
       not reads the old ones. Consumers: cuBLAS's products in the decode step's shapes at 1-256 rows (q|k|v,
       o and down with the residual added in place, gate|up, the LM head's float32 logits), a Triton copy
       without the wait (the control: it must read the old values) and with it. Prints, and writes to the JSON,
       each kernel name's verdict and a regular expression of the names that always waited (`waiters`).
chain  a decode step's 112 cuBLAS products (28 layers of the Qwen3-0.6B shape, each its own weights, the real
       dependencies as gemm_pdl.py chains them) in one graph, as captured and with every kernel-to-kernel edge
       into a waiting kernel programmatic: the same bits, and the time of a replay.
names  the kernels of the engine's decode graphs (--model), by name and count, and how many edges a waiter
       regex (the probe's) would make programmatic.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from skinny_gemm import replay_ms  # noqa: E402

from minisgl.engine.graph_edges import make_programmatic  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# (output width, input width) of each product of a Qwen3-0.6B decode step
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
VOCAB = 151936


@triton.jit
def _late_write(x_ptr, n, spins, BLOCK: tl.constexpr):
    """Lets the next kernel launch at once, then writes ones over x[:n] after `spins` dependent steps."""
    tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((), dtype=tl.float32)
    for _ in range(spins):
        acc = acc * 0.9999 + 1.0
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    one = tl.where(acc > -1.0, 1.0, 0.0)
    tl.store(
        x_ptr + offs, (tl.zeros((BLOCK,), dtype=tl.float32) + one).to(x_ptr.dtype.element_ty), mask=offs < n
    )


@triton.jit
def _copy(x_ptr, y_ptr, n, WAIT: tl.constexpr, BLOCK: tl.constexpr):
    if WAIT:
        tl.extra.cuda.gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def replay_graph(
    fn: Callable[[], None], waits: Callable[[str], bool] | None
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """`fn` captured (after two eager runs), its edges into kernels that `waits` made programmatic."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g, stream=stream):
        fn()
    report = make_programmatic(g.raw_cuda_graph(), waits) if waits is not None else None
    g.instantiate()
    return g, report


def probe(spins: int) -> dict[str, Any]:
    dev = torch.device("cuda")
    verdicts: dict[str, list[bool]] = {}
    cases = []
    # torch's own kernels (at::native) never wait: edges into them stay as captured
    waits = lambda name: "_late_write" not in name and "native" not in name  # noqa: E731

    def check(
        label: str, x: torch.Tensor, consume: Callable[[], torch.Tensor], reset: Callable[[], Any]
    ) -> None:
        n = x.numel()
        held: list[torch.Tensor] = []

        def fn() -> None:
            _late_write[(triton.cdiv(n, 1024),)](x, n, spins, BLOCK=1024)
            held[:] = [consume()]

        g, report = replay_graph(fn, waits)
        out = held[0]  # the captured run's output buffer
        # what the consumer gives from the new x (ones) and from the old (zeros), eagerly
        x.fill_(1)
        reset()
        new = consume().float().clone()
        x.zero_()
        reset()
        old = consume().float().clone()
        results = []
        for _ in range(5):
            x.zero_()
            reset()
            torch.cuda.synchronize()
            g.replay()
            torch.cuda.synchronize()
            got = out.float()
            results.append("new" if torch.equal(got, new) else "old" if torch.equal(got, old) else "mixed")
        consumers = [k for k in report.names if waits(k)]
        waited = all(r == "new" for r in results)
        for name in consumers:
            verdicts.setdefault(name, []).append(waited)
        cases.append({"case": label, "replays": results, "consumers": consumers,
                      "made_programmatic": report.made_programmatic})  # fmt: skip
        print(f"{label:24s} {'waits' if waited else 'DOES NOT WAIT'} {dict(Counter(results))} "
              f"{report.made_programmatic} edges {[c[:60] for c in consumers]}", flush=True)  # fmt: skip
        del g

    n = 1 << 20
    x = torch.zeros(n, device=dev, dtype=torch.bfloat16)
    y = torch.zeros_like(x)
    for wait in (False, True):

        def copy(wait: bool = wait) -> torch.Tensor:
            _copy[(n // 1024,)](x, y, n, WAIT=wait, BLOCK=1024)
            return y

        check(f"triton copy wait={wait}", x, copy, lambda: None)
    for m in ROWS:
        for shape, (nout, k) in SHAPES.items():
            w = torch.randn(nout, k, device=dev, dtype=torch.bfloat16) * k**-0.5
            xa = torch.zeros(m, k, device=dev, dtype=torch.bfloat16)
            out = torch.zeros(m, nout, device=dev, dtype=torch.bfloat16)
            if shape in ("o", "down"):
                res = torch.randn(m, nout, device=dev, dtype=torch.bfloat16)
                check(f"addmm_ {shape} rows={m}", xa, lambda out=out, xa=xa, w=w: out.addmm_(xa, w.t()),
                      lambda out=out, res=res: out.copy_(res))  # fmt: skip
            else:
                check(f"mm {shape} rows={m}", xa, lambda out=out, xa=xa, w=w: torch.mm(xa, w.t(), out=out),
                      lambda: None)  # fmt: skip
        head = torch.randn(VOCAB, 1024, device=dev, dtype=torch.bfloat16) * 1024**-0.5
        xh = torch.zeros(m, 1024, device=dev, dtype=torch.bfloat16)
        check(f"lm head rows={m}", xh, lambda xh=xh, head=head: torch.mm(xh, head.t(), out_dtype=torch.float32),
              lambda: None)  # fmt: skip
        del head
    always = sorted(name for name, v in verdicts.items() if all(v) and "_copy" not in name)
    never = sorted(name for name, v in verdicts.items() if not all(v))
    regex = "^(" + "|".join(re.escape(nm) for nm in always) + ")$" if always else ""
    print(f"kernels that always waited: {len(always)}; that did not: {len(never)} {never}", flush=True)
    return {"cases": cases, "waiters": always, "not_waiting": never, "waiters_regex": regex}


def chain(regex: str) -> list[dict[str, Any]]:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    weights = [
        {
            k: torch.randn(n, kk, device=dev, dtype=torch.bfloat16) * (0.5 * kk**-0.5)
            for k, (n, kk) in SHAPES.items()
        }
        for _ in range(28)
    ]
    rx = re.compile(regex) if regex else None
    waits = (lambda name: rx.search(name) is not None) if rx else (lambda name: True)
    rows = []
    for m in (1, 16, 64, 128, 256):
        h0 = torch.randn(m, 1024, device=dev, dtype=torch.bfloat16)
        h = h0.clone()
        qkv = torch.empty(m, 4096, device=dev, dtype=torch.bfloat16)
        gu = torch.empty(m, 6144, device=dev, dtype=torch.bfloat16)

        def step(h: torch.Tensor = h, qkv: torch.Tensor = qkv, gu: torch.Tensor = gu) -> None:
            for lw in weights:
                torch.mm(h, lw["qkv"].t(), out=qkv)
                h.addmm_(qkv[:, :2048], lw["o"].t())
                torch.mm(h, lw["gate_up"].t(), out=gu)
                h.addmm_(gu[:, :3072], lw["down"].t())

        finals, times, reports = {}, {}, {}
        for mode in ("plain", "programmatic"):
            g, report = replay_graph(step, waits if mode == "programmatic" else None)
            h.copy_(h0)
            g.replay()
            torch.cuda.synchronize()
            finals[mode] = h.clone()
            times[mode] = replay_ms(g, 30)
            if report is not None:
                reports[mode] = (report.made_programmatic, report.edges)
            del g
        same = torch.equal(finals["plain"], finals["programmatic"])
        row = {"rows": m, "plain_ms": times["plain"], "programmatic_ms": times["programmatic"], "same_bits": same,
               "made_programmatic": reports["programmatic"]}  # fmt: skip
        rows.append(row)
        print(f"chain rows {m:3d}: plain {times['plain']:.3f} ms, programmatic {times['programmatic']:.3f} ms "
              f"(edges made {reports['programmatic'][0]} of {reports['programmatic'][1]}; same bits {same})", flush=True)  # fmt: skip
    return rows


def names(model: str, regex: str) -> dict[str, Any]:
    import minisgl.engine.graph as graph_mod
    from minisgl import LLM
    from minisgl.env import ENV

    reports = []
    original = graph_mod.make_programmatic

    def record(graph: int, waits: Callable[[str], bool]) -> Any:
        r = original(graph, waits)
        reports.append(r)
        return r

    graph_mod.make_programmatic = record  # type: ignore[assignment]
    ENV.GRAPH_PDL.value = regex or "(?!)"  # the graphs kept and walked; no edge changed without a regex
    llm = LLM(model, max_running_req=256, cache_type="naive", max_seq_len_override=2056)
    del llm
    out = []
    for r in reports:
        out.append({"kernels": r.kernels, "edges": r.edges, "made_programmatic": r.made_programmatic,
                    "names": dict(r.names)})  # fmt: skip
    for r in reports[:3] + reports[-3:]:
        print(
            f"graph: {r.kernels} kernels, {r.edges} edges, {r.made_programmatic} made programmatic",
            flush=True,
        )
        for name, count in r.names.most_common():
            print(f"    {count:4d} {name[:110]}")
    return {"graphs": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="probe,chain,names")
    ap.add_argument("--model", default=None)
    ap.add_argument("--spins", type=int, default=20000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    parts = args.parts.split(",")
    result: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    regex = ""
    if "probe" in parts:
        result["probe"] = probe(args.spins)
        regex = result["probe"]["waiters_regex"]
    if "chain" in parts and (regex or "probe" not in parts):
        result["chain"] = chain(regex)
    if "names" in parts and args.model:
        result["names"] = names(args.model, regex)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
