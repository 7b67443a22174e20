"""The HTTP server end to end: a real `python -m minisgl` process serving a tiny model, driven by the
official openai client (and by raw HTTP where a client would refuse to send the request)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
import torch
from procs import _descendants, _wait_gone

import minisgl
from minisgl.core import SamplingParams
from minisgl.llm import LLM

SERVER_ARGS = ["--dtype", "float32", "--max-running-req", "80"]
READY_TIMEOUT_S = 240  # a loaded 2-core machine needs a while to import torch three times


class Server:
    """`python -m minisgl` in a subprocess, on a port it picks; its log is kept for assertions."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, api_key: str = "none") -> None:
        """`env`: variables added to this process's environment; `api_key`: what the clients send."""
        cmd = [sys.executable, "-m", "minisgl", "--port", "0", *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
            # SIGINT as a shell's foreground command has it, even where this run ignores it (inherited)
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.api_key = api_key
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(READY_TIMEOUT_S) or not self.url:
            self.proc.kill()
            raise RuntimeError("the server did not start:\n" + self.log)
        self.host, port = self.url.removeprefix("http://").split(":")
        self.port = int(port)
        self.children = _descendants(self.proc.pid)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            found = re.search(r"is serving \S+ at (http://\S+)", line)
            if found:
                self.url = found.group(1)
                self._ready.set()
        self._ready.set()  # it exited

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_log(self, pattern: str, timeout: float = 10) -> bool:
        """Whether the log shows `pattern` (a regex) within `timeout` seconds: a thread reads the server's
        output, so a line may come in a moment after the answer it logs."""
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.log):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=0, **kwargs)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=0, timeout=120)

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        """`headers`: None sends the client's key; give them to send exactly those."""
        if headers is None:
            headers = {"Authorization": f"Bearer {self.api_key}"}
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        data = resp.read().decode()
        conn.close()
        try:
            return resp.status, json.loads(data)
        except json.JSONDecodeError:
            return resp.status, data

    def metrics(self) -> dict[str, float]:
        """Every series of /metrics by its name and labels, less the model_name label every sglang: one has."""
        _, text = self.request("GET", "/metrics")
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                name = re.sub(r',?model_name="[^"]*"', "", name).replace("{}", "")
                out[name] = float(value)
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait(timeout)

    def wait(self, timeout: float = 60) -> int:
        """The exit code, once the server has exited and its log is read to the end."""
        code = self.proc.wait(timeout)
        self._reader.join(10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return code


def _wait_metrics(
    server: Server, done: Callable[[dict[str, float]], bool], timeout: float = 30
) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if done(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


@pytest.fixture(scope="session")
def model_dir(tiny_model: Callable[[str], str]) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="session")
def server(model_dir: str) -> Iterator[Server]:
    s = Server(["--model", model_dir, *SERVER_ARGS])
    yield s
    s.stop()


@pytest.fixture(scope="session")
def offline(model_dir: str) -> Iterator[LLM]:
    """The offline engine on the same model: the reference for the server's text."""
    llm = LLM(model_dir, dtype=torch.float32, max_running_req=80)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def model_name(server: Server) -> str:
    return server.client().models.list().data[0].id


def greedy(n: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=n, **kwargs)


PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "hello world"}]


# ---- the happy paths --------------------------------------------------------------------------
def test_health_and_models_describe_the_served_model(server: Server, model_dir: str) -> None:
    assert server.request("GET", "/health") == (200, {"status": "ok"})
    models = server.client().models.list().data
    assert [m.id for m in models] == [os.path.basename(model_dir)]  # the folder's name
    assert models[0].model_extra["max_model_len"] == 512
    # one model by its id, as the openai client retrieves it; an unknown id is a 404 in OpenAI's shape
    assert server.client().models.retrieve(models[0].id).id == models[0].id
    status, body = server.request("GET", "/v1/models/no-such-model")
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    assert server.request("GET", "/version") == (200, {"version": minisgl.__version__})
    # SGLang's: what its clients read at connection, and the check that the engine generates
    status, got = server.request("GET", "/get_model_info")
    assert status == 200 and got["model_path"] == model_dir and got["is_generation"] is True
    assert got["max_model_len"] == 512 and got["served_model_names"] == [models[0].id]
    assert server.request("GET", "/health_generate") == (200, {"status": "ok"})
    status, got = server.request("GET", "/get_server_info")
    assert status == 200 and got["model"] == model_dir and got["max_running_req"] == 80
    assert got["version"] == minisgl.__version__ and got["max_total_num_tokens"] > 0
    assert "api_key" not in got and got["internal_states"][0]["last_gen_throughput"] >= 0


