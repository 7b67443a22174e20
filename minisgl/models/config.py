"""ModelConfig: the few numbers of a Hugging Face config that the engine needs, in one typed record."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # the two traits that the model class states, not the HF config (see LlamaForCausalLM)
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    # MoE (Qwen3-MoE): which layers are sparse, and how their experts route; no experts means all dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)

    def check_tp(self, tp: int) -> None:
        """Raise ValueError unless the model splits over `tp` tensor-parallel ranks."""
        bad = []
        if self.num_qo_heads % tp:
            bad.append(f"{self.num_qo_heads} attention heads")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            bad.append(f"{self.num_kv_heads} KV heads (nor is {tp} a multiple of them)")
        if self.intermediate_size % tp:
            bad.append(f"intermediate size {self.intermediate_size}")
        if self.num_experts and self.moe_intermediate_size % tp:
            bad.append(f"expert intermediate size {self.moe_intermediate_size}")
        if bad:
            raise ValueError(
                f"tensor-parallel size {tp} does not divide the model's {', '.join(bad)}; choose a size that does"
            )

    def local_kv_heads(self, tp: int) -> int:
        """KV heads each rank keeps: its share, or one replicated head when the ranks outnumber them."""
        return max(1, self.num_kv_heads // tp)

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        # imported here: the registry's model classes import this module
        from minisgl.models import MODELS

        arch = (getattr(hf, "architectures", None) or ["LlamaForCausalLM"])[0]
        model_cls = MODELS.get(arch)
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        rope_theta = getattr(hf, "rope_theta", None)
        rope_scaling = getattr(hf, "rope_scaling", None)
        params = getattr(hf, "rope_parameters", None)  # transformers >= 5 keeps rope settings here
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = dict(params)
        if isinstance(rope_scaling, dict):
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            rope_scaling = None if kind in (None, "default") else rope_scaling
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        use_sliding = getattr(hf, "use_sliding_window", True)
        return cls(
            architecture=arch,
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            intermediate_size=getattr(hf, "intermediate_size", 0),
            num_qo_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=hf.vocab_size,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=getattr(hf, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=model_cls.attention_bias or bool(getattr(hf, "attention_bias", False)),
            qk_norm=model_cls.qk_norm,
            hidden_act=getattr(hf, "hidden_act", "silu"),
            rope_scaling=rope_scaling,
            sliding_window=getattr(hf, "sliding_window", None) if use_sliding else None,
            num_experts=getattr(hf, "num_experts", 0) or 0,
            num_experts_per_tok=getattr(hf, "num_experts_per_tok", 0) or 0,
            moe_intermediate_size=getattr(hf, "moe_intermediate_size", 0) or 0,
            norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)),
            decoder_sparse_step=getattr(hf, "decoder_sparse_step", 1) or 1,
            mlp_only_layers=list(getattr(hf, "mlp_only_layers", None) or []),
            eos_token_ids=eos_ids,
        )
