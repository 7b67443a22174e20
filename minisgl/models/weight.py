"""Loading a Hugging Face safetensors checkpoint into a minisgl model, sharded for this TP rank.

Checkpoint names are the model's own names except for the projections minisgl merges into one
matmul: q/k/v -> qkv_proj and gate/up -> gate_up_proj.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from minisgl.distributed import get_tp_info
from minisgl.layers.embedding import VocabParallelEmbedding
from minisgl.layers.linear import LinearColParallelMerged, LinearRowParallel

_MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {folder}; pass a Hugging Face model folder or a .gguf file"
        )
    total = 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            total += len(f.keys())
    # shown only on a terminal (disable=None), and cleared once the weights are in
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=None, leave=False) as bar:
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
                    bar.update(1)


def _split(name: str) -> tuple[str, str]:
    module, _, attr = name.rpartition(".")
    return module, attr


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy each checkpoint tensor into its parameter, taking this rank's shard; every parameter must be filled."""
    info = get_tp_info()
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: set[str] = set()
    for name, tensor in weights:
        module_name, attr = _split(name)
        parent, _, leaf = module_name.rpartition(".")
        shard = None
        if leaf in _MERGED:
            merged, shard = _MERGED[leaf]
            module_name = f"{parent}.{merged}"
        if module_name not in modules:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            raise KeyError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        module = modules[module_name]
        target_name = f"{module_name}.{attr}"
        param: torch.Tensor = getattr(module, attr)
        if isinstance(module, LinearColParallelMerged):
            start, size = module.shard_offset(shard or 0)
            piece = tensor.narrow(0, module.slices[shard or 0][0], size)
            param.data.narrow(0, start, size).copy_(piece)
            filled.add(f"{target_name}#{shard}")
            continue
        if isinstance(module, LinearRowParallel) and attr == "weight":
            size = param.shape[1]
            tensor = tensor.narrow(1, info.rank * size, size)
        elif isinstance(module, VocabParallelEmbedding):
            rows = max(0, min(module.shard, tensor.shape[0] - module.start))
            param.data.zero_()
            param.data[:rows].copy_(tensor[module.start : module.start + rows])
            filled.add(target_name)
            continue
        if param.shape != tensor.shape:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}"
            )
        param.data.copy_(tensor)
        filled.add(target_name)
    _check_filled(model, modules, params, filled)


def _check_filled(
    model: nn.Module, modules: dict[str, nn.Module], params: dict[str, torch.Tensor], filled: set[str]
) -> None:
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    missing = []
    for pname in params:
        module_name, _ = _split(pname)
        module = modules[module_name]
        if isinstance(module, LinearColParallelMerged):
            wanted = [f"{pname}#{i}" for i in range(len(module.local_sizes))]
            missing += [w for w in wanted if w not in filled]
        elif pname not in filled and not (tied and pname == "lm_head.weight"):
            missing.append(pname)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
