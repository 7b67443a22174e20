"""The per-layer K and V scales of an FP8 KV cache, taken from the checkpoint where it has them.

vLLM's checkpoints (and the quantizers that write for it) name them `model.layers.N.self_attn.k_scale`
and `.v_scale` (also under `self_attn.attn.`), or `.kv_scale` for one scale of both. A checkpoint
without them is read with every scale 1.0, as vLLM and SGLang do without calibration: e4m3's range of
±448 holds the K and V activations of common models, and what it clamps is rare.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

import torch

_SCALE = re.compile(r"(?:.+\.)?layers\.(?P<layer>\d+)\.self_attn\.(?:attn\.)?(?P<which>k|v|kv)_scale")


class KVScales:
    """Collects the scales from a stream of checkpoint tensors, passing every other tensor on."""

    def __init__(self, num_layers: int) -> None:
        self.k = [1.0] * num_layers
        self.v = [1.0] * num_layers
        self.found = 0  # scale tensors the checkpoint had

    def take(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            match = _SCALE.fullmatch(name)
            if match is None:
                yield name, tensor
                continue
            self._record(name, int(match["layer"]), match["which"], tensor)

    def _record(self, name: str, layer: int, which: str, tensor: torch.Tensor) -> None:
        if layer >= len(self.k):
            raise ValueError(f"{name}: layer {layer} is beyond the model's {len(self.k)} layers")
        if tensor.numel() != 1:
            raise ValueError(
                f"{name} has {tensor.numel()} values; minisgl takes one KV scale per layer (per-tensor)"
            )
        value = float(tensor.float().item())
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} is {value}; a KV scale must be a positive finite number")
        if which in ("k", "kv"):
            self.k[layer] = value
        if which in ("v", "kv"):
            self.v[layer] = value
        self.found += 1
