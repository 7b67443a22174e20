"""The offline LLM interface as a user drives it: the chapter's example, text in and out, stopping, chat, teardown."""

from __future__ import annotations

import json
import runpy
import shutil
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from conftest import Reference
from tiny import assert_nothing_held, random_prompts

from minisgl.core import Batch, SamplingParams
from minisgl.env import ENV
from minisgl.llm import LLM

TEXT_PROMPTS = [
    "The capital of France is",
    "List three prime numbers:",
    "def fibonacci(n):",
    "1 + 1 =",
    "Once upon a time,",
]
ID_PROMPTS = random_prompts(8, seed=3, min_len=2, max_len=24)


@pytest.fixture(autouse=True)
def _plain_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ENV.DISABLE_OVERLAP_SCHEDULING, "value", True)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _trace(llm: LLM) -> list[tuple[str, list[tuple[int, int]]]]:
    """Record every scheduled batch as (phase, [(uid, tokens computed), ...]), as the chapter's example prints it."""
    trace: list[tuple[str, list[tuple[int, int]]]] = []

    def traced(batch: Batch | None) -> None:
        if batch is not None:
            trace.append((batch.phase, [(r.uid, r.extend_len) for r in batch.reqs]))

    llm.step_observers.append(traced)
    return trace


def test_the_chapter_example_runs_as_written(
    tiny_model: Callable[[str], str], hf_reference: Reference, make_llm: Callable[..., LLM]
) -> None:
    path = tiny_model("qwen3")
    llm = make_llm(
        path,
        dtype=torch.float32,
        max_running_req=8,
        num_page_override=1024,
        max_seq_len_override=512,
        cache_type="naive",
    )
    trace = _trace(llm)
    lengths = [6, 2, 5, 1, 4]  # the short ones finish and leave first
    outputs = llm.generate(TEXT_PROMPTS, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])

    ids = [llm.tokenizer(p).input_ids for p in TEXT_PROMPTS]
    ref = hf_reference(path, ids, max(lengths))
    assert [o["token_ids"] for o in outputs] == [r[:n] for r, n in zip(ref, lengths)]
    assert [o["text"] for o in outputs] == [
        llm.tokenizer.decode(o["token_ids"], skip_special_tokens=True) for o in outputs
    ]
    # one prefill of all five, then decode batches that shrink as requests reach their max_tokens
    assert trace == [
        ("prefill", [(uid, len(p)) for uid, p in enumerate(ids)]),
        ("decode", [(0, 1), (1, 1), (2, 1), (4, 1)]),
        ("decode", [(0, 1), (2, 1), (4, 1)]),
        ("decode", [(0, 1), (2, 1), (4, 1)]),
        ("decode", [(0, 1), (2, 1)]),
        ("decode", [(0, 1)]),
    ]
    assert llm.table_manager.available_size == 8
    llm.shutdown()


def test_requests_with_different_lengths_leave_and_join(
    tiny_model: Callable[[str], str], hf_reference: Reference, make_llm: Callable[..., LLM]
) -> None:
    """Different max_tokens: the short ones finish and leave the batch first while the rest carry on, and a later generate's requests join afterwards."""
    qwen3 = tiny_model("qwen3")
    llm = make_llm(qwen3, max_running_req=8, cache_type="naive")
    prompts = ID_PROMPTS[:5]
    lengths = [3, 12, 7, 1, 9]
    out = llm.generate(prompts, [greedy(n) for n in lengths])
    ref = hf_reference(qwen3, prompts, 12)
    assert [o["token_ids"] for o in out] == [r[:n] for r, n in zip(ref, lengths)]
    assert llm.table_manager.available_size == 8  # every row has been returned
    later = llm.generate(prompts[::-1], [greedy(n) for n in lengths])
    assert [o["token_ids"] for o in later] == [r[:n] for r, n in zip(ref[::-1], lengths)]
    assert llm.table_manager.available_size == 8
    llm.shutdown()


