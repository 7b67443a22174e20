"""Request fields of the OpenAI / vLLM / SGLang APIs beyond the basics, against a real server on a tiny model:
each is applied (and shown where the APIs show it) or refused with a 400 naming it; nothing is dropped."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
import torch
from test_server import SERVER_ARGS, Server

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "hello world"}]
FORCED = 42  # a token a +100 bias forces


@pytest.fixture(scope="module")
def model_dir(tiny_model: Callable[[str], str]) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[Server]:
    s = Server(["--model", model_dir, *SERVER_ARGS])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def name(server: Server) -> str:
    return server.client().models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_logprobs(model_dir: str) -> Callable[[list[int]], torch.Tensor]:
    """log_softmax of transformers' logits at every position of a sequence (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return run


def post(server: Server, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    return server.request("POST", path, json.dumps(body).encode())


def sse(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of a stream, without the final [DONE]."""
    import http.client

    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    data = conn.getresponse().read().decode()
    conn.close()
    events = [line.removeprefix("data: ") for line in data.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ---- never a silent ignore ------------------------------------------------------------------------
REFUSED: dict[str, tuple[str, dict[str, Any], str]] = {
    # case: (path, body, the param the error names)
    "unknown-completions": ("/v1/completions", {"prompt": "a", "frobnicate": 1}, "frobnicate"),
    "unknown-chat": ("/v1/chat/completions", {"messages": CHAT, "best_of_luck": 1}, "best_of_luck"),
    "unknown-message-field": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a", "mood": "x"}]},
        "messages[0].mood",
    ),
    "a-refusal-sent-back": (
        "/v1/chat/completions",
        {"messages": [*CHAT, {"role": "assistant", "content": "no", "refusal": "I can't"}]},
        "messages[1].refusal",
    ),
    "unknown-stream-option": (
        "/v1/completions",
        {"prompt": "a", "stream": True, "stream_options": {"include_usage": True, "extra": 1}},
        "stream_options.extra",
    ),
    "unknown-generate": ("/generate", {"text": "a", "lora_path": "x"}, "lora_path"),
    "unknown-generate-sampling": (
        "/generate",
        {"text": "a", "sampling_params": {"foo": 1}},
        "sampling_params.foo",
    ),
    "stream-options-without-stream": (
        "/v1/completions",
        {"prompt": "a", "stream_options": {"include_usage": True}},
        "stream_options",
    ),
    "cache-salt-empty": ("/v1/completions", {"prompt": "a", "cache_salt": ""}, "cache_salt"),
    "cache-salt-too-long": (
        "/v1/chat/completions",
        {"messages": CHAT, "cache_salt": "s" * 1025},
        "cache_salt",
    ),
    "cache-salt-a-number": ("/v1/completions", {"prompt": "a", "cache_salt": 7}, "cache_salt"),
    # this server runs without priority scheduling: a priority it would not keep is refused (0 is taken)
    "priority-without-priority-scheduling": (
        "/v1/chat/completions",
        {"messages": CHAT, "priority": 1},
        "priority",
    ),
    "priority-on-generate-without-priority-scheduling": (
        "/generate",
        {"text": "a", "priority": -2},
        "priority",
    ),
    "priority-as-a-string": ("/v1/completions", {"prompt": "a", "priority": "1"}, "priority"),
    "priority-as-a-bool": ("/v1/completions", {"prompt": "a", "priority": True}, "priority"),
    "priority-past-64-bits": ("/v1/completions", {"prompt": "a", "priority": 2**70}, "priority"),
    "priority-as-a-float": ("/generate", {"text": "a", "priority": 1.5}, "priority"),
    "truncate-to-nothing": (
        "/v1/completions",
        {"prompt": "a", "truncate_prompt_tokens": 0},
        "truncate_prompt_tokens",
    ),
    "truncate-below-minus-one": (
        "/v1/chat/completions",
        {"messages": CHAT, "truncate_prompt_tokens": -2},
        "truncate_prompt_tokens",
    ),
    "truncate-as-a-string": (
        "/v1/completions",
        {"prompt": "a", "truncate_prompt_tokens": "3"},
        "truncate_prompt_tokens",
    ),
    "truncate-as-a-bool": (
        "/v1/completions",
        {"prompt": "a", "truncate_prompt_tokens": True},
        "truncate_prompt_tokens",
    ),
    "truncate-past-64-bits": (
        "/v1/completions",
        {"prompt": [1, 2], "truncate_prompt_tokens": 2**64},
        "truncate_prompt_tokens",
    ),
    "request-id-empty": ("/v1/chat/completions", {"messages": CHAT, "request_id": ""}, "request_id"),
    "request-id-with-a-space": ("/v1/completions", {"prompt": "a", "request_id": "a b"}, "request_id"),
    "request-id-with-a-newline": (
        "/v1/completions",
        {"prompt": "a", "request_id": "a\nINFO forged"},
        "request_id",
    ),
    "request-id-too-long": ("/v1/completions", {"prompt": "a", "request_id": "x" * 257}, "request_id"),
    "request-id-a-number": ("/v1/completions", {"prompt": "a", "request_id": 5}, "request_id"),
    "rid-one-for-a-batch": ("/generate", {"text": ["a", "b"], "rid": "x"}, "rid"),
    "rid-too-few": ("/generate", {"text": ["a", "b"], "rid": ["x"]}, "rid"),
    "rid-with-a-space": ("/generate", {"text": "a", "rid": "x y"}, "rid"),
    "rid-a-number": ("/generate", {"text": "a", "rid": 5}, "rid"),
    "texts-in-logprobs-a-string": (
        "/generate",
        {"text": "a", "return_text_in_logprobs": "no"},
        "return_text_in_logprobs",
    ),
    "documents-a-string": ("/v1/chat/completions", {"messages": CHAT, "documents": "x"}, "documents"),
    "documents-field-not-a-word": (
        "/v1/chat/completions",
        {"messages": CHAT, "documents": [{"title": "a", "the text": "b"}]},
        "documents[0]",
    ),
    "documents-empty-one": ("/v1/chat/completions", {"messages": CHAT, "documents": [{}]}, "documents[0]"),
    "allowed-token-ids-empty": (
        "/v1/completions",
        {"prompt": "a", "allowed_token_ids": []},
        "allowed_token_ids",
    ),
    "allowed-token-ids-outside-the-vocabulary": (
        "/v1/chat/completions",
        {"messages": CHAT, "allowed_token_ids": [1, 99999]},
        "allowed_token_ids",
    ),
    "allowed-token-ids-in-generate": (
        "/generate",
        {"text": "a", "sampling_params": {"allowed_token_ids": [-3]}},
        "sampling_params.allowed_token_ids",
    ),
    "truncate-on-generate": (
        "/generate",
        {"text": "a", "truncate_prompt_tokens": 1},
        "truncate_prompt_tokens",
    ),
    "special-tokens-kept-as-a-number": (
        "/v1/chat/completions",
        {"messages": CHAT, "skip_special_tokens": 0},
        "skip_special_tokens",
    ),
    "no-spaces-between-special-tokens": (
        "/v1/completions",
        {"prompt": "a", "spaces_between_special_tokens": False},
        "spaces_between_special_tokens",
    ),
    # this server runs without --reasoning-parser: its answers keep the reasoning in the content
    "separate-reasoning-without-a-parser": (
        "/v1/chat/completions",
        {"messages": CHAT, "separate_reasoning": True},
        "separate_reasoning",
    ),
    "reasoning-held-without-a-parser": (
        "/v1/chat/completions",
        {"messages": CHAT, "stream": True, "stream_reasoning": False},
        "stream_reasoning",
    ),
    "separate-reasoning-as-a-string": (
        "/v1/chat/completions",
        {"messages": CHAT, "separate_reasoning": "yes"},
        "separate_reasoning",
    ),
    "reasoning-of-a-system-message": (
        "/v1/chat/completions",
        {"messages": [{"role": "system", "content": "a", "reasoning": "hm"}, *CHAT]},
        "messages[0].reasoning",
    ),
    "reasoning-of-a-user": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a", "reasoning_content": "hm"}]},
        "messages[0].reasoning_content",
    ),
    "store-true": ("/v1/chat/completions", {"messages": CHAT, "store": True}, "store"),
    "service-tier": ("/v1/chat/completions", {"messages": CHAT, "service_tier": "flex"}, "service_tier"),
    "both-template-flags": (
        "/v1/chat/completions",
        {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True},
        "continue_final_message",
    ),
    "continue-a-user-message": (
        "/v1/chat/completions",
        {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": False},
        "continue_final_message",
    ),
    "logit-bias-key": ("/v1/completions", {"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias"),
    "logit-bias-range": ("/v1/completions", {"prompt": "a", "logit_bias": {"1": 100.5}}, "logit_bias"),
    "logit-bias-vocab": ("/v1/completions", {"prompt": "a", "logit_bias": {"99999": 1}}, "logit_bias"),
    "logit-bias-generate": (
        "/generate",
        {"text": "a", "sampling_params": {"logit_bias": {"-3": 1}}},
        "sampling_params.logit_bias",
    ),
    "min-tokens-over-max": (
        "/v1/completions",
        {"prompt": "a", "max_tokens": 2, "min_tokens": 3},
        "min_tokens",
    ),
    "min-new-tokens": (
        "/generate",
        {"text": "a", "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 5}},
        "sampling_params.min_new_tokens",
    ),
    "prompt-logprobs-range": ("/v1/completions", {"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
    "max-tokens-over-context": ("/v1/completions", {"prompt": "a", "max_tokens": 512}, "max_tokens"),
    "max-completion-tokens-over-context": (
        "/v1/chat/completions",
        {"messages": CHAT, "max_completion_tokens": 100000},
        "max_completion_tokens",
    ),
    "max-new-tokens-over-context": (
        "/generate",
        {"text": "a", "sampling_params": {"max_new_tokens": 513}},
        "sampling_params.max_new_tokens",
    ),
    "max-tokens-0-without-echo": ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    "logprob-start-without-return-logprob": (
        "/generate",
        {"input_ids": [5, 6, 7], "logprob_start_len": 1},
        "logprob_start_len",
    ),
    "logprob-start-negative": (
        "/generate",
        {"input_ids": [5, 6, 7], "return_logprob": True, "logprob_start_len": -2},
        "logprob_start_len",
    ),
    "request-chat-template": (
        "/v1/chat/completions",
        {"messages": CHAT, "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
        "chat_template",
    ),
    "bad-words-of-spaces": ("/v1/chat/completions", {"messages": CHAT, "bad_words": ["  "]}, "bad_words"),
    "bad-words-a-string": ("/v1/completions", {"prompt": "a", "bad_words": "a"}, "bad_words"),
    # found by the scheduler, which tokenizes the words: nothing allowed is left to sample
    "bad-words-ban-every-allowed-token": (
        "/v1/completions",
        {"prompt": "a", "allowed_token_ids": [67], "bad_words": ["a"]},  # 67: the tiny tokenizer's "a"
        "bad_words",
    ),
    "bad-words-in-generate": (
        "/generate",
        {"text": "a", "sampling_params": {"bad_words": [""]}},
        "sampling_params.bad_words",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_field_not_applied_is_a_400_naming_it(server: Server, case: str) -> None:
    path, body, param = REFUSED[case]
    status, got = post(server, path, body)
    assert status == 400, got
    assert got["error"]["param"] == param, got
    assert got["error"]["type"] == "invalid_request_error"


def test_an_unknown_field_gets_openais_words_through_the_openai_client(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        server.client().completions.create(model="x", prompt="a", extra_body={"frobnicate": True})
    assert bad.value.status_code == 400
    assert bad.value.body["message"] == "Unrecognized request argument supplied: frobnicate"


def test_no_op_fields_of_openai_clients_change_nothing(server: Server, name: str) -> None:
    client = server.client()
    plain = client.chat.completions.create(model=name, messages=CHAT, max_tokens=6, temperature=0)
    noted = client.chat.completions.create(
        model=name,
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        user="u-1",
        metadata={"k": "v"},
        store=False,
        service_tier="auto",
        # what this server does without a reasoning parser, said explicitly
        extra_body={
            "safety_identifier": "s",
            "prompt_cache_key": "p",
            "separate_reasoning": False,
            "stream_reasoning": True,
        },
    )
    assert noted.choices[0].message.content == plain.choices[0].message.content
    # an answer's message sent back as the client got it (its null fields included), and a speaker's name
    history = [
        {**CHAT[0], "name": "ada"},
        # (tool_calls is the tools' to take)
        plain.choices[0].message.model_dump(exclude={"tool_calls"}),
        {"role": "user", "content": "and then?"},
    ]
    again = client.chat.completions.create(model=name, messages=history, max_tokens=2, temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length")


# ---- logit_bias and min_tokens --------------------------------------------------------------------
def test_logit_bias_forces_a_token_on_every_endpoint(server: Server, name: str) -> None:
    client = server.client()
    bias = {str(FORCED): 100}
    done = client.completions.create(
        model=name,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0.8,
        seed=1,
        logit_bias=bias,
        extra_body={"return_token_ids": True},
    )
    assert done.choices[0].model_extra["token_ids"] == [FORCED] * 4
    chat = client.chat.completions.create(
        model=name,
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        logit_bias=bias,
        extra_body={"return_token_ids": True},
    )
    assert chat.choices[0].model_extra["token_ids"] == [FORCED] * 4
    status, gen = post(
        server,
        "/generate",
        {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "logit_bias": bias}},
    )
    assert status == 200 and gen["meta_info"]["completion_tokens"] == 3
    forced_text = client.completions.create(model=name, prompt=[FORCED] * 3, max_tokens=1, echo=True)
    assert gen["text"] == forced_text.choices[0].text[: len(gen["text"])] and gen["text"]


def test_min_tokens_delays_eos_and_the_stop_is_reported(server: Server, tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "logit_bias": {str(eos): 100}}
    _, at_once = post(server, "/v1/completions", {**body, "logprobs": 1})
    choice = at_once["choices"][0]
    # only the EOS token: no text, yet the logprobs asked for are there (one entry, the EOS)
    assert choice["text"] == "" and choice["finish_reason"] == "stop" and choice["stop_reason"] is None
    # from the logits before the bias, as every logprob is
    assert choice["logprobs"]["token_logprobs"][0] < 0
    assert len(choice["logprobs"]["tokens"]) == at_once["usage"]["completion_tokens"] == 1
    _, delayed = post(server, "/v1/completions", {**body, "min_tokens": 3, "return_token_ids": True})
    ids = delayed["choices"][0]["token_ids"]
    assert len(ids) == 4 and ids[-1] == eos and eos not in ids[:3]
    assert delayed["choices"][0]["finish_reason"] == "stop"
    _, gen = post(
        server,
        "/generate",
        {
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": 10, "min_new_tokens": 2, "logit_bias": {str(eos): 100}},
        },
    )
    assert gen["meta_info"]["completion_tokens"] == 3 and gen["meta_info"]["matched_stop"] == eos


# ---- logprobs, echo and prompt logprobs -------------------------------------------------------------
def test_logprobs_0_gives_the_sampled_token_in_top_logprobs(server: Server, name: str) -> None:
    got = server.client().completions.create(
        model=name, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0
    )
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == 4
    assert lp.top_logprobs == [{t: x} for t, x in zip(lp.tokens, lp.token_logprobs)]


@pytest.mark.parametrize("max_tokens", [0, 1])
@pytest.mark.parametrize("form", ["ids", "text"])
def test_lm_eval_loglikelihood_requests_match_transformers(
    server: Server,
    tokenizer: Any,
    hf_logprobs: Callable[[list[int]], torch.Tensor],
    max_tokens: int,
    form: str,
) -> None:
    context, continuation = "The capital of France", " is Paris."
    ids = tokenizer.encode(context + continuation)
    # lm-eval --model local-completions: a batch of prompts, echo, one top logprob, greedy
    body = {
        "prompt": [ids, ids[:-2]] if form == "ids" else [context + continuation, tokenizer.decode(ids[:-2])],
        "echo": True,
        "logprobs": 1,
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 1234,
    }
    status, got = post(server, "/v1/completions", body)
    assert status == 200, got
    for choice, prompt in zip(got["choices"], [ids, ids[:-2]]):
        want = hf_logprobs(prompt)
        lp = choice["logprobs"]
        n = len(prompt)
        assert len(lp["tokens"]) == n + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = [want[p - 1, prompt[p]].item() for p in range(1, n)]
        assert lp["token_logprobs"][1:n] == pytest.approx(ref, abs=1e-4)
        for p in range(1, n):  # each top entry holds the most likely token and the prompt's
            top = lp["top_logprobs"][p]
            assert max(top.values()) == pytest.approx(want[p - 1].max().item(), abs=1e-4)
            assert lp["token_logprobs"][p] in top.values()
        prompt_text = tokenizer.decode(prompt)
        assert choice["text"].startswith(prompt_text)
        if max_tokens == 0:
            assert choice["text"] == prompt_text and choice["finish_reason"] == "length"
    assert got["usage"]["completion_tokens"] == 2 * max_tokens


def test_echo_streams_the_prompt_first_and_equals_the_plain_answer(server: Server) -> None:
    body = {"prompt": PROMPT, "echo": True, "max_tokens": 5, "temperature": 0, "logprobs": 2}
    _, plain = post(server, "/v1/completions", body)
    events = sse(server, "/v1/completions", {**body, "stream": True})
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    tokens = [
        t
        for e in events
        if e["choices"] and e["choices"][0]["logprobs"]
        for t in e["choices"][0]["logprobs"]["tokens"]
    ]
    assert text == plain["choices"][0]["text"] and text.startswith(PROMPT)
    assert tokens == plain["choices"][0]["logprobs"]["tokens"]


def test_prompt_logprobs_in_vllms_shape_and_past_the_prefix_cache(
    server: Server, name: str, tokenizer: Any, hf_logprobs: Callable[[list[int]], torch.Tensor]
) -> None:
    ids = tokenizer.encode(PROMPT + " Paris, and the capital of Italy is Rome.")
    want = hf_logprobs(ids)
    post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1})  # the prompt is in the prefix cache now
    _, got = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2})
    entries = got["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        entry = entries[p]
        mine = entry[str(ids[p])]
        assert mine["logprob"] == pytest.approx(want[p - 1, ids[p]].item(), abs=1e-4)
        assert mine["rank"] == int((want[p - 1] > want[p - 1, ids[p]]).sum()) + 1
        best = want[p - 1].topk(2)
        for rank, (value, token) in enumerate(zip(best.values.tolist(), best.indices.tolist()), 1):
            assert entry[str(token)]["rank"] == rank or token == ids[p]
            assert entry[str(token)]["logprob"] == pytest.approx(value, abs=1e-4)
    assert (
        "prompt_logprobs"
        not in post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1})[1]["choices"][0]
    )
    chat = server.client().chat.completions.create(
        model=name, messages=CHAT, max_tokens=1, extra_body={"prompt_logprobs": 0, "return_token_ids": True}
    )
    chat_entries, chat_ids = chat.model_extra["prompt_logprobs"], chat.model_extra["prompt_token_ids"]
    assert len(chat_entries) == len(chat_ids) and chat_entries[0] is None
    assert all(list(e) == [str(t)] for e, t in zip(chat_entries[1:], chat_ids[1:]))
    _, gen = post(
        server,
        "/generate",
        {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "prompt_logprobs": 1}},
    )
    inputs = gen["meta_info"]["input_token_logprobs"]
    assert inputs[0][0] is None and [x[1] for x in inputs] == ids
    assert inputs[1][0] == pytest.approx(want[0, ids[1]].item(), abs=1e-4)


# ---- what the answer shows --------------------------------------------------------------------------
def test_return_token_ids_gives_the_prompt_and_the_output_ids(
    server: Server, name: str, tokenizer: Any
) -> None:
    ids = tokenizer.encode(PROMPT)
    got = server.client().completions.create(
        model=name,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = got.choices[0].model_extra
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 5
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == got.choices[0].text
    events = sse(
        server,
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        },
    )
    streamed = [t for e in events for t in e["choices"][0].get("token_ids", [])]
    assert len(streamed) == 4 and "prompt_token_ids" in events[0]
    # streamed completions: every id arrives, also those of tokens whose text is still empty
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    _, whole = post(server, "/v1/completions", {**body, "return_token_ids": True})
    events = sse(server, "/v1/completions", {**body, "return_token_ids": True, "stream": True})
    streamed = [t for e in events for t in e["choices"][0].get("token_ids", [])]
    assert streamed == whole["choices"][0]["token_ids"] and len(streamed) == 12


def test_stop_reason_and_matched_stop_name_what_ended_the_output(
    server: Server, name: str, tokenizer: Any
) -> None:
    client = server.client()
    full = client.completions.create(
        model=name,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    text, ids = full.choices[0].text, full.choices[0].model_extra["token_ids"]
    stop_string = text[2:4]
    assert stop_string
    by_string = client.completions.create(
        model=name,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        stop=[stop_string],
        extra_body={"ignore_eos": True},
    )
    assert by_string.choices[0].model_extra["stop_reason"] == stop_string
    by_id = client.completions.create(
        model=name,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [ids[1]]},
    )
    assert by_id.choices[0].model_extra["stop_reason"] == ids[1]
    assert by_id.choices[0].finish_reason == "stop"
    length = client.completions.create(
        model=name, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
    )
    assert length.choices[0].model_extra["stop_reason"] is None
    _, gen = post(
        server,
        "/generate",
        {"text": PROMPT, "sampling_params": {"max_new_tokens": 8, "stop": [stop_string], "ignore_eos": True}},
    )
    assert gen["meta_info"]["matched_stop"] == stop_string


def test_system_fingerprint_is_one_string_on_answers_and_chunks(server: Server, name: str) -> None:
    client = server.client()
    a = client.chat.completions.create(model=name, messages=CHAT, max_tokens=2)
    b = client.completions.create(model=name, prompt=PROMPT, max_tokens=2)
    chunks = list(client.completions.create(model=name, prompt=PROMPT, max_tokens=2, stream=True))
    assert a.system_fingerprint and a.system_fingerprint == b.system_fingerprint
    assert {c.system_fingerprint for c in chunks} == {a.system_fingerprint}


def test_continuous_usage_stats_put_usage_on_every_chunk(server: Server) -> None:
    body = {
        "prompt": PROMPT,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    events = sse(server, "/v1/completions", body)
    with_choices = [e for e in events if e["choices"]]
    assert with_choices and all(e["usage"] is not None for e in with_choices)
    counts = [e["usage"]["completion_tokens"] for e in with_choices]
    assert counts == sorted(counts) and counts[-1] == 4
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4


def test_chat_template_flags_shape_the_prompt(server: Server, tokenizer: Any) -> None:
    convo = [*CHAT, {"role": "assistant", "content": "The answer"}]

    def prompt_ids(**flags: Any) -> list[int]:
        status, got = post(
            server,
            "/v1/chat/completions",
            {"messages": convo, "max_tokens": 1, "return_token_ids": True, **flags},
        )
        assert status == 200, got
        return got["prompt_token_ids"]

    new_turn = tokenizer.apply_chat_template(
        convo, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    closed = tokenizer.apply_chat_template(
        convo, add_generation_prompt=False, tokenize=True, return_dict=False
    )
    continued = tokenizer.apply_chat_template(
        convo, continue_final_message=True, tokenize=True, return_dict=False
    )
    assert len({tuple(new_turn), tuple(closed), tuple(continued)}) == 3
    assert prompt_ids() == list(new_turn)
    assert prompt_ids(add_generation_prompt=False) == list(closed)
    assert prompt_ids(continue_final_message=True, add_generation_prompt=False) == list(continued)
    assert prompt_ids(continue_final_message=True) == list(continued)
    assert tokenizer.decode(continued).endswith("The answer")


def test_add_special_tokens_reaches_the_tokenizer(server: Server, tokenizer: Any) -> None:
    """vLLM's add_special_tokens on a text prompt: the prompt's ids as `encode` gives them either way (the tiny
    tokenizer adds nothing; tests/test_add_special_tokens.py has one that adds its BOS)."""
    for flag in (True, False):
        body = {"prompt": PROMPT, "max_tokens": 1, "add_special_tokens": flag, "return_token_ids": True}
        status, got = post(server, "/v1/completions", body)
        assert status == 200, got
        assert got["choices"][0]["prompt_token_ids"] == tokenizer.encode(PROMPT, add_special_tokens=flag)


def test_skip_special_tokens_false_keeps_control_tokens_in_the_text(server: Server, tokenizer: Any) -> None:
    """vLLM's and SGLang's skip_special_tokens: a control token the model samples (forced by a bias) is left
    out of the text by default and with true, and kept with false, on every endpoint, whole and streamed."""
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")  # a control token that stops nothing
    bias = {str(start): 100}
    body = {"prompt": PROMPT, "max_tokens": 3, "logit_bias": bias, "return_token_ids": True}
    for flags in ({}, {"skip_special_tokens": True, "spaces_between_special_tokens": True}):
        status, got = post(server, "/v1/completions", {**body, **flags})
        assert status == 200, got
        assert got["choices"][0]["token_ids"] == [start] * 3 and got["choices"][0]["text"] == ""
    kept = "<|im_start|>" * 3
    assert tokenizer.decode([start] * 3) == kept
    status, got = post(server, "/v1/completions", {**body, "skip_special_tokens": False})
    assert status == 200 and got["choices"][0]["text"] == kept, got
    chat = {"messages": CHAT, "max_tokens": 3, "logit_bias": bias, "skip_special_tokens": False}
    status, got = post(server, "/v1/chat/completions", chat)
    assert status == 200 and got["choices"][0]["message"]["content"] == kept, got
    streamed = sse(server, "/v1/chat/completions", {**chat, "stream": True})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed if c["choices"]) == kept
    sampling = {"max_new_tokens": 3, "logit_bias": bias, "skip_special_tokens": False}
    status, got = post(server, "/generate", {"text": PROMPT, "sampling_params": sampling})
    assert status == 200 and got["text"] == kept, got


def test_chat_template_kwargs_reach_the_template_and_the_rest_is_refused(
    server: Server, tokenizer: Any, name: str
) -> None:
    """vLLM's and SGLang's chat_template_kwargs (the tiny template reads enable_thinking, as Qwen3's does):
    rendered as transformers renders them, the prompt's ids the same through /tokenize; a name the template
    does not take from a request is a 400 naming the field, as is the field beside a plain prompt."""
    off = tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False, enable_thinking=False
    )
    r = server.client().chat.completions.create(
        model=name,
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True},
    )
    assert r.model_extra is not None and r.model_extra["prompt_token_ids"] == list(off)
    status, got = post(
        server, "/tokenize", {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert status == 200 and got["tokens"] == list(off)
    for path, body in (
        ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"thinking_budget": 5}}),
        ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": False}}),
        ("/tokenize", {"prompt": "hi", "chat_template_kwargs": {"enable_thinking": False}}),
        ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": ["enable_thinking"]}),
    ):
        status, got = post(server, path, body)
        assert status == 400 and got["error"]["param"] == "chat_template_kwargs", (path, body, got)


# ---- truncate_prompt_tokens (vLLM's): the prompt's last tokens -------------------------------------
def _completion(server: Server, name: str, prompt: Any, **extra: Any) -> Any:
    body = {"return_token_ids": True, "ignore_eos": True, **extra.pop("extra_body", {})}
    return server.client().completions.create(
        model=name,
        prompt=prompt,
        max_tokens=extra.pop("max_tokens", 4),
        temperature=0,
        extra_body=body,
        **extra,
    )


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(
    server: Server, name: str, tokenizer: Any
) -> None:
    ids = list(range(3, 40))
    cut = _completion(server, name, ids, extra_body={"truncate_prompt_tokens": 5})
    assert cut.choices[0].prompt_token_ids == ids[-5:] and cut.usage.prompt_tokens == 5  # type: ignore[attr-defined]
    # the answer is that of the last tokens sent alone
    assert cut.choices[0].token_ids == _completion(server, name, ids[-5:]).choices[0].token_ids  # type: ignore[attr-defined]
    # a text: the last tokens of the whole text's tokens, and echo shows what was kept
    text = "Once upon a time, there was a small engine that served many requests at once."
    echoed = _completion(server, name, text, echo=True, extra_body={"truncate_prompt_tokens": 6})
    kept = tokenizer(text)["input_ids"][-6:]
    assert echoed.choices[0].prompt_token_ids == kept  # type: ignore[attr-defined]
    assert echoed.choices[0].text.startswith(tokenizer.decode(kept))
    # more than the prompt has: all of it
    whole = _completion(server, name, ids, extra_body={"truncate_prompt_tokens": 2**62})
    assert whole.choices[0].prompt_token_ids == ids  # type: ignore[attr-defined]


def test_truncate_prompt_tokens_lets_a_prompt_longer_than_the_context_in(server: Server, name: str) -> None:
    context = server.client().models.list().data[0].max_model_len  # type: ignore[attr-defined]
    ids = [3 + i % 200 for i in range(context + 50)]
    with pytest.raises(openai.BadRequestError) as over:
        _completion(server, name, ids)
    assert over.value.code == "context_length_exceeded"
    # -1: as many of the last tokens as leave room for max_tokens
    out = _completion(server, name, ids, max_tokens=10, extra_body={"truncate_prompt_tokens": -1})
    assert out.choices[0].prompt_token_ids == ids[-(context - 10) :] and out.usage.completion_tokens == 10  # type: ignore[attr-defined]
    # a chat: the rendered conversation's last tokens (the start of the conversation is what goes)
    # (longer than the context, shorter than the characters the tokenizer takes whole: 8 a token of it)
    messages = [{"role": "user", "content": "hello world " * (context // 2)}]
    chat = server.client().chat.completions.create(
        model=name,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=3,
        extra_body={"truncate_prompt_tokens": 40, "return_token_ids": True},
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == 40
    status, got = post(server, "/tokenize", {"messages": messages})
    assert status == 200 and chat.prompt_token_ids == got["tokens"][-40:]  # type: ignore[attr-defined]
    assert len(got["tokens"]) > context
    # a text longer than the server tokenizes whole in one step is refused, saying what to send instead
    status, got = post(
        server,
        "/v1/completions",
        {"prompt": "ab " * (4 * context), "truncate_prompt_tokens": 8, "max_tokens": 1},
    )
    assert status == 400 and got["error"]["param"] == "truncate_prompt_tokens", got
    assert "token ids" in got["error"]["message"]


def test_request_id_names_the_answer_and_its_chunks(server: Server, name: str) -> None:
    client = server.client()
    chat = client.chat.completions.create(
        model=name,
        messages=CHAT,
        max_tokens=2,
        extra_body={"request_id": "call-7_b"},  # type: ignore[arg-type]
    )
    assert chat.id == "chatcmpl-call-7_b"
    chunks = list(
        client.completions.create(
            model=name, prompt="a", max_tokens=3, stream=True, extra_body={"request_id": "x" * 256}
        )
    )
    assert {c.id for c in chunks} == {"cmpl-" + "x" * 256}
    # without one, each call its own
    ids = {client.completions.create(model=name, prompt="a", max_tokens=1).id for _ in range(2)}
    assert len(ids) == 2 and all(i.startswith("cmpl-") for i in ids)
    assert server.wait_log("request chatcmpl-call-7_b:")


def test_cache_salt_shares_cached_prefixes_only_within_a_salt(server: Server, name: str) -> None:
    prompt = [5 + (i * 7) % 250 for i in range(60)]  # no other test sends it: nothing of it is cached yet

    def cached(salt: str | None) -> tuple[int, list[int]]:
        out = _completion(server, name, prompt, extra_body={} if salt is None else {"cache_salt": salt})
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        return out.usage.prompt_tokens_details.cached_tokens or 0, out.choices[0].token_ids  # type: ignore[attr-defined]

    runs = [cached(salt) for salt in ("secret-a", "secret-a", "secret-b", None, None, "secret-b")]
    # the first of each salt computes the whole prompt; the second reads all of it but the last token from the
    # cache. (The unsalted first may find a first token or two that other tests' prompts began with, never more.)
    hits = [n for n, _ in runs]
    assert hits[:3] == [0, 59, 0] and hits[3] < 10 and hits[4:] == [59, 59], hits
    assert all(tokens == runs[0][1] for _, tokens in runs)  # the same greedy answer whatever was cached


def test_flush_cache_empties_the_prefix_cache_when_nothing_runs(server: Server, name: str) -> None:
    prompt = [7 + (i * 11) % 240 for i in range(40)]

    def cached() -> int:
        out = _completion(server, name, prompt, max_tokens=2)
        return out.usage.prompt_tokens_details.cached_tokens or 0

    cached()
    assert cached() == 39
    # SGLang's route (GET or POST) and vLLM's
    for method, path in (("POST", "/flush_cache"), ("GET", "/flush_cache"), ("POST", "/reset_prefix_cache")):
        status, got = server.request(method, path)
        assert status == 200 and got["status"] == "ok", got
        assert cached() == 0  # computed in full again, then cached for the next
    # refused while a request runs: a flush then would empty only what no request holds
    stream = server.client().completions.create(
        model=name, prompt=prompt, max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    status, got = server.request("POST", "/flush_cache")
    assert status == 400 and got["error"]["code"] == "server_busy", got
    stream.close()


def test_generate_takes_sglangs_rid_and_return_text_in_logprobs(server: Server) -> None:
    short = {"max_new_tokens": 2}
    status, one = post(server, "/generate", {"text": "a", "rid": "job-1", "sampling_params": short})
    assert status == 200 and one["meta_info"]["id"] == "job-1", one
    assert server.wait_log("request job-1:")
    status, batch = post(
        server, "/generate", {"text": ["a", "b"], "rid": ["x", "y"], "sampling_params": short}
    )
    assert status == 200 and [b["meta_info"]["id"] for b in batch] == ["x", "y"], batch
    status, choices = post(
        server, "/generate", {"text": "a", "rid": "z", "sampling_params": {**short, "n": 2}}
    )
    assert status == 200 and [c["meta_info"]["id"] for c in choices] == ["z/0", "z/1"], choices
    body = {"text": "a", "return_logprob": True, "top_logprobs_num": 1, "sampling_params": short}
    _, texts = post(server, "/generate", body)
    _, bare = post(server, "/generate", {**body, "return_text_in_logprobs": False})
    for key in ("output_token_logprobs",):
        assert all(isinstance(e[2], str) for e in texts["meta_info"][key])
        assert [e[:2] for e in bare["meta_info"][key]] == [e[:2] for e in texts["meta_info"][key]]
        assert all(e[2] is None for e in bare["meta_info"][key])
    assert all(x[2] is None for top in bare["meta_info"]["output_top_logprobs"] for x in top)


def test_chat_echo_starts_the_answer_with_the_assistant_message_it_continues(
    server: Server, name: str
) -> None:
    messages = [*CHAT, {"role": "assistant", "content": "Once upon"}]
    body = {"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True}

    def answer(echo: bool, stream: bool = False, msgs: list[dict[str, str]] = messages) -> str:
        out = server.client().chat.completions.create(
            model=name, messages=msgs, max_tokens=5, temperature=0, stream=stream,  # type: ignore[arg-type]
            extra_body={**body, "echo": echo} if msgs is messages else {"echo": echo},
        )  # fmt: skip
        if not stream:
            return out.choices[0].message.content or ""  # type: ignore[union-attr]
        return "".join(c.choices[0].delta.content or "" for c in out if c.choices)  # type: ignore[union-attr]

    plain = answer(False)
    assert answer(True) == "Once upon" + plain == answer(True, stream=True)
    # the last message a user's: nothing to echo (vLLM's rule)
    assert answer(True, msgs=CHAT) == answer(False, msgs=CHAT)


def test_documents_are_written_by_the_template_as_client_text(
    server: Server, name: str, tokenizer: Any
) -> None:
    docs = [{"title": "Paris", "text": "the capital of France"}, {"title": "Rome", "text": "Italy's"}]

    def prompt_ids(**extra: Any) -> list[int]:
        out = server.client().chat.completions.create(
            model=name, max_tokens=1, extra_body={"return_token_ids": True, **extra.pop("body", {})}, **extra
        )
        return out.prompt_token_ids  # type: ignore[attr-defined]

    # the tiny template writes the documents as a first system message: the same prompt as that message sent
    as_system = "Paris: the capital of France\nRome: Italy's\n"
    with_docs = prompt_ids(messages=CHAT, body={"documents": docs})
    assert with_docs == prompt_ids(messages=[{"role": "system", "content": as_system}, *CHAT])
    assert with_docs != prompt_ids(messages=CHAT)
    # a control token a client wrote into a document stays text: only the template's own are control tokens
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    spelled = prompt_ids(messages=CHAT, body={"documents": [{"title": "x", "text": "<|im_end|>"}]})
    assert spelled.count(end) == 2  # the system block's and the user message's


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server: Server, name: str) -> None:
    body = {"return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True}
    chat = server.client().chat.completions.create(
        model=name, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2, extra_body=body
    )
    ids = chat.choices[0].token_ids  # type: ignore[attr-defined]
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [e.token for e in content] == [f"token_id:{i}" for i in ids]
    assert all(e.bytes == list(e.token.encode()) for e in content)
    assert all(x.token.startswith("token_id:") for e in content for x in e.top_logprobs)
    plain = server.client().chat.completions.create(
        model=name, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].message.content == plain.choices[0].message.content  # the text as it was
    done = server.client().completions.create(
        model=name, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1, echo=True, extra_body=body
    )
    lp = done.choices[0].logprobs
    assert lp is not None and all(t.startswith("token_id:") for t in lp.tokens)
    assert lp.tokens[-3:] == [f"token_id:{i}" for i in done.choices[0].token_ids]  # type: ignore[attr-defined]
    # the offsets still count the text's characters
    assert lp.text_offset[-1] < len(done.choices[0].text)


def test_allowed_token_ids_hold_every_sampled_token(server: Server, name: str) -> None:
    allowed = [5, 9, 17, 40]
    out = server.client().chat.completions.create(
        model=name,
        messages=CHAT,
        max_tokens=10,
        temperature=1.0,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True},
    )
    assert set(out.choices[0].token_ids) <= set(allowed) and len(out.choices[0].token_ids) == 10  # type: ignore[attr-defined]


def test_responses_give_the_output_texts_logprobs_where_asked(server: Server, name: str) -> None:
    client = server.client()
    ask = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}
    kwargs = {"model": name, "input": "hello world", "max_output_tokens": 5, "temperature": 0}
    whole = client.responses.create(**kwargs, extra_body={"ignore_eos": True}, **ask)  # type: ignore[call-overload]
    part = whole.output[0].content[0]
    assert len(part.logprobs) == 5 and "".join(t.token for t in part.logprobs) == whole.output_text
    assert all(len(t.top_logprobs) == 2 for t in part.logprobs)
    # the chat route's for the same conversation
    chat = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "hello world"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    want = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [t.token for t in part.logprobs] == [t.token for t in want]
    # (the prompt read from the prefix cache the second time: the same values to float32's rounding)
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(part.logprobs, want))
    events = list(client.responses.create(**kwargs, stream=True, extra_body={"ignore_eos": True}, **ask))  # type: ignore[call-overload]
    # the deltas carry their tokens' (a token whose text is held back, with the text that follows); the done
    # events all of them
    streamed = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    done = events[-1].response.output[0].content[0].logprobs
    assert [t.token for t in done] == [t.token for t in part.logprobs]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(done, part.logprobs))
    assert [t.token for t in streamed] == [t.token for t in done][: len(streamed)] and len(streamed) >= 3
    # not asked for: none
    assert client.responses.create(**kwargs).output[0].content[0].logprobs == []  # type: ignore[call-overload]
    for body, param in (({"top_logprobs": 2}, "top_logprobs"), ({**ask, "top_logprobs": 21}, "top_logprobs")):
        status, got = post(server, "/v1/responses", {"model": name, "input": "a", **body})
        assert status == 400 and got["error"]["param"] == param, got


def test_bad_words_never_appear_in_the_output(server: Server, name: str, tokenizer: Any) -> None:
    client = server.client()
    kwargs: dict[str, Any] = {"model": name, "messages": CHAT, "max_tokens": 12, "temperature": 0}
    ids = {"return_token_ids": True, "ignore_eos": True}
    free = client.chat.completions.create(**kwargs, extra_body=ids).choices[0].token_ids  # type: ignore[attr-defined]
    # a token of the free answer that is a word as the tokenizer writes it (alone or after a space)
    token = next(
        t
        for t in free
        if tokenizer.decode([t]).strip()
        and tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t]
    )
    word = tokenizer.decode([token]).strip()
    banned = [token]
    out = client.chat.completions.create(**kwargs, extra_body={**ids, "bad_words": [word]})
    tokens = out.choices[0].token_ids  # type: ignore[attr-defined]
    assert banned[0] in free and len(banned) == 1 and banned[0] not in tokens and len(tokens) == 12
    # the same on /generate, in SGLang's sampling_params
    body = {"input_ids": [5, 6, 7], "sampling_params": {"bad_words": [word], "max_new_tokens": 12}}
    status, got = post(server, "/generate", {**body, "return_logprob": True})
    assert status == 200 and banned[0] not in [e[1] for e in got["meta_info"]["output_token_logprobs"]], got


def test_logprob_start_len_gives_the_prompts_logprobs_from_that_position(
    server: Server, hf_logprobs: Callable[[list[int]], torch.Tensor]
) -> None:
    prompt = [5, 9, 14, 3, 40, 41]
    body: dict[str, Any] = {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 2}
    body["sampling_params"] = {"max_new_tokens": 2, "temperature": 0}
    metas = {}
    for start in (-1, 0, 2, 6, 2**63 - 1):
        status, got = post(server, "/generate", {**body, "logprob_start_len": start})
        assert status == 200, got
        metas[start] = got["meta_info"]
    assert "input_token_logprobs" not in metas[-1] and len(metas[-1]["output_token_logprobs"]) == 2
    whole = metas[0]["input_token_logprobs"]
    assert (
        [e[1] for e in whole] == prompt and whole[0][0] is None and metas[0]["input_top_logprobs"][0] is None
    )
    # the entries from position 2 on are the whole list's, and transformers' log-probabilities
    assert metas[2]["input_token_logprobs"] == whole[2:]
    assert metas[2]["input_top_logprobs"] == metas[0]["input_top_logprobs"][2:]
    assert all(len(top) == 2 for top in metas[2]["input_top_logprobs"])
    ref = hf_logprobs(prompt)
    for p, (logprob, token, _) in enumerate(metas[2]["input_token_logprobs"], start=2):
        assert abs(logprob - float(ref[p - 1, token])) < 1e-3
    assert metas[6]["input_token_logprobs"] == [] and metas[2**63 - 1]["input_token_logprobs"] == []


def test_include_stop_str_in_output_keeps_what_ended_the_output(server: Server, name: str) -> None:
    client = server.client()
    kwargs: dict[str, Any] = {"model": name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True, "return_token_ids": True})
    text, ids = full.choices[0].text, full.choices[0].model_extra["token_ids"]
    stop = text[2:4]
    kept = client.completions.create(
        **kwargs, stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": True}
    )
    cut = text.find(stop)
    assert kept.choices[0].text == text[: cut + len(stop)] and kept.choices[0].finish_reason == "stop"
    # a stop token: in the text and the token ids (vLLM's), and SGLang's no_stop_trim on /generate the same
    by_id = client.completions.create(
        **kwargs,
        extra_body={
            "ignore_eos": True,
            "stop_token_ids": [ids[2]],
            "include_stop_str_in_output": True,
            "return_token_ids": True,
        },
    )
    assert by_id.choices[0].model_extra["token_ids"] == ids[:3]
    status, gen = post(
        server,
        "/generate",
        {
            "text": PROMPT,
            "sampling_params": {
                "max_new_tokens": 8,
                "stop": [stop],
                "ignore_eos": True,
                "no_stop_trim": True,
            },
        },
    )
    assert status == 200 and gen["text"] == kept.choices[0].text, gen
    status, got = post(server, "/v1/completions", {"prompt": "a", "include_stop_str_in_output": "yes"})
    assert status == 400 and got["error"]["param"] == "include_stop_str_in_output"
