"""What tensor parallelism's collectives cost on this machine's GPUs: the all-reduce after each
row-parallel linear, the LM head's all-gather of logits and the broadcast of sampled tokens, at decode
sizes, eager and replayed from a CUDA graph (as decode runs them), and the all-reduce through torch's
symmetric memory beside NCCL's. Also whether the GPUs reach each other directly (peer access), which
decides whether NCCL uses NVLink or goes through host memory.

    python benchmark/offline/tp_comm.py [--hidden 4096] [--vocab 128256]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _time(fn, graph: bool, iters: int = 50) -> float:
    """Mean microseconds per call of fn, eager or replayed from a CUDA graph of `iters` calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        g.replay()
        torch.cuda.synchronize()
        start = time.perf_counter()
        g.replay()
    else:
        start = time.perf_counter()
        for _ in range(iters):
            fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def _symm_mem_cases(batch: int, hidden: int) -> dict:
    """The same all-reduce through torch's symmetric memory (peer loads over NVLink, no multicast): one
    pass (each rank reads every rank's buffer) and two (reduce-scatter then all-gather), as candidates for
    the row-parallel all-reduce at decode sizes, where NCCL's ring pays its launch and protocol latency."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD.group_name
        buf = symm_mem.empty((batch, hidden), dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(buf, group)
    except Exception as e:
        return {f"symm_mem [{batch}, {hidden}]: {type(e).__name__} {str(e)[:60]}": lambda: None}
    out = torch.empty_like(buf)
    ops = torch.ops.symm_mem
    return {
        f"symm_mem one-shot all_reduce [{batch}, {hidden}]": lambda: ops.one_shot_all_reduce_out(
            buf, "sum", group, out
        ),
        f"symm_mem two-shot all_reduce [{batch}, {hidden}]": lambda: ops.two_shot_all_reduce_(
            buf, "sum", group
        ),
    }


def _rank(rank: int, world: int, port: int, hidden: int, vocab: int, out: dict) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = []
    for batch in (1, 64, 256):
        x = torch.randn(batch, hidden, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(batch, vocab // world, device="cuda", dtype=torch.bfloat16)
        gathered = torch.empty(world * batch, vocab // world, device="cuda", dtype=torch.bfloat16)
        tokens = torch.zeros(batch, device="cuda", dtype=torch.int64)
        cases = {
            f"all_reduce [{batch}, {hidden}] bf16": lambda x=x: dist.all_reduce(x),
            f"all_gather logits [{batch}, {vocab // world}] bf16": lambda lg=logits, g=gathered: (
                dist.all_gather_into_tensor(g, lg)
            ),
            f"broadcast tokens [{batch}] int64": lambda t=tokens: dist.broadcast(t, src=0),
        }
        cases.update(_symm_mem_cases(batch, hidden))
        for name, fn in cases.items():
            try:
                rows.append((name, _time(fn, False), _time(fn, True)))
            except Exception as e:  # an operator this torch or this machine lacks: say so, measure the rest
                rows.append(
                    (f"{name}: {type(e).__name__} {str(e).splitlines()[0][:60]}", float("nan"), float("nan"))
                )
    if rank == 0:
        out["rows"] = rows
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    args = p.parse_args()
    world = torch.cuda.device_count()
    if world < 2:
        raise SystemExit("needs two GPUs")
    world = 2
    print("peer access 0->1:", torch.cuda.can_device_access_peer(0, 1))
    topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
    print(topo.strip().splitlines()[:4] and "\n".join(topo.strip().splitlines()[:4]))
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    with mp.Manager() as manager:
        out = manager.dict()
        port = 29500 + os.getpid() % 1000
        mp.spawn(_rank, args=(world, port, args.hidden, args.vocab, out), nprocs=world, join=True)
        print(f"{'collective (2 ranks)':<48}{'eager us':>10}{'graph us':>10}")
        for name, eager, graphed in out["rows"]:
            print(f"{name:<48}{eager:>10.1f}{graphed:>10.1f}")


if __name__ == "__main__":
    main()
