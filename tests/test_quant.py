"""Weights kept quantized on the CPU: each packed format multiplies like the float weight it stands for,
GGUF's 4-bit files load with their own codes, an int8 model greedy-decodes like the float one, and the
`quantization` option is plumbed through LLM and both command lines, refusing unknown names.

Tolerances: a packed weight's scale and offset are rounded to bf16 (torch's kernels take them so), so
its values are within 2^-7 of the largest magnitude in their group of the file's (half a bf16 step of the
scale times 8 codes plus half a step of the offset); matmuls take bf16
activations, so products are compared at bf16's relative 2^-7 of the output's scale.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from test_gguf import hf_weights, write_tiny_gguf
from tiny import float_and_quantized_tokens

from minisgl import core
from minisgl.core import Batch, Context, SamplingParams, set_global_ctx
from minisgl.env import ENV
from minisgl.layers.linear import LinearReplicated
from minisgl.layers.quant import Int4Weight, Int8Weight, W8A8Weight
from minisgl.llm import LLM
from minisgl.llm.cli import build_parser as generate_parser
from minisgl.models.gguf_quant import int4_groups, quantize_q4_k
from minisgl.server.args import build_parser as server_parser
from minisgl.server.args import parse_args as server_args
from minisgl.utils import cpu_probe
from minisgl.utils.cpu_probe import CpuChoice
from minisgl.utils.torch_utils import resolve_dtype


@pytest.fixture
def weight_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed weights with bf16 activations (torch's kernels): the tests that compare a packed model's
    tokens with the float one's measure the weights' rounding alone. The activations' rounding of the
    C kernel is tested against its own reference (test_qlinear.py)."""
    monkeypatch.setattr(ENV.CPU_INT8_ACTIVATIONS, "value", False)


INT4_FILES = {
    T.Q4_0: lambda w: quantize(w, T.Q4_0),
    T.Q4_1: lambda w: quantize(w, T.Q4_1),
    T.Q4_K: quantize_q4_k,
}


