"""One streamed OpenAI-style request and its timings, as the client sees them."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass
class RequestResult:
    """Timings of one request in seconds from the moment it was sent.

    `chunk_times`: arrival of every chunk that carried text. `output_tokens`: the server's
    usage when it sent one, else the number of text chunks. `error` is None on success.
    """

    sent: float  # time.perf_counter() when sent
    done: float = 0.0  # time.perf_counter() when the stream ended or failed
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.done - self.sent

    def itls(self) -> list[float]:
        """Gaps between consecutive text chunks."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    def tpot(self) -> float | None:
        """(e2e - ttft) / (output tokens - 1): the decode time per token after the first."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def build_payload(endpoint: str, prompt: str, output_len: int, model: str | None,
                  temperature: float = 0.0) -> dict:
    """A streaming request for exactly `output_len` tokens (ignore_eos is a tidal/vLLM
    extension; servers without it may stop early, which the token counts then show)."""
    body: dict = {"max_tokens": output_len, "temperature": temperature, "ignore_eos": True,
                  "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if model is not None:
        body["model"] = model
    return body


async def stream_request(client: httpx.AsyncClient, base_url: str, endpoint: str, payload: dict) -> RequestResult:
    """Send `payload` to `base_url` + the endpoint's path and time the stream. Never raises
    for a failed request (connection, HTTP status, malformed stream): the result says why."""
    result = RequestResult(sent=time.perf_counter())
    try:
        async with client.stream("POST", base_url.rstrip("/") + ENDPOINTS[endpoint], json=payload) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {_error_message(await r.aread())}"
            else:
                await _read_stream(r, endpoint, result)
    except Exception as e:  # noqa: BLE001 - any failure is this request's result, not the sweep's
        result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    result.done = result.done or time.perf_counter()
    return result


async def _read_stream(r: httpx.Response, endpoint: str, result: RequestResult) -> None:
    usage_tokens, done = None, False
    async for line in r.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            result.error = f"bad stream: not JSON: {data[:200]!r}"
            return
        if not isinstance(event, dict):
            result.error = f"bad stream: not an object: {data[:200]!r}"
            return
        if "error" in event:
            result.error = f"error in stream: {_error_message(data.encode())}"
            return
        if _chunk_text(event, endpoint):
            result.chunk_times.append(time.perf_counter() - result.sent)
        if isinstance(event.get("usage"), dict) and event["usage"].get("completion_tokens") is not None:
            usage_tokens = int(event["usage"]["completion_tokens"])
    result.done = time.perf_counter()  # the last chunk, before the connection is released
    if not done:
        result.error = "bad stream: it ended without [DONE]"
    result.output_tokens = usage_tokens if usage_tokens is not None else len(result.chunk_times)


def _chunk_text(event: dict, endpoint: str) -> str:
    choices = event.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-shaped error body, else the body's start."""
    text = body.decode(errors="replace")
    try:
        err = json.loads(text)
        if isinstance(err, dict):
            inner = err.get("error", err)
            if isinstance(inner, dict) and inner.get("message"):
                return str(inner["message"])
            if isinstance(inner, str):
                return inner
    except json.JSONDecodeError:
        pass
    return text[:300].strip() or "(empty body)"
