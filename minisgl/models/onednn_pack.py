"""A CPU model's bf16 linear weights held in oneDNN's blocked layout (`layers.linear.pack_onednn`).

Which copy a layer keeps: the packed one serves every batch of more than two rows (and every prompt
where no quantized weight does). The plain one is read only by the C one- and two-row kernel where no
packed quantized weight serves those rows; it is kept there, for models whose plain weights take up
to `KEEP_PLAIN_BYTES`, because that kernel beats oneDNN at one row (13.9 against 18.3 ms for the
default model's layers on an AVX512-BF16 CPU without AMX). Above that size memory matters more than
the one-row step, and the packed copy replaces the plain one everywhere. Float32 models stay as they
are: their matmuls are MKL's, whose sums a oneDNN kernel would not reproduce.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.env import ENV
from minisgl.kernel import cpu as cpu_kernels
from minisgl.kernel import triton_everywhere
from minisgl.layers.linear import QuantizableLinear, onednn_packing_supported

KEEP_PLAIN_BYTES = 2 << 30


def pack_model(model: nn.Module) -> str:
    """Pack the bf16 linear layers of a CPU `model` in place; returns a one-line summary for the log."""
    if triton_everywhere() or ENV.CPU_COMPILE or not ENV.CPU_ONEDNN_WEIGHTS or not onednn_packing_supported():
        # a compiled decode step traces the plain weights; the Triton path runs the CUDA code
        return ""
    layers = [
        m
        for m in model.modules()
        if isinstance(m, QuantizableLinear)
        and m.weight is not None
        and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.bfloat16
    ]
    if not layers:
        return ""
    # the layers whose one- and two-row steps read the plain weight (no packed weight serves them)
    one_row = {id(m) for m in layers if m.qweight is None or m.max_rows < cpu_kernels.LINEAR_MAX_ROWS}
    plain_bytes = sum(m.weight.numel() * m.weight.element_size() for m in layers if id(m) in one_row)
    keep_plain = plain_bytes <= KEEP_PLAIN_BYTES
    for m in layers:
        m.pack_onednn_(keep_plain=keep_plain and id(m) in one_row)
    kept = f", the plain copy kept for 1-2 rows in {len(one_row)}" if keep_plain and one_row else ""
    return f"{len(layers)} linear layers in oneDNN's layout{kept}"
