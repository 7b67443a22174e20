"""W8A8 on the CPU: int8 weights times activations quantized to int8 per token, with int32 sums.

The layer's only errors are the two roundings to int8: per element, half a step of the activation row's
scale (rowmax/254) and of the weight row's (rowmax/254, on a scale rounded to bf16). So |y - x @ w.T| is
bounded by sum_k |dx_k| |w_k| + |x_k| |dw_k| + |dx_k| |dw_k| with those steps, plus the output's own
rounding (bf16: 2^-8 relative). The C ends (quantize, rescale) must equal the torch ops bit for bit.
A tiny random model's greedy tokens are compared with the float model's at a floor measured on it:
random weights leave near-ties between logits, so a few tokens move (measured with the smoothing: 20 of 32
at float32, 19 at bf16; each layer's own error is lower with it than without, on the tiny model too).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_gguf import hf_weights, write_tiny_gguf
from tiny import float_and_quantized_tokens

from minisgl.core import SamplingParams
from minisgl.kernel import cpu as cpu_kernels
from minisgl.layers.quant import W8A8Weight, quantize_rows, round_per_channel
from minisgl.llm import LLM
from minisgl.llm.cli import build_parser as generate_parser
from minisgl.models.smoothing import smoothing_factors
from minisgl.server.args import parse_args as server_args


def weight_and_input(
    rows: int, n: int = 96, k: int = 512, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # rows of different magnitudes, and an activation with an outlier channel, as real layers have
    w = torch.randn(n, k, generator=gen) * torch.empty(n, 1).uniform_(0.01, 0.2, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    x[:, 7] *= 20
    return w, x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_w8a8_matmul_is_within_the_two_roundings_of_the_float_product(rows: int, dtype: torch.dtype) -> None:
    w, x = weight_and_input(rows)
    x = x.to(dtype).float()
    layer = W8A8Weight.from_float(w)
    got = layer.matmul(x.to(dtype))
    assert got.dtype == dtype and got.shape == (rows, w.shape[0])
    want = F.linear(x.double(), w.double())
    dx = x.abs().amax(dim=1, keepdim=True) / 254
    dw = (layer.dequantize() - w).abs()
    assert (dw <= w.abs().amax(dim=1, keepdim=True) * (1 / 254 + 2**-8)).all()
    # dx is one step a row, the same for every k: its terms sum |w| and |dw| along k
    dx, w_sum, dw_sum = dx.double(), w.abs().double().sum(1), dw.double().sum(1)
    bound = dx * w_sum + x.abs().double() @ dw.double().t() + dx * dw_sum
    rel = 2**-8 if dtype == torch.bfloat16 else 1e-6
    assert ((got.double() - want).abs() <= bound + want.abs() * rel + 1e-6).all()
    # tighter: the product of the two rounded operands, exact but for the output's own rounding
    q, row_scale = quantize_rows(x.to(dtype))
    exact = (q.double() * row_scale.double()) @ layer.dequantize().double().t()
    assert ((got.double() - exact).abs() <= exact.abs() * rel + 1e-6).all()
    # and the bound is not loose enough to pass a weight-only product: the activations are rounded
    weight_only = F.linear(x.double(), layer.dequantize().double())
    assert not torch.allclose(got.double(), weight_only, atol=1e-4, rtol=0)


def test_the_c_kernels_equal_the_torch_ops_bit_for_bit() -> None:
    lib = cpu_kernels.library()
    if lib is None:
        pytest.skip("no C compiler here: the torch ops are the only path")
    w, x = weight_and_input(17, n=40, k=96, seed=3)
    x[4] = 0  # an all-zero row gets the smallest scale, not a division by zero
    x[5, :3] = torch.tensor([0.5, -0.5, 1.5]) * (x[5].abs().max() / 127)  # halves round to even
    layer = W8A8Weight.from_float(w)
    for dtype in (torch.float32, torch.bfloat16):
        for xs in (x.to(dtype), torch.cat([x, x], dim=1).to(dtype)[:, :96]):  # contiguous and strided rows
            q_c, s_c = cpu_kernels.quantize_rows_int8(lib, xs)
            q_t, s_t = quantize_rows(xs)
            assert torch.equal(q_c, q_t) and torch.equal(s_c, s_t)
            assert q_t.abs().max() == 127 and not q_t[4].any()
            acc = torch._int_mm(q_t, layer.codes().t())
            torch_y = (acc.float() * (s_t * layer.scale_f32)).to(dtype)
            assert torch.equal(cpu_kernels.rescale_int32(lib, acc, s_t, layer.scale_f32, dtype), torch_y)
            assert torch.equal(layer.matmul(xs), torch_y)


@pytest.mark.parametrize(("dtype", "floor"), [("float32", 0.55), ("bfloat16", 0.35)])
def test_w8a8_greedy_tokens_follow_the_float_models(tiny_model, make_llm, dtype: str, floor: float) -> None:
    floats, got, w8a8 = float_and_quantized_tokens(make_llm, tiny_model("llama"), dtype, "w8a8")
    assert all(len(g) == 8 for g in got)
    same = sum(a == b for f, g in zip(floats, got) for a, b in zip(f, g))
    assert same >= floor * 32, (floats, got)
    model = w8a8.engine.model
    layer = model.model.layers[0].mlp.gate_up_proj
    assert isinstance(layer.qweight, W8A8Weight) and layer.weight is None
    # the LM head is W8A8 too, smoothed like the layers (docs/benchmarks.md: its quality was measured), and
    # serves every batch: no float copy is read by it
    assert isinstance(model.lm_head.qweight, W8A8Weight) and model.lm_head.qweight.inv_smooth is not None
    assert model.lm_head.weight is None and model.lm_head.packed is None


def test_w8a8_from_a_gguf_file_requantizes_its_dequantized_values(tmp_path) -> None:
    from gguf import GGMLQuantizationType as T

    weights = hf_weights("llama", tied=True, seed=3, hidden=256, ffn=256, head_dim=64)
    quant = {f"model.layers.{i}.mlp.down_proj.weight": T.Q4_1 for i in range(2)}
    path = str(tmp_path / "q41.gguf")
    write_tiny_gguf(path, "llama", weights, quant)
    floats = LLM(path, dtype="float32", quantization="none", max_running_req=2)
    try:
        want = floats.engine.model.model.layers[1].mlp.down_proj.weight.float().clone()
    finally:
        floats.shutdown()
    llm = LLM(path, dtype="bfloat16", quantization="w8a8", max_running_req=2)
    try:
        qweight = llm.engine.model.model.layers[1].mlp.down_proj.qweight
        assert isinstance(qweight, W8A8Weight) and qweight.inv_smooth is not None
        # the codes are of the smoothed weight w * s: within half a step of its row's scale, column by column
        s = 1 / qweight.inv_smooth
        step = (want * s).abs().amax(dim=1, keepdim=True)
        assert (((qweight.dequantize() - want) * s).abs() <= step * (1 / 254 + 2**-8) * (1 + 1e-5)).all()
        out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(out[0]["token_ids"]) == 4
    finally:
        llm.shutdown()


def test_w8a8_is_a_choice_of_both_command_lines() -> None:
    assert (
        server_args(["--quantization", "w8a8"]).scheduler_config("ipc://a", "ipc://b").quantization == "w8a8"
    )
    assert generate_parser().parse_args(["--quantization", "w8a8", "hi"]).quantization == "w8a8"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_w8a8_on_a_gpu_is_refused_saying_it_runs_on_the_cpu_only(tiny_model) -> None:
    with pytest.raises(ValueError, match="quantization='w8a8' runs on the CPU only"):
        LLM(tiny_model("llama"), dtype="bfloat16", quantization="w8a8", device="cuda")


def test_the_c_quantize_with_a_smoothing_vector_equals_the_torch_op_bit_for_bit() -> None:
    lib = cpu_kernels.library()
    if lib is None:
        pytest.skip("no C compiler here: the torch ops are the only path")
    _, x = weight_and_input(9, n=8, k=96, seed=5)
    inv = torch.empty(96).uniform_(0.05, 3.0, generator=torch.Generator().manual_seed(1))
    for dtype in (torch.float32, torch.bfloat16):
        q_c, s_c = cpu_kernels.quantize_rows_int8(lib, x.to(dtype), inv)
        q_t, s_t = quantize_rows(x.to(dtype), inv)
        assert torch.equal(q_c, q_t) and torch.equal(s_c, s_t)
        # and the vector is applied: the codes differ from the unsmoothed ones
        assert not torch.equal(q_c, cpu_kernels.quantize_rows_int8(lib, x.to(dtype))[0])


def test_smoothing_factors_follow_the_rule_and_keep_the_product() -> None:
    w, x = weight_and_input(4, n=16, k=64, seed=2)
    peak = x.abs().amax(dim=0)
    peak[3] = 0  # a channel the calibration never lit
    s = smoothing_factors(peak, w, alpha=0.5)
    want = peak.clamp(min=1e-5).sqrt() / w.abs().amax(dim=0).clamp(min=1e-5).sqrt()
    assert torch.allclose(s, want.clamp(min=1e-5)) and (s > 0).all()
    # x / s times w * s is x times w: the smoothing moves range, not values
    xs, ws = x.double() / s.double(), w.double() * s.double()
    assert torch.allclose(xs @ ws.t(), x.double() @ w.double().t(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rows", [1, 64])
def test_smoothing_brings_an_outlier_channel_input_closer_to_the_float_product(rows: int) -> None:
    w, x = weight_and_input(rows, n=96, k=512, seed=4)
    x[:, 100] *= 30  # two outlier channels (7 from weight_and_input, and this one), as after an RMSNorm
    want = F.linear(x.double(), w.double())
    plain = W8A8Weight.from_float(w)
    smooth = W8A8Weight.from_float(w, smoothing_factors(x.abs().amax(dim=0), w))
    err_plain = (plain.matmul(x).double() - want).norm()
    err_smooth = (smooth.matmul(x).double() - want).norm()
    assert err_smooth < 0.5 * err_plain, (err_smooth, err_plain)
    # dequantize() is the weight that multiplies the unsmoothed input, within int8's step of w * s
    s = smoothing_factors(x.abs().amax(dim=0), w)
    step = (w * s).abs().amax(dim=1, keepdim=True) * (1 / 254 + 2**-8)
    assert ((smooth.dequantize() - w) * s).abs().le(step * (1 + 1e-5)).all()
    # the engine's product equals the two roundings' product: codes of x / s times the codes of w * s
    q, row_scale = quantize_rows(x, smooth.inv_smooth)
    exact = (q.double() * row_scale.double()) @ (
        smooth.codes().double() * smooth.scale_f32.double()[:, None]
    ).t()
    assert torch.allclose(smooth.matmul(x).double(), exact, rtol=1e-6, atol=1e-6)


def test_a_w8a8_engine_smooths_every_layer_from_its_calibration_and_leaves_the_tables_clean(
    tiny_model, make_llm
) -> None:
    from minisgl.engine.calibrate import input_peaks
    from minisgl.layers.linear import QuantizableLinear
    from minisgl.models.smoothing import calibration_ids

    folder = tiny_model("llama")
    floats = make_llm(folder, dtype="bfloat16", quantization="none")
    engine = floats.engine
    ids = calibration_ids(engine.model_dir, engine.model_config.vocab_size, engine.max_seq_len - 2)
    assert len(ids) > 100  # the tiny tokenizer encodes the calibration text
    peaks = input_peaks(engine, ids)
    layers = {n: m for n, m in engine.model.named_modules() if isinstance(m, QuantizableLinear)}
    assert set(peaks) == set(layers)
    for name, m in layers.items():
        assert peaks[name].shape == (m.weight.shape[1],) and (peaks[name] > 0).any()
    assert not engine.page_table.any() and not engine.token_pool.any()
    # the engine's own w8a8 load computes the same peaks and smooths each layer with them
    w8a8 = make_llm(folder, dtype="bfloat16", quantization="w8a8")
    model = w8a8.engine.model
    layer = model.model.layers[1].self_attn.qkv_proj
    assert isinstance(layer.qweight, W8A8Weight) and layer.qweight.inv_smooth is not None
    want = 1 / smoothing_factors(
        peaks["model.layers.1.self_attn.qkv_proj"], layers["model.layers.1.self_attn.qkv_proj"].weight
    )
    assert torch.allclose(layer.qweight.inv_smooth, want, rtol=1e-6)
    out = w8a8.generate([[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0]["token_ids"]) == 4


def test_the_lm_heads_peaks_are_over_every_calibration_token(tiny_model, make_llm) -> None:
    from minisgl.engine.calibrate import input_peaks

    engine = make_llm(tiny_model("llama"), dtype="float32", quantization="none").engine
    seen: list[int] = []
    engine.model.lm_head.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0]))
    input_peaks(engine, list(range(3, 40)))
    assert sum(seen) >= 37  # not only the last position, as a plain prefill scores


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_onednn_layout_gives_the_int_mm_paths_bits(dtype: torch.dtype) -> None:
    from minisgl.layers.quant import onednn_int8_supported

    if cpu_kernels.library() is None or not onednn_int8_supported():
        pytest.skip("no C kernels or no oneDNN int8 matmul here")
    w, x = weight_and_input(33, n=80, k=160, seed=6)
    smooth = smoothing_factors(x.abs().amax(dim=0), w)
    layer = W8A8Weight.from_float(w, smooth)
    assert layer.onednn is not None
    # oneDNN's copy serves every call: the plain codes are dropped, and read back from that copy
    assert layer.q is None
    assert torch.equal(layer.codes(), round_per_channel(w.float() * smooth.float())[0].to(torch.int8))
    got = layer.matmul(x.to(dtype))
    layer.q, layer.onednn = layer.codes(), None
    assert torch.equal(got, layer.matmul(x.to(dtype)))
    # and the uint8 codes the oneDNN path multiplies are the int8 ones + 128
    lib = cpu_kernels.library()
    q8, s8 = cpu_kernels.quantize_rows_int8(lib, x.to(dtype), layer.inv_smooth)
    qu, su = cpu_kernels.quantize_rows_int8(lib, x.to(dtype), layer.inv_smooth, as_uint8=True)
    assert qu.dtype == torch.uint8 and torch.equal(qu.to(torch.int16) - 128, q8.to(torch.int16))
    assert torch.equal(su, s8)
