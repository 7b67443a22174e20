"""GGUF's 4-bit block formats read as codes, scales and offsets per group of 32 (and Q4_K written, for tests).

Q4_0 (w = d * (q - 8)), Q4_1 (w = d * q + m) and Q4_K (w = d * sc_j * q - dmin * m_j for each 32-element
sub-block j of a 256-element block) all store a 4-bit code per weight and an affine map per group of
32: w = code * scale + offset. Rather than decoding each layout's scale bytes here, the map is read
through `gguf`'s own dequantizer: the blocks with every code set to 0 give the offsets, with every code
set to 1 give offset + scale, and the real blocks then give the codes. So the codes are the file's own.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from minisgl.layers.quant import INT4_GROUP

# bytes per block and where its packed 4-bit codes lie
_CODE_BYTES: dict[GGMLQuantizationType, tuple[int, int, int]] = {
    GGMLQuantizationType.Q4_0: (18, 2, 18),
    GGMLQuantizationType.Q4_1: (20, 4, 20),
    GGMLQuantizationType.Q4_K: (144, 16, 144),
}
INT4_TYPES = frozenset(_CODE_BYTES)


def int4_groups(data: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw blocks [N, bytes per row] of a 4-bit type -> codes [N, K], scale [N, K/32], offset [N, K/32]."""
    block, lo, hi = _CODE_BYTES[qtype]
    raw = np.ascontiguousarray(data, dtype=np.uint8)
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, block)

    def with_codes(byte: int) -> np.ndarray:
        probe = blocks.copy()
        probe[..., lo:hi] = byte
        return np.asarray(dequantize(probe.reshape(n, -1), qtype), dtype=np.float32).reshape(n, -1)

    w = np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(n, -1)
    k = w.shape[1]
    offset = with_codes(0x00)[:, ::INT4_GROUP]
    scale = with_codes(0x11)[:, ::INT4_GROUP] - offset
    g = w.reshape(n, k // INT4_GROUP, INT4_GROUP)
    safe = np.where(scale == 0, 1, scale)
    codes = np.rint((g - offset[..., None]) / safe[..., None]).clip(0, 15)
    # a group whose scale is zero has all its weights equal to the offset: any code gives them
    codes = np.where(scale[..., None] == 0, 0, codes).reshape(n, k)
    return codes.astype(np.uint8), scale, offset


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """Float rows [N, K] (K a multiple of 256) -> Q4_K blocks [N, K / 256 * 144] (min/max per sub-block).

    `gguf` has no Q4_K quantizer; this one makes test and benchmark files. It follows the format, not
    llama.cpp's search for the best scales, so its error is a little above llama.cpp's.
    """
    n, k = w.shape
    sub = w.astype(np.float32).reshape(n, k // 256, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0)
    step = (sub.max(axis=-1) - lo) / 15
    d = (step.max(axis=-1) / 63).astype(np.float16)
    dmin = (-lo.min(axis=-1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.rint(step / np.where(d32 == 0, 1, d32)[..., None]).clip(0, 63).astype(np.uint8)
    m = np.rint(-lo / np.where(dmin32 == 0, 1, dmin32)[..., None]).clip(0, 63).astype(np.uint8)
    scale = d32[..., None] * sc
    offset = -dmin32[..., None] * m
    q = np.rint((sub - offset[..., None]) / np.where(scale == 0, 1, scale)[..., None]).clip(0, 15)
    q = q.astype(np.uint8)
    packed_scales = np.empty((n, k // 256, 12), dtype=np.uint8)
    packed_scales[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed_scales[..., 4:8] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    packed_scales[..., 8:12] = (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)
    # each 64 weights share 32 bytes: sub-block 2i in the low nibbles, 2i + 1 in the high ones
    pairs = q.reshape(n, k // 256, 4, 2, 32)
    qs = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(n, k // 256, 128)
    out = np.concatenate(
        [d.reshape(n, -1, 1).view(np.uint8), dmin.reshape(n, -1, 1).view(np.uint8), packed_scales, qs],
        axis=-1,
    )
    return out.reshape(n, -1)