def test_waiting_requests_join_in_arrival_order_as_rows_free(
    tiny_model: Callable[[str], str], hf_reference: Reference, make_llm: Callable[..., LLM]
) -> None:
    path = tiny_model("llama")
    llm = make_llm(
        path, max_running_req=2, cache_type="naive", enable_mixed_chunk=False
    )  # the plain schedule
    trace = _trace(llm)
    lengths = [3, 12, 7, 1, 9, 4]
    out = llm.generate(ID_PROMPTS[:6], [greedy(n) for n in lengths])

    ref = hf_reference(path, ID_PROMPTS[:6], 12)
    assert [o["token_ids"] for o in out] == [r[:n] for r, n in zip(ref, lengths)]
    assert max(len(reqs) for _, reqs in trace) <= 2
    prefilled = [uid for phase, reqs in trace if phase == "prefill" for uid, _ in reqs]
    assert prefilled == list(range(6))  # first come, first served, each prompt computed once
    first_decode = next(i for i, (phase, _) in enumerate(trace) if phase == "decode")
    assert any(phase == "prefill" for phase, _ in trace[first_decode:])  # some joined while others decoded
    for uid, n in enumerate(lengths):  # a request decodes until it has its max_tokens, then leaves
        assert sum(uid in dict(reqs) for phase, reqs in trace if phase == "decode") == n - 1
    assert all([u for u, _ in reqs] == sorted(u for u, _ in reqs) for _, reqs in trace)
    assert_nothing_held(llm)


def test_admission_stops_at_the_first_request_that_does_not_fit(
    tiny_model: Callable[[str], str], hf_reference: Reference, make_llm: Callable[..., LLM]
) -> None:
    path = tiny_model("llama")
    # 80 KV tokens: the first request takes 30 + 10; the second (35 + 10) must wait for it to finish,
    # and the small third (5 + 10), which would fit at once, waits behind the second
    llm = make_llm(path, max_running_req=4, num_page_override=80, cache_type="naive")
    trace = _trace(llm)
    prompts = [random_prompts(1, seed=s, min_len=n, max_len=n)[0] for s, n in ((5, 30), (6, 35), (7, 5))]
    out = llm.generate(prompts, greedy(10))

    assert [o["token_ids"] for o in out] == hf_reference(path, prompts, 10)
    assert [[uid for uid, _ in reqs] for phase, reqs in trace if phase == "prefill"] == [[0], [1, 2]]
    assert_nothing_held(llm)


def test_string_prompts_are_tokenized_and_outputs_decoded(
    tiny_model: Callable[[str], str], hf_reference: Reference, make_llm: Callable[..., LLM]
) -> None:
    path = tiny_model("llama")
    llm = make_llm(path, max_running_req=4)
    out = llm.generate(TEXT_PROMPTS, greedy(8))

    ids = [llm.tokenizer(p).input_ids for p in TEXT_PROMPTS]
    assert [o["token_ids"] for o in out] == hf_reference(path, ids, 8)
    assert [o["text"] for o in out] == [
        llm.tokenizer.decode(o["token_ids"], skip_special_tokens=True) for o in out
    ]
    assert [o["prompt_tokens"] for o in out] == [len(i) for i in ids]
    # one string alone is one prompt
    [single] = llm.generate(TEXT_PROMPTS[0], greedy(8))
    assert single["token_ids"] == out[0]["token_ids"]
    assert_nothing_held(llm)


def _first_stop(tokens: list[int], stops: set[int]) -> int | None:
    return next((i for i, t in enumerate(tokens) if t in stops), None)


def test_a_request_stops_at_any_eos_id_of_the_generation_config(
    tiny_model: Callable[[str], str],
    hf_reference: Reference,
    make_llm: Callable[..., LLM],
    tmp_path: Any,
) -> None:
    n = 16
    ref = hf_reference(tiny_model("llama"), ID_PROMPTS, n)
    # two eos ids that the greedy runs produce mid-way, each the first stop of some prompt
    first_eos = ref[0][3]
    second_eos = next(r[4] for r in ref[1:] if r[4] != first_eos and first_eos not in r[:5])
    folder = shutil.copytree(tiny_model("llama"), tmp_path / "two-eos")
    gen_config = json.loads((folder / "generation_config.json").read_text())
    gen_config["eos_token_id"] = [first_eos, second_eos]
    (folder / "generation_config.json").write_text(json.dumps(gen_config))
    tokenizer_eos = int(json.loads((folder / "config.json").read_text())["eos_token_id"])

    llm = make_llm(str(folder), max_running_req=4)
    out = llm.generate(ID_PROMPTS, SamplingParams(max_tokens=n))

    stops = {first_eos, second_eos, tokenizer_eos}
    ends = [_first_stop(r, stops) for r in ref]
    assert {ref[i][end] for i, end in enumerate(ends) if end is not None} >= {first_eos, second_eos}
    assert [o["token_ids"] for o in out] == [r if end is None else r[:end] for r, end in zip(ref, ends)]
    assert [o["finish_reason"] for o in out] == ["length" if end is None else "stop" for end in ends]
    assert all(o["stop_reason"] is None for o in out)  # an EOS is no stop string or stop token id (vLLM's)
    # ignore_eos runs through them all
    out = llm.generate(ID_PROMPTS, SamplingParams(max_tokens=n, ignore_eos=True))
    assert [o["token_ids"] for o in out] == ref
    assert all(o["finish_reason"] == "length" for o in out)
    assert_nothing_held(llm)


