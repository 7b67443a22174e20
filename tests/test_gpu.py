"""The CUDA fast path (Triton attention, fused kernels, CUDA graphs, overlap scheduling) against transformers.

Run with `pytest -m gpu` on a CUDA machine; skipped elsewhere. float32 runs with TF32 off must give
transformers' greedy tokens exactly; bf16 runs must keep every step's logits within BF16_LOGITS_REL_ERR
of transformers' float32 logits (and on average about as close as transformers' own bf16 run);
graphs, overlap and page size must not change any token.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from tiny import assert_nothing_held, mixed_steps, random_prompts

from minisgl.core import SamplingParams
from minisgl.engine import warmup
from minisgl.env import ENV
from minisgl.llm import LLM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BF16_LOGITS_REL_ERR = 0.1  # ||ours - transformers float32|| / ||transformers float32||, every step
VARIANTS = [
    "llama",
    "qwen3",
    "qwen2-tied",
    "mistral",
    "qwen3-mqa-head-dim",
    "llama-head-dim",
    "qwen3-moe",
    "qwen3-moe-mixed",
]


@pytest.fixture(autouse=True)
def exact_float32() -> Iterator[None]:
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture
def overlap(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], None]:
    def set_overlap(on: bool) -> None:
        monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", not on)

    return set_overlap


def gpu_llm(make_llm: Callable[..., LLM], folder: str, **kwargs: Any) -> LLM:
    kwargs.setdefault("max_running_req", 8)
    return make_llm(folder, device="cuda", **kwargs)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_greedy_tokens_equal_transformers(
    variant: str, page_size: int, tiny_model, hf_reference, make_llm
) -> None:
    folder = tiny_model(variant)
    # more prompts than rows and a small prefill budget: chunked prefills, a changing decode batch, padding
    prompts = random_prompts(11, seed=5, max_len=60)
    llm = gpu_llm(make_llm, folder, page_size=page_size, max_extend_tokens=96)
    assert llm.engine.graph_runner.graphs, "decode should run from CUDA graphs"
    out = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert [o["token_ids"] for o in out] == hf_reference(folder, prompts, 10)
    assert llm.table_manager.available_size == 8


@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("variant", ["qwen3", "llama"])
def test_kv_stored_by_the_rotary_kernel_or_on_its_own_gives_transformers_tokens(
    variant: str, separate: bool, tiny_model, hf_reference, make_llm, monkeypatch
) -> None:
    # decode replays graphs captured with the store inside the rotary kernel (or beside it)
    monkeypatch.setattr(ENV.SEPARATE_KV_STORE, "value", separate)
    folder = tiny_model(variant)
    prompts = random_prompts(9, seed=7, max_len=60)
    llm = gpu_llm(make_llm, folder, page_size=16, max_extend_tokens=96)
    assert llm.engine.graph_runner.graphs, "decode should run from CUDA graphs"
    out = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert [o["token_ids"] for o in out] == hf_reference(folder, prompts, 10)


@pytest.mark.parametrize("variant", ["qwen3", "llama"])
def test_decode_longest_first_leaves_transformers_tokens(
    variant: str, tiny_model, hf_reference, make_llm, monkeypatch
) -> None:
    # batches of 8 rows ordered, the last 3 requests' batches not: graphs of both kinds replay in one run
    monkeypatch.setattr(ENV.DECODE_LONGEST_FIRST, "value", 4)
    folder = tiny_model(variant)
    prompts = random_prompts(11, seed=9, max_len=60)
    llm = gpu_llm(make_llm, folder, page_size=16, max_extend_tokens=96)
    backend = llm.engine.attn_backend
    assert backend.ordered(8) and not backend.ordered(3) and llm.engine.graph_runner.graphs
    out = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert [o["token_ids"] for o in out] == hf_reference(folder, prompts, 10)


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_steps_give_transformers_tokens(
    page_size: int, split: bool, tiny_model, hf_reference, make_llm, monkeypatch
) -> None:
    # float32: a mixed step's prompts through the extend kernel, its decode rows through the Triton decode kernel
    # or with the prompts (or the whole step from a prefill graph where one fits), beside decode steps from graphs
    monkeypatch.setattr(ENV.MIXED_DECODE_SPLIT, "value", split)
    folder = tiny_model("qwen3")
    prompts = random_prompts(11, seed=5, max_len=60)
    llm = gpu_llm(
        make_llm,
        folder,
        page_size=page_size,
        max_running_req=4,
        max_extend_tokens=40,
        enable_mixed_chunk=True,
    )
    seen = mixed_steps(llm)
    out = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert [o["token_ids"] for o in out] == hf_reference(folder, prompts, 10)
    assert sum(n > 0 for n in seen) >= 2, seen
    assert_nothing_held(llm)


def test_mixed_steps_on_the_tensor_core_decode_kernel_keep_the_plain_schedules_tokens(
    tiny_model, make_llm
) -> None:
    """bf16, head dim 128: the decode rows of mixed steps go to the tensor-core kernel, compiled for each of their
    counts' variants by the warm-up. The tokens are the plain schedule's but where bf16's rounding in products
    of other row counts turns a close choice (most of them stay)."""
    folder = tiny_model("qwen3-head-dim-128")
    prompts = random_prompts(11, seed=8, max_len=60)
    runs = []
    for mixed in (False, True):
        llm = gpu_llm(
            make_llm,
            folder,
            dtype=torch.bfloat16,
            max_running_req=4,
            max_extend_tokens=40,
            enable_mixed_chunk=mixed,
        )
        assert llm.engine.attn_backend.tc_decode is not None
        assert bool(warmup._mixed_decode_sizes(llm.engine)) == mixed
        seen = mixed_steps(llm)
        out = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        assert_nothing_held(llm)
        assert (sum(n > 0 for n in seen) >= 2) == mixed, seen
        runs.append([o["token_ids"] for o in out])
        llm.shutdown()
    same = sum(a == b for p, m in zip(*runs) for a, b in zip(p, m))
    assert same >= 0.8 * sum(map(len, runs[0])), runs


def test_torch_backend_on_cuda_runs_without_graphs(tiny_model, hf_reference, make_llm) -> None:
    folder = tiny_model("qwen3")
    prompts = random_prompts(5, seed=6, max_len=30)
    llm = gpu_llm(make_llm, folder, attention_backend="torch")
    assert not llm.engine.graph_runner.graphs  # the reference backend has no static metadata to capture
    out = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [o["token_ids"] for o in out] == hf_reference(folder, prompts, 6)


def _run(make_llm: Callable[..., LLM], folder: str, params: list[SamplingParams], prompts, **kw: Any):
    llm = gpu_llm(make_llm, folder, max_running_req=4, max_extend_tokens=80, **kw)
    out = llm.generate(prompts, params)
    llm.check_integrity()
    assert llm.table_manager.available_size == 4
    llm.shutdown()
    return [o["token_ids"] for o in out], [o["finish_reason"] for o in out]


def test_graphs_overlap_and_page_size_do_not_change_tokens(
    tiny_model, make_llm, overlap, monkeypatch
) -> None:
    monkeypatch.setattr(ENV.DEBUG_CHECK_INTEGRITY, "value", True)
    folder = tiny_model("qwen3")
    prompts = random_prompts(14, seed=9, max_len=50)
    # stop tokens taken from a first run end requests mid-flight, so rows are freed and reused under overlap
    overlap(False)
    first, _ = _run(make_llm, folder, [SamplingParams(max_tokens=16, ignore_eos=True)] * 14, prompts)
    stops = sorted({t for toks in first for t in toks[4:6]})[:5]
    params = [
        SamplingParams(
            max_tokens=4 + 3 * (i % 5), temperature=0.8 if i % 2 else 0.0, seed=i, stop_token_ids=stops
        )
        for i in range(14)
    ]
    results = {}
    for graphs in (True, False):
        for on in (True, False):
            for page_size in (1, 16):
                overlap(on)
                results[(graphs, on, page_size)] = _run(
                    make_llm,
                    folder,
                    params,
                    prompts,
                    page_size=page_size,
                    cuda_graph_max_bs=None if graphs else 0,
                )
    reference = results[(False, False, 1)]
    assert "stop" in reference[1] and "length" in reference[1]
    for key, result in results.items():
        assert result == reference, f"graphs, overlap, page size = {key} changed the output"


def test_constrained_requests_keep_their_tokens_under_overlap_and_graphs(
    tiny_model, make_llm, overlap, monkeypatch
) -> None:
    # a constrained step samples after the last step's results, with masks copied on the scheduler's
    # stream: a mask read before its copy landed, or a graph buffer overwritten first, changes tokens
    pytest.importorskip("xgrammar")
    monkeypatch.setattr(ENV.DEBUG_CHECK_INTEGRITY, "value", True)
    folder = tiny_model("llama")
    prompts = random_prompts(12, seed=5, max_len=40)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    params = [
        SamplingParams(max_tokens=24, json_schema=json.dumps(schema), temperature=0.8 * (i % 2), seed=i)
        if i % 3 == 0
        else SamplingParams(max_tokens=8 + i, ignore_eos=True, temperature=0.8 * (i % 2), seed=i)
        for i in range(12)
    ]
    results = {}
    for graphs in (True, False):
        for on in (True, False):
            overlap(on)
            llm = gpu_llm(make_llm, folder, max_running_req=4, cuda_graph_max_bs=None if graphs else 0)
            out = llm.generate(prompts, params)
            llm.check_integrity()
            assert llm.table_manager.available_size == 4 and not llm.grammars.active
            llm.shutdown()
            results[(graphs, on)] = [(o["token_ids"], o["finish_reason"]) for o in out]
            for o in out[::3]:
                if o["finish_reason"] == "stop":
                    assert set(json.loads(o["text"])) == {"n", "ok"}, o["text"]
    reference = results[(False, False)]
    for key, result in results.items():
        assert result == reference, f"graphs, overlap = {key} changed the output"


def test_abort_of_an_inflight_prefill_under_overlap_frees_everything_once(
    tiny_model, make_llm, overlap, monkeypatch
):
    monkeypatch.setattr(ENV.DEBUG_CHECK_INTEGRITY, "value", True)
    overlap(True)
    folder = tiny_model("llama")
    prompts = random_prompts(6, seed=2, max_len=40)
    llm = gpu_llm(make_llm, folder, max_running_req=4, cache_type="radix")
    aborted = []

    def abort_first_prefill(batch):
        if batch is not None and batch.is_prefill and not aborted:
            # arrives while this prefill is in flight (aborts are taken at the next receive, after the
            # launch): its result must be dropped, its locks released once
            aborted.append(batch.reqs[0].uid)
            llm.abort(aborted[0])

    llm.step_observers.append(abort_first_prefill)
    out = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert out[aborted[0]]["finish_reason"] == "abort"
    assert all(len(o["token_ids"]) == 8 for i, o in enumerate(out) if i != aborted[0])
    llm.check_integrity()
    assert llm.table_manager.available_size == 4
    # the same prompts again: the prefix cache serves them, with locks and pages intact
    again = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o["token_ids"] for i, o in enumerate(again) if i != aborted[0]] == [
        o["token_ids"] for i, o in enumerate(out) if i != aborted[0]
    ]


def test_trace_has_device_time_from_cuda_events_for_every_step(
    tiny_model, make_llm, overlap, tmp_path
) -> None:
    overlap(True)
    path = str(tmp_path / "gpu.json")
    llm = gpu_llm(make_llm, tiny_model("qwen3"), max_running_req=4, max_extend_tokens=80, trace=path)
    sizes: list[int] = []
    llm.step_observers.append(lambda b: b is not None and sizes.append(b.size))
    llm.generate(random_prompts(10, seed=3, max_len=60), SamplingParams(max_tokens=12, ignore_eos=True))
    llm.shutdown()
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    device_tid = next(tid for tid, name in threads.items() if name.startswith("device cuda"))
    assert "CUDA events" in threads[device_tid]
    host = [e for e in events if e["ph"] == "X" and "kind" in e.get("args", {})]
    device = [e for e in events if e["ph"] == "X" and e["tid"] == device_tid]
    results = {e["args"]["step"]: e for e in events if e["ph"] == "X" and e["name"] == "results"}
    assert [h["args"]["batch_size"] for h in host] == sizes
    assert [d["args"]["step"] for d in device] == [h["args"]["step"] for h in host]
    slack = 2000  # us: CUDA time is placed on the host clock by one synchronised event
    for h, d in zip(host, device):
        assert d["dur"] == h["args"]["device_us"] > 0 and "launch_us" in h["args"]
        # the device runs a step after its launch begins, and is done when its results are handled
        assert d["ts"] >= h["ts"] - slack
        r = results[h["args"]["step"]]
        assert d["ts"] + d["dur"] <= r["ts"] + r["dur"] + slack
    assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(device, device[1:]))
    # overlap: the device starts step k+1 before the host has finished handling step k's results
    assert any(
        nxt["ts"] < results[cur["args"]["step"]]["ts"] + results[cur["args"]["step"]]["dur"]
        for cur, nxt in zip(device, device[1:])
    )


def _teacher_forced_logits(folder: str, seq: list[int], prompt_len: int, dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).cuda().eval()
    with torch.no_grad():
        logits = model(torch.tensor([seq], device="cuda")).logits[0].float()
    return logits[prompt_len - 1 : len(seq) - 1]


def _rel_errors(ours: torch.Tensor, ref: torch.Tensor) -> list[float]:
    return ((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).tolist()


def test_a_shared_prefix_is_computed_once_under_overlap(tiny_model, hf_reference, make_llm, overlap) -> None:
    # under overlap the next prefill is built before the last one's KV reaches the cache: the requests
    # behind the first must still wait for it rather than compute the shared prefix again
    overlap(True)
    folder = tiny_model("llama")
    system = random_prompts(1, seed=11, min_len=100, max_len=100)[0]
    prompts = [system + q for q in random_prompts(8, seed=12, min_len=4, max_len=12)]
    llm = gpu_llm(make_llm, folder, cache_type="radix", dtype=torch.float32)
    out = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert [o["token_ids"] for o in out] == hf_reference(folder, prompts, 4)
    assert [o["cached_tokens"] for o in out] == [0] + [len(system)] * 7


def record_row0_logits(llm: LLM) -> list[torch.Tensor]:
    """The list every step's logits of the batch's first row will be appended to (float32 copies). The engine
    must be built without the fused LM head and sampling (ENV.FUSED_SAMPLING 0): its steps make no logits."""
    assert llm.engine.fused_head is None, "build the engine with ENV.FUSED_SAMPLING 0 to record its logits"
    steps: list[torch.Tensor] = []
    sample = llm.engine.sampler.sample

    def recording_sample(logits: torch.Tensor, args: Any) -> torch.Tensor:
        steps.append(logits[0].float().clone())
        return sample(logits, args)

    llm.engine.sampler.sample = recording_sample  # type: ignore[method-assign]
    return steps


@pytest.mark.parametrize("variant", ["qwen3", "llama"])
def test_bf16_logits_stay_close_to_transformers(
    variant: str, tiny_model, hf_reference, make_llm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step within BF16_LOGITS_REL_ERR of transformers' float32 logits, and on average no further from
    them than transformers' own bf16 run is (the tiny models' wide weights make bf16 rounding show)."""
    monkeypatch.setattr(ENV.FUSED_SAMPLING, "value", 0)  # every step's logits, recorded
    folder = tiny_model(variant)
    llm = gpu_llm(make_llm, folder, dtype=torch.bfloat16)
    steps = record_row0_logits(llm)
    ours_all, theirs_all = [], []
    for prompt in random_prompts(3, seed=4, min_len=5, max_len=50):
        steps.clear()
        tokens = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]["token_ids"]
        seq = prompt + tokens
        ref = _teacher_forced_logits(folder, seq, len(prompt), torch.float32)
        ours = _rel_errors(torch.stack(steps), ref)  # one request alone: row 0 of every step
        theirs = _rel_errors(_teacher_forced_logits(folder, seq, len(prompt), torch.bfloat16), ref)
        assert max(ours) < BF16_LOGITS_REL_ERR, f"per-step relative errors {ours}"
        assert tokens[:1] == hf_reference(folder, [prompt], 1)[0]
        ours_all += ours
        theirs_all += theirs
    mean_ours, mean_theirs = sum(ours_all) / len(ours_all), sum(theirs_all) / len(theirs_all)
    print(
        f"{variant} bf16 logits, mean relative error: minisgl {mean_ours:.3e}, transformers {mean_theirs:.3e}"
    )
    assert mean_ours < 2 * mean_theirs + 5e-3


