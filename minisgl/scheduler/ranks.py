"""The scheduler processes of tensor-parallel ranks other than 0: checked, started and stopped by
whoever runs rank 0 (`LLM` offline, the server launcher online).

Each runs a plain Scheduler whose messages come from rank 0 (`receive_all`), so it builds the same
batches; it never replies. A rank that dies breaks rank 0's next collective, which ends the run with
an error; rank 0's owner then stops the rest.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from minisgl.distributed import DistributedInfo
from minisgl.scheduler.config import SchedulerConfig
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

_STOP_TIMEOUT_S = 10.0


def free_tcp_addr() -> str:
    """A rendezvous address on this machine that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def check_tp(config: SchedulerConfig) -> str:
    """Raise ValueError before any process starts if the model cannot run at this tensor-parallel size;
    returns the model's folder (a GGUF file is converted here, once, for every rank)."""
    import torch

    from minisgl.models import ModelConfig
    from minisgl.utils.hf import load_hf_config, resolve_model_path

    tp, nnodes = config.tp_info.size, config.nnodes
    if tp % nnodes:
        raise ValueError(f"tensor-parallel size {tp} does not spread evenly over {nnodes} nodes")
    model_dir = resolve_model_path(config.model_path)
    ModelConfig.from_hf(load_hf_config(model_dir)).check_tp(tp)
    on_cuda = config.device == "cuda" or (config.device is None and torch.cuda.is_available())
    if on_cuda and tp // nnodes > torch.cuda.device_count():
        raise ValueError(
            f"tensor-parallel size {tp} needs {tp // nnodes} GPUs on each node, but {torch.cuda.device_count()} "
            "are visible; lower the size or add nodes"
        )
    return model_dir


def _rank_main(config: SchedulerConfig, conn: Connection) -> None:
    try:
        from minisgl.scheduler.scheduler import Scheduler
        from minisgl.utils.process import exit_now, init_child_process

        init_child_process()
        # said before the rendezvous, which would wait minutes for a rank that could not even start
        conn.send(("started", None))
        scheduler = Scheduler(config)
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        raise SystemExit(1) from None
    conn.send(("ready", None))
    try:
        scheduler.run_forever()
    except (KeyboardInterrupt, SystemExit):  # rank 0's ExitMsg, or SIGTERM
        code = 0
    except BaseException:  # rank 0 is gone or failed: its collective broke
        logger.exception(f"rank {config.tp_info.rank} stopped")
        code = 1
    from minisgl.utils.trace import TRACE

    TRACE.finish()  # exit_now skips the interpreter's exit hooks
    exit_now(code)


class RankProcesses:
    """Ranks `first`..`last - 1` of `config` as child processes of this one."""

    def __init__(self, config: SchedulerConfig, first: int, last: int) -> None:
        ctx = mp.get_context("spawn")
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        for rank in range(first, last):
            conn, child = ctx.Pipe()
            cfg = replace(config, tp_info=DistributedInfo(rank, config.tp_info.size))
            proc = ctx.Process(
                target=_rank_main, args=(cfg, child), name=f"scheduler-rank{rank}", daemon=True
            )
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(conn)

    def wait_started(self) -> None:
        """Wait until every rank has its imports done and is about to meet the others."""
        self._wait_for("started")

    def wait_ready(self) -> None:
        """Wait until every rank's scheduler is built."""
        self._wait_for("ready")

    def _wait_for(self, wanted: str) -> None:
        """Raise RuntimeError saying which rank failed to start, and why."""
        for proc, conn in zip(self.procs, self.conns):
            status, payload = "started", None
            while status != wanted:
                wait([conn, proc.sentinel])
                status, payload = conn.recv() if conn.poll() else ("failed", f"exit code {proc.exitcode}")
                if status == "failed":
                    raise RuntimeError(f"the {proc.name} process failed to start:\n{payload}")

    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def stop(self) -> None:
        """Wait for the ranks to end (rank 0 has sent them ExitMsg), killing any that does not."""
        for p in self.procs:
            p.join(_STOP_TIMEOUT_S)
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()
        self.procs.clear()
