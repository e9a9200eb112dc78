"""`tidal serve` as a real process on 127.0.0.1: the official openai client against offline
output, raw HTTP for the error shapes, 200 concurrent streams, disconnects, the waiting-queue
bound, SIGTERM, and a bounded schemathesis run over the OpenAPI schema.

Servers run the bundled model in float32 on its dense weights, where greedy output does not depend
on the batch, so every served text can be compared with conftest's offline `llm`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tidal import SamplingParams

openai = pytest.importorskip("openai")

STARTUP_S = 180
ERROR_KEYS = {"message", "type", "param", "code"}
PROMPTS = json.loads((Path(__file__).parents[1] / "tidal/data/chat_prompts.json").read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `tidal serve` subprocess, ready once /health answers 200."""

    def __init__(self, log_dir: Path, *args: str, env: dict | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{self.port}.log"
        cmd = [sys.executable, "-m", "tidal.cli", "serve", "--dtype", "float32", "--weight-layouts", "dense",
               "--enforce-eager", "--host", "127.0.0.1",
               "--port", str(self.port), "--no-access-log", *args]
        full_env = {k: v for k, v in os.environ.items() if k != "TIDAL_API_KEY"} | (env or {})
        # one compute thread: the server shares two cores with this process's clients, and
        # torch's threads slow down many times over when another process takes a core
        full_env.setdefault("OMP_NUM_THREADS", "1")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server not ready in {STARTUP_S}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == name and labels.items() <= s.labels.items())

    def wait_metric(self, name: str, want: float, timeout: float = 30.0, **labels: str) -> float:
        deadline = time.monotonic() + timeout
        while (value := self.metric(name, **labels)) != want and time.monotonic() < deadline:
            time.sleep(0.1)
        return value

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # no speculation: these tests compare with the plain offline engine, token for token
    s = Server(tmp_path_factory.mktemp("server"), "--speculation", "off")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model_id(server) -> str:
    return httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]


