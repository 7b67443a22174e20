"""Structured output: json_schema, regex, ebnf and choice constrain what a request generates, offline and
through the server (OpenAI response_format, SGLang's fields, vLLM's guided_* and structured_outputs).

Outputs are checked the way a user would: json.loads and a schema check written here, re.fullmatch.
A random tiny model may not close a JSON object within max_tokens: then the text must still be a prefix
the grammar accepts.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_trace import host_steps, load
from tiny import assert_nothing_held, overlap_loop_llm

from minisgl.constrained.grammar import MAX_GRAMMAR_CHARS, GrammarManager, apply_token_mask, choice_regex
from minisgl.core import Batch, RequestError, SamplingParams, set_global_ctx
from minisgl.env import ENV
from minisgl.llm import LLM

xgr = pytest.importorskip("xgrammar")

_BIG = {"type": "object", "properties": {f"p{i:05d}": {"type": "integer"} for i in range(1500)}}
_BIG_TEXT = "a" * (MAX_GRAMMAR_CHARS + 1)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "member"],
    "additionalProperties": False,
}


def conforms(value: Any, schema: dict[str, Any]) -> bool:
    """The schemas these tests build: objects of string / integer / boolean / enum properties."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
        return ok and schema.get("minimum", value) <= value <= schema.get("maximum", value)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "object":
        props = schema.get("properties", {})
        return (
            isinstance(value, dict)
            and all(k in value for k in schema.get("required", []))
            and all(k in props and conforms(v, props[k]) for k, v in value.items())
        )
    raise AssertionError(f"no check for {schema}")