def test_stop_token_ids_end_a_request_without_appearing_in_it(
    tiny_model: Callable[[str], str], hf_reference: Reference, make_llm: Callable[..., LLM]
) -> None:
    path = tiny_model("llama")
    ref = hf_reference(path, ID_PROMPTS, 16)
    stop_ids = [r[5] for r in ref]  # a token each greedy run produces
    llm = make_llm(path, max_running_req=4)
    params = [SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=[t, 1]) for t in stop_ids]
    out = llm.generate(ID_PROMPTS, params)

    ends = [_first_stop(r, {t, 1}) for r, t in zip(ref, stop_ids)]
    assert [o["token_ids"] for o in out] == [r[:end] for r, end in zip(ref, ends)]
    assert all(o["finish_reason"] == "stop" for o in out)
    # vLLM's stop_reason: the stop token id that ended it
    assert [o["stop_reason"] for o in out] == [r[end] for r, end in zip(ref, ends)]
    assert [o.outputs[0].stop_reason for o in out] == [o["stop_reason"] for o in out]
    # include_stop_str_in_output: the stop token stays, in the ids and the text
    kept = llm.generate(ID_PROMPTS, [replace(p, include_stop_str_in_output=True) for p in params])
    assert [o["token_ids"] for o in kept] == [r[: end + 1] for r, end in zip(ref, ends)]
    assert [o["text"] for o in kept] == [llm.tokenizer.decode(o["token_ids"]) for o in kept]
    assert_nothing_held(llm)