def _client(server: Server, key: str = "unused", cls=None):
    cls = cls or openai.OpenAI
    return cls(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture
def llm(llm):
    """conftest's offline LLM, computing on one thread while the server computes on another."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield llm
    torch.set_num_threads(threads)


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def _chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def _sse(response: httpx.Response):
    """The JSON events of an SSE response, and whether it ended with [DONE]."""
    events, done = [], False
    for line in response.iter_lines():
        if line.startswith("data: "):
            if line == "data: [DONE]":
                done = True
            else:
                events.append(json.loads(line[6:]))
    return events, done


def _assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


# ------------------------------------------------------------------ the openai client


def test_models_health_version(server, model_id):
    models = _client(server).models.list()
    assert [m.id for m in models.data] == [model_id] == ["SmolLM2-135M-Instruct"]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    from tidal import __version__

    assert httpx.get(f"{server.url}/version", timeout=10).json() == {"version": __version__}


def test_completion_equals_offline_greedy(server, model_id, llm):
    prompt = "The three primary colors are"
    want = llm.generate(prompt, _greedy(24))[0]
    got = _client(server).completions.create(model=model_id, prompt=prompt, max_tokens=24, temperature=0)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    assert got.object == "text_completion" and got.model == model_id and got.id.startswith("cmpl-")
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_chat_equals_offline_greedy(server, model_id, llm):
    want = llm.chat(_chat("What is the capital of France?"), _greedy(24))[0]
    got = _client(server).chat.completions.create(
        model=model_id, messages=_chat("What is the capital of France?"), max_tokens=24, temperature=0)
    assert got.choices[0].message.content == want.text and "Paris" in want.text
    assert got.choices[0].message.role == "assistant" and got.object == "chat.completion"
    assert got.choices[0].finish_reason == want.finish_reason == "stop"  # the model ended it itself
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))


def test_streams_equal_offline_with_usage(server, model_id, llm):
    client = _client(server)
    prompt = "Write a haiku about the sea."
    want = llm.generate(prompt, _greedy(20))[0]
    chunks = list(client.completions.create(model=model_id, prompt=prompt, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert len(chunks) > 3  # text arrives token by token, not at the end
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert all(c.usage is None for c in chunks[:-1])

    want = llm.chat(_chat(prompt), _greedy(20))[0]
    chunks = list(client.chat.completions.create(model=model_id, messages=_chat(prompt), max_tokens=20,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    # without include_usage there is no usage chunk
    plain = list(client.chat.completions.create(model=model_id, messages=_chat(prompt), max_tokens=4,
                                                temperature=0, stream=True))
    assert all(c.choices and c.usage is None for c in plain)


def test_stop_strings_cut_streamed_and_whole_text(server, model_id, llm):
    prompt, stop = "Count: one, two, three, four, five,", [" seven", "eight"]
    want = llm.generate(prompt, _greedy(24, stop=tuple(stop)))[0]
    assert want.finish_reason == "stop"  # the case exercises a stop string, not the length limit
    client = _client(server)
    got = client.completions.create(model=model_id, prompt=prompt, max_tokens=24, temperature=0, stop=stop)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model=model_id, prompt=prompt, max_tokens=24, temperature=0,
                                       stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == want.text  # nothing sent that the stop cut


def test_seeded_sampling_and_knobs_equal_offline(server, model_id, llm):
    knobs = dict(temperature=0.9, top_p=0.9, seed=1234)
    want = llm.generate("Once upon a time", SamplingParams(max_tokens=16, top_k=40, **knobs))[0]
    client = _client(server)
    texts = [client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=16,
                                       extra_body={"top_k": 40}, **knobs).choices[0].text for _ in range(2)]
    assert texts == [want.text, want.text]  # the seed fixes the draw, whatever else is batched


def test_ignore_eos_runs_to_max_tokens(server, model_id):
    client = _client(server)
    kw = dict(model=model_id, messages=_chat("What is the capital of France?"), max_tokens=40, temperature=0)
    natural = client.chat.completions.create(**kw)
    assert natural.choices[0].finish_reason == "stop" and natural.usage.completion_tokens < 40
    forced = client.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 40


def test_openai_client_sees_openai_errors(server, model_id):
    client = _client(server)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=_chat("hi"), n=2)
    assert e.value.body["param"] == "n"


# ------------------------------------------------------------------ errors over raw HTTP


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "n": 3}, "n"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),  # pydantic's 422, answered as 400
    ({"prompt": "hi", "max_tokens": 10**6}, "max_tokens"),  # does not fit the context
    ({"prompt": [1] * 8192, "max_tokens": 1}, "max_tokens"),  # a prompt that fills the context
    ({"prompt": [10**9]}, "prompt"),  # not a token id
    ({"prompt": ["one", "two"]}, "prompt"),  # one prompt per request
    ({"prompt": ""}, "prompt"),
    ({"prompt": "hi", "seed": 2**64}, "seed"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "logprobs": 2}, "logprobs"),
    ({"max_tokens": 2}, "prompt"),  # missing
])
def test_invalid_completion_params_are_400(server, body, param):
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert _assert_error(r, 400, param)["type"] == "invalid_request_error"


def test_invalid_chat_requests_are_400(server):
    url = f"{server.url}/v1/chat/completions"
    _assert_error(httpx.post(url, json={"messages": []}, timeout=30), 400, "messages")
    _assert_error(httpx.post(url, json={"messages": [{"role": "user"}], "top_k": -2}, timeout=30), 400, "top_k")
    _assert_error(httpx.post(url, json={"messages": [{"content": "hi"}]}, timeout=30), 400, "messages")
    _assert_error(httpx.post(url, json={"messages": [{"role": "robot", "content": "hi"}]}, timeout=30), 400, "messages")
    image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    _assert_error(httpx.post(url, json={"messages": [{"role": "user", "content": image}]}, timeout=30), 400, "messages")
    long = [{"role": "user", "content": "word " * 9000}]  # no max_tokens: the prompt alone overflows
    _assert_error(httpx.post(url, json={"messages": long}, timeout=30), 400, "messages")


def test_malformed_json_unknown_model_and_route(server):
    r = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "hi",',
                   headers={"content-type": "application/json"}, timeout=30)
    assert "JSON" in _assert_error(r, 400)["message"]
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b"[1, 2]",
                   headers={"content-type": "application/json"}, timeout=30)
    _assert_error(r, 400)
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "nope", "messages": _chat("hi")}, timeout=30)
    assert _assert_error(r, 404, "model")["code"] == "model_not_found"
    _assert_error(httpx.get(f"{server.url}/v1/nothing", timeout=30), 404)
    _assert_error(httpx.get(f"{server.url}/v1/completions", timeout=30), 405)


# ------------------------------------------------------------------ load


def test_200_concurrent_streams_equal_offline_greedy(server, model_id, llm):
    """200 concurrent streaming clients, 32 greedy tokens each (every 4th a chat, the rest
    completions, over 40 prompts): all complete, none errs, each text is the offline one, and the
    KV cache drains to empty."""
    prompts = PROMPTS[:40]
    is_chat = [i % 4 == 0 for i in range(40)]  # request i asks prompts[i % 40], so this holds per i too
    params = _greedy(32, ignore_eos=True)
    offline = [llm.tokenizer.apply_chat_template(_chat(p)) if c else p for p, c in zip(prompts, is_chat)]
    want = [o.text for o in llm.generate(offline, params)]

    async def one(i: int):
        client = _client(server, cls=openai.AsyncOpenAI)
        prompt, kw = prompts[i % 40], dict(model=model_id, max_tokens=32, temperature=0, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        async with client:
            if is_chat[i % 40]:
                stream = await client.chat.completions.create(messages=_chat(prompt), **kw)
                parts = [c async for c in stream]
                text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
            else:
                stream = await client.completions.create(prompt=prompt, **kw)
                parts = [c async for c in stream]
                text = "".join(c.choices[0].text for c in parts if c.choices)
        finish = [c.choices[0].finish_reason for c in parts if c.choices][-1]
        return text == want[i % 40], finish, parts[-1].usage.completion_tokens

    async def run():
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(200)), return_exceptions=True), 480)

    before = server.metric("tidal:request_success_total")
    results = asyncio.run(run())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} of 200 failed, e.g. {errors[0]!r}"
    assert all(r == (True, "length", 32) for r in results), [i for i, r in enumerate(results) if r != (True, "length", 32)]
    assert server.metric("tidal:request_success_total") - before == 200
    assert server.wait_metric("tidal:kv_cache_usage_perc", 0.0) == 0.0
    assert server.metric("tidal:num_requests_running") == 0 and server.metric("tidal:num_requests_waiting") == 0


# ------------------------------------------------------------------ disconnects


def test_disconnect_mid_stream_aborts_and_frees_blocks(server, model_id):
    aborted = server.metric("tidal:request_success_total", finished_reason="abort")
    body = {"model": model_id, "prompt": "Tell me a long story.", "max_tokens": 4000, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(3):  # a few tokens in: the request is running and holds blocks
                while not next(lines).startswith("data: "):
                    pass
            assert server.metric("tidal:num_requests_running") == 1
            assert server.metric("tidal:kv_cache_usage_perc") > 0
    # closed long before 4000 tokens: the server must abort it and give its blocks back
    assert server.wait_metric("tidal:request_success_total", aborted + 1, finished_reason="abort") == aborted + 1
    assert server.wait_metric("tidal:num_requests_running", 0) == 0
    assert server.wait_metric("tidal:kv_cache_usage_perc", 0.0) == 0.0


def test_disconnect_while_waiting_for_whole_response_aborts(server, model_id):
    aborted = server.metric("tidal:request_success_total", finished_reason="abort")
    body = {"model": model_id, "messages": _chat("Tell me a long story."), "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=2))
    assert server.wait_metric("tidal:request_success_total", aborted + 1, finished_reason="abort") == aborted + 1
    assert server.wait_metric("tidal:kv_cache_usage_perc", 0.0) == 0.0


# ------------------------------------------------------------------ schemathesis


def test_schemathesis_finds_no_server_errors(server):
    """~200 generated requests (valid and invalid) over every operation: no 5xx, and every
    error body of the generation endpoints is OpenAI-shaped."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    budget = {"POST": 48, "GET": 3}  # 2 POST x 2 modes x 48 + 6 GET x 3 = 210 at most
    failures, count, served = [], 0, {"/v1/completions": 0, "/v1/chat/completions": 0}
    for result in schema.get_all_operations():
        op = result.ok()
        modes = [schemathesis.GenerationMode.POSITIVE]
        if op.method.upper() == "POST":  # GETs take no input, so there is nothing to make invalid
            modes.append(schemathesis.GenerationMode.NEGATIVE)
        for mode in modes:

            @settings(max_examples=budget[op.method.upper()], deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(mode))
            def check(case):
                nonlocal count
                count += 1
                _bounded(case)
                r = case.call(base_url=server.url, timeout=60)
                if r.status_code == 200 and case.path in served:
                    served[case.path] += 1
                if r.status_code >= 500:
                    failures.append(f"{case.method} {case.path} {case.body!r} -> {r.status_code} {r.text[:200]}")
                elif r.status_code >= 400 and case.path.startswith("/v1"):
                    body = r.json()
                    assert set(body["error"]) == ERROR_KEYS, body

            check()
    print(f"schemathesis: {count} cases, {served} generations")
    assert count >= 150, count
    assert all(served.values()), served  # the valid cases got past validation into the engine
    assert not failures, failures[:5]
    assert server.metric("tidal:kv_cache_usage_perc") == 0.0 or server.wait_metric("tidal:kv_cache_usage_perc", 0.0) == 0.0


def _bounded(case) -> None:
    """Valid bodies ask for at most 4 tokens, so the run measures the API, not the CPU."""
    if isinstance(case.body, dict) and case.path.startswith("/v1/"):
        for key in ("max_tokens", "max_completion_tokens"):
            if type(case.body.get(key)) is int and case.body[key] > 4:
                case.body[key] = 4
        if case.body.get("max_tokens") is None and case.body.get("max_completion_tokens") is None:
            case.body["max_tokens"] = 4


# ------------------------------------------------------------------ API key, queue bound, SIGTERM

AUTH = {"Authorization": "Bearer sekrit"}
_strict: list[Server] = []


@pytest.fixture
def strict_server(tmp_path_factory):
    """Key from the environment; two running requests at most, one waiting at most; n-gram
    speculation, K=3. Shared by the tests below; the SIGTERM test ends it, and a later user
    starts a fresh one."""
    if not _strict or _strict[-1].proc.poll() is not None:
        _strict.append(Server(tmp_path_factory.mktemp("strict"), "--max-num-seqs", "2", "--max-waiting", "1",
                              "--shutdown-timeout", "4", "--speculation", "fixed", "--speculative-method",
                              "ngram", "--num-speculative-tokens", "3", env={"TIDAL_API_KEY": "sekrit"}))
    return _strict[-1]


@pytest.fixture(scope="module", autouse=True)
def _stop_strict_servers():
    yield
    for s in _strict:
        s.stop()


def test_api_key_required_on_v1_only(strict_server):
    url = strict_server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
        r = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
        assert _assert_error(r, 401)["code"] == "invalid_api_key"
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=headers, timeout=30)
        _assert_error(r, 401)
    with pytest.raises(openai.AuthenticationError):
        _client(strict_server, key="wrong").models.list()
    client = _client(strict_server, key="sekrit")
    model = client.models.list().data[0].id
    assert client.completions.create(model=model, prompt="hi", max_tokens=2).usage.completion_tokens == 2
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{url}{path}", timeout=30).status_code == 200