def test_chat_completion_equals_offline_greedy_text(server: Server, offline: LLM, model_name: str) -> None:
    want = offline.chat([CHAT], greedy(12))[0]
    got = server.client().chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=12, temperature=0
    )
    assert got.choices[0].message.content == want["text"]
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].finish_reason == want["finish_reason"]
    assert got.usage.prompt_tokens == want["prompt_tokens"]
    assert got.usage.completion_tokens == len(want["token_ids"]) + (want["finish_reason"] == "stop")


def test_streamed_chat_equals_offline_greedy_text_and_ends_with_usage(
    server: Server, offline: LLM, model_name: str
) -> None:
    want = offline.chat([CHAT], greedy(40, ignore_eos=True))[0]
    stream = server.client().chat.completions.create(
        model=model_name,
        messages=CHAT,
        max_completion_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True},
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want["text"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert chunks[-1].usage.prompt_tokens == want["prompt_tokens"]


def test_streamed_choices_of_n_arrive_interleaved_and_each_finishes(
    server: Server, offline: LLM, model_name: str
) -> None:
    want = offline.chat([CHAT], greedy(10, ignore_eos=True))[0]["text"]
    stream = server.client().chat.completions.create(
        model=model_name,
        messages=CHAT,
        max_tokens=10,
        temperature=0,
        n=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts, reasons = ["", ""], [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [want, want] and reasons == ["length", "length"]


def test_sse_stream_ends_with_done(server: Server) -> None:
    # ignore_eos: a sampled EOS would end the stream with "stop"
    body = json.dumps({"prompt": PROMPT, "max_tokens": 3, "stream": True, "ignore_eos": True}).encode()
    status, text = server.request("POST", "/v1/completions", body)
    events = [e for e in text.split("\n\n") if e]
    assert status == 200
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: ") :])["choices"][0]["finish_reason"] == "length"


def test_completions_stream_and_not_equal_offline_text(server: Server, offline: LLM, model_name: str) -> None:
    want = offline.generate([PROMPT], greedy(30, ignore_eos=True))[0]["text"]
    client = server.client()
    kwargs: dict[str, Any] = dict(model=model_name, prompt=PROMPT, max_tokens=30, temperature=0)
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    assert full.choices[0].text == want
    assert streamed == want
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 30


def test_completion_prompt_forms_and_n_choices(server: Server, offline: LLM, model_name: str) -> None:
    ids = offline.tokenizer.encode(PROMPT)
    want = offline.generate([PROMPT, "1 + 1 ="], greedy(6, ignore_eos=True))
    client = server.client()
    kwargs: dict[str, Any] = dict(
        model=model_name, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    by_ids = client.completions.create(prompt=ids, **kwargs)
    assert by_ids.choices[0].text == want[0]["text"]
    batch = client.completions.create(prompt=[PROMPT, "1 + 1 ="], n=2, **kwargs)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [want[0]["text"]] * 2 + [want[1]["text"]] * 2
    # the prompt counts once per prompt, the output once per choice
    assert batch.usage.prompt_tokens == want[0]["prompt_tokens"] + want[1]["prompt_tokens"]
    assert batch.usage.completion_tokens == 4 * 6
    id_batch = client.completions.create(prompt=[ids, ids[:2]], **kwargs)
    assert id_batch.choices[0].text == want[0]["text"] and len(id_batch.choices) == 2


def test_stop_string_is_cut_out_of_the_text(server: Server, offline: LLM, model_name: str) -> None:
    full = offline.generate([PROMPT], greedy(40, ignore_eos=True))[0]["text"]
    stop = full[10:12]
    want = full[: full.find(stop)]
    client = server.client()
    kwargs: dict[str, Any] = dict(model=model_name, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop])
    got = client.completions.create(**kwargs)
    streamed = list(client.completions.create(**kwargs, stream=True))
    assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_stop_token_id_and_max_tokens_set_the_finish_reason(
    server: Server, offline: LLM, model_name: str
) -> None:
    want = offline.generate([PROMPT], greedy(8, ignore_eos=True))[0]
    client = server.client()
    stopped = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [want["token_ids"][3]], "ignore_eos": True},
    )
    first = want["token_ids"].index(want["token_ids"][3])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == offline.tokenizer.decode(
        want["token_ids"][:first], skip_special_tokens=True
    )
    cut = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2, temperature=0)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 2