def test_skip_special_tokens_false_keeps_control_tokens_in_the_text(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(tiny_model("llama"), max_running_req=4)
    start = llm.tokenizer.convert_tokens_to_ids("<|im_start|>")  # a control token that stops nothing
    forced = dict(max_tokens=3, ignore_eos=True, logit_bias={start: 100.0})
    skipped, kept = llm.generate(
        [TEXT_PROMPTS[0]] * 2,
        [SamplingParams(**forced), SamplingParams(**forced, skip_special_tokens=False)],
    )
    assert skipped["token_ids"] == kept["token_ids"] == [start] * 3
    assert (skipped["text"], kept["text"]) == ("", "<|im_start|>" * 3)
    with pytest.raises(ValueError, match="skip_special_tokens"):
        llm.generate([TEXT_PROMPTS[0]], SamplingParams(skip_special_tokens="no"))  # type: ignore[arg-type]
    assert_nothing_held(llm)


def test_stop_strings_end_a_request_and_are_cut_from_the_text(
    tiny_model: Callable[[str], str], hf_reference: Reference, make_llm: Callable[..., LLM]
) -> None:
    path = tiny_model("llama")
    llm = make_llm(path, max_running_req=4)
    decode = llm.tokenizer.decode
    ref = hf_reference(path, ID_PROMPTS, 16)
    # a stop string from the middle of each greedy text
    picks = [(i, decode(r[6:8])) for i, r in enumerate(ref)]
    picks = [(i, s) for i, s in picks if s.isascii() and s.strip() and len(s) >= 2]
    assert len(picks) >= 3
    prompts = [ID_PROMPTS[i] for i, _ in picks]
    out = llm.generate(
        prompts, [SamplingParams(max_tokens=16, ignore_eos=True, stop=["never-said", s]) for _, s in picks]
    )

    for (i, stop), o in zip(picks, out):
        end = next(m for m in range(1, 17) if stop in decode(ref[i][:m]))  # the token that completes it
        assert o["finish_reason"] == "stop"
        assert o["token_ids"] == ref[i][:end]
        text = decode(ref[i][:end])
        assert o["text"] == text[: text.index(stop)]
        assert stop not in o["text"] and o["stop_reason"] == stop
    kept = llm.generate(
        prompts,
        [
            SamplingParams(
                max_tokens=16, ignore_eos=True, stop=["never-said", s], include_stop_str_in_output=True
            )
            for _, s in picks
        ],
    )
    for (_, stop), o, cut in zip(picks, kept, out):
        assert o["text"] == cut["text"] + stop and o["token_ids"] == cut["token_ids"]
    assert_nothing_held(llm)


def test_outputs_read_as_vllms_request_outputs(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM]
) -> None:
    """A vLLM script's reads (out.prompt, out.outputs[0].text, ...) on the same outputs as the dict's keys."""
    llm = make_llm(tiny_model("llama"), max_running_req=4)
    prompts: list[Any] = [TEXT_PROMPTS[0], TEXT_PROMPTS[1], ID_PROMPTS[0]]
    out = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2))
    for o, prompt in zip(out, [TEXT_PROMPTS[0], TEXT_PROMPTS[1], None]):
        [c] = o.outputs
        assert (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) == (
            0, o["text"], o["token_ids"], "length", None
        )  # fmt: skip
        chosen = [lp[t] for t, lp in zip(o["token_ids"], o["logprobs"])]
        assert len(chosen) == 6 and c.cumulative_logprob == pytest.approx(sum(chosen))
        assert c.logprobs == o["logprobs"] and c.finished()
        assert o.prompt == prompt and o.finished and o.num_cached_tokens == o["cached_tokens"]
        assert o.prompt_logprobs is None
    assert out[0].prompt_token_ids == llm.tokenizer(TEXT_PROMPTS[0]).input_ids
    assert out[2].prompt_token_ids == ID_PROMPTS[0]
    assert len({o.request_id for o in out}) == 3
    assert json.loads(json.dumps(out[0])) == {**out[0], "logprobs": [
        {str(t): x for t, x in lp.items()} for lp in out[0]["logprobs"]
    ]}  # fmt: skip
    # n=2: each prompt's choices in a row (SGLang's shape), each its one completion, numbered
    two = llm.generate(TEXT_PROMPTS[:2], SamplingParams(max_tokens=3, n=2, seed=1, temperature=1.0))
    assert [o.outputs[0].index for o in two] == [0, 1, 0, 1]
    assert [o.prompt for o in two] == [TEXT_PROMPTS[0]] * 2 + [TEXT_PROMPTS[1]] * 2
    assert two[0].outputs[0].cumulative_logprob is None and two[0].outputs[0].logprobs is None
    assert_nothing_held(llm)


def test_sglangs_prompt_and_input_ids_keywords(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM]
) -> None:
    """SGLang's Engine.generate(prompt=..., input_ids=...): the same tokens as the prompts given positionally, and
    one prompt alone answered with one output, as SGLang answers it."""
    llm = make_llm(tiny_model("llama"), max_running_req=4)
    want = [o["token_ids"] for o in llm.generate(TEXT_PROMPTS[:2], greedy(5))]
    sglang_params = {"max_new_tokens": 5, "ignore_eos": True}
    assert [
        o["token_ids"] for o in llm.generate(prompt=TEXT_PROMPTS[:2], sampling_params=sglang_params)
    ] == want
    one = llm.generate(prompt=TEXT_PROMPTS[0], sampling_params=greedy(5))
    assert isinstance(one, dict) and one["token_ids"] == want[0]
    ids = [llm.tokenizer(p).input_ids for p in TEXT_PROMPTS[:2]]
    alone = llm.generate(input_ids=ids[0], sampling_params=greedy(5))
    assert isinstance(alone, dict) and alone["token_ids"] == want[0] and alone.prompt is None
    assert [o["token_ids"] for o in llm.generate(input_ids=ids, sampling_params=greedy(5))] == want
    # n=2 of one prompt: its two outputs, a list
    two = llm.generate(prompt=TEXT_PROMPTS[0], sampling_params=SamplingParams(max_tokens=3, n=2, seed=1))
    assert isinstance(two, list) and [o.outputs[0].index for o in two] == [0, 1]
    bad: list[tuple[dict[str, Any], str]] = [
        ({"prompts": ["a"], "prompt": "b"}, "once"),
        ({"prompt": "a", "input_ids": [1]}, "one of them"),
        ({}, "prompts=None is invalid"),
        ({"input_ids": [[1, 2], [3.5]]}, r"input_ids\[1\]\[0\] is 3.5"),
        ({"input_ids": 5}, "input_ids=5 is invalid"),
    ]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            llm.generate(sampling_params=greedy(2), **kwargs)
    assert_nothing_held(llm)