def random_weight(n: int = 96, k: int = 512, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # rows of different magnitudes, as real layers have
    return (rng.standard_normal((n, k)) * rng.uniform(0.01, 0.2, (n, 1))).astype(np.float32)


def assert_matmul_matches(packed: Int4Weight | Int8Weight, w: torch.Tensor) -> None:
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want = F.linear(x.float(), w)
    got = packed.matmul(x).float()
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2**-7 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("qtype", list(INT4_FILES), ids=lambda t: t.name)
def test_a_gguf_4_bit_file_loads_with_its_own_codes_and_multiplies_like_its_floats(qtype: T) -> None:
    w = random_weight()
    blocks = INT4_FILES[qtype](w)
    file_floats = np.asarray(dequantize(blocks, qtype), dtype=np.float32).reshape(w.shape)
    codes, scale, offset = int4_groups(blocks, qtype)
    assert codes.max() <= 15
    # the codes and the affine map per group give back exactly what the file means
    rebuilt = (codes.reshape(96, -1, 32) * scale[..., None] + offset[..., None]).reshape(w.shape)
    np.testing.assert_array_equal(rebuilt, file_floats)
    packed = Int4Weight(torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(offset))
    group_max = np.abs(file_floats).reshape(96, -1, 32).max(-1, keepdims=True)
    err = np.abs(packed.dequantize().numpy() - file_floats).reshape(96, -1, 32)
    assert (err <= 2**-7 * group_max).all()
    assert_matmul_matches(packed, torch.from_numpy(file_floats))
    # and the file is a 4-bit rendering of the weight: within a code step of it
    step = np.abs(scale).max()
    assert np.abs(file_floats - w).max() <= step


def test_q4_k_blocks_written_here_read_back_with_ggufs_dequantizer() -> None:
    w = random_weight(8, 256)
    blocks = quantize_q4_k(w)
    assert blocks.shape == (8, 144)
    back = np.asarray(dequantize(blocks, T.Q4_K), dtype=np.float32)
    # a 4-bit code per weight: within one step (a sixteenth of the sub-block's range, plus scale rounding)
    rng = w.reshape(8, 8, 32).max(-1) - np.minimum(w.reshape(8, 8, 32).min(-1), 0)
    assert (np.abs(back - w).reshape(8, 8, 32) <= (rng / 15 * 1.1)[..., None]).all()


@pytest.mark.parametrize("source", ["float", "Q8_0"])
def test_int8_per_channel_round_trip_and_matmul(source: str) -> None:
    w = random_weight()
    if source == "Q8_0":
        w = np.asarray(dequantize(quantize(w, T.Q8_0), T.Q8_0), dtype=np.float32).reshape(w.shape)
    packed = Int8Weight.from_float(torch.from_numpy(w))
    scale = np.abs(w).max(axis=1, keepdims=True) / 127
    # half a step of the row's scale (a bf16 scale moves the grid by at most 2^-8 of the row's largest)
    err = np.abs(packed.dequantize().numpy() - w)
    assert (err <= scale / 2 + 2**-8 * np.abs(w).max(axis=1, keepdims=True)).all()
    assert_matmul_matches(packed, packed.dequantize())


def test_a_mixed_gguf_model_loads_each_layer_packed_as_the_file_says(tmp_path, weight_only) -> None:
    weights = hf_weights("llama", tied=True, seed=3, hidden=256, ffn=256, head_dim=64)
    quant = {}
    for i in range(2):
        p = f"model.layers.{i}."
        quant |= {
            p + "self_attn.q_proj.weight": T.Q4_K,
            p + "self_attn.k_proj.weight": T.Q4_K,
            p + "self_attn.v_proj.weight": T.Q4_0,
            p + "self_attn.o_proj.weight": T.Q8_0,
            p + "mlp.gate_proj.weight": T.Q4_1,
            p + "mlp.up_proj.weight": T.Q8_0,
            p + "mlp.down_proj.weight": T.Q4_1 if i else T.Q4_K,
        }
    path = str(tmp_path / "mixed.gguf")
    write_tiny_gguf(path, "llama", weights, quant)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[3, 4, 5, 5, 6], [14, 19], [7, 8, 9, 10, 11, 12]]
    floats = LLM(path, dtype="float32", quantization="none", max_running_req=4)
    try:
        want = {
            n: m.weight.float().clone()
            for n, m in floats.engine.model.named_modules()
            if hasattr(m, "qweight")
        }
        a = [o["token_ids"] for o in floats.generate(prompts, params)]
    finally:
        floats.shutdown()
    packed = LLM(path, dtype="bfloat16", quantization="gguf", max_running_req=4)
    try:
        got = dict(packed.engine.model.named_modules())
        kinds = {}
        for name, module in got.items():
            qweight = getattr(module, "qweight", None)
            if qweight is None:
                continue
            kinds[name] = type(qweight).__name__
            ref = want[name]
            # q|k|v and gate|up merged, Q/K rows un-permuted: every layer must equal the file's floats
            tol = 2**-7 * ref.abs().amax(dim=1, keepdim=True)
            if isinstance(qweight, Int8Weight):
                tol = tol + ref.abs().amax(dim=1, keepdim=True) / 254
            assert ((qweight.dequantize() - ref).abs() <= tol).all(), name
        assert kinds["model.layers.0.self_attn.qkv_proj"] == "Int4Weight"
        assert kinds["model.layers.0.mlp.down_proj"] == "Int4Weight"
        # Q8_0 and a Q4_1|Q8_0 merge are per-channel int8; the tied LM head is int8 too
        assert kinds["model.layers.0.self_attn.o_proj"] == "Int8Weight"
        assert kinds["model.layers.1.mlp.gate_up_proj"] == "Int8Weight"
        assert kinds["lm_head"] == "Int8Weight"
        assert got["model.layers.0.mlp.down_proj"].weight is None  # the float copy is gone
        b = [o["token_ids"] for o in packed.generate(prompts, params)]
    finally:
        packed.shutdown()
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    assert same >= 0.8 * 18, (a, b)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_int8_greedy_tokens_match_the_float_models(tiny_model, make_llm, weight_only, dtype: str) -> None:
    floats, packed, int8 = float_and_quantized_tokens(make_llm, tiny_model("llama"), dtype, "int8")
    assert all(len(p) == 8 for p in packed)
    first = [p[:2] for p in packed] == [f[:2] for f in floats]
    same = sum(x == y for a, b in zip(floats, packed) for x, y in zip(a, b))
    assert first and same >= 0.75 * 32, (floats, packed)
    layer = int8.engine.model.model.layers[0].mlp.gate_up_proj
    assert isinstance(layer.qweight, Int8Weight) and layer.weight is None


