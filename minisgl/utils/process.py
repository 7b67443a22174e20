"""The set-up every child process runs (the server's, and the tensor-parallel ranks): signals, no orphans,
a fast exit. It needs no ZMQ, so ranks start where only torch is installed."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from typing import Any, NoReturn


def _raise_exit(signum: int, frame: Any) -> None:
    # once only: a second SIGTERM while the first one unwinds ends the process without a traceback
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise SystemExit(0)


def exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C does, through every `finally`, instead of killing the process outright."""
    signal.signal(signal.SIGTERM, _raise_exit)


def exit_now(code: int) -> NoReturn:
    """End a child process without the interpreter's teardown, which spends seconds collecting torch's
    and transformers' objects when nothing is left to save."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def init_child_process() -> None:
    """Signals of a server child: its parent decides when it stops, and it never outlives the parent."""
    # Ctrl-C in a terminal reaches the whole process group; the parent shuts the children down in order
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_on_sigterm()
    # tqdm's default lock is a multiprocessing semaphore, which a child that ends with exit_now never
    # unregisters: the resource tracker would then warn of a leak at shutdown. A thread lock will do.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    if sys.platform.startswith("linux"):
        parent = os.getppid()
        pr_set_pdeathsig = 1
        # the kernel sends SIGTERM when the parent dies, even by SIGKILL: no orphans
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the call above
            raise SystemExit(0)


def release_free_memory() -> None:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim; nothing elsewhere).

    Without it a process keeps its peak size for good: the activations of a large batch stay mapped
    after they are freed, and a process's memory cannot be told from a leak.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()