def test_chat_applies_the_chat_template(
    tiny_model: Callable[[str], str], hf_reference: Reference, make_llm: Callable[..., LLM]
) -> None:
    path = tiny_model("qwen3")
    llm = make_llm(path, max_running_req=4)
    conversations = [
        [{"role": "user", "content": "hello world"}],
        [
            {"role": "system", "content": "Once upon a time"},
            {"role": "user", "content": "List three prime numbers:"},
        ],
    ]
    out = llm.chat(conversations, greedy(8))

    templated = [
        "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>system\nOnce upon a time<|im_end|>\n"
        "<|im_start|>user\nList three prime numbers:<|im_end|>\n<|im_start|>assistant\n",
    ]
    ids = [llm.tokenizer(t).input_ids for t in templated]
    assert [o["prompt_tokens"] for o in out] == [len(i) for i in ids]
    assert [o["token_ids"] for o in out] == hf_reference(path, ids, 8)
    # vLLM's RequestOutput.prompt of a chat: the rendered conversation; each of n choices carries it
    assert [o.prompt for o in out] == templated and [o.prompt_token_ids for o in out] == ids
    two = llm.chat(conversations, SamplingParams(max_tokens=2, n=2, temperature=0.8, seed=1))
    assert [o.prompt for o in two] == [templated[0]] * 2 + [templated[1]] * 2
    assert_nothing_held(llm)


def test_vllms_and_sglangs_option_names_build_the_same_llm(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM]
) -> None:
    path = tiny_model("llama")
    ours = make_llm(path, max_seq_len_override=256, max_running_req=4, cache_type="naive", page_size=4).config
    vllm = make_llm(
        None, model=path, max_model_len=256, max_num_seqs=4, enable_prefix_caching=False, block_size=4
    ).config
    # SGLang's Engine(model_path=...) is LLM's own first argument
    sglang = make_llm(
        path, context_length=256, max_running_requests=4, disable_radix_cache=True, page_size=4
    ).config
    for config in (vllm, sglang):
        assert config == ours
    eager = make_llm(path, enforce_eager=True, tensor_parallel_size=1, trust_remote_code=False).config
    assert eager.cuda_graph_max_bs == 0 and eager.tp_info.size == 1
    assert make_llm(path, mem_fraction_static=0.5).config.gpu_memory_utilization == 0.5


def test_the_kv_pool_takes_a_share_of_free_memory_or_vllms_share_of_the_whole() -> None:
    from minisgl.engine.engine import ACTIVATIONS_RESERVE, kv_budget

    gib = 1 << 30
    # 80 GiB, 60 free after 16 GiB of weights and 4 of another process's
    assert kv_budget(60 * gib, 80 * gib, 0.9, None) == 54 * gib - ACTIVATIONS_RESERVE
    # vLLM's 0.5: the instance may hold 40 GiB in all, 20 of them in use already
    assert kv_budget(60 * gib, 80 * gib, 0.9, 0.5) == 20 * gib - ACTIVATIONS_RESERVE
    assert kv_budget(30 * gib, 80 * gib, 0.9, 0.5) < 0  # more than half in use already: no pool (an error)


@pytest.mark.parametrize(
    "options, error, says",
    [
        ({"bogus": 1}, TypeError, "LLM() has no option 'bogus'; its options are model_path, dtype, tp_size"),
        ({"tp_info": None}, TypeError, "LLM() has no option 'tp_info'"),
        ({"seed": 0}, TypeError, "pass SamplingParams(seed=...)"),
        (
            {"gpu_memory_utilization": 1.5},
            ValueError,
            "gpu_memory_utilization=1.5 is invalid: it must be in (0, 1]",
        ),
        ({"memory_ratio": 0}, ValueError, "memory_ratio=0 is invalid"),
        ({"max_model_len": 64, "max_seq_len_override": 64}, TypeError, "which set the same option"),
        ({"model": "x"}, TypeError, "LLM() got model_path twice"),
        ({"trust_remote_code": True}, ValueError, "minisgl runs its own model code only"),
        ({"enforce_eager": False}, ValueError, "enforce_eager=False is not taken"),
    ],
)
def test_an_option_llm_does_not_take_says_which_and_what_to_pass(
    options: dict[str, Any], error: type[Exception], says: str, tiny_model: Callable[[str], str]
) -> None:
    with pytest.raises(error) as e:
        LLM(tiny_model("llama"), **options)
    assert says in str(e.value)


