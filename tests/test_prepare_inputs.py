"""A decode step's host-built inputs, packed into one tensor and one copy: the same values as the per-tensor
builders give, each part 16-byte aligned (Triton specialises pointer arguments on it), and the Triton attention
backend's decode metadata as before (rows, context lengths, the longest-first order)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from minisgl.attention.triton_backend import TritonAttnBackend
from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.prepare import make_decode_inputs, make_input_tuple, make_positions, make_write_tuple
from minisgl.kernel.attention import decode_order
from minisgl.utils.torch_utils import int_tensor

CPU = torch.device("cpu")


def decode_batch(n: int, pad: int, seed: int) -> Batch:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = rng.randint(1, 50)
        out = rng.randint(1, 20)
        req = Req(
            input_ids=list(range(prompt)),
            table_idx=rng.randrange(300),
            cached_len=0,
            output_len=out,
            uid=i,
            sampling_params=SamplingParams(),
            cache_handle=None,
            seed=0,
        )
        # a decode step: everything but the last token computed, some rows at their last token
        req.cached_len = req.device_len - 1
        if i % 5 == 0:
            req.max_device_len = req.device_len
        reqs.append(req)
    batch = Batch(reqs, "decode")
    dummy = Req(
        input_ids=[0], table_idx=0, cached_len=0, output_len=1, uid=-1, sampling_params=SamplingParams(),
        cache_handle=None, seed=0,
    )  # fmt: skip
    batch.padded_reqs = reqs + [dummy] * pad
    return batch


def aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


@pytest.mark.parametrize("n,pad", [(1, 0), (3, 0), (5, 3), (8, 0), (77, 3), (256, 0)])
def test_a_decode_steps_packed_inputs_equal_the_tensors_built_apart(n: int, pad: int) -> None:
    batch = decode_batch(n, pad, seed=n)
    positions, (rows, pos2), (write_rows, write_cols) = make_decode_inputs(batch, CPU)
    assert pos2 is positions
    expected_positions = make_positions(batch, CPU)
    batch.positions = expected_positions
    expected_rows, _ = make_input_tuple(batch, CPU)
    expected_write = make_write_tuple(batch, CPU)
    assert torch.equal(positions, expected_positions)
    assert torch.equal(rows, expected_rows)
    assert torch.equal(write_rows, expected_write[0]) and torch.equal(write_cols, expected_write[1])
    if n > 5:  # rows at their length (every fifth) are not written, the others are
        assert (write_cols == -1).any() and (write_cols >= 0).any()
    assert all(aligned(t) for t in (positions, rows, write_rows, write_cols))


@pytest.mark.parametrize("n,order_from", [(1, 0), (6, 32), (40, 32), (256, 32)])
def test_the_triton_backends_decode_metadata_holds_rows_lengths_and_order(n: int, order_from: int) -> None:
    backend = object.__new__(TritonAttnBackend)
    backend.device, backend.order_from = CPU, order_from
    backend.kv_cache = SimpleNamespace(num_kv_heads=8)
    batch = decode_batch(n, 0, seed=100 + n)
    backend.prepare_metadata(batch)
    meta = batch.attn_metadata
    lens = [r.device_len for r in batch.padded_reqs]
    assert meta.rows.tolist() == [r.table_idx for r in batch.padded_reqs]
    assert meta.seq_lens.tolist() == lens
    if 0 < order_from <= n:
        assert meta.order is not None and meta.order.tolist() == decode_order(lens)
    else:
        assert meta.order is None
    assert meta.packed.dtype == torch.int32
    # every row of the packed metadata starts 16-byte aligned
    assert all(aligned(meta.packed[i]) for i in range(meta.packed.shape[0]))


def test_int_tensor_is_torch_tensor_of_the_same_ints() -> None:
    values = [0, 1, -1, 2**40, -(2**40), 7]
    assert torch.equal(int_tensor(values), torch.tensor(values, dtype=torch.int64))
    small = [0, 1, -1, 2**31 - 1, -(2**31)]
    assert torch.equal(int_tensor(small, torch.int32), torch.tensor(small, dtype=torch.int32))
    assert int_tensor([]).shape == (0,) and int_tensor([], torch.int32).dtype == torch.int32
    with pytest.raises(OverflowError):
        int_tensor([2**31], torch.int32)
