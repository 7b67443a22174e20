"""The quantized layers of a CPU engine saved at its first start-up and read back at the next ones.

Quantizing the default model at start-up reads the GGUF file's 4-bit blocks through `gguf`'s reader (its metadata
alone, the tokenizer's 49,152 strings, takes seconds), runs the calibration prefill for W8A8's smoothing and
rounds every layer's int8 copy: about ten seconds of the engine's start, every start, for the same result. The
recipes (`models/quantize.py`: each layer's kind and its constructor's tensors, before any machine-specific layout)
are saved once under the cache folder (MINISGL_CACHE_DIR, `quant/`) and later starts build the layers from them.

The file's name carries a digest of everything its contents follow, in two parts: the configuration (the
quantization plan, the model's dtype and maximum length where it cuts the calibration prompt, the tensor-parallel
rank, the smoothing exponent) and the version (the model file or folder's path, sizes and modification times,
torch's version and CPU capability, and the source of the modules that compute the recipes), so that a change to
any of them writes a new file rather than reading a stale one; a new version replaces its configuration's older
ones. MINISGL_QUANT_CACHE=0 turns it off.
"""

from __future__ import annotations

import hashlib
import os
import uuid

import torch

from minisgl.env import ENV
from minisgl.models.quantize import LayerRecipe, Recipe
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

# a recipe's tensors as saved: int4 codes two to a byte
_FORMAT = 1


def _sources() -> list[str]:
    """The modules whose code decides a recipe's tensors."""
    from minisgl.engine import calibrate
    from minisgl.layers import quant
    from minisgl.models import gguf, gguf_quant, quantize, smoothing

    return [m.__file__ or "" for m in (calibrate, quant, gguf, gguf_quant, quantize, smoothing)]


def _stat_lines(source: str) -> list[str]:
    if os.path.isdir(source):
        names = sorted(n for n in os.listdir(source) if os.path.isfile(os.path.join(source, n)))
        return [line for n in names for line in _stat_lines(os.path.join(source, n))]
    st = os.stat(source)
    return [f"{os.path.realpath(source)} {st.st_size} {st.st_mtime_ns}"]


def cache_path(
    source: str, plan: str, dtype: torch.dtype, max_seq_len: int, tp: tuple[int, int]
) -> str | None:
    """Where the recipes of `source` quantized as `plan` are kept; None when caching is off or the source is
    not a file or folder that can be told apart from its later versions."""
    if not ENV.QUANT_CACHE.value or not os.path.exists(source):
        return None
    from minisgl.models import quantize, smoothing

    # what the recipes are for (another configuration keeps its own file beside this one) and which version of
    # the model file, the code and torch made them (a newer version replaces the older: `_drop_older`)
    config = hashlib.sha256(
        "\n".join(
            [
                # the calibration prompt (about 1,400 characters of text and chat) is cut to max_seq_len - 2 tokens:
                # from 2,048 on nothing is cut, so every longer context shares one file
                f"format {_FORMAT} plan {plan} dtype {dtype} max_seq_len {min(max_seq_len, 2048)} tp {tp}",
                f"alpha {smoothing.ALPHA} w8a8_head {quantize.W8A8_HEAD}",  # module settings a script may change
            ]
        ).encode()
    ).hexdigest()[:8]
    version = hashlib.sha256()
    for line in [
        f"torch {torch.__version__} {torch.backends.cpu.get_cpu_capability()}",
        *_stat_lines(source),
    ]:
        version.update(line.encode() + b"\n")
    for path in _sources():
        with open(path, "rb") as f:
            version.update(f.read())
    stem = os.path.splitext(os.path.basename(os.path.normpath(source)))[0]
    rank = f"-tp{tp[0]}" if tp[1] > 1 else ""
    return os.path.join(
        os.path.abspath(ENV.CACHE_DIR.value), "quant", f"{stem}{rank}-{config}-{version.hexdigest()[:16]}.pt"
    )


def _pack_codes(codes: torch.Tensor) -> torch.Tensor:
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def _unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def _saved(recipe: Recipe) -> Recipe:
    kind, args = recipe
    if kind == "int4":
        return kind, (_pack_codes(args[0]), *args[1:])
    return kind, tuple(a.contiguous() if a is not None else None for a in args)


def _loaded(recipe: Recipe) -> Recipe:
    kind, args = recipe
    if kind == "int4":
        return kind, (_unpack_codes(args[0]), *args[1:])
    return kind, args


def load(path: str) -> dict[str, LayerRecipe] | None:
    """The recipes saved at `path`, or None (no such file, or one this code cannot read)."""
    if not os.path.isfile(path):
        return None
    try:
        # mapped, not read: each tensor's pages come in as its layer's constructor reads them
        saved = torch.load(path, weights_only=True, mmap=True)
        return {
            name: LayerRecipe(_loaded(tuple(w)), None if b is None else _loaded(tuple(b)))  # type: ignore[arg-type]
            for name, (w, b) in saved.items()
        }
    except Exception as e:  # a truncated or foreign file: quantize again (and overwrite it)
        logger.warning(f"the quantized layers cached at {path} could not be read ({e}); quantizing again")
        return None


def save(path: str, recipes: dict[str, LayerRecipe]) -> None:
    """Write the recipes to `path` through a temporary file renamed into place (a reader never sees half a
    file, and two processes starting together each write a whole one). A cache that cannot be written is
    skipped with a warning."""
    saved = {
        name: (_saved(r.weight), None if r.batch is None else _saved(r.batch)) for name, r in recipes.items()
    }
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(saved, tmp)
        os.replace(tmp, path)
        _drop_older(path)
    except Exception as e:  # a full disk or a read-only folder: the engine starts all the same
        logger.warning(f"the quantized layers could not be cached at {path} ({e})")
        if os.path.exists(tmp):
            os.remove(tmp)


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def _drop_older(path: str) -> None:
    """Remove the files of the same model name, rank and configuration under other versions (an earlier version
    of the model file, of the code or of torch): the default model's is about 240 MB, and each change of the code
    would add one. Another configuration's file stays (the test suite's starts of a model beside the README
    command's: each would otherwise quantize again after the other)."""
    folder, name = os.path.split(path)
    prefix = name[: name.rindex("-") + 1]  # model, rank and configuration
    base = prefix[: prefix.rindex("-", 0, len(prefix) - 1) + 1]  # model and rank
    for other in os.listdir(folder):
        same_config = other.startswith(prefix) and len(other) == len(name)
        # a file named before configurations had their own names: model, rank and a version
        legacy = other.startswith(base) and len(other) == len(base) + 19 and _is_hex(other[len(base) : -3])
        if other != name and other.endswith(".pt") and (same_config or legacy):
            try:
                os.remove(os.path.join(folder, other))
            except OSError:
                pass  # another process removed it first, or it is not ours to remove