def is_prefix(text: str, schema: dict[str, Any], tokenizer: Any) -> bool:
    """`text` can still be completed into JSON that the schema accepts."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False)
    return xgr.GrammarMatcher(compiled).accept_string(text)


def check_json(out: dict[str, Any], schema: dict[str, Any], tokenizer: Any) -> None:
    if out["finish_reason"] == "stop":
        assert conforms(json.loads(out["text"]), schema), out["text"]
    else:
        assert out["finish_reason"] == "length" and is_prefix(out["text"], schema, tokenizer), out


def test_token_mask_keeps_exactly_the_tokens_whose_bit_is_set() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word is partly padding
    mask = torch.randint(-(2**31), 2**31, (5, 4), dtype=torch.int64, generator=gen).to(torch.int32)
    logits = torch.randn(5, vocab, generator=gen)
    out = apply_token_mask(logits, mask)
    for i in range(5):
        for t in range(vocab):
            allowed = (int(mask[i, t // 32]) >> (t % 32)) & 1
            assert out[i, t] == (logits[i, t] if allowed else float("-inf"))


def test_sampling_never_draws_a_masked_token_even_where_its_noise_is_zero() -> None:
    from minisgl.engine.sample import BatchSamplingArgs, Sampler, hash_uniform

    # seed 14702, step 0: token 3300's uniform rounds to 1, so its exponential noise is 0
    seeds, steps = torch.tensor([14702]), torch.tensor([0])
    assert hash_uniform(seeds, steps, 4096)[0, 3300] == 1.0
    mask = torch.zeros(1, 4096 // 32, dtype=torch.int32)
    mask[0, 0] = 0b1111  # tokens 0-3 only
    args = BatchSamplingArgs(
        greedy=False, temperatures=torch.ones(1, 1), seeds=seeds, steps=steps, token_mask=mask
    )
    token = Sampler(torch.device("cpu"), 4096).sample(torch.randn(1, 4096), args)
    assert int(token[0]) in range(4)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model: Callable[[str], str]) -> Iterator[LLM]:
    llm = LLM(tiny_model("llama"), dtype=torch.float32, max_running_req=16)
    yield llm
    llm.shutdown()


PROMPTS = ["The capital of France is", "1 + 1 = 2, 2 + 2 =", "Once upon a time"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_parses_and_conforms_on_a_tiny_model(tiny_llm: LLM, temperature: float) -> None:
    sp = SamplingParams(max_tokens=120, temperature=temperature, seed=1, json_schema=json.dumps(PERSON))
    outs = tiny_llm.generate(PROMPTS, sp)
    for out in outs:
        check_json(out, PERSON, tiny_llm.tokenizer)
    assert any(o["finish_reason"] == "stop" for o in outs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_choice_and_ebnf_outputs_match(tiny_llm: LLM, temperature: float) -> None:
    regex = r"[0-9]{3}-[0-9]{4}"
    choices = ["Paris", "New York (US)", "a.b*c"]
    ebnf = 'root ::= "yes" | "no" | "maybe " [0-9]'
    kw: dict[str, Any] = dict(max_tokens=30, temperature=temperature, seed=3)
    outs = tiny_llm.generate(
        PROMPTS * 3,
        [SamplingParams(regex=regex, **kw)] * 3
        + [SamplingParams(regex=choice_regex(choices), **kw)] * 3
        + [SamplingParams(ebnf=ebnf, **kw)] * 3,
    )
    for out in outs:
        assert out["finish_reason"] == "stop", out
    assert all(re.fullmatch(regex, o["text"]) for o in outs[:3]), outs[:3]
    assert all(o["text"] in choices for o in outs[3:6]), outs[3:6]
    assert all(re.fullmatch(r"yes|no|maybe [0-9]", o["text"]) for o in outs[6:]), outs[6:]


def test_unconstrained_requests_beside_constrained_ones_get_their_own_tokens(tiny_llm: LLM) -> None:
    free = SamplingParams(max_tokens=24, ignore_eos=True)
    alone = tiny_llm.generate(PROMPTS, free)
    mixed = tiny_llm.generate(
        PROMPTS + PROMPTS, [free] * 3 + [SamplingParams(max_tokens=24, json_schema=json.dumps(PERSON))] * 3
    )
    assert [o["token_ids"] for o in mixed[:3]] == [o["token_ids"] for o in alone]


@pytest.fixture
def overlap_llm(
    tiny_llm: LLM, tiny_model: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., LLM]]:
    """overlap_llm(**kwargs) -> an LLM on the tiny model that runs the overlap loop, checking every table row
    and KV page after each step; shut down when the test ends."""
    monkeypatch.setattr(ENV.DEBUG_CHECK_INTEGRITY, "value", True)
    built: list[LLM] = []

    def make(**kwargs: Any) -> LLM:
        built.append(overlap_loop_llm(tiny_model("llama"), dtype=torch.float32, max_running_req=16, **kwargs))
        return built[-1]

    yield make
    for llm in built:
        llm.shutdown()
    # a process runs one engine at a time: the module's engine takes its context back
    set_global_ctx(tiny_llm.engine.ctx)


# constrained (greedy and sampled) and unconstrained requests, mixed in every batch
MIXED = [
    SamplingParams(max_tokens=40, json_schema=json.dumps(PERSON)),
    SamplingParams(max_tokens=20, ignore_eos=True),
    SamplingParams(max_tokens=30, regex=r"[0-9]{3}-[0-9]{4}", temperature=1.0, seed=5),
    SamplingParams(max_tokens=60, json_schema=json.dumps(PERSON), temperature=1.0, seed=7),
    SamplingParams(max_tokens=25, temperature=0.8, seed=11),
    SamplingParams(max_tokens=30, regex=choice_regex(["Paris", "New York (US)", "a.b*c"])),
]


def test_overlap_loop_gives_the_tokens_of_the_plain_loop_with_constrained_requests(
    tiny_llm: LLM, overlap_llm: Callable[..., LLM]
) -> None:
    prompts = PROMPTS * 2
    plain = tiny_llm.generate(prompts, MIXED)
    llm = overlap_llm()
    overlapped = llm.generate(prompts, MIXED)
    assert_nothing_held(llm)
    assert not llm.grammars.active  # every matcher is gone with its request
    # a second round: constrained requests have finished, the loop runs unconstrained batches whole
    free = llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o["token_ids"] for o in overlapped] == [o["token_ids"] for o in plain]
    assert [o["finish_reason"] for o in overlapped] == [o["finish_reason"] for o in plain]
    for i in (0, 3):
        check_json(overlapped[i], PERSON, llm.tokenizer)
    assert overlapped[2]["finish_reason"] == "stop" and re.fullmatch(
        r"[0-9]{3}-[0-9]{4}", overlapped[2]["text"]
    )
    assert overlapped[5]["text"] in ("Paris", "New York (US)", "a.b*c")
    assert len(overlapped[1]["token_ids"]) == 20
    assert all(len(o["token_ids"]) == 8 for o in free)


def test_overlap_loop_runs_the_next_model_before_handling_constrained_results(
    tiny_llm: LLM, overlap_llm: Callable[..., LLM], tmp_path: Any
) -> None:
    path = str(tmp_path / "overlap.json")
    llm = overlap_llm(trace=path)
    params = SamplingParams(max_tokens=30, json_schema=json.dumps(PERSON))
    outs = llm.generate(PROMPTS, params)
    llm.shutdown()
    for out in outs:
        check_json(out, PERSON, tiny_llm.tokenizer)
    events = load(path)
    steps = {s["args"]["step"]: s for s in host_steps(events)}
    results = {e["args"]["step"]: e for e in events if e["ph"] == "X" and e["name"] == "results"}
    assert len(steps) > 10 and set(results) == set(steps)
    # every step is constrained here; step k + 1's model had run (on the CPU the launch computes it)
    # before step k's tokens were handled, and so before step k + 1's masks could be filled
    for k in range(1, len(steps)):
        launched = steps[k + 1]["ts"] + steps[k + 1]["dur"]
        assert launched <= results[k]["ts"], (k, steps[k + 1], results[k])
        # ... and step k + 1's results come after step k's
        assert results[k]["ts"] + results[k]["dur"] <= results[k + 1]["ts"]


def test_aborting_constrained_requests_under_overlap_frees_everything(
    tiny_llm: LLM, overlap_llm: Callable[..., LLM]
) -> None:
    prompts = PROMPTS * 2
    params = [SamplingParams(max_tokens=40, json_schema=json.dumps(PERSON))] * 4 + MIXED[1:3]
    # first: a process runs one engine at a time, and the next one built takes the context
    reference = tiny_llm.generate(prompts, params)
    llm = overlap_llm()
    decodes: dict[int, int] = {}
    aborted: list[int] = []

    def abort_mid_run(batch: Batch | None) -> None:
        if batch is None or not batch.is_decode:
            return
        for r in batch.reqs:
            decodes[r.uid] = decodes.get(r.uid, 0) + 1
            # 0: in its third decode step (in flight when the abort is taken); 3: in its first
            if (r.uid, decodes[r.uid]) in ((0, 3), (3, 1)) and r.uid not in aborted:
                aborted.append(r.uid)
                llm.abort(r.uid)

    llm.step_observers.append(abort_mid_run)
    outs = llm.generate(prompts, params)
    assert sorted(aborted) == [0, 3]
    assert outs[0]["finish_reason"] == "abort" and outs[3]["finish_reason"] == "abort"
    for i in (1, 2):
        check_json(outs[i], PERSON, llm.tokenizer)
    assert len(outs[4]["token_ids"]) == 20 and re.fullmatch(r"[0-9]{3}-[0-9]{4}", outs[5]["text"])
    assert_nothing_held(llm)
    assert not llm.grammars.active
    # what the aborts freed is reused: the same requests again, none aborted, give the plain loop's tokens
    llm.step_observers.clear()
    again = llm.generate(prompts, params)
    assert [o["token_ids"] for o in again] == [o["token_ids"] for o in reference]
    assert_nothing_held(llm)


def test_two_constraints_or_a_grammar_that_does_not_compile_are_refused_naming_the_field(
    tiny_llm: LLM,
) -> None:
    with pytest.raises(RequestError) as e:
        tiny_llm.generate("x", SamplingParams(json_schema="{}", regex="a"))
    assert e.value.param == "regex" and "only one of" in str(e.value)
    for field, bad in [
        ("json_schema", '{"type": 5}'),
        ("json_schema", "{not json"),
        ("regex", "a(b"),
        ("ebnf", "x"),
    ]:
        with pytest.raises(RequestError) as e:
            tiny_llm.generate("x", SamplingParams(**{field: bad}))
        assert e.value.param == field and str(e.value).startswith(f"{field} does not compile"), str(e.value)


def test_a_grammar_text_over_the_size_limit_is_refused_naming_the_field(tiny_llm: LLM) -> None:
    assert len(json.dumps(_BIG)) > MAX_GRAMMAR_CHARS
    for field, text in [
        ("json_schema", json.dumps(_BIG)),
        ("regex", _BIG_TEXT),
        ("ebnf", f'root ::= "{_BIG_TEXT}"'),
    ]:
        with pytest.raises(RequestError) as e:
            tiny_llm.generate("x", SamplingParams(**{field: text}))
        assert e.value.param == field and f"at most {MAX_GRAMMAR_CHARS}" in str(e.value), str(e.value)


def test_grammars_compile_on_a_thread_while_the_caller_goes_on(
    tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = GrammarManager(tiny_llm.tokenizer, tiny_llm.engine.model_config.vocab_size, [2])
    compile_grammar = manager._compile
    release = threading.Event()

    def slow_compile(kind: str, text: str) -> Any:
        assert threading.current_thread() is not threading.main_thread()
        release.wait(30)
        return compile_grammar(kind, text)

    monkeypatch.setattr(manager, "_compile", slow_compile)
    req = SimpleNamespace(uid=1, can_decode=True)
    try:
        manager.add(1, SamplingParams(regex="[0-9]{3}"))  # returns while its compile is held
        manager.add(2, SamplingParams(regex="[a-z]{3}"))
        assert manager.active and not release.is_set()
        manager.remove(2)  # a request aborted while it waits for its grammar leaves nothing
        release.set()
        mask = manager.fill_masks([req, SimpleNamespace(uid=3, can_decode=True)])
        assert mask is not None
        allowed = [t for t in range(manager.vocab_size) if (int(mask[0, t // 32]) >> (t % 32)) & 1]
        texts = {tiny_llm.tokenizer.decode([t]) for t in allowed}
        assert texts and all(re.fullmatch("[0-9]{1,3}", t) for t in texts), texts
        assert bool((mask[1] == -1).all())  # an unconstrained row allows everything
        manager.remove(1)
        assert not manager.active
    finally:
        release.set()
        manager.close()


def test_without_xgrammar_a_constrained_request_is_refused_saying_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    from minisgl.constrained.grammar import check_grammar

    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(RequestError, match=r"pip install 'minisgl\[grammar\]'"):
        check_grammar(SamplingParams(regex="[a-z]+ without xgrammar"))
    check_grammar(SamplingParams())  # free text needs nothing


_PROPERTY = st.one_of(
    st.just({"type": "string", "maxLength": 6}),
    st.just({"type": "integer", "minimum": -50, "maximum": 999}),
    st.just({"type": "boolean"}),
    st.lists(st.text("abcxyz ", min_size=1, max_size=5), min_size=1, max_size=3, unique=True).map(
        lambda xs: {"type": "string", "enum": xs}
    ),
)


@st.composite
def schemas(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(st.text("abcdefgh_", min_size=1, max_size=6), min_size=1, max_size=4, unique=True))
    props = {n: draw(_PROPERTY) for n in names}
    required = draw(st.lists(st.sampled_from(names), unique=True))
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas(), temperature=st.sampled_from([0.0, 1.0]))
def test_generated_schemas_give_conforming_json_or_a_valid_prefix(
    tiny_llm: LLM, schema: dict[str, Any], temperature: float
) -> None:
    sp = SamplingParams(max_tokens=40, temperature=temperature, seed=0, json_schema=json.dumps(schema))
    (out,) = tiny_llm.generate(["Once upon a time"], sp)
    check_json(out, schema, tiny_llm.tokenizer)


@pytest.mark.slow
def test_default_model_output_parses_against_generated_schemas() -> None:
    llm = LLM(max_running_req=16)
    try:
        chat = [{"role": "user", "content": "Describe a person as a JSON object."}]
        prompt = llm.apply_chat_template(chat)
        fixed = [
            PERSON,
            {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
                "required": ["ok"],
            },
            {"type": "object", "properties": {"color": {"enum": ["red", "green"]}}, "required": ["color"]},
        ]
        params = [
            SamplingParams(max_tokens=200, temperature=t, seed=i, json_schema=json.dumps(s))
            for i, s in enumerate(fixed)
            for t in (0.0, 0.8)
        ]
        outs = llm.generate([prompt] * len(params), params)
        for out, sp in zip(outs, params):
            assert out["finish_reason"] == "stop", out
            assert conforms(json.loads(out["text"]), json.loads(sp.json_schema or "")), out["text"]
    finally:
        llm.shutdown()


# ---- the server ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model: Callable[[str], str]) -> Iterator[Any]:
    from test_server import SERVER_ARGS, Server

    s = Server(["--model", tiny_model("llama"), *SERVER_ARGS])
    s.model = s.client().models.list().data[0].id
    yield s
    s.stop()


def _chat(server: Any, **kwargs: Any) -> Any:
    messages = [{"role": "user", "content": "The capital of France is"}]
    return server.client().chat.completions.create(
        model=server.model, messages=messages, max_tokens=120, temperature=0, **kwargs
    )


def test_server_response_format_json_schema_and_json_object(server: Any, tiny_llm: LLM) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    choice = _chat(server, response_format=fmt).choices[0]
    check_json(
        {"text": choice.message.content, "finish_reason": choice.finish_reason}, PERSON, tiny_llm.tokenizer
    )
    choice = _chat(server, response_format={"type": "json_object"}).choices[0]
    text = choice.message.content or ""
    assert text.startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_server_sglang_and_vllm_fields_constrain_the_output(server: Any) -> None:
    regex = r"[0-9]{3}-[0-9]{4}"
    assert re.fullmatch(regex, _chat(server, extra_body={"regex": regex}).choices[0].message.content or "")
    assert re.fullmatch(
        regex, _chat(server, extra_body={"guided_regex": regex}).choices[0].message.content or ""
    )
    choices = ["yes", "no", "it depends"]
    for body in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        assert _chat(server, extra_body=body).choices[0].message.content in choices
    completion = server.client().completions.create(
        model=server.model,
        prompt="Once upon a time",
        max_tokens=30,
        temperature=0,
        extra_body={"ebnf": 'root ::= "a" | "b"'},
    )
    assert completion.choices[0].text in ("a", "b")
    status, body = server.request(
        "POST",
        "/generate",
        json.dumps(
            {"text": "Once", "sampling_params": {"json_schema": json.dumps(PERSON), "max_new_tokens": 120}}
        ).encode(),
    )
    assert status == 200
    assert (
        conforms(json.loads(body["text"]), PERSON) or body["meta_info"]["finish_reason"]["type"] == "length"
    )


@pytest.mark.parametrize(
    "body, param",
    [
        ({"regex": "a", "guided_choice": ["x"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}}, "guided_json"),
        ({"json_schema": "{}", "ebnf": 'root ::= "a"'}, "ebnf"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"regex": "a(b"}, "regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar"),
        ({"stream": True, "guided_json": '{"type": "nope"}'}, "guided_json"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _BIG}}},
            "response_format.json_schema.schema",
        ),
        ({"guided_json": _BIG}, "guided_json"),
        ({"regex": _BIG_TEXT}, "regex"),
        ({"structured_outputs": {"regex": _BIG_TEXT}}, "structured_outputs.regex"),
        ({"ebnf": f'root ::= "{_BIG_TEXT}"'}, "ebnf"),
    ],
)
def test_server_refuses_two_constraints_or_a_bad_grammar_with_a_400_naming_the_field(
    server: Any, body: dict[str, Any], param: str
) -> None:
    request = {
        "model": server.model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        **body,
    }
    status, answer = server.request("POST", "/v1/chat/completions", json.dumps(request).encode())
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer
