"""The "triton" attention backend: paged decode and extend kernels reading the pool through the page table.

The metadata is a few int32 vectors per batch (table row, context length and, for a prefill, where
each request's queries start and how many there are), copied to the device in one transfer. For
CUDA graphs the decode metadata lives in static buffers that each replay refreshes with one
device-to-device copy on the engine's stream, so the scheduler can build the next batch while the
current one still runs.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from minisgl.attention.base import BaseAttnBackend, DecodeRope, KVDestination
from minisgl.core import Batch
from minisgl.env import ENV
from minisgl.kernel import fresh_attention as fresh
from minisgl.kernel.attention import (
    SHORT_QUERIES,
    WIDE_PROGRAMS,
    decode_attention,
    decode_order,
    decode_splits,
    extend_attention,
    ordered_from,
)
from minisgl.kernel.cuda import CudaUnavailable
from minisgl.kernel.cuda.decode import GROUPS as CUDA_GROUPS
from minisgl.kernel.cuda.decode import (
    HEAD_DIM,
    TC_BF16_VARIANTS,
    TC_GROUPS,
    TC_VARIANTS,
    CudaDecode,
    TensorCoreDecode,
)
from minisgl.kernel.store import store_kv
from minisgl.kvcache.mha_pool import FP8_DTYPE, MHAKVCache
from minisgl.utils.logger import init_logger
from minisgl.utils.misc import next_pow2
from minisgl.utils.torch_utils import int_tensor, pin, to_device_async

logger = init_logger(__name__)


@dataclass
class TritonAttnMetadata:
    packed: torch.Tensor  # [2 or 3, B] (decode) or [4, B] (prefill) int32: the rows below, in one tensor
    rows: torch.Tensor  # [B] page-table row of each request
    seq_lens: torch.Tensor  # [B] context length after this step (device_len)
    q_starts: torch.Tensor | None = None  # [B] prefill: packed index of each request's first query
    q_lens: torch.Tensor | None = None  # [B] prefill: queries of each request this step
    max_q_len: int = 1
    num_splits: int = 1  # decode: splits along the sequence
    order: torch.Tensor | None = None  # [B] decode, MINISGL_DECODE_LONGEST_FIRST: the programs' order
    # prefill: a mixed step's decode rows (Batch.num_decode_rows), for the decode kernels; the fields above are then
    # those of the requests before them
    decode: TritonAttnMetadata | None = None
    # prefill, where the fresh-prompt kernel is on: every request's context is this step's tokens (no cached prefix)
    fresh: bool = False


def _cuda_decode_wanted(kv_cache: MHAKVCache, device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and bool(ENV.DECODE_CUDA.value)
        and kv_cache.head_dim == HEAD_DIM
        and kv_cache.dtype in (torch.bfloat16, FP8_DTYPE)
    )


def _cuda_decode(kv_cache: MHAKVCache, device: torch.device, group: int | None = None) -> CudaDecode | None:
    """The CUDA C++ decode kernel for this pool, where it applies and NVRTC and the driver can give it; for a
    model whose query heads a KV head (`group`) are known, compiled for that group only, or not at all where it
    never takes it."""
    if not _cuda_decode_wanted(kv_cache, device) or (group is not None and group not in CUDA_GROUPS):
        return None
    groups = CUDA_GROUPS if group is None else (group,)
    try:
        return CudaDecode(kv_cache.dtype == FP8_DTYPE, device.index or 0, groups=groups)
    except CudaUnavailable as e:
        logger.info_rank0(f"decode attention by the Triton kernel only: {e}")
        return None


def _fresh_prefill(device: torch.device) -> bool:
    """Whether prefill steps of fresh prompts take fresh_attention.py's kernel (MINISGL_FRESH_PREFILL)."""
    mode = int(ENV.FRESH_PREFILL.value)
    if mode < 0:  # measured on Hopper, where the descriptors' boxes come in through the copy engine
        cuda = device.type == "cuda" and torch.cuda.is_available()
        return cuda and torch.cuda.get_device_capability(device) >= (9, 0)
    return mode > 0


def _tensor_core_decode(
    kv_cache: MHAKVCache, device: torch.device, group: int | None = None
) -> TensorCoreDecode | None:
    """The tensor-core decode kernel for this pool (FP8 or bf16; the query groups of TC_GROUPS), where it is asked
    for and the model's `group` (where known) is one of them; then compiled for that group only (NVRTC takes
    about 0.4 s a kernel on a 2-core machine, once a machine)."""
    if not (_cuda_decode_wanted(kv_cache, device) and ENV.DECODE_TENSOR_CORES.value):
        return None
    if group is not None and group not in TC_GROUPS:
        return None
    fp8 = kv_cache.dtype == FP8_DTYPE
    variants = TC_VARIANTS if fp8 else TC_BF16_VARIANTS
    groups = TC_GROUPS if group is None else (group,)
    try:
        return TensorCoreDecode(
            device.index or 0, variants, groups, fp8=fp8, rope=bool(ENV.TC_DECODE_ROPE.value)
        )
    except CudaUnavailable as e:
        logger.info_rank0(f"decode attention without the tensor-core kernel: {e}")
    return None