def test_vllm_prompt_dicts_and_token_id_sequences_are_prompts(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(tiny_model("llama"), max_running_req=4)
    ids = ID_PROMPTS[0]
    want = llm.generate([TEXT_PROMPTS[0], ids], greedy(4))
    got = llm.generate([{"prompt": TEXT_PROMPTS[0]}, {"prompt_token_ids": ids}], greedy(4))
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
    # one dict alone is one prompt; a tuple or a 1-D integer tensor is a list of ids
    assert [o["token_ids"] for o in llm.generate({"prompt_token_ids": ids}, greedy(4))] == [
        want[1]["token_ids"]
    ]
    for seq in (tuple(ids), torch.tensor(ids)):
        assert llm.generate([seq], greedy(4))[0]["token_ids"] == want[1]["token_ids"]
    assert_nothing_held(llm)


def test_sampling_params_as_sglangs_dicts(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(tiny_model("llama"), max_running_req=4)
    ids = ID_PROMPTS[:2]
    want = llm.generate(ids, SamplingParams(max_tokens=5, min_tokens=5, ignore_eos=True))
    for params in ({"max_new_tokens": 5, "min_new_tokens": 5, "ignore_eos": True},
                   [{"max_tokens": 5, "min_tokens": 5, "ignore_eos": True}] * 2):  # fmt: skip
        assert [o["token_ids"] for o in llm.generate(ids, params)] == [o["token_ids"] for o in want]
    refused = {
        "sampling_params got 'max_tokens' and 'max_new_tokens', which set the same option (max_tokens)": {
            "max_tokens": 4,
            "max_new_tokens": 5,
        },
        "sampling_params has 'bogus', which is not a sampling parameter": {"bogus": 1},
        "sampling_params=5 is invalid": 5,
        "sampling_params[1] is 'x'": [{}, "x"],
        "2 prompts but 1 sampling_params": [{}],
    }
    for says, params in refused.items():
        with pytest.raises(ValueError) as e:
            llm.generate(ids, params)
        assert says in str(e.value)
    assert_nothing_held(llm)


@pytest.mark.parametrize(
    "prompts, says",
    [
        ([[1.5, 2]], r"prompts\[0\]\[0\] is 1.5; token ids are integers"),
        ([[True, 2]], r"prompts\[0\]\[0\] is True"),
        ([[[1, 2]]], r"prompts\[0\]\[0\] is \[1, 2\]"),
        ([1, 2, 3], r"prompts\[0\] is the integer 1; .* \[\[1, 2, 3\]\] for one"),
        (None, r"prompts=None is invalid: pass a prompt or a list of prompts"),
        (
            [{"prompt": "a", "multi_modal_data": {}}],
            r"prompts\[0\] has 'multi_modal_data', which minisgl does not take",
        ),
        ([{"prompt": "a", "prompt_token_ids": [1]}], r"has both 'prompt' and 'prompt_token_ids'"),
        ([{"prompt": 5}], r"prompts\[0\]\['prompt'\] is 5; it must be a string"),
        ([{"prompt_token_ids": "abc"}], r"prompts\[0\]\['prompt_token_ids'\] is 'abc'"),
    ],
)
def test_a_prompt_of_another_shape_is_refused_before_anything_runs(
    prompts: Any, says: str, tiny_model: Callable[[str], str], make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(tiny_model("llama"), max_running_req=4)
    with pytest.raises(ValueError, match=says):
        llm.generate(prompts, greedy(4))
    assert_nothing_held(llm)
    assert llm.generate([ID_PROMPTS[0]], greedy(2))[0]["finish_reason"] == "length"


def test_chat_takes_one_conversation_and_text_parts_and_refuses_what_the_server_refuses(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(tiny_model("qwen3"), max_running_req=4)
    conversation = [{"role": "user", "content": "hello world"}]
    [want] = llm.chat([conversation], greedy(4))
    assert llm.get_tokenizer() is llm.tokenizer  # vLLM's accessor
    # vLLM's LLM.chat takes a conversation alone, and OpenAI's content parts
    assert [o["token_ids"] for o in llm.chat(conversation, greedy(4))] == [want["token_ids"]]
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}
    ]
    assert llm.chat(parts, greedy(4))[0]["token_ids"] == want["token_ids"]
    refused = {
        "conversations[0]: messages[0].role='wizard' is invalid": [[{"role": "wizard", "content": "x"}]],
        "'messages[0].content' has the wrong type": [[{"role": "user", "content": 5}]],
        "a part of type 'image_url'": [
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
        ],
        "messages is empty": [[]],
        "messages[0].foo": [[{"role": "user", "content": "x", "foo": 1}]],
        "conversations[1]: messages[0] has role 'tool' and needs the 'tool_call_id'": [
            conversation,
            [{"role": "tool", "content": "4"}],
        ],
        "conversations='hi' is invalid": "hi",
    }
    for says, conversations in refused.items():
        with pytest.raises(ValueError) as e:
            llm.chat(conversations, greedy(4))
        assert says in str(e.value)
    assert_nothing_held(llm)


def test_chat_continues_the_last_message_or_leaves_the_generation_prompt_out_as_vllm_does(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(tiny_model("qwen3"), max_running_req=4)
    conversation = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "Once upon"}]
    for options in ({"continue_final_message": True}, {"add_generation_prompt": False}, {}):
        template = {"add_generation_prompt": not options, **options}
        ids = llm.tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True, **template)[
            "input_ids"
        ]
        [got] = llm.chat(conversation, greedy(4), **options)
        [want] = llm.generate([list(ids)], greedy(4))
        assert got["prompt_tokens"] == len(ids) and got["token_ids"] == want["token_ids"], options
    for bad in (
        {"continue_final_message": True, "add_generation_prompt": True},
        {"continue_final_message": True},
    ):
        with pytest.raises(ValueError, match="continue_final_message"):
            llm.chat(conversation[:1] if len(bad) == 1 else conversation, greedy(4), **bad)
    assert_nothing_held(llm)


