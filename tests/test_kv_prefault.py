"""A CPU KV pool maps its memory ahead of the pages the scheduler hands out (kvcache/prefault.py).

Residency is read with mincore(2): a page of fresh anonymous memory is not resident until written or
populated. The thread must keep its lead above the highest page handed out, never change what a step
wrote (it may populate pages a step is writing), and stop with the engine.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import weakref

import pytest
import torch
from tiny import assert_nothing_held, build_model

from minisgl.core import SamplingParams
from minisgl.kvcache import prefault
from minisgl.kvcache.mha_pool import MHAKVCache
from minisgl.llm import LLM
from minisgl.scheduler.cache import CacheManager

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]

pytestmark = pytest.mark.skipif(
    prefault._madvise() is None or LIBC.madvise(0, 0, prefault.MADV_POPULATE_WRITE) != 0,
    reason="MADV_POPULATE_WRITE needs Linux 5.14",
)


def resident(t: torch.Tensor, first: int, end: int) -> list[bool]:
    """Whether each OS page of t's rows [first, end) is resident."""
    row = t.stride(0) * t.itemsize
    lo = (t.data_ptr() + first * row) // prefault.OS_PAGE * prefault.OS_PAGE
    hi = t.data_ptr() + end * row
    pages = (hi - lo + prefault.OS_PAGE - 1) // prefault.OS_PAGE
    out = ctypes.create_string_buffer(pages)
    assert LIBC.mincore(lo, hi - lo, out) == 0, ctypes.get_errno()
    return [bool(b & 1) for b in out.raw]


def pool(num_pages: int, page_size: int = 1) -> MHAKVCache:
    # 4 layers, one KV head of 64 float32: 256 bytes a slot and layer
    return MHAKVCache(4, num_pages, page_size, 1, 64, torch.float32, torch.device("cpu"))


def fresh_buffer(layers: int, slots: int) -> torch.Tensor:
    """[layers, slots, 1, 64] float32 in fresh anonymous memory that no huge page backs: a page is resident
    exactly when it was written or populated (the heap may hand out resident memory; a huge page maps 2 MB)."""
    area = mmap.mmap(-1, layers * slots * 256, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(area, dtype=torch.float32).view(layers, slots, 1, 64)


def test_the_pool_is_mapped_ahead_of_the_highest_page_handed_out_and_no_further(monkeypatch) -> None:
    monkeypatch.setattr(prefault, "LEAD_BYTES", 256 << 10)  # 128 pages of 2 KB
    monkeypatch.setattr(prefault, "CHUNK_BYTES", 64 << 10)
    # 4 layers of K and V, 256 bytes a slot and layer: 2 KB of the pool a page of one slot
    buffers = [fresh_buffer(4, 1024), fresh_buffer(4, 1024)]
    f = prefault.PoolPrefaulter(buffers, num_pages=1024, page_size=1)
    try:
        assert f.lead == 128
        assert f.wait_idle()
        assert f.populated == 128
        for buf in buffers:
            for layer in range(4):
                assert all(resident(buf[layer], 0, 128)), layer
                assert not any(resident(buf[layer], 136, 1024)), layer
        f.advance(40)  # within the lead's first half: nothing to do
        assert f.wait_idle() and f.populated == 128
        f.advance(500)
        assert f.wait_idle() and f.populated == 628
        assert all(resident(buffers[1][3], 128, 628)) and not any(resident(buffers[1][3], 640, 1024))
        f.advance(1000)
        assert f.wait_idle() and f.populated == 1024  # the lead stops at the pool's end
        assert all(resident(buffers[0][2], 0, 1024))
    finally:
        f.close()
    assert f._thread is None


def test_populating_keeps_what_a_step_already_wrote(monkeypatch) -> None:
    monkeypatch.setattr(prefault, "LEAD_BYTES", 64 << 10)
    kv = pool(512, page_size=4)
    try:
        assert kv.prefaulter is not None and kv.prefaulter.wait_idle()
        start = kv.prefaulter.populated * 4
        # K/V written above the mapped pages, then the pages around them populated
        slots = torch.arange(start + 3, start + 200, 7)
        k, v = torch.randn(len(slots), 1, 64), torch.randn(len(slots), 1, 64)
        for layer in range(4):
            kv.store_kv(k + layer, v - layer, slots, layer)
        kv.will_use(511)
        assert kv.prefaulter.wait_idle() and kv.prefaulter.populated == 512
        for layer in range(4):
            assert torch.equal(kv.k_cache(layer)[slots], k + layer)
            assert torch.equal(kv.v_cache(layer)[slots], v - layer)
            others = torch.ones(kv.k_cache(layer).shape[0], dtype=torch.bool)
            others[slots] = False
            assert not kv.k_cache(layer)[others].any()
    finally:
        kv.close()


def test_the_cache_manager_reports_each_new_highest_page_once() -> None:
    seen: list[int] = []
    cm = CacheManager(64, 1, torch.zeros(4, 64, dtype=torch.int32), "naive", will_use=seen.append)
    assert [cm._take_pages(1)[0] for _ in range(3)] == [0, 1, 2] and seen == [0, 1, 2]
    assert cm._take_pages(2) == [3, 4] and seen == [0, 1, 2, 4]
    cm._free([4, 2])
    assert cm._take_pages(3) == [2, 4, 5]
    assert cm._take_pages(1) == [6]
    assert seen == [0, 1, 2, 4, 5, 6]


def test_an_engine_maps_its_pool_ahead_and_stops_the_thread_at_shutdown(tmp_path) -> None:
    folder = build_model(str(tmp_path), "llama")
    llm = LLM(folder, max_running_req=4)
    f = llm.engine.kv_cache.prefaulter
    try:
        assert f is not None and f._thread is not None
        out = llm.generate([[3, 4, 5, 6]] * 4, SamplingParams(max_tokens=8, ignore_eos=True))
        assert all(len(o["token_ids"]) == 8 for o in out)
        assert f.wait_idle() and f.populated > 0
        assert_nothing_held(llm)
    finally:
        llm.shutdown()
    assert f._thread is None


def test_a_pool_dropped_without_close_is_freed_and_its_thread_ends(monkeypatch) -> None:
    monkeypatch.setattr(prefault, "IDLE_CHECK_S", 0.05)
    kv = pool(256)
    assert kv.prefaulter is not None and kv.prefaulter.wait_idle()
    thread, alive = kv.prefaulter._thread, weakref.ref(kv.prefaulter)
    assert thread is not None and thread.is_alive()
    del kv
    gc.collect()
    assert alive() is None  # the thread does not keep the pool's memory
    thread.join(timeout=5)
    assert not thread.is_alive()