def test_quantization_gguf_on_a_folder_says_to_use_int8(tiny_model) -> None:
    with pytest.raises(ValueError, match="needs a .gguf model file; use 'int8'"):
        LLM(tiny_model("llama"), dtype="float32", quantization="gguf")


@pytest.mark.parametrize("value", ["int4", "fp8", "INT8", ""])
def test_an_unknown_quantization_is_refused_naming_the_choices(tiny_model, value: str) -> None:
    with pytest.raises(
        ValueError, match=f"quantization={value!r} is not supported; use one of auto, none, int8, w8a8, gguf"
    ):
        LLM(tiny_model("llama"), dtype="float32", quantization=value)


def test_the_quantization_flag_reaches_the_engine_config(capsys) -> None:
    config = server_args(["--quantization", "int8"]).scheduler_config("ipc://a", "ipc://b")
    assert config.quantization == "int8"
    assert server_args([]).scheduler_config("ipc://a", "ipc://b").quantization is None
    assert generate_parser().parse_args(["--quantization", "gguf", "hi"]).quantization == "gguf"
    assert generate_parser().parse_args(["hi"]).quantization == "auto"
    for parser, argv in ((generate_parser, ["hi"]), (server_parser, [])):
        with pytest.raises(SystemExit) as e:
            parser().parse_args(["--quantization", "int4", *argv])
        assert e.value.code == 2
        assert "--quantization" in capsys.readouterr().err


def test_generate_runs_with_int8_from_the_command_line(tiny_model) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "minisgl",
            "generate",
            "--model",
            tiny_model("llama"),
            "--quantization",
            "int8",
            "--max-tokens",
            "3",
            "--ignore-eos",
            "--temperature",
            "0",
            "hello",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


def test_a_layer_with_both_copies_uses_the_packed_one_for_few_rows_only() -> None:
    layer = LinearReplicated(512, 96)
    layer.weight.data.copy_(torch.from_numpy(random_weight()))
    float_weight = layer.weight.data.clone()
    layer.quantize_(Int4Weight.from_float(float_weight), keep_float=True, max_rows=4)
    gen = torch.Generator().manual_seed(2)
    for rows, want_packed in ((1, True), (4, True), (5, False), (64, False)):
        x = torch.randn(rows, 512, generator=gen)
        y = layer(x)
        packed, floats = layer.qweight.matmul(x), F.linear(x, float_weight)
        assert torch.equal(y, packed if want_packed else floats), rows
        assert not torch.equal(packed, floats)
    # a prefill (or extend) step takes the float copy whatever its rows: a prompt's first token must not
    # depend on how much of it was cached
    x = torch.randn(1, 512, generator=gen)
    for phase, want_packed in (("prefill", False), ("decode", True)):
        with _forwarding(phase):
            assert torch.equal(
                layer(x), layer.qweight.matmul(x) if want_packed else F.linear(x, float_weight)
            )
    layer.quantize_(Int8Weight.from_float(float_weight), keep_float=False, max_rows=0)
    assert layer.weight is None
    x = torch.randn(64, 512, generator=gen)
    assert torch.equal(layer(x), layer.qweight.matmul(x))


@contextmanager
def _forwarding(phase: Literal["prefill", "decode"]) -> Iterator[None]:
    """A forward pass of a `phase` batch, as the engine sets one up, for a layer called by hand."""
    saved = core._GLOBAL_CTX
    ctx = Context(page_size=1, kv_cache=None, page_table=torch.zeros(1, 1), attn_backend=None)  # type: ignore[arg-type]
    set_global_ctx(ctx)
    try:
        with ctx.forward_batch(Batch(reqs=[], phase=phase)):
            yield
    finally:
        set_global_ctx(saved)


