"""Quantization of a loaded model's linear layers (CPU): what each `quantization` value means.

- "int8": every linear layer and the LM head as int8 with one scale per output channel, from the float
  weights (any checkpoint; a GGUF file's dequantized values). Like every packed weight here, multiplied
  by activations rounded to int8 in blocks of 32 on a CPU with AVX512-VNNI (`minisgl/layers/quant.py`),
  by bf16 activations elsewhere.
- "w8a8": the same int8 weights, multiplied by activations quantized to int8 per token at run time
  (integer dot products, int32 sums), every layer's input channels smoothed (`minisgl/models/smoothing.py`,
  calibrated at load); the LM head too (`W8A8_HEAD`).
- "gguf": a GGUF file's own packing: Q4_0 / Q4_1 / Q4_K layers as int4 groups of 32 with the file's
  codes; layers of other quantized types (Q8_0, Q5_0, Q6_K, ...) and a merged layer whose parts differ
  as per-channel int8 of their float values (torch has no int8 kernel with a scale per group); the LM
  head as int8; layers stored as F32 / F16 / BF16 stay float.
- "none": the float weights (a GGUF file dequantized).
- None ("auto"): on a CPU, for a GGUF file in bf16, the file's packing for decode steps of up to
  `PACKED_MAX_ROWS` rows, where it measured faster; prompts and larger batches take smoothed W8A8 copies
  where the start-up timing finds W8A8 faster than bf16 (`utils/cpu_probe.py`; it was, 0.6-0.7x, on
  AVX512-VNNI without AMX), the float weights elsewhere (`QuantizableLinear` says why prompts never take the packed copy).
  W8A8's perplexity on the default model is within 0.1 of the float weights' (docs/benchmarks.md, "W8A8").
The embedding lookup always reads the float table: it touches one row per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from minisgl.layers.embedding import ParallelLMHead
from minisgl.layers.linear import LinearColParallelMerged, QuantizableLinear
from minisgl.layers.quant import Int4Weight, Int8Weight, QuantizedWeight, W8A8Weight
from minisgl.models.smoothing import smoothing_factors

# rows up to which a packed weight beats the bf16 matmul when both are kept: at SmolLM2-135M's shapes
# on AVX512-BF16 without AMX, int4 takes 0.5x of bf16's time at 1 and 4 rows, 0.9-1.3x at 8 and 1.9x
# at 16 (benchmark/offline/quant_matmul.py, docs/benchmarks.md)
PACKED_MAX_ROWS = 4

# whether "w8a8" quantizes the LM head's activations too, or keeps it int8 weight-only: smoothed, the W8A8
# head measured as good (perplexity 25.28 against 25.31) and faster at every batch (docs/benchmarks.md)
W8A8_HEAD = True


@dataclass
class _Groups:
    """One GGUF tensor as int4 groups (codes, scale, offset), rows in the model's order."""

    codes: np.ndarray
    scale: np.ndarray
    offset: np.ndarray


# how one packed weight is built: its kind ("int4", "int8", "w8a8") and its constructor's tensors, kept apart from
# the object so that a start-up can save them and the next one rebuild the objects from them (models/quant_cache.py)
Recipe = tuple[str, tuple[torch.Tensor | None, ...]]
_KINDS: dict[str, type[QuantizedWeight]] = {"int4": Int4Weight, "int8": Int8Weight, "w8a8": W8A8Weight}


@dataclass
class LayerRecipe:
    weight: Recipe  # the packed weight decode steps read
    batch: Recipe | None = None  # a W8A8 copy for prompts and large batches (batch_w8a8)


def quantize_model(
    model: nn.Module,
    quantization: str,
    gguf_path: str | None,
    keep_float: bool,
    input_peaks: dict[str, torch.Tensor] | None = None,
    batch_w8a8: bool = False,
) -> str:
    """Pack the linear layers of `model` in place; returns a one-line summary for the log. `input_peaks`
    (module name -> the peaks of its input channels, engine/calibrate.py) smooths the W8A8 layers;
    `batch_w8a8` gives every packed layer a W8A8 copy for prompts and large batches in place of the float
    weight (`keep_float` then keeps nothing)."""
    recipes = quant_recipes(model, quantization, gguf_path, input_peaks, batch_w8a8)
    return apply_recipes(model, recipes, keep_float)


def quant_recipes(
    model: nn.Module,
    quantization: str,
    gguf_path: str | None,
    input_peaks: dict[str, torch.Tensor] | None = None,
    batch_w8a8: bool = False,
) -> dict[str, LayerRecipe]:
    """What `quantize_model` packs each linear layer into, as recipes (module name -> LayerRecipe)."""
    groups = _gguf_groups(gguf_path, model) if quantization == "gguf" else {}
    peaks = input_peaks or {}
    recipes: dict[str, LayerRecipe] = {}
    for name, module in model.named_modules():
        if not isinstance(module, QuantizableLinear) or module.weight is None:
            continue
        weight = _pack(name, module, quantization, groups, peaks.get(name))
        if weight is not None:
            batch = _w8a8(module.weight, peaks.get(name)) if batch_w8a8 else None
            recipes[name] = LayerRecipe(weight, batch)
    return recipes