def test_n_completions_of_a_prompt_come_in_a_row_seeded_as_the_server_seeds_its_choices(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(tiny_model("llama"), max_running_req=8)
    prompts = [ID_PROMPTS[0], ID_PROMPTS[1]]
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3, ignore_eos=True)
    out = llm.generate(prompts, sampled)
    assert [o["prompt_tokens"] for o in out] == [len(prompts[0])] * 3 + [len(prompts[1])] * 3
    # choice i is the prompt sampled with seed + i: the same as asking for those seeds one prompt each
    one_each = [replace(sampled, n=1, seed=11 + i) for i in range(3)] * 2
    want = llm.generate([p for p in prompts for _ in range(3)], one_each)
    assert [o["token_ids"] for o in out] == [o["token_ids"] for o in want]
    assert len({tuple(o["token_ids"]) for o in out[:3]}) == 3, "the choices differ"
    # greedy choices are the greedy output, each
    [single] = llm.generate([prompts[0]], greedy(6))
    assert [o["token_ids"] for o in llm.generate([prompts[0]], replace(greedy(6), n=2))] == [
        single["token_ids"]
    ] * 2
    with pytest.raises(ValueError, match=r"n=0 is invalid: it must be an integer in \[1, 128\]"):
        llm.generate(prompts, replace(greedy(6), n=0))
    assert_nothing_held(llm)


def test_two_llms_one_after_another_both_work(
    tiny_model: Callable[[str], str], hf_reference: Reference
) -> None:
    llama, qwen3 = tiny_model("llama"), tiny_model("qwen3")
    results: list[list[list[int]]] = []
    for path in (llama, qwen3, llama):
        llm = LLM(path, dtype=torch.float32, max_running_req=4)
        try:
            results.append([o["token_ids"] for o in llm.generate(ID_PROMPTS, greedy(6))])
            assert_nothing_held(llm)
        finally:
            llm.shutdown()
    assert results == [hf_reference(p, ID_PROMPTS, 6) for p in (llama, qwen3, llama)]