@pytest.mark.parametrize("w8a8_batches", [False, True])
def test_a_cached_prompt_gets_the_same_greedy_answer_as_a_cold_one(monkeypatch, w8a8_batches: bool) -> None:
    # The default model with its packed weights beside the floats (or beside W8A8 copies), as auto picks
    # them where they measure faster: asked twice, the second time from the prefix cache (a one-row
    # extend), the answer must not change. Packed steps of few rows used to take that extend and flip a
    # near-tie ("The" at -1.79 against "L" at -1.92): "The capital of France is Paris." became "L'Étoile, ...".
    choice = CpuChoice(torch.bfloat16, True, w8a8_batches, "as the test says")
    monkeypatch.setattr(cpu_probe, "cpu_choice", lambda: choice)
    llm = LLM(max_running_req=4)
    try:
        layer = llm.engine.model.model.layers[0].mlp.down_proj
        assert layer.qweight is not None and (layer.batch_qweight is not None) == w8a8_batches
        question = [{"role": "user", "content": "What is the capital of France?"}]
        greedy = SamplingParams(temperature=0.0, max_tokens=12)
        cold, cached = (llm.chat([question], greedy)[0] for _ in range(2))
        assert cold["cached_tokens"] == 0 and cached["cached_tokens"] > 0
        assert cached["token_ids"] == cold["token_ids"], (cold["text"], cached["text"])
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("packed_faster", "w8a8_batches", "dtype"),
    [
        (True, False, "bfloat16"),
        (True, True, "bfloat16"),
        (False, True, "bfloat16"),
        (True, True, "float32"),
    ],
)
def test_auto_keeps_a_gguf_files_packing_beside_the_floats_where_it_measured_faster(
    tmp_path, monkeypatch, packed_faster: bool, w8a8_batches: bool, dtype: str
) -> None:
    weights = hf_weights("llama", tied=False, seed=4, hidden=256, ffn=256, head_dim=64)
    quant = {n: T.Q4_1 for n in weights if n.endswith("_proj.weight")}
    path = str(tmp_path / "q4_1.gguf")
    write_tiny_gguf(path, "llama", weights, quant)
    choice = CpuChoice(torch.bfloat16, packed_faster, w8a8_batches, "as the test says")
    monkeypatch.setattr(cpu_probe, "cpu_choice", lambda: choice)
    llm = LLM(path, dtype=dtype, max_running_req=4)
    try:
        model = llm.engine.model
        layer = model.model.layers[1].mlp.down_proj
        # a float32 model keeps float32 results: the packed kernels take bf16 activations
        if packed_faster and dtype == "bfloat16":
            assert isinstance(layer.qweight, Int4Weight) and layer.serves_batches_apart()
            assert isinstance(model.lm_head.qweight, Int8Weight)
            if w8a8_batches:
                # prompts and batches above 4 rows take smoothed W8A8 copies; no float weight is left
                for m in (layer, model.lm_head, model.model.layers[0].self_attn.qkv_proj):
                    assert isinstance(m.batch_qweight, W8A8Weight) and m.batch_qweight.inv_smooth is not None
                    assert m.weight is None and m.packed is None and m.max_rows == 4
            else:
                assert layer.batch_qweight is None and (layer.weight is not None or layer.packed is not None)
        else:
            assert layer.qweight is None and layer.batch_qweight is None and layer.serves_batches_apart()
        out = llm.generate([[3, 4, 5], [6, 7]] * 3, SamplingParams(max_tokens=4, ignore_eos=True))
        assert all(len(o["token_ids"]) == 4 for o in out)
    finally:
        llm.shutdown()


def test_the_cpu_choice_is_timed_once_and_its_reason_logged(caplog) -> None:
    cpu_probe.cpu_choice.cache_clear()
    with caplog.at_level("INFO", logger="minisgl.utils.cpu_probe"):
        first = cpu_probe.cpu_choice()
        again = cpu_probe.cpu_choice()
    assert first is again
    lines = [r.getMessage() for r in caplog.records if r.name == "minisgl.utils.cpu_probe"]
    assert len(lines) == 1
    assert "dtype auto is" in lines[0] and "bf16" in lines[0] and "float32" in lines[0] and "int4" in lines[0]
    assert first.dtype in (torch.bfloat16, torch.float32)
    assert resolve_dtype(None, torch.device("cpu")) == first.dtype
    assert resolve_dtype(torch.float16, torch.device("cpu")) == torch.float16