def test_seeded_sampling_is_reproducible_and_choices_differ(server: Server, model_name: str) -> None:
    client = server.client()
    kwargs: dict[str, Any] = dict(
        model=model_name, messages=CHAT, max_tokens=16, temperature=1.0, n=3, seed=7
    )
    kwargs["extra_body"] = {"ignore_eos": True}
    first = [c.message.content for c in client.chat.completions.create(**kwargs).choices]
    again = [c.message.content for c in client.chat.completions.create(**kwargs).choices]
    assert first == again
    assert len(set(first)) == 3
    other = client.chat.completions.create(**{**kwargs, "seed": 8}).choices[0].message.content
    assert other != first[0]


SAMPLING_CASES = {
    "top_k and temperature": dict(temperature=0.9, top_k=20, seed=3),
    "top_p": dict(temperature=1.0, top_p=0.8, seed=4),
    "min_p": dict(temperature=1.2, min_p=0.1, seed=5),
    "presence and frequency penalties": dict(presence_penalty=1.5, frequency_penalty=1.0),
    "repetition penalty": dict(repetition_penalty=3.0),
}


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_every_sampling_parameter_reaches_the_engine(
    server: Server, offline: LLM, model_name: str, case: str
) -> None:
    params = SAMPLING_CASES[case]
    want = offline.generate([PROMPT], greedy(24, ignore_eos=True, **params))[0]["text"]
    plain = offline.generate([PROMPT], greedy(24, ignore_eos=True))[0]["text"]
    assert want != plain  # the parameter changes the text, so the comparison below means something
    body: dict[str, Any] = {"temperature": 0, **params, "ignore_eos": True}
    seed = body.pop("seed", None)
    got = server.client().completions.create(
        model=model_name, prompt=PROMPT, max_tokens=24, seed=seed, extra_body=body
    )
    assert got.choices[0].text == want


