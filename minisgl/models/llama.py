"""The Llama decoder, which Qwen2 (qkv bias), Qwen3 (per-head q/k norm), Qwen3-MoE and Mistral share."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from minisgl.core import get_global_ctx
from minisgl.kernel import use_triton
from minisgl.layers.activation import silu_and_mul
from minisgl.layers.attention import AttentionLayer
from minisgl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl.layers.linear import LinearColParallelMerged, LinearRowParallel
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.models.config import ModelConfig
from minisgl.models.cpu_decode import CpuDecodeLayers
from minisgl.models.cpu_decode import build as build_cpu_decode


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act={hidden_act!r} is not supported; only silu")
        self.gate_up_proj = LinearColParallelMerged(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = LinearRowParallel(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor, norm_eps: float | None = None) -> torch.Tensor:
        """With norm_eps (the norm before it folded: `DecoderModel.fold_norms`), x is the residual stream:
        gate|up is scaled by its rows' 1 / rms in the activation kernel, and the result is x + the MLP's
        (written over x: see `linear_add`)."""
        if norm_eps is None:
            return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), (x, norm_eps)), residual=x)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = AttentionLayer(config, layer_id, rotary)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.folded = False  # fold_norms: each norm's weight in the projection after it

    def can_fold(self) -> bool:
        """Whether this layer's norms can go into its projections: a dense MLP, no q|k|v bias (the scale
        would scale it), plain float weights on a device the Triton kernels run on, and a rotary kernel
        that can store K/V (it applies the scale to q, k and v)."""
        qkv, gate_up = self.self_attn.qkv_proj, getattr(self.mlp, "gate_up_proj", None)
        return (
            isinstance(self.mlp, GatedMLP)
            and gate_up is not None
            and qkv.bias is None
            and all(p.qweight is None and p.packed is None and p.weight is not None for p in (qkv, gate_up))
            and self.self_attn.rotary.stores_kv(qkv.weight)  # also: the Triton kernels run on its device
        )

    def fold(self) -> None:
        """W <- W diag(g) for q|k|v and gate|up, g the norm before each; the norms' 1 / rms is then applied
        to the projections' outputs (rotary and SiLU kernels) and the residual adds go into the o and down
        projections' epilogues: the layer's two norm launches go."""
        for proj, norm in (
            (self.self_attn.qkv_proj, self.input_layernorm),
            (self.mlp.gate_up_proj, self.post_attention_layernorm),
        ):
            w = proj.weight
            w.copy_((w.float() * norm.weight.float()[None, :]).to(w.dtype))
        self.folded = True

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.folded:
            # x is the residual stream (every folded layer returns no separate residual): no norm launch
            x = self.self_attn(x, positions, self.input_layernorm.eps)
            return self.mlp(x, self.post_attention_layernorm.eps), None
        x, residual = self.input_layernorm.forward_with_residual(x, residual)
        x = self.self_attn(x, positions)
        x, residual = self.post_attention_layernorm.forward_with_residual(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, build_mlp: Callable[[ModelConfig, int], nn.Module]) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.rotary, build_mlp(config, i)) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.folded = False
        # the C decode step (models/cpu_decode.py): False until the first CPU decode step decides
        self.cpu_decode: CpuDecodeLayers | None | bool = False

    def fold_norms(self) -> bool:
        """Fold every layer's two RMSNorms into the projections after them (`DecoderLayer.fold`) where every
        layer can (`can_fold`): 56 launches fewer a Qwen3-0.6B step. Changes the weights in place; once."""
        if self.folded or not all(layer.can_fold() for layer in self.layers):
            return False
        with torch.no_grad():
            for layer in self.layers:
                layer.fold()
        self.folded = True
        return True

    def _cpu_decode(self, x: torch.Tensor) -> CpuDecodeLayers | None:
        """The C decode step where this batch can take it: a CPU decode of at most its packed rows."""
        if x.device.type != "cpu" or torch.compiler.is_compiling():
            return None
        batch = get_global_ctx().batch
        if not batch.is_decode:
            return None
        if self.folded:
            return None
        if self.cpu_decode is False:
            self.cpu_decode = build_cpu_decode(self, x)
        fused = self.cpu_decode
        return fused if isinstance(fused, CpuDecodeLayers) and x.shape[0] <= fused.max_rows else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        fused = self._cpu_decode(x)
        if fused is not None:
            x, residual = fused.forward(x, positions, get_global_ctx().batch)
        else:
            for layer in self.layers:
                x, residual = layer(x, residual, positions)
        if residual is None:
            return self.norm(x)
        if use_triton(x):
            # the add folds into the norm's launch, as in every layer
            return self.norm.forward_with_residual(x, residual)[0]
        return self.norm(x + residual)


class LlamaForCausalLM(nn.Module):
    # traits of the architecture that its HF config does not state; ModelConfig.from_hf reads them
    attention_bias = False  # a bias on the q/k/v projections (a Llama config may still ask for one)
    qk_norm = False  # RMSNorm over each query and key head before rotary

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.build_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def build_mlp(config: ModelConfig, layer_id: int) -> nn.Module:
        """The feed-forward block of layer `layer_id` (an MoE model answers with its sparse block where it has one)."""
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def fold_norms(self) -> bool:
        """See DecoderModel.fold_norms; True if the norms were folded."""
        return self.model.fold_norms()

    def forward(self) -> torch.Tensor:
        """Logits of the last position of every request in the batch being forwarded (then, in a prefill,
        of the prompt positions batch.prompt_logit_indices names)."""
        return self.lm_head(self.hidden_states()).float()

    def hidden_states(self) -> torch.Tensor:
        """The final hidden rows whose logits `forward` gives: what the LM head multiplies."""
        batch = get_global_ctx().batch
        hidden = self.model(batch.input_ids, batch.positions)
        if batch.is_prefill:
            rows = batch.last_indices
            if batch.prompt_logit_indices is not None:
                rows = torch.cat([rows, batch.prompt_logit_indices])
            hidden = hidden[rows]
        return hidden