class TritonAttnBackend(BaseAttnBackend):
    supports_cuda_graphs = True
    takes_padded_prefill = True

    def __init__(
        self,
        kv_cache: MHAKVCache,
        page_table: torch.Tensor,
        device: torch.device,
        group: int | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.page_table = page_table
        self.device = device
        self.scale = kv_cache.head_dim**-0.5
        # each layer's K and V pools and scales as views made once (every step asks for them layer by layer);
        # the scales are device views, so a captured graph reads them, not a copy of their values
        self.layer_views = [
            (kv_cache.k_cache(i), kv_cache.v_cache(i), *kv_cache.scales(i))
            for i in range(kv_cache.num_layers)
        ]
        # read once, so that the graphs and every step's metadata agree on it
        self.order_from = int(ENV.DECODE_LONGEST_FIRST.value)
        self.splits_mixed_steps = bool(ENV.MIXED_DECODE_SPLIT.value)
        self.graph_meta: torch.Tensor | None = None  # [2 or 3, max_bs] static decode metadata of the graphs
        # the tensor-core kernel takes its groups at every batch, so for a model whose group is known decode.cu's
        # module is compiled only where the tensor-core one is not
        self.tc_decode = _tensor_core_decode(kv_cache, device, group)
        self.cuda_decode = (
            None
            if self.tc_decode is not None and group is not None
            else _cuda_decode(kv_cache, device, group)
        )
        self.prefill_meta: torch.Tensor | None = None  # [4, max_reqs] static prefill metadata
        self.fresh_prefill = _fresh_prefill(device)

    def prepare_metadata(self, batch: Batch) -> None:
        reqs = batch.padded_reqs
        rows = [r.table_idx for r in reqs]
        lens = [r.device_len for r in reqs]
        if batch.is_decode:
            batch.attn_metadata = self._decode_metadata(rows, lens)
            return
        decode = None
        # a prefill graph's replay keeps its static metadata
        decoding = batch.num_decode_rows if self.splits_mixed_steps and not batch.padded_tokens else 0
        if decoding:
            split = len(reqs) - decoding
            decode = self._decode_metadata(rows[split:], lens[split:])
            reqs, rows, lens = reqs[:split], rows[:split], lens[:split]
        pad = [0] * (-len(reqs) % 4)  # as _decode_metadata pads
        q_lens = [r.extend_len for r in reqs]
        q_starts, total = [], 0
        for n in q_lens:
            q_starts.append(total)
            total += n
        host = torch.tensor(
            [rows + pad, lens + pad, q_starts + pad, q_lens + pad],
            dtype=torch.int32,
            pin_memory=pin(self.device),
        )
        packed = host.to(self.device, non_blocking=True)[:, : len(reqs)]
        batch.attn_metadata = TritonAttnMetadata(
            packed,
            packed[0],
            packed[1],
            packed[2],
            packed[3],
            max_q_len=max(q_lens),
            decode=decode,
            # steps of short prompts keep the extend kernel's short tiles (as fast or faster there)
            fresh=self.fresh_prefill and lens == q_lens and max(q_lens) > SHORT_QUERIES,
        )

    def _decode_metadata(self, rows: list[int], lens: list[int]) -> TritonAttnMetadata:
        """A decode step's metadata (rows and context lengths, the programs' order where ordered) in one copy."""
        # rows padded to 4 ints keep every row of `packed` 16-byte aligned: Triton specialises pointer
        # arguments on that alignment, and without the padding each batch size modulo 4 compiles anew
        pad = [0] * (-len(rows) % 4)
        flat, num = rows + pad + lens + pad, 2
        if self.ordered(len(rows)):
            flat, num = flat + decode_order(lens) + pad, 3
        host = int_tensor(flat, torch.int32).view(num, -1)
        packed = to_device_async(host, self.device)[:, : len(rows)]
        return TritonAttnMetadata(
            packed,
            packed[0],
            packed[1],
            order=packed[2] if num == 3 else None,
            num_splits=decode_splits(len(rows), self.kv_cache.num_kv_heads),
        )

    def ordered(self, batch_size: int) -> bool:
        """Whether a decode batch of this size starts its programs longest context first."""
        return ordered_from(batch_size, self.order_from)

    def decode_variant(self, batch_size: int) -> Hashable:
        # what decode_attention's constexprs follow (tiles, split or not, the merge's block, the order, the
        # rotary inside), and the split count where Triton specialises an integer: equal to 1 or divisible by 16
        hk = self.kv_cache.num_kv_heads
        splits = decode_splits(batch_size, hk)
        return (
            batch_size * hk >= WIDE_PROGRAMS,
            next_pow2(splits),
            splits % 16 == 0,
            self.ordered(batch_size),
            batch_size <= ENV.FUSED_DECODE_ROPE.value or self.tc_rope(batch_size),
            self.cuda_decode is not None and self.cuda_decode.variant(batch_size),
            self.tc_decode is not None and self.tc_decode.variant(batch_size),
        )

    def tc_rope(self, batch_size: int) -> bool:
        """Whether a decode batch of this size above FUSED_DECODE_ROPE rows may take the rotation inside the
        tensor-core kernel (up to TC_DECODE_ROPE rows: above, its programs' extra latency costs more than the rotary
        kernel's launch)."""
        return (
            self.tc_decode is not None
            and self.tc_decode.rope
            and ENV.FUSED_DECODE_ROPE.value < batch_size <= ENV.TC_DECODE_ROPE.value
        )

    def fuses_decode_rope(self, batch: Batch, q: torch.Tensor) -> bool:
        if not batch.is_decode or ENV.SEPARATE_KV_STORE.value:
            return False
        if batch.size > ENV.FUSED_DECODE_ROPE.value:
            # the tensor-core kernel's `_rope` kernels, where they take this model's heads: checked on the step's
            # own tensors by forward_decode_rope, which otherwise rotates as the layer would have
            tc = self.tc_decode
            return tc is not None and self.tc_rope(batch.size) and tc.applies(q, self.layer_views[0][0])
        # the kernel's tiles are the head dim wide (at least 16: tl.dot's least K), and it rotates in q's
        # dtype as the rotary kernel does
        d = self.kv_cache.head_dim
        return d >= 16 and d & (d - 1) == 0 and self.kv_cache.attention_dtype(q.dtype) == q.dtype

    def forward_decode_rope(
        self, q: torch.Tensor, layer_id: int, batch: Batch, rope: DecodeRope
    ) -> torch.Tensor:
        if batch.size > ENV.FUSED_DECODE_ROPE.value:
            k_cache = self.layer_views[layer_id][0]
            params = self.tc_decode.rope_params(rope, q, k_cache) if self.tc_decode is not None else None
            if params is None:
                return self._rope_then_decode(q, layer_id, batch, rope)
            return self._decode(q, layer_id, batch, tc_rope=params)
        return self._decode(q, layer_id, batch, rope)

    def _rope_then_decode(
        self, q: torch.Tensor, layer_id: int, batch: Batch, rope: DecodeRope
    ) -> torch.Tensor:
        """The rotary kernel's work as its own launch (the layer's path), for a step the fused kernel cannot take."""
        from minisgl.kernel.rotary import apply_rotary

        norms = (rope.q_weight, rope.k_weight, rope.eps) if rope.q_weight is not None else None
        k_cache, v_cache, k_scale, v_scale = self.layer_views[layer_id]
        dest = KVDestination(k_cache, v_cache, rope.loc, k_scale, v_scale)
        apply_rotary(rope.positions, q, rope.k, rope.cos_sin, norms, rope.v, dest, row_scale=rope.row_scale)
        return self._decode(q, layer_id, batch)

    def _decode(
        self,
        q: torch.Tensor,
        layer_id: int,
        batch: Batch,
        rope: DecodeRope | None = None,
        meta: TritonAttnMetadata | None = None,
        tc_rope: tuple[Any, ...] | None = None,
    ) -> torch.Tensor:
        """`meta`: a mixed step's decode rows' (their part of q); None: the decode step's. `rope`: the rotary work
        inside Triton's decode kernel; `tc_rope`: inside the tensor-core kernel (its `rope_params`)."""
        meta = batch.attn_metadata if meta is None else meta
        assert meta is not None
        k_cache, v_cache, k_scale, v_scale = self.layer_views[layer_id]
        # the arguments both kernels take, in their order
        args = (q, k_cache, v_cache, self.page_table, meta.rows, meta.seq_lens, meta.num_splits, self.scale)
        if tc_rope is not None:
            assert self.tc_decode is not None
            return self.tc_decode(*args, k_scale, v_scale, order=meta.order, rope=tc_rope)
        if rope is None:
            for kernel in (self.tc_decode, self.cuda_decode):  # the tensor cores first where they apply
                if kernel is not None and kernel.applies(q, k_cache):
                    return kernel(*args, k_scale, v_scale, order=meta.order)
        return decode_attention(*args, k_scale, v_scale, rope, meta.order)

    def kv_destination(self, layer_id: int, batch: Batch) -> KVDestination | None:
        if ENV.SEPARATE_KV_STORE.value:
            return None
        k_cache, v_cache, k_scale, v_scale = self.layer_views[layer_id]
        return KVDestination(k_cache, v_cache, batch.out_loc, k_scale, v_scale)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: Batch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        meta: TritonAttnMetadata = batch.attn_metadata
        k_cache, v_cache, k_scale, v_scale = self.layer_views[layer_id]
        if not kv_stored:
            # the store casts (and for FP8 scales) to the pool's dtype
            store_kv(k, v, k_cache, v_cache, batch.out_loc, k_scale, v_scale)
        out_dtype = q.dtype
        q = q.to(self.kv_cache.attention_dtype(q.dtype))
        if batch.is_decode:
            return self._decode(q, layer_id, batch).to(out_dtype)
        assert meta.q_starts is not None and meta.q_lens is not None
        decode = meta.decode
        tail = None
        if decode is not None:
            # the decode rows are the packed batch's last tokens, one a request
            tail = self._decode(q[q.shape[0] - decode.rows.shape[0] :], layer_id, batch, meta=decode)
            q = q[: q.shape[0] - decode.rows.shape[0]]
        if meta.fresh and fresh.takes(q, k, v):
            # the step's own K/V rows (rotated, and scaled by a folded norm, in place) are the whole context
            out = fresh.fresh_attention(q, k, v, meta.q_starts, meta.q_lens, meta.max_q_len, self.scale)
            if tail is not None:
                out = torch.cat([out, tail.to(out.dtype)])
            return out.to(out_dtype)
        out = extend_attention(
            q,
            k_cache,
            v_cache,
            self.page_table,
            meta.rows,
            meta.seq_lens,
            meta.q_starts,
            meta.q_lens,
            meta.max_q_len,
            self.scale,
            k_scale,
            v_scale,
        )
        if tail is not None:
            out = torch.cat([out, tail.to(out.dtype)])
        return out.to(out_dtype)

    # ---- CUDA graphs ---------------------------------------------------------------------------
    def init_capture_graph(self, max_seq_len: int, bs_list: list[int]) -> None:
        # rows, lengths and (when the graphs are captured ordered) the programs' order
        rows = 3 if self.order_from > 0 else 2
        self.graph_meta = torch.zeros((rows, max(bs_list)), dtype=torch.int32, device=self.device)

    def _static_metadata(self, bs: int) -> TritonAttnMetadata:
        assert self.graph_meta is not None, "init_capture_graph comes first"
        meta = self.graph_meta
        return TritonAttnMetadata(
            meta[:, :bs],
            meta[0, :bs],
            meta[1, :bs],
            order=meta[2, :bs] if self.ordered(bs) else None,
            num_splits=decode_splits(bs, self.kv_cache.num_kv_heads),
        )

    def prepare_for_capture(self, batch: Batch) -> None:
        bs = batch.padded_size
        assert self.graph_meta is not None, "init_capture_graph comes first"
        # the dummy request's row and length: the warm-up run before capture reads real values
        self.graph_meta[0, :bs] = batch.padded_reqs[0].table_idx
        self.graph_meta[1, :bs] = batch.padded_reqs[0].device_len
        if self.order_from > 0:
            self.graph_meta[2, :bs] = torch.arange(bs, dtype=torch.int32, device=self.device)
        batch.attn_metadata = self._static_metadata(bs)

    def prepare_for_replay(self, batch: Batch) -> None:
        assert self.graph_meta is not None, "init_capture_graph comes first"
        meta: TritonAttnMetadata = batch.attn_metadata
        # the order's row only where the batch's size is ordered (the graph of that size reads it)
        self.graph_meta[: meta.packed.shape[0], : batch.padded_size].copy_(meta.packed)

    # ---- prefill graphs: rows, context lengths, query starts and counts of max_reqs requests -------
    def init_prefill_capture(self, max_reqs: int) -> None:
        self.prefill_meta = torch.zeros((4, max_reqs), dtype=torch.int32, device=self.device)

    def prepare_for_prefill_capture(self, batch: Batch, tokens: int) -> None:
        meta = self.prefill_meta
        assert meta is not None, "init_prefill_capture comes first"
        # no queries while capturing: the extend kernel's programs return at once; the grid is fixed by
        # `tokens`, the most queries one request of a replay may have
        meta[0] = batch.padded_reqs[0].table_idx
        meta[1] = 1
        meta[2:] = 0
        batch.attn_metadata = TritonAttnMetadata(meta, meta[0], meta[1], meta[2], meta[3], max_q_len=tokens)

    def prepare_for_prefill_replay(self, batch: Batch) -> None:
        assert self.prefill_meta is not None, "init_prefill_capture comes first"
        meta: TritonAttnMetadata = batch.attn_metadata
        self.prefill_meta.copy_(meta.packed)