def test_chat_logprobs_are_log_softmax_of_the_chosen_tokens(
    server: Server, offline: LLM, model_name: str
) -> None:
    want = offline.chat([CHAT], greedy(5, ignore_eos=True))[0]
    got = server.client().chat.completions.create(
        model=model_name,
        messages=CHAT,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = got.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        top = [t.logprob for t in entry.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True)
        assert entry.logprob == pytest.approx(top[0])  # greedy picks the most likely token
        assert entry.logprob < 0 and sum(2.718281828**t for t in top) <= 1.0 + 1e-5
    assert [e.token for e in content] == [offline.tokenizer.decode([t]) for t in want["token_ids"]]


def test_logprobs_come_from_the_raw_logits_whatever_the_temperature(
    server: Server, offline: LLM, model_dir: str, model_name: str
) -> None:
    from transformers import AutoModelForCausalLM

    ids = offline.apply_chat_template(CHAT)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)
    top = want.topk(4)
    got = server.client().chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=1, temperature=1.7, seed=1, logprobs=True, top_logprobs=4
    )
    first = got.choices[0].logprobs.content[0]
    assert [t.logprob for t in first.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert [t.token for t in first.top_logprobs] == [
        offline.tokenizer.decode([i]) for i in top.indices.tolist()
    ]
    # the sampled token need not be the most likely one; its logprob is still its own
    same_text = [i for i in range(want.numel()) if offline.tokenizer.decode([i]) == first.token]
    assert any(want[i].item() == pytest.approx(first.logprob, abs=1e-4) for i in same_text)


def test_completion_logprobs_stream_and_not_agree(server: Server, model_name: str) -> None:
    client = server.client()
    kwargs: dict[str, Any] = dict(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    full = client.completions.create(**kwargs).choices[0].logprobs
    chunks = list(client.completions.create(**kwargs, stream=True))
    streamed = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(full.token_logprobs)
    assert len(full.tokens) == 4
    # top_logprobs maps token text to logprob, so two byte tokens that both show as U+FFFD share a key
    assert all(1 <= len(top) <= 2 for top in full.top_logprobs)
    assert full.token_logprobs == pytest.approx([max(top.values()) for top in full.top_logprobs])
    assert full.text_offset[0] == 0


def test_generate_endpoint_speaks_sglang(server: Server, offline: LLM) -> None:
    want = offline.generate([PROMPT], greedy(6, ignore_eos=True))[0]
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    status, got = server.request("POST", "/generate", json.dumps(body).encode())
    assert status == 200
    assert got["text"] == want["text"]
    assert got["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert got["meta_info"]["prompt_tokens"] == want["prompt_tokens"]
    status, text = server.request("POST", "/generate", json.dumps({**body, "stream": True}).encode())
    events = [json.loads(e[len("data: ") :]) for e in text.split("\n\n") if e and e != "data: [DONE]"]
    assert events[-1]["text"] == want["text"] and text.rstrip().endswith("data: [DONE]")
    status, batch = server.request(
        "POST", "/generate", json.dumps({**body, "text": [PROMPT, PROMPT]}).encode()
    )
    assert [b["text"] for b in batch] == [want["text"]] * 2


def test_64_concurrent_streams_complete_and_leave_nothing_running(
    server: Server, offline: LLM, model_name: str
) -> None:
    prompts = [f"request {i}: hello world" for i in range(64)]
    lengths = [8 + i % 17 for i in range(64)]
    want = [o["text"] for o in offline.generate(prompts, [greedy(n, ignore_eos=True) for n in lengths])]

    async def one(client: openai.AsyncOpenAI, prompt: str, n: int) -> str:
        stream = await client.completions.create(
            model=model_name,
            prompt=prompt,
            max_tokens=n,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([c.choices[0].text async for c in stream])

    async def run() -> list[str]:
        client = server.async_client()
        try:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))
        finally:
            await client.close()

    assert asyncio.run(run()) == want
    m = _wait_metrics(server, lambda m: m["sglang:num_running_reqs"] == 0)
    assert m["sglang:num_running_reqs"] == 0 and m["sglang:num_queue_reqs"] == 0
    assert m["minisgl_kv_pages_held"] == 0 and m["minisgl_requests_in_flight"] == 0
    assert m["minisgl_free_request_slots"] == 80


def test_metrics_count_tokens_latencies_and_prefix_cache_hits(server: Server, model_name: str) -> None:
    before = server.metrics()
    prompt = "Once upon a time, there was a small engine that served many requests at once. " * 3
    for _ in range(2):
        server.client().completions.create(model=model_name, prompt=prompt, max_tokens=3)
    after = server.metrics()
    assert after["sglang:cached_tokens_total"] > before["sglang:cached_tokens_total"]
    assert after["sglang:generation_tokens_total"] == before["sglang:generation_tokens_total"] + 6
    assert (
        after["sglang:time_to_first_token_seconds_count"]
        == before["sglang:time_to_first_token_seconds_count"] + 2
    )
    assert (
        after["sglang:e2e_request_latency_seconds_count"]
        == before["sglang:e2e_request_latency_seconds_count"] + 2
    )
    assert after["minisgl_kv_pages_total"] > 0


# ---- bad input ----------------------------------------------------------------------------------
LONG = "hello " * 600  # far more than the tiny model's 512 tokens
BAD_REQUESTS = {
    "malformed json": ("/v1/chat/completions", b'{"messages": [', 400, None, "invalid_json"),
    "body not an object": ("/v1/completions", b"[1, 2]", 400, None, "invalid_type"),
    "missing messages": (
        "/v1/chat/completions",
        {"max_tokens": 3},
        400,
        "messages",
        "missing_required_parameter",
    ),
    "messages not a list": ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "invalid_type"),
    "prompt of wrong type": ("/v1/completions", {"prompt": 5}, 400, "prompt", "invalid_type"),
    "temperature a string": (
        "/v1/completions",
        {"prompt": "a", "temperature": "hot"},
        400,
        "temperature",
        None,
    ),
    "max_tokens a float": ("/v1/completions", {"prompt": "a", "max_tokens": 2.5}, 400, "max_tokens", None),
    "max_tokens zero": (
        "/v1/completions",
        {"prompt": "a", "max_tokens": 0},
        400,
        "max_tokens",
        "invalid_value",
    ),
    "negative temperature": (
        "/v1/chat/completions",
        {"messages": CHAT, "temperature": -1},
        400,
        "temperature",
        None,
    ),
    "top_p above one": ("/v1/completions", {"prompt": "a", "top_p": 1.5}, 400, "top_p", "invalid_value"),
    "n zero": ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n", "invalid_value"),
    "top_logprobs too many": (
        "/v1/chat/completions",
        {"messages": CHAT, "logprobs": True, "top_logprobs": 50},
        400,
        "top_logprobs",
        "invalid_value",
    ),
    "empty prompt": ("/v1/completions", {"prompt": ""}, 400, "prompt", "empty_prompt"),
    "token id outside the vocabulary": (
        "/v1/completions",
        {"prompt": [1, 99999]},
        400,
        "prompt",
        "invalid_token_ids",
    ),
    "prompt too long": ("/v1/completions", {"prompt": LONG}, 400, "prompt", "context_length_exceeded"),
    "chat too long, streamed": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": LONG}], "stream": True},
        400,
        "messages",
        "context_length_exceeded",
    ),
    "image content": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages[0].content",
        "unsupported_content",
    ),
    "unknown model": ("/v1/completions", {"prompt": "a", "model": "gpt-4"}, 404, "model", "model_not_found"),
    "generate without a prompt": ("/generate", {"sampling_params": {}}, 400, "text", "invalid_value"),
    "generate negative max_new_tokens": (
        "/generate",
        {"text": "a", "sampling_params": {"max_new_tokens": -1}},
        400,
        "sampling_params.max_new_tokens",
        "invalid_value",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(
    server: Server, model_name: str, case: str
) -> None:
    path, body, status, param, code = BAD_REQUESTS[case]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    got_status, got = server.request("POST", path, raw)
    assert got_status == status, got
    error = got["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]
    if code is not None:
        assert error["code"] == code
    # greedy: at OpenAI's default temperature of 1 the tiny model may sample its end token
    ok = server.client().completions.create(model=model_name, prompt=PROMPT, max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason == "length"


def test_error_messages_say_what_to_change(server: Server, model_name: str) -> None:
    _, long = server.request("POST", "/v1/completions", json.dumps({"prompt": LONG}).encode())
    assert "at most 511 prompt tokens" in long["error"]["message"]
    _, temp = server.request(
        "POST", "/v1/completions", json.dumps({"prompt": "a", "temperature": -1}).encode()
    )
    assert "must be >= 0" in temp["error"]["message"]
    _, model = server.request("POST", "/v1/completions", json.dumps({"prompt": "a", "model": "x"}).encode())
    assert repr(model_name) in model["error"]["message"]


def test_openai_client_sees_bad_request_errors(server: Server, model_name: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        server.client().completions.create(model=model_name, prompt="a", temperature=-2)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="no-such-model", messages=CHAT)


def test_every_request_gets_one_log_line_with_its_figures(server: Server, model_name: str) -> None:
    got = server.client().chat.completions.create(model=model_name, messages=CHAT, max_tokens=2)
    pattern = (
        rf"INFO minisgl\.server\.client\] request {got.id}: \d+ prompt tokens \(\d+ cached\), "
        rf"{got.usage.completion_tokens} output tokens, first token [\d.]+ s, total [\d.]+ s, "
        rf"finish_reason={got.choices[0].finish_reason}\n"
    )
    assert server.wait_log(pattern) and len(re.findall(pattern, server.log)) == 1, server.log[-2000:]


def test_client_disconnect_mid_stream_aborts_and_frees_pages(server: Server, model_name: str) -> None:
    before = server.metrics()
    body = json.dumps(
        {"model": model_name, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "stream": True}
    ).encode()
    sock = socket.create_connection((server.host, server.port))
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    sock.sendall(head.encode() + body)
    received = b""
    while received.count(b"data: ") < 3:
        received += sock.recv(4096)
    running = server.metrics()
    assert running["sglang:num_running_reqs"] == 1 and running["minisgl_kv_pages_held"] > 0
    sock.close()
    m = _wait_metrics(server, lambda m: m["minisgl_requests_in_flight"] == 0)
    assert m["sglang:num_running_reqs"] == 0 and m["minisgl_kv_pages_held"] == 0
    abort = 'minisgl_requests_finished_total{finish_reason="abort"}'
    assert m[abort] == before[abort] + 1
    assert m["sglang:generation_tokens_total"] < before["sglang:generation_tokens_total"] + 480


# ---- processes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 0)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_the_server_and_every_child(model_dir: str, sig: int, code: int) -> None:
    s = Server(["--model", model_dir, *SERVER_ARGS])
    assert len(s.children) >= 2  # the scheduler and the tokenizer worker (and multiprocessing's tracker)
    assert s.stop(sig) == code  # 130 after Ctrl-C, as a shell reports it
    assert _wait_gone(s.children) == set()
    assert "shutting down" in s.log and "Traceback" not in s.log


def test_a_dead_worker_takes_the_server_down_with_a_log_line(model_dir: str) -> None:
    s = Server(["--model", model_dir, *SERVER_ARGS])
    scheduler = int(re.search(r"scheduler \(pid (\d+)\)", s.log).group(1))
    os.kill(scheduler, signal.SIGKILL)
    assert s.wait(60) == 1
    assert re.search(r"the scheduler process \(pid \d+\) was killed by SIGKILL; shutting down", s.log)
    assert _wait_gone(s.children) == set()


def test_health_generate_fails_while_the_engine_is_stopped_and_passes_again(model_dir: str) -> None:
    s = Server(["--model", model_dir, *SERVER_ARGS], env={"MINISGL_HEALTH_GENERATE_TIMEOUT": "2"})
    try:
        scheduler = int(re.search(r"scheduler \(pid (\d+)\)", s.log).group(1))
        os.kill(scheduler, signal.SIGSTOP)
        start = time.monotonic()
        status, got = s.request("GET", "/health_generate")
        assert status == 503 and got["error"]["code"] == "engine_unavailable", got
        assert 2 <= time.monotonic() - start < 10
        assert s.request("GET", "/health") == (200, {"status": "ok"})  # the processes are alive
        os.kill(scheduler, signal.SIGCONT)
        assert s.request("GET", "/health_generate") == (200, {"status": "ok"})
        # the check's own requests leave nothing behind (the stopped one included)
        m = _wait_metrics(s, lambda m: m["minisgl_requests_in_flight"] == 0)
        assert m["sglang:num_running_reqs"] == 0 and m["minisgl_kv_pages_held"] == 0
    finally:
        s.stop()


def test_a_bad_option_fails_fast_with_a_message() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "minisgl", "--tp-size", "0"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "--tp-size" in out.stderr


# ---- the default model ----------------------------------------------------------------------------
@pytest.mark.slow
def test_default_model_answers_the_capital_of_france() -> None:
    s = Server([])
    try:
        client = s.client()
        assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
        got = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20,
            temperature=0,
        )
        assert got.choices[0].message.content == "The capital of France is Paris."
        assert got.choices[0].finish_reason == "stop"
        stream = client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt="The capital of France is",
            max_tokens=3,
            temperature=0,
            stream=True,
        )
        assert "".join(c.choices[0].text for c in stream).startswith(" Paris")
    finally:
        assert s.stop() == 0
