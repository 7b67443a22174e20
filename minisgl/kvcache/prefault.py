"""Page faults of a CPU KV pool taken ahead of use, on a thread of their own.

A CPU pool is fresh anonymous memory (mha_pool._zeros): it costs nothing until written, and then each
4 KB page costs a fault when a step first stores K/V in it. On the VMs measured here a fault costs
4-10 us (more when the kernel compacts memory for a 2 MB page), so a prompt of 500 tokens of SmolLM2
(11.5 MB of K/V) waited ~25 ms for faults, a 64-row decode step 3.8 ms, and the first run of a process
was a quarter slower than the next. The scheduler hands out pages lowest first and the prefix cache
keeps finished requests' pages, so new K/V keeps landing above the highest page used so far.

The prefaulter keeps a lead of populated memory above that mark: madvise(MADV_POPULATE_WRITE) maps the
pages without changing their contents (Linux 5.14+), so it is safe beside a step that writes the same
pages, and the call runs without the GIL (ctypes), on the core the step does not use or between its
threads' work. Where the call is refused (older kernels), nothing is populated and nothing changes.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import weakref
from collections.abc import Callable

import torch

from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

MADV_POPULATE_WRITE = 23  # <linux/mman.h>; Python's mmap module does not name it
OS_PAGE = 4096
# populated memory kept above the highest page handed out, in bytes of the whole pool (every layer's K
# and V): enough for a burst of prompts, little against the pool's budget
LEAD_BYTES = 32 << 20
# the most pages one pass of the thread populates before it looks at the mark again
CHUNK_BYTES = 4 << 20
# how often an idle thread looks whether its pool is still there
IDLE_CHECK_S = 1.0


def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):  # the advice's number is Linux's own
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class PoolPrefaulter:
    """Populates pages [0, mark + lead) of a pool whose buffers are [layers, pages * page_size, ...]."""

    def __init__(self, buffers: list[torch.Tensor], num_pages: int, page_size: int) -> None:
        self._madvise = _madvise()
        # each buffer's layers, as (base address, bytes per pool page)
        self._regions = [
            (b[i].data_ptr(), b[i].stride(0) * b.itemsize * page_size)
            for b in buffers
            for i in range(b.shape[0])
        ]
        self._buffers = buffers  # the regions' memory, alive as long as the prefaulter
        self.num_pages = num_pages
        pool_page_bytes = sum(step for _, step in self._regions)
        self.lead = max(1, min(num_pages, LEAD_BYTES // max(1, pool_page_bytes)))
        self.chunk = max(1, CHUNK_BYTES // max(1, pool_page_bytes))
        self.populated = 0  # pages [0, populated) are mapped
        self._target = 0
        self._cond = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None
        if self._madvise is not None:
            # the thread holds the prefaulter weakly: a pool dropped without close() is freed, and its
            # thread ends at its next look (IDLE_CHECK_S)
            self._thread = threading.Thread(
                target=_run, args=(weakref.ref(self), self._cond), name="kv-prefault", daemon=True
            )
            self._thread.start()
            self.advance(0)

    def advance(self, page: int) -> None:
        """Page `page` has been handed out: keep the lead above it."""
        if page + self.lead // 2 <= self._target or self._thread is None:
            return
        with self._cond:
            self._target = min(self.num_pages, page + self.lead)
            self._cond.notify()

    def close(self) -> None:
        thread = self._thread
        if thread is None:
            return
        with self._cond:
            self._stopped = True
            self._cond.notify()
        thread.join()
        self._thread = None

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Whether the thread caught up with the mark within `timeout` s (for tests and benchmarks)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self.populated >= self._target or self._stopped or self._thread is None, timeout
            )

    def _populate(self, start: int, end: int) -> bool:
        assert self._madvise is not None
        for base, step in self._regions:
            lo = (base + start * step) // OS_PAGE * OS_PAGE
            hi = base + end * step
            if self._madvise(lo, hi - lo, MADV_POPULATE_WRITE) != 0:
                logger.debug(f"KV pool pages not populated ahead (madvise errno {ctypes.get_errno()})")
                return False
        return True


def _run(ref: weakref.ref[PoolPrefaulter], cond: threading.Condition) -> None:
    while True:
        with cond:
            f = ref()
            if f is None or f._stopped:
                return
            if f.populated >= f._target:
                del f  # not held while waiting: the pool may go meanwhile
                cond.wait(IDLE_CHECK_S)
                continue
            start, end = f.populated, min(f._target, f.populated + f.chunk)
        ok = f._populate(start, end)  # the buffers stay alive through f meanwhile
        with cond:
            if not ok:
                f._thread = None  # refused: stop asking
            else:
                f.populated = end
            cond.notify_all()
        if not ok:
            return
        del f