def _stream_until_running(client: httpx.Client, url: str, body: dict) -> tuple:
    """Open a stream and read up to its first token: then it holds a place in the batch. The
    line iterator is kept too: dropping it would close the connection (and abort the request)."""
    cm = client.stream("POST", f"{url}/v1/completions", json=body)
    r = cm.__enter__()
    assert r.status_code == 200, r.read()
    lines = r.iter_lines()
    while not next(lines).startswith("data: "):
        pass
    return cm, lines


def test_full_waiting_queue_answers_503_with_retry_after(strict_server):
    url = strict_server.url
    long = {"prompt": "Tell me a long story.", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    short = dict(long, max_tokens=3)
    with httpx.Client(timeout=60, headers=AUTH) as client:
        running = [_stream_until_running(client, url, long) for _ in range(2)]  # the batch is full
        try:
            with client.stream("POST", f"{url}/v1/completions", json=short) as waiting:
                assert waiting.status_code == 200  # taken, and queued behind the running two
                assert strict_server.metric("tidal:num_requests_waiting") == 1
                r = client.post(f"{url}/v1/completions", json=short)
                assert _assert_error(r, 503)["code"] == "overloaded"
                assert int(r.headers["Retry-After"]) >= 1
                running[0][0].__exit__(None, None, None)  # an abort frees a slot: the queued one runs
                events, done = _sse(waiting)
                assert done and events[-1]["choices"][0]["finish_reason"] == "length"
        finally:
            for cm, _ in running:
                cm.__exit__(None, None, None)
    assert strict_server.wait_metric("tidal:kv_cache_usage_perc", 0.0) == 0.0


def test_speculation_metrics_and_lossless_output(strict_server, llm):
    """n-gram drafts on a repetitive prompt: drafted/accepted totals and per-position counts
    agree, chosen K is observed, and the greedy text is still the plain offline one."""
    prompt = "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat"
    want = llm.generate(prompt, _greedy(32))[0]
    client = _client(strict_server, key="sekrit")
    got = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=32, temperature=0)
    assert got.choices[0].text == want.text
    m = strict_server.metric
    drafted, accepted = m("tidal:spec_decode_num_drafted_tokens_total"), m("tidal:spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and 0 < accepted <= drafted
    assert m("tidal:spec_decode_num_drafted_tokens_per_pos_total") == drafted
    assert m("tidal:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    per_pos = [m("tidal:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(3)]
    assert per_pos[0] > 0 and per_pos == sorted(per_pos, reverse=True)  # accepting i+1 means accepting i
    assert m("tidal:spec_decode_chosen_k_count") > 0 and m("tidal:spec_decode_chosen_k_sum") > 0


def test_sigterm_finishes_short_requests_aborts_long_ones_and_exits_0(strict_server):
    s = strict_server
    asyncio.run(asyncio.wait_for(_sigterm_scenario(s), 120))
    assert s.proc.wait(60) == 0, s.log()


async def _sigterm_scenario(s: Server) -> None:
    """A short and a long stream are running when SIGTERM comes (grace: 4 s)."""

    async def stream(max_tokens: int, started: asyncio.Event):
        body = {"prompt": "Tell me a long story.", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        events = []
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as client:
            async with client.stream("POST", f"{s.url}/v1/completions", json=body) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        started.set()
                    elif line == "data: [DONE]":
                        return events, True
        return events, False

    short_started, long_started = asyncio.Event(), asyncio.Event()
    long = asyncio.create_task(stream(8000, long_started))
    await long_started.wait()  # one at a time: the server lets one request wait for its first token
    short = asyncio.create_task(stream(16, short_started))
    await short_started.wait()
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.5)
    with pytest.raises(httpx.ConnectError):  # no longer accepting
        async with httpx.AsyncClient(timeout=5) as client:
            await client.get(f"{s.url}/health")
    events, done = await short
    assert done and events[-1]["choices"][0]["finish_reason"] == "length"  # finished in the grace time
    assert sum(len(e["choices"][0]["text"]) > 0 for e in events) > 1
    events, done = await long
    assert done and events[-1]["choices"][0]["finish_reason"] == "abort"  # cut at the grace deadline
    assert 3.5 < time.monotonic() - t0 < 30
