"""A decode step's host-built inputs, packed into one tensor and one copy: the same values as the per-tensor
builders give, each part 16-byte aligned (Triton specialises pointer arguments on it), and the Triton attention
backend's decode metadata as before (rows, context lengths, the longest-first order)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

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


@pytest.mark.parametrize("n,pad", [(1, 0), (3, 0), (5, 3), (8, 0), (77, 3), (256, 0), (2, 1)])
@pytest.mark.parametrize("with_slots", [False, True])
def test_a_decode_steps_packed_inputs_equal_the_tensors_built_apart(
    n: int, pad: int, with_slots: bool
) -> None:
    batch = decode_batch(n, pad, seed=n)
    slots = [1000 + 3 * i for i in range(n)] if with_slots else None
    positions, (rows, pos2), (write_rows, write_cols), out_loc, packed = make_decode_inputs(
        batch, CPU, slots, 77
    )
    assert pos2 is positions
    # a decode graph of this size reads its rows and positions where DecodeGraphInputs.views puts them
    p = batch.padded_size
    q = p + p % 2
    assert torch.equal(packed[:p], rows) and torch.equal(packed[q : q + p], positions)
    if with_slots:
        assert out_loc is not None and out_loc.data_ptr() == packed[2 * q :].data_ptr()
    assert rows.data_ptr() == packed.data_ptr()
    expected_positions = make_positions(batch, CPU)
    batch.positions = expected_positions
    expected_rows, _ = make_input_tuple(batch, CPU)
    expected_write = make_write_tuple(batch, CPU)
    assert torch.equal(positions, expected_positions)
    assert torch.equal(rows, expected_rows)
    assert torch.equal(write_rows, expected_write[0]) and torch.equal(write_cols, expected_write[1])
    if n > 5:  # rows at their length (every fifth) are not written, the others are
        assert (write_cols == -1).any() and (write_cols >= 0).any()
    parts = (positions, rows, write_rows, write_cols) + ((out_loc,) if with_slots else ())
    assert all(aligned(t) for t in parts)
    if with_slots:  # each request's slot, then the scratch slot for every padding row
        assert out_loc is not None and out_loc.tolist() == [*(slots or []), *[77] * pad]
    else:
        assert out_loc is None


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


def test_a_decode_steps_host_calls_on_the_cuda_paths_code(
    tiny_model: Callable[[str], str], tmp_path: Any
) -> None:
    """benchmark/offline/host_ops.py in a process of its own (it runs the CUDA path's code under Triton's
    interpreter, and the step replays an emulated decode graph): with a slot a page the step's slots come with
    its other inputs, one copy for them and one for the attention metadata, and no gather of the slots from the
    page table; the replay copies the step's inputs in at once and gathers nothing outside the graph."""
    out = tmp_path / "ops.json"
    script = os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "benchmark", "offline", "host_ops.py"
    )
    args = ["--requests", "4", "--graphs", "--model", tiny_model("qwen3"), "--json", str(out)]
    subprocess.run([sys.executable, script, *args], check=True, capture_output=True, timeout=600)
    counts = json.loads(out.read_text())
    assert "KV pages" not in counts  # nothing of its own to the device
    prepare = counts["engine.prepare_batch"]
    assert prepare["host-to-device copy"] == 2 and "torch index" not in prepare
    assert prepare["torch index_put_"] == 1
    launch = counts["launch (less the model)"]
    assert launch["triton _sample_chunk_kernel"] == launch["triton _sample_merge_kernel"] == 1
    # the step's inputs and the attention metadata: a copy each; the token ids gathered inside the graph
    assert launch["graph replay"] == 1 and launch["torch copy_"] == 2 and "torch index" not in launch
    # 27 when measured (32 with three input buffers and the gather before the replay; without the replay 23,
    # 36 before the slots came with the inputs and the sampler's views were made once)
    assert sum(sum(c.values()) for c in counts.values()) <= 27