def apply_recipes(model: nn.Module, recipes: dict[str, LayerRecipe], keep_float: bool) -> str:
    """Build each recipe's packed weights into its layer (their constructors lay them out for this machine's
    kernels); returns the summary `quantize_model` logs."""
    modules = dict(model.named_modules())
    counts: dict[str, int] = {}
    for name, recipe in recipes.items():
        module = modules[name]
        assert isinstance(module, QuantizableLinear), f"{name} is not a linear layer"
        qweight = build(recipe.weight)
        batch = None if recipe.batch is None else build(recipe.batch)
        # a tied LM head shares its float weight with the embedding, which needs it, and the int8 head is
        # slow on batches; a W8A8 copy beats the float one at every batch (docs/benchmarks.md, "W8A8"),
        # so where there is one nothing else reads the float weight
        keep = (
            batch is None
            and not isinstance(qweight, W8A8Weight)
            and (keep_float or (isinstance(module, ParallelLMHead) and _is_tied(model)))
        )
        module.quantize_(qweight, keep, PACKED_MAX_ROWS if keep or batch is not None else 0, batch)
        kinds = [type(qweight).__name__] + ([f"{type(batch).__name__} for batches"] if batch else [])
        for kind in kinds:
            counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no layer packed"


def build(recipe: Recipe) -> QuantizedWeight:
    kind, args = recipe
    return _KINDS[kind](*args)


def _int8(weight: torch.Tensor) -> Recipe:
    return "int8", Int8Weight.codes_of(weight)


def _w8a8(weight: torch.Tensor, input_peak: torch.Tensor | None) -> Recipe:
    smooth = None if input_peak is None else smoothing_factors(input_peak, weight)
    return "w8a8", W8A8Weight.codes_of(weight, smooth)


def _is_tied(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))


def _pack(
    name: str,
    module: QuantizableLinear,
    quantization: str,
    groups: dict[str, list[_Groups | None]],
    input_peak: torch.Tensor | None,
) -> Recipe | None:
    assert module.weight is not None
    if quantization == "w8a8":
        if isinstance(module, ParallelLMHead) and not W8A8_HEAD:
            return _int8(module.weight)
        return _w8a8(module.weight, input_peak)
    if quantization == "int8" or isinstance(module, ParallelLMHead):
        # the LM head as int8: at one row it is 1.6x faster than the bf16 kernel and int4 (measured)
        return _int8(module.weight)
    shards = groups.get(name)
    if shards is None:
        return None
    if all(s is not None for s in shards):
        parts = [s for s in shards if s is not None]
        cat = [
            torch.from_numpy(np.concatenate([getattr(p, f) for p in parts]))
            for f in ("codes", "scale", "offset")
        ]
        return "int4", (cat[0], cat[1], cat[2])
    # Q8_0, or a merged layer whose parts are of different types: per-channel int8 of the float values
    return _int8(module.weight)


def _gguf_groups(path: str | None, model: nn.Module) -> dict[str, list[_Groups | None]]:
    """For each linear layer stored quantized in the GGUF file: its parts (q, k, v / gate, up) as int4
    groups, None for a part of another quantized type. Layers stored as float are absent."""
    from gguf import GGMLQuantizationType, GGUFReader

    from minisgl.models.gguf import hf_tensor_name, read_str, unpermute_rows
    from minisgl.models.gguf_quant import INT4_TYPES, int4_groups
    from minisgl.models.weight import MERGED

    if path is None or not path.endswith(".gguf"):
        raise ValueError("quantization='gguf' needs a .gguf model file; use 'int8' for other checkpoints")
    config = model.config  # type: ignore[attr-defined]
    reader = GGUFReader(path)
    arch = read_str(reader, "general.architecture")
    modules = dict(model.named_modules())
    found: dict[str, list[_Groups | None]] = {}
    for t in reader.tensors:
        hf = hf_tensor_name(t.name)
        if (
            hf is None
            or not hf.endswith(".weight")
            or t.tensor_type
            in (
                GGMLQuantizationType.F32,
                GGMLQuantizationType.F16,
                GGMLQuantizationType.BF16,
            )
        ):
            continue
        module_name = hf[: -len(".weight")]
        parent, _, leaf = module_name.rpartition(".")
        shard = 0
        if leaf in MERGED:
            merged, shard = MERGED[leaf]
            module_name = f"{parent}.{merged}"
        module = modules.get(module_name)
        if not isinstance(module, QuantizableLinear) or isinstance(module, ParallelLMHead):
            continue
        parts = found.setdefault(
            module_name,
            [None] * (len(module.local_sizes) if isinstance(module, LinearColParallelMerged) else 1),
        )
        if t.tensor_type not in INT4_TYPES:
            continue
        codes, scale, offset = int4_groups(t.data, t.tensor_type)
        if arch == "llama" and leaf in ("q_proj", "k_proj"):
            heads = config.num_qo_heads if leaf == "q_proj" else config.num_kv_heads
            codes, scale, offset = (unpermute_rows(a, heads) for a in (codes, scale, offset))
        parts[shard] = _Groups(codes, scale, offset)
    return found
