"""Loading a Hugging Face safetensors checkpoint into a minisgl model, sharded for this TP rank.

Checkpoint names are the model's own names except for the projections minisgl merges into one
matmul: q/k/v -> qkv_proj and gate/up -> gate_up_proj, and the experts of an MoE layer, which
minisgl stacks: experts.{e}.gate_proj/up_proj -> experts.gate_up_proj[e], experts.{e}.down_proj ->
experts.down_proj[e].
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterator

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from minisgl.distributed import DistributedInfo, get_tp_info
from minisgl.layers.embedding import VocabParallelEmbedding
from minisgl.layers.linear import LinearColParallelMerged, LinearRowParallel
from minisgl.layers.moe import MoeExperts

MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# one expert's projection in an MoE layer; MoeExperts stacks them
_EXPERT = re.compile(
    r"(?P<module>(?:.+\.)?experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight"
)


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
        expert = _EXPERT.fullmatch(name)
        if expert is not None and isinstance(modules.get(expert["module"]), MoeExperts):
            filled.add(_load_expert(modules[expert["module"]], expert, tensor, info, name))
            continue
        module_name, attr = _split(name)
        parent, _, leaf = module_name.rpartition(".")
        shard = None
        if leaf in MERGED:
            merged, shard = MERGED[leaf]
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


def _load_expert(
    experts: MoeExperts, match: re.Match[str], tensor: torch.Tensor, info: DistributedInfo, name: str
) -> str:
    """Copy this rank's slice of one expert's projection into the stacked tensors; returns what it filled."""
    e, proj, size = int(match["expert"]), match["proj"], experts.local_intermediate
    if e >= experts.num_experts:
        raise ValueError(f"{name}: expert {e} is beyond the model's {experts.num_experts} experts")
    hidden, inter = experts.gate_up_proj.shape[2], size * info.size
    want = (hidden, inter) if proj == "down_proj" else (inter, hidden)
    if tuple(tensor.shape) != want:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {want}")
    if proj == "down_proj":
        # down's input features are the intermediate ones: this rank's columns
        param, shard = "down_proj", None
        experts.down_proj.data[e].copy_(tensor.narrow(1, info.rank * size, size))
    else:
        param, shard = "gate_up_proj", MERGED[proj][1]
        target = experts.gate_up_proj.data[e].narrow(0, shard * size, size)
        target.copy_(tensor.narrow(0, info.rank * size, size))
    return _expert_key(f"{match['module']}.{param}", e, shard)


def _expert_key(param_name: str, expert: int, shard: int | None) -> str:
    return f"{param_name}[{expert}]" + ("" if shard is None else f"#{shard}")


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
        elif isinstance(module, MoeExperts):
            shards = (0, 1) if pname.endswith("gate_up_proj") else (None,)
            wanted = [_expert_key(pname, e, s) for e in range(module.num_experts) for s in shards]
            missing += [w for w in wanted if w not in filled]
        elif pname not in filled and not (tied and pname == "lm_head.weight"):
            missing.append(pname)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
