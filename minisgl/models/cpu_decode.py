"""A Llama-shaped model's decode step on the CPU as one C call for all its layers (kernel/cpu/layer.c).

Taken where every part of a layer has a C kernel: bf16 activations and K/V pool, the "cpu" attention
backend, each linear layer packed for the int8-activation kernel (qlinear.c) and used at this batch's
size, one tensor-parallel rank, no q/k/v bias or per-head q/k norm, a dense SiLU MLP. Anything else,
and every prefill, keeps the module-by-module path, which the tests compare this one with.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from minisgl.attention.cpu_backend import CpuAttnBackend, CpuDecodeMetadata
from minisgl.core import Batch, get_global_ctx
from minisgl.distributed import get_tp_info
from minisgl.kernel import cpu as cpu_kernels
from minisgl.kernel import triton_everywhere
from minisgl.layers.linear import QuantizableLinear
from minisgl.layers.quant import Int4Weight, Int8Weight


class _Weight(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int),
        ("N", ctypes.c_int),
        ("K", ctypes.c_int),
        ("w", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("off", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("in_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", _Weight),
        ("o", _Weight),
        ("gate_up", _Weight),
        ("down", _Weight),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", ctypes.c_int),
        ("H", ctypes.c_int),
        ("I", ctypes.c_int),
        ("Hq", ctypes.c_int),
        ("Hk", ctypes.c_int),
        ("D", ctypes.c_int),
        ("eps", ctypes.c_float),
        ("attn_scale", ctypes.c_float),
        ("cos_sin", ctypes.c_void_p),
        ("page_table", ctypes.c_void_p),
        ("pt_stride", ctypes.c_int64),
    ]


def declare(lib: ctypes.CDLL) -> None:
    p = ctypes.c_void_p
    lib.decode_layers.argtypes = [ctypes.POINTER(_Model), p, p, p, p, p, p, p, ctypes.c_int, ctypes.c_int]
    lib.decode_layers.restype = ctypes.c_int


def _weight(layer: QuantizableLinear) -> _Weight | None:
    """The packed weight of `layer` as layer.c reads it, or None where it has none."""
    q = layer.qweight
    if isinstance(q, Int4Weight) and q.pack is not None:
        pk = q.pack
        return _Weight(
            4, q.out_features, q.in_features, pk.qs.data_ptr(), pk.d.data_ptr(), pk.off.data_ptr(), None
        )
    if type(q) is Int8Weight and q.pack is not None:
        pk8 = q.pack
        return _Weight(8, q.out_features, q.in_features, pk8.w.data_ptr(), None, None, pk8.scale.data_ptr())
    return None


class CpuDecodeLayers:
    """The C decode step of `model` (a DecoderModel), built once its eligibility is known."""

    def __init__(self, model: nn.Module, lib: ctypes.CDLL, backend: CpuAttnBackend) -> None:
        declare(lib)
        self.lib = lib
        self.max_rows = min(
            self._max_rows(m)
            for layer in model.layers
            for m in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
        )
        first = model.layers[0]
        attn, kv = first.self_attn, backend.kv_cache
        self.layers = (_Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            a, mlp = layer.self_attn, layer.mlp
            weights = [_weight(m) for m in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            assert all(w is not None for w in weights)
            self.layers[i] = _Layer(
                layer.input_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(),
                *weights,
                kv.k_cache(a.layer_id).data_ptr(),
                kv.v_cache(a.layer_id).data_ptr(),
            )
        self.model = _Model(
            len(model.layers),
            first.input_layernorm.weight.shape[0],
            first.mlp.gate_up_proj.qweight.out_features // 2,
            attn.num_qo_heads,
            attn.num_kv_heads,
            attn.head_dim,
            first.input_layernorm.eps,
            backend.scale,
            model.rotary.cos_sin.data_ptr(),
            backend.page_table.data_ptr(),
            backend.page_table.stride(0),
        )
        # kept alive: the C structs hold their addresses
        self._tensors = (model, backend)

    @staticmethod
    def _max_rows(m: QuantizableLinear) -> int:
        # the packed weight serves batches of up to max_rows rows where the float one is kept, all without
        return m.max_rows if m.serves_batches_apart() else 1 << 30

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, batch: Batch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [M, H] bf16 embeddings -> (the last layer's output, the residual stream), as the layers give."""
        meta: CpuDecodeMetadata = batch.attn_metadata
        x = x.contiguous()
        residual = torch.empty_like(x)
        positions = positions.to(torch.int64).contiguous()
        out_loc = batch.out_loc.to(torch.int64).contiguous()
        rc = self.lib.decode_layers(
            ctypes.byref(self.model), ctypes.addressof(self.layers), x.data_ptr(), residual.data_ptr(),
            positions.data_ptr(), out_loc.data_ptr(), meta.rows.data_ptr(), meta.seq_lens.data_ptr(),
            x.shape[0], torch.get_num_threads(),
        )  # fmt: skip
        if rc:
            raise RuntimeError(f"the C decode step failed ({'out of memory' if rc == -2 else 'bad shape'})")
        return x, residual


def build(model: nn.Module, x: torch.Tensor) -> CpuDecodeLayers | None:
    """The C decode step for `model` (a DecoderModel), or None where some part of it has no C kernel."""
    from minisgl.models.llama import GatedMLP

    ctx = get_global_ctx()
    backend = getattr(ctx, "attn_backend", None)
    lib = cpu_kernels.library()
    if (
        lib is None
        or x.device.type != "cpu"
        or x.dtype != torch.bfloat16
        or triton_everywhere()
        or get_tp_info().size != 1
        or not isinstance(backend, CpuAttnBackend)
        or backend.kv_cache.k_buffer.dtype != torch.bfloat16
        or model.rotary.cos_sin.dtype != torch.float32
    ):
        return None
    for layer in model.layers:
        a, mlp = layer.self_attn, layer.mlp
        if not isinstance(mlp, GatedMLP) or a.q_norm is not None or a.qkv_proj.bias is not None:
            return None
        if any(m.bias is not None for m in (a.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            return None
        linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(_weight(m) is None for m in linears):
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        eps = model.layers[0].input_layernorm.eps
        if any(
            n.weight.dtype != torch.bfloat16 or not n.weight.is_contiguous() or n.eps != eps for n in norms
        ):
            return None
    return CpuDecodeLayers(model, lib, backend)