def _moe_inputs(num_tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """Inputs of one Qwen3-30B-A3B MoE layer: 128 experts, top-8 renormalised, hidden 2048, intermediate 768."""
    from minisgl.moe import select_experts

    experts, top_k, hidden, inter = 128, 8, 2048, 768
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=g).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) * hidden**-0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, device="cuda", generator=g) * inter**-0.5).to(dtype)
    weights, ids = select_experts(torch.randn(num_tokens, experts, device="cuda", generator=g), top_k, True)
    return x, gate_up, down, weights, ids


def _rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 512])
def test_triton_moe_within_bf16_error_of_the_torch_reference(num_tokens: int) -> None:
    from minisgl.kernel.moe import fused_moe
    from minisgl.moe.torch_backend import TorchMoeBackend

    x, gate_up, down, weights, ids = _moe_inputs(num_tokens, torch.bfloat16, seed=num_tokens)
    torch_moe = TorchMoeBackend()
    # float32 arithmetic on the same bf16 numbers: what both bf16 runs approximate
    exact = torch_moe.forward(x.float(), gate_up.float(), down.float(), weights, ids)
    ours = _rel_error(fused_moe(x, gate_up, down, weights, ids), exact)
    reference = _rel_error(torch_moe.forward(x, gate_up, down, weights, ids), exact)
    print(f"{num_tokens} tokens, bf16 MoE relative error: triton {ours:.2e}, torch {reference:.2e}")
    assert ours < 2 * reference + 1e-3


@pytest.mark.parametrize("num_tokens", [3, 300])
def test_triton_moe_float32_equals_the_torch_reference(num_tokens: int) -> None:
    from minisgl.kernel.moe import fused_moe
    from minisgl.moe.torch_backend import TorchMoeBackend

    inputs = _moe_inputs(num_tokens, torch.float32, seed=num_tokens)
    assert _rel_error(fused_moe(*inputs), TorchMoeBackend().forward(*inputs)) < 1e-5


def test_triton_moe_replays_from_a_cuda_graph() -> None:
    """Routing and both grouped GEMMs are captured; a replay on new inputs gives what an eager call gives."""
    from minisgl.kernel.moe import fused_moe
    from minisgl.moe import select_experts

    x, gate_up, down, _, _ = _moe_inputs(16, torch.bfloat16, seed=0)
    logits = torch.randn(16, 128, device="cuda")

    def step() -> torch.Tensor:
        weights, ids = select_experts(logits, 8, True)
        return fused_moe(x, gate_up, down, weights, ids)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (1, 2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(x.shape, device="cuda", generator=g))
        logits.copy_(torch.randn(logits.shape, device="cuda", generator=g))
        graph.replay()
        assert torch.equal(out, step())