def test_quantized_layers_are_cached_and_built_alike_at_the_next_start(tmp_path, monkeypatch, caplog) -> None:
    """A GGUF model's quantized layers (int4 from the file, W8A8 copies from the calibration) are written under
    the cache folder at the first start; the next start builds the same layers from that file without reading
    the GGUF blocks or calibrating, and answers the same. A new file's key follows the model file's change; an
    unreadable cache file is quantized again; MINISGL_QUANT_CACHE=0 writes nothing."""
    from minisgl.models import quant_cache, quantize

    monkeypatch.setattr(ENV.CACHE_DIR, "value", str(tmp_path / "cache"))
    weights = hf_weights("llama", tied=False, seed=5, hidden=256, ffn=256, head_dim=64)
    path = str(tmp_path / "q4_1.gguf")
    write_tiny_gguf(path, "llama", weights, {n: T.Q4_1 for n in weights if n.endswith("_proj.weight")})
    choice = CpuChoice(torch.bfloat16, True, True, "as the test says")
    monkeypatch.setattr(cpu_probe, "cpu_choice", lambda: choice)
    prompts = [[3, 4, 5, 9], [6, 7]]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

    def start() -> tuple[list[list[int]], dict[str, torch.Tensor]]:
        llm = LLM(path, dtype="bfloat16", max_running_req=4)
        try:
            layers = {}
            for name, m in llm.engine.model.named_modules():
                for part in ("qweight", "batch_qweight"):
                    if getattr(m, part, None) is not None:
                        layers[f"{name}.{part}"] = getattr(m, part).dequantize()
            return [o["token_ids"] for o in llm.generate(prompts, params)], layers
        finally:
            llm.shutdown()

    first, first_layers = start()
    saved = list((tmp_path / "cache" / "quant").iterdir())
    assert len(saved) == 1 and saved[0].suffix == ".pt"
    # the next start reads neither the file's blocks nor the calibration prompt
    monkeypatch.setattr(quantize, "_gguf_groups", lambda *a: pytest.fail("the GGUF blocks were read again"))
    from minisgl.engine import calibrate

    monkeypatch.setattr(calibrate, "input_peaks", lambda *a: pytest.fail("calibrated again"))
    with caplog.at_level("INFO", logger="minisgl.engine.engine"):
        again, again_layers = start()
    assert "built from" in caplog.text
    assert again == first and again_layers.keys() == first_layers.keys()
    assert all(torch.equal(again_layers[k], first_layers[k]) for k in first_layers)
    assert any(k.endswith("batch_qweight") for k in first_layers)  # W8A8 copies were among them
    # the recipes' int4 codes, packed two to a byte on disk, come back as they were
    codes = torch.randint(0, 16, (6, 64), dtype=torch.uint8)
    assert torch.equal(quant_cache._unpack_codes(quant_cache._pack_codes(codes)), codes)
    # a changed model file is another key; an unreadable cache file is quantized again
    key = ("gguf batch_w8a8=True", torch.bfloat16, 512, (0, 1))
    before = quant_cache.cache_path(path, *key)
    saved[0].write_bytes(b"not a cache")
    assert quant_cache.load(str(saved[0])) is None
    with open(path, "ab") as f:
        f.write(b"\0")
    assert quant_cache.cache_path(path, *key) != before
    monkeypatch.setattr(ENV.QUANT_CACHE, "value", False)
    assert quant_cache.cache_path(path, *key) is None
    # a new version's file replaces the model's older ones of its configuration, and those named before
    # configurations had names; not another configuration's, another model's, nor another rank's
    folder = tmp_path / "cache" / "quant"
    stem, config, _ = saved[0].name.split("-")  # the first start's file: model, configuration, version
    assert stem == Path(path).stem and len(config) == 8
    other_config = "01234567" if config != "01234567" else "76543210"
    kept = [
        folder / f"q4_1-tp1-{config}-0123456789abcdef.pt",
        folder / f"other-{config}-0123456789abcdef.pt",
        folder / f"q4_1-{other_config}-0123456789abcdef.pt",
        folder / "q4_1-tp1-0123456789abcdef.pt",
    ]
    dropped = [folder / f"q4_1-{config}-0123456789abcdef.pt", folder / "q4_1-0123456789abcdef.pt"]
    for other in kept + dropped:
        other.write_bytes(b"x")
    newer = str(folder / f"q4_1-{config}-fedcba9876543210.pt")
    quant_cache.save(newer, {})
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(("q4_1", "other"))) == sorted(
        [p.name for p in kept] + [Path(newer).name]
    )
