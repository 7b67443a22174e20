"""The server's access and bookkeeping routes end to end: API keys, /tokenize and /detokenize, and the
SGLang-named metrics, on a real `python -m minisgl` serving a tiny model behind a key."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from test_server import SERVER_ARGS, Server, _wait_metrics

from minisgl.server.args import parse_args
from minisgl.utils.hf import load_tokenizer

KEY = "sk-test-0123456789"
CHAT = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "the capital"}]


@pytest.fixture(scope="module")
def model_dir(tiny_model: Callable[[str], str]) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[Server]:
    s = Server(["--model", model_dir, "--api-key", KEY, *SERVER_ARGS], api_key=KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tokenizer(model_dir: str) -> Any:
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def model_name(server: Server) -> str:
    return server.client().models.list().data[0].id


def post(server: Server, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    return server.request("POST", path, json.dumps(body).encode())


# ---- API keys -------------------------------------------------------------------------------------
def test_the_right_key_is_served(server: Server, model_name: str) -> None:
    # ignore_eos: a sampled EOS would end the answer early; the key is what this test checks
    out = server.client().completions.create(
        model=model_name, prompt="hello", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None and out.usage.completion_tokens == 3


@pytest.mark.parametrize("key", ["sk-wrong", KEY + "x", KEY[:-1]])
def test_a_wrong_key_is_refused_in_openai_error_shape(server: Server, key: str) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        client.models.list()
    assert e.value.status_code == 401
    assert e.value.body == {
        "message": e.value.body["message"],  # type: ignore[index]
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
    assert "Authorization: Bearer" in e.value.message


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("GET", "/v1/models/x"),
        ("GET", "/version"),
        ("GET", "/metrics"),
        ("GET", "/get_server_info"),
        ("GET", "/get_model_info"),
        ("GET", "/health_generate"),
        ("POST", "/flush_cache"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/v1/responses"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/generate"),
        ("POST", "/tokenize"),
        ("POST", "/v1/detokenize"),
        ("GET", "/no-such-route"),
    ],
)
def test_every_route_but_health_needs_the_key(server: Server, method: str, path: str) -> None:
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode() if method == "POST" else None
    for headers in ({}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        status, got = server.request(method, path, body, headers=headers)
        assert status == 401, (headers, got)
        assert got["error"]["code"] == "invalid_api_key"


def test_health_is_open_without_a_key(server: Server) -> None:
    assert server.request("GET", "/health", headers={}) == (200, {"status": "ok"})


def test_api_key_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from minisgl.env import ENV

    monkeypatch.setattr(ENV.API_KEY, "value", "from-env")
    assert parse_args([]).api_key == "from-env"
    assert parse_args(["--api-key", "flag"]).api_key == "flag"
    monkeypatch.setattr(ENV.API_KEY, "value", "")
    assert parse_args([]).api_key is None
    assert "from-env" not in repr(parse_args(["--api-key", "from-env"]))


@pytest.mark.parametrize(("extra", "warned"), [([], True), (["--api-key", KEY], False)])
def test_listening_beyond_loopback_without_a_key_logs_a_warning(
    model_dir: str, extra: list[str], warned: bool
) -> None:
    # --tp-size 3 does not divide the tiny model's heads: the server stops right after it has bound
    cmd = [sys.executable, "-m", "minisgl", "--host", "0.0.0.0", "--port", "0", "--tp-size", "3"]
    out = subprocess.run([*cmd, "--model", model_dir, *extra], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "invalid engine option" in out.stderr
    assert ("without an API key" in out.stderr) == warned


# ---- /tokenize and /detokenize --------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/tokenize", "/v1/tokenize"])
def test_tokenize_a_prompt_gives_the_tokenizers_ids(server: Server, tokenizer: Any, path: str) -> None:
    text = "The capital of France is Paris."
    status, got = post(server, path, {"prompt": text})
    ids = tokenizer.encode(text)
    assert status == 200
    assert got == {"tokens": ids, "count": len(ids), "max_model_len": 512}
    _, plain = post(server, path, {"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    plain_ids = tokenizer.encode(text, add_special_tokens=False)
    assert plain["tokens"] == plain_ids
    assert plain["token_strs"] == tokenizer.convert_ids_to_tokens(plain_ids)


def test_tokenize_a_list_of_prompts_answers_lists(server: Server, tokenizer: Any) -> None:
    texts = ["hello world", "the capital of", "a"]
    status, got = post(
        server, "/v1/tokenize", {"prompt": texts, "model": server.client().models.list().data[0].id}
    )
    assert status == 200
    assert got["tokens"] == [tokenizer.encode(t) for t in texts]
    assert got["count"] == [len(tokenizer.encode(t)) for t in texts]


def test_tokenize_messages_uses_the_chat_template(server: Server, tokenizer: Any) -> None:
    def template_ids(add_generation_prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(
            CHAT, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        return tokenizer.encode(text, add_special_tokens=False)

    _, got = post(server, "/tokenize", {"messages": CHAT})
    assert got["tokens"] == template_ids(True)
    _, bare = post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert bare["tokens"] == template_ids(False)
    assert bare["count"] < got["count"]


def test_tokenize_counts_what_a_request_is_billed(server: Server, model_name: str) -> None:
    prompt = "Once upon a time there was an engine"
    _, counted = post(server, "/tokenize", {"prompt": prompt})
    out = server.client().completions.create(model=model_name, prompt=prompt, max_tokens=1)
    assert out.usage is not None and out.usage.prompt_tokens == counted["count"]
    _, chat_counted = post(server, "/tokenize", {"messages": CHAT[:1]})
    chat = server.client().chat.completions.create(model=model_name, messages=CHAT[:1], max_tokens=1)  # type: ignore[arg-type]
    assert chat.usage is not None and chat.usage.prompt_tokens == chat_counted["count"]


@pytest.mark.parametrize("path", ["/detokenize", "/v1/detokenize"])
def test_detokenize_gives_the_text_under_both_names(server: Server, tokenizer: Any, path: str) -> None:
    ids = tokenizer.encode("The capital of France is Paris.")
    status, got = post(server, path, {"tokens": ids})
    assert status == 200 and got == {"prompt": tokenizer.decode(ids), "text": tokenizer.decode(ids)}
    _, batch = post(server, path, {"tokens": [ids, ids[:2], []]})
    texts = [tokenizer.decode(ids), tokenizer.decode(ids[:2]), ""]
    assert batch == {"prompt": texts, "text": texts}


def test_detokenize_keeps_control_tokens_unless_asked_to_skip_them(server: Server, tokenizer: Any) -> None:
    _, chat = post(server, "/tokenize", {"messages": CHAT})
    _, kept = post(server, "/detokenize", {"tokens": chat["tokens"]})
    assert kept["text"] == tokenizer.decode(chat["tokens"]) and "<|im_start|>" in kept["text"]
    _, skipped = post(server, "/detokenize", {"tokens": chat["tokens"], "skip_special_tokens": True})
    assert skipped["text"] == tokenizer.decode(chat["tokens"], skip_special_tokens=True)
    assert "<|im_start|>" not in skipped["text"] and "hello world" in skipped["text"]


BAD_TOKENS_REQUESTS = [
    ("/detokenize", {"tokens": [1, -1]}, "tokens", "invalid_token_ids"),
    ("/detokenize", {"tokens": [[1], [2, 4096]]}, "tokens", "invalid_token_ids"),
    ("/detokenize", {"tokens": [1, 2**70]}, "tokens", "invalid_token_ids"),
    ("/detokenize", {"tokens": [[1], [-(2**64)]]}, "tokens", "invalid_token_ids"),
    ("/detokenize", {"tokens": "hello"}, "tokens", "invalid_type"),
    ("/detokenize", {"tokens": [1.5]}, "tokens", "invalid_type"),
    ("/detokenize", {}, "tokens", "missing_required_parameter"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": 1}, "skip_special_tokens", "invalid_type"),
    (
        "/detokenize",
        {"tokens": [1], "spaces_between_special_tokens": True},
        "spaces_between_special_tokens",
        "unrecognized_argument",
    ),
    ("/tokenize", {}, "prompt", "invalid_value"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt", "invalid_value"),
    ("/tokenize", {"prompt": []}, "prompt", "empty_prompt"),
    ("/tokenize", {"prompt": 5}, "prompt", "invalid_type"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt", "invalid_value"),
    ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, "add_special_tokens", "invalid_value"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "a"}]}, "messages[0].role", "invalid_value"),
    (
        "/tokenize",
        {"prompt": "a", "truncate_prompt_tokens": 2},
        "truncate_prompt_tokens",
        "unrecognized_argument",
    ),
    ("/tokenize", {"prompt": "hello " * 5000}, "prompt", "context_length_exceeded"),
]


@pytest.mark.parametrize(("path", "body", "param", "code"), BAD_TOKENS_REQUESTS)
def test_bad_tokenize_requests_get_a_400_naming_the_field(
    server: Server, path: str, body: dict[str, Any], param: str, code: str
) -> None:
    status, got = post(server, path, body)
    assert status == 400, got
    assert got["error"]["param"] == param and got["error"]["code"] == code, got


def test_tokenize_for_another_model_is_a_404(server: Server) -> None:
    status, got = post(server, "/tokenize", {"prompt": "a", "model": "gpt-4"})
    assert status == 404 and got["error"]["code"] == "model_not_found"


# ---- /metrics under SGLang's names ----------------------------------------------------------------
def _histogram_is_consistent(m: dict[str, float], name: str) -> None:
    buckets = sorted(
        (float(k.split('le="')[1].split('"')[0]), v) for k, v in m.items() if k.startswith(f"{name}_bucket")
    )
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and buckets[-1] == (float("inf"), m[f"{name}_count"])


def test_metrics_count_requests_tokens_and_latencies_under_sglang_names(
    server: Server, model_name: str
) -> None:
    before = _wait_metrics(server, lambda m: m["minisgl_requests_in_flight"] == 0)
    prompt = "Once upon a time, there was a small engine that served many requests at once. " * 3
    usages = []
    for _ in range(3):
        out = server.client().completions.create(
            model=model_name, prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True}
        )
        assert out.usage is not None
        usages.append(out.usage)
    after = server.metrics()

    def grew(name: str) -> float:
        return after[f"sglang:{name}"] - before[f"sglang:{name}"]

    assert grew("prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages if u.prompt_tokens_details)
    assert grew("cached_tokens_total") == cached > 0  # the second and third found the first's prefix
    assert grew("generation_tokens_total") == 15
    assert grew("num_requests_total") == 3 and grew("num_aborted_requests_total") == 0
    assert grew("time_to_first_token_seconds_count") == 3
    assert grew("e2e_request_latency_seconds_count") == 3
    assert grew("inter_token_latency_seconds_count") == 3 * 4  # every token after each first
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        _histogram_is_consistent(after, f"sglang:{name}")
    assert after["sglang:cache_hit_rate"] == pytest.approx(
        after["sglang:cached_tokens_total"] / after["sglang:prompt_tokens_total"]
    )
    assert after["sglang:gen_throughput"] > 0
    assert after["sglang:max_total_num_tokens"] == after["minisgl_kv_pages_total"]  # one token a page


def test_token_usage_counts_running_requests_pages_not_the_idle_cache(
    server: Server, model_name: str
) -> None:
    idle = _wait_metrics(server, lambda m: m["sglang:num_running_reqs"] == 0)
    # the prefix cache keeps the pages of finished requests, but none of them is in use
    assert idle["minisgl_kv_pages_cached"] > 0
    assert idle["sglang:token_usage"] == 0 and idle["sglang:num_used_tokens"] == 0
    stream = server.client().completions.create(
        model=model_name, prompt="hello", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    running = _wait_metrics(server, lambda m: m["sglang:num_running_reqs"] == 1)
    stream.close()
    assert running["sglang:num_running_reqs"] == 1 and running["sglang:num_queue_reqs"] == 0
    assert running["sglang:num_used_tokens"] > 0
    assert running["sglang:token_usage"] == pytest.approx(
        running["sglang:num_used_tokens"] / running["sglang:max_total_num_tokens"]
    )
    done = _wait_metrics(server, lambda m: m["minisgl_requests_in_flight"] == 0)
    assert done["sglang:num_aborted_requests_total"] == running["sglang:num_aborted_requests_total"] + 1


def test_sglang_series_carry_the_model_name_label(server: Server, model_name: str) -> None:
    _, text = server.request("GET", "/metrics")
    series = [line for line in text.splitlines() if line.startswith("sglang:")]
    assert series and all(f'model_name="{model_name}"' in line for line in series)
    assert "# TYPE sglang:time_to_first_token_seconds histogram" in text


def test_a_tokenize_call_waiting_when_the_workers_die_gets_engine_unavailable(tmp_path: Any) -> None:
    import asyncio

    from minisgl.message.frontend import TokensMsg
    from minisgl.server.client import EngineClient, EngineUnavailable
    from minisgl.utils.mp import ipc_addr

    async def run() -> None:
        # nobody answers on these sockets: the call waits until the client learns the workers are gone
        client = EngineClient(ipc_addr(str(tmp_path), "worker"), ipc_addr(str(tmp_path), "api"))
        try:
            waiting = asyncio.ensure_future(client.tokens(TokensMsg(0, texts=["hello"])))
            await asyncio.sleep(0.05)
            assert not waiting.done()
            client.fail_all("the tokenizer process exited")
            with pytest.raises(EngineUnavailable, match="tokenizer process exited"):
                await waiting
            with pytest.raises(EngineUnavailable):  # and every later call at once
                await client.tokens(TokensMsg(0, texts=["hello"]))
            assert not client._lookups
        finally:
            client.close()

    asyncio.run(run())
