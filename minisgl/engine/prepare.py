"""The tensors of one step: positions, where inputs come from and samples go, and the last token of each prompt."""

from __future__ import annotations

from typing import NamedTuple

import torch

from minisgl.core import Batch
from minisgl.engine.sample import BatchSamplingArgs
from minisgl.utils.torch_utils import int_tensor, pin, to_device_async

Indice2D = tuple[torch.Tensor, torch.Tensor]


class ForwardInput(NamedTuple):
    batch: Batch
    sample_args: BatchSamplingArgs
    input_mapping: Indice2D
    write_mapping: Indice2D


def _lens(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    reqs = batch.padded_reqs
    starts = torch.tensor([r.cached_len for r in reqs], dtype=torch.int64)
    lens = torch.tensor([r.extend_len for r in reqs], dtype=torch.int64)
    return starts, lens


def _pad(t: torch.Tensor, n: int, value: int) -> torch.Tensor:
    return torch.cat([t, t.new_full((n - t.shape[0],), value)]) if n > t.shape[0] else t


def make_positions(batch: Batch, device: torch.device) -> torch.Tensor:
    """[cached_len, device_len) of every request, packed into one dimension (a prefill padded for its
    graph: position 0 for every padding token)."""
    starts, lens = _lens(batch)
    if batch.is_decode:
        return to_device_async(starts, device)
    offsets = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    pos = torch.arange(int(lens.sum())) - offsets + torch.repeat_interleave(starts, lens)
    return to_device_async(_pad(pos, batch.padded_tokens, 0), device)


def make_input_tuple(batch: Batch, device: torch.device, pad_row: int = 0) -> Indice2D:
    """(row, position) of every input token: the input comes from the token pool, its KV slot from the page table.

    A prefill padded for its graph gives its padding tokens row `pad_row` (the dummy row: every slot of
    it is the scratch slot, so their K/V land where no request reads)."""
    rows = torch.tensor([r.table_idx for r in batch.padded_reqs], dtype=torch.int64)
    if not batch.is_decode:  # a decode step has one input a row: nothing to repeat
        rows = _pad(torch.repeat_interleave(rows, _lens(batch)[1]), batch.padded_tokens, pad_row)
    return to_device_async(rows, device), batch.positions


def make_write_tuple(batch: Batch, device: torch.device) -> Indice2D:
    """The sampled token is written to token_pool[table_idx, device_len], the next step's input position.

    A column of -1 means do not write: a chunked request, or one that can no longer generate
    (writing -1 lands in the last column, harmlessly). The scheduler advances device_len only after
    the forward pass, so the value read here is exactly the new token's position.
    """
    rows = torch.tensor([r.table_idx for r in batch.reqs], dtype=torch.int64, pin_memory=pin(device))
    cols = torch.tensor(
        [r.device_len if r.can_decode else -1 for r in batch.reqs], dtype=torch.int64, pin_memory=pin(device)
    )
    return rows.to(device, non_blocking=True), cols.to(device, non_blocking=True)


class DecodeInputs(NamedTuple):
    positions: torch.Tensor  # [padded] int64
    input_mapping: Indice2D
    write_mapping: Indice2D
    # with the step's slots given: [padded] int64, each row's KV slot (padding rows: the scratch slot)
    out_loc: torch.Tensor | None
    # all of the above in one int64 tensor: the input rows from 0, the positions from q = padded rounded up to
    # even, the slots (when given) from 2q, then the write columns (a decode graph copies it into its static
    # buffer at once and reads its parts there)
    packed: torch.Tensor


def make_decode_inputs(
    batch: Batch, device: torch.device, slots: list[int] | None = None, scratch: int = 0
) -> DecodeInputs:
    """A decode step's positions, input mapping and write mapping (what make_positions, make_input_tuple and
    make_write_tuple give; the engine uses those for prefills) from one host tensor and one copy: each small
    tensor built and copied apart cost the host tens of microseconds, every step. A graph batch's padding rows
    come after its requests. `slots`: the KV slot of each request's position (a slot a page), which come along
    in the same copy, the padding rows' the `scratch` slot."""
    padded, n = batch.padded_reqs, batch.size
    p = len(padded)
    # each part starts 16-byte aligned, as a tensor of its own would: Triton specialises pointer arguments on it
    gap = [0] * (p % 2)
    q = p + len(gap)
    rows = [r.table_idx for r in padded]
    # no chunked request decodes: a row can decode while below its length (Req.can_decode)
    cols = [r.device_len if r.device_len < r.max_device_len else -1 for r in batch.reqs]
    # rows, positions and slots at fixed offsets for a batch size (a decode graph reads them there), the
    # write columns last
    flat = rows + gap + [r.cached_len for r in padded] + gap
    if slots is not None:
        flat += slots + [scratch] * (p - n) + gap
    w = len(flat)
    packed = to_device_async(int_tensor(flat + cols), device)
    positions = packed[q : q + p]
    out_loc = packed[2 * q : 2 * q + p] if slots is not None else None
    rows_t = packed[:p]
    # every slice is a torch call the host pays for: the write rows are the input rows when nothing is padded
    write_rows = rows_t if p == n else packed[:n]
    write_cols = packed[w : w + n]
    return DecodeInputs(positions, (rows_t, positions), (write_rows, write_cols), out_loc, packed)


def make_last_indices(batch: Batch, device: torch.device) -> torch.Tensor:
    _, lens = _lens(batch)
    return to_device_async(torch.cumsum(lens, 0) - 1, device)