def _run_example(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    monkeypatch.setattr(sys, "argv", ["ch07_scheduler.py", *argv])
    runpy.run_path("examples/ch07_scheduler.py", run_name="__main__")
    return capsys.readouterr().out


def test_the_chapter_example_script_prints_its_trace_and_matches_transformers(
    tiny_model: Callable[[str], str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _run_example([tiny_model("qwen3")], monkeypatch, capsys)
    lines = out.splitlines()
    assert lines[0] == "the scheduling trace:"
    assert [line.split()[:2] for line in lines[1:7]] == [["prefill", "bs=5"]] + [
        ["decode", f"bs={n}"] for n in (4, 3, 3, 2, 1)
    ]
    assert out.count("matches HF: True") == 5


@pytest.mark.slow
def test_the_chapter_example_script_runs_on_the_default_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _run_example([], monkeypatch, capsys)
    assert "prefill bs=5" in out
    assert out.count("matches HF: True") == 5


def test_two_llms_in_one_process_each_use_their_own_model_and_cache(
    tiny_model: Callable[[str], str], hf_reference: Reference, make_llm: Callable[..., LLM]
) -> None:
    """The layers reach the context (KV cache, page table) through a global: the engine that runs a step
    must be the one they see, whichever was built last, and one shut down must not break the other."""
    llama, qwen3 = tiny_model("llama"), tiny_model("qwen3")
    first = make_llm(llama, max_running_req=4)
    second = make_llm(qwen3, max_running_req=4)
    prompts = ID_PROMPTS[:3]
    want_llama, want_qwen3 = hf_reference(llama, prompts, 6), hf_reference(qwen3, prompts, 6)
    for _ in range(2):  # interleaved
        assert [o["token_ids"] for o in first.generate(prompts, greedy(6))] == want_llama
        assert [o["token_ids"] for o in second.generate(prompts, greedy(6))] == want_qwen3
    second.shutdown()
    assert [o["token_ids"] for o in first.generate(prompts, greedy(6))] == want_llama


def test_plain_decode_tokens_travel_as_one_token_step_message(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM]
) -> None:
    """A decode token that ends nothing and carries no logprobs goes out in the step's TokenStepMsg; the first
    token (prompt counts), the last (its finish) and a logprobs request's tokens go as messages of their own."""
    from minisgl.message import DetokenizeMsg
    from minisgl.message.tokenizer import TokenStepMsg

    llm = make_llm(tiny_model("qwen3"), max_running_req=4)
    plain: dict[int, int] = {}
    own: dict[int, list[DetokenizeMsg]] = {}
    send = llm.send_result

    def record(reply: list[Any]) -> None:
        for m in reply:
            if isinstance(m, TokenStepMsg):
                assert len(m.uids) == len(m.tokens) == len(set(m.uids))
                for uid in m.uids:
                    plain[uid] = plain.get(uid, 0) + 1
            else:
                own.setdefault(m.uid, []).append(m)
        send(reply)

    llm.send_result = record  # type: ignore[method-assign]
    params = [greedy(6), SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1), greedy(3)]
    out = llm.generate(ID_PROMPTS[:3], params)
    assert [len(o["token_ids"]) for o in out] == [6, 6, 3]
    a, b, c = sorted(own)
    assert plain == {a: 4, c: 1}  # all but the first and the last token
    assert [m.prompt_tokens > 0 for m in own[a]] == [True, False] and own[a][-1].finish_reason == "length"
    assert len(own[b]) == 6 and all(m.logprob is not None for m in own[b])
    assert len(out[1]["logprobs"]) == 6
    assert_nothing_held(llm)


def test_one_sampling_params_for_every_prompt_is_checked_once_by_the_scheduler(
    tiny_model: Callable[[str], str], make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler checks a SamplingParams object shared by a call's prompts once (generate's messages come
    together); objects of their own are each checked, and what depends on the prompt is checked for each."""
    from minisgl.scheduler import check

    llm = make_llm(tiny_model("llama"), max_running_req=4)
    checked: list[int] = []
    params_check = check.check_params
    monkeypatch.setattr(check, "check_params", lambda p: (checked.append(id(p)), params_check(p))[1])
    shared = greedy(2)
    out = llm.generate(ID_PROMPTS[:6], shared)
    assert checked == [id(shared)] and all(len(o["token_ids"]) == 2 for o in out)
    checked.clear()
    own = [greedy(2) for _ in range(6)]
    llm.generate(ID_PROMPTS[:6], own)
    assert sorted(checked) == sorted(map(id, own))
    # max_tokens is cut for each prompt by its own length, even when the object was checked already
    long_prompt = ID_PROMPTS[0] * (llm.engine.max_seq_len // len(ID_PROMPTS[0]) - 1)
    room = llm.engine.max_seq_len - len(long_prompt)
    out = llm.generate([ID_PROMPTS[1], long_prompt], greedy(room + 5))
    assert len(out[0]["token_ids"]) == room + 5 and len(out[1]["token_ids"]) == room
    assert_nothing_held(llm)
