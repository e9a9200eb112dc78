"""A fake OpenAI-compatible streaming server for the `tidal bench` tests, on a fixed schedule.

    python tests/bench_fake_server.py --port P --ttft 0.1 --itl 0.02

Every request's first token is sent `ttft` seconds after the request arrives and each next one
`itl` later, by absolute deadlines (late wake-ups do not accumulate). The first path segment
picks the behaviour, so one process serves several targets:
  /ok/...       streams, usage when asked, tidal's spec metrics at /ok/metrics
  /nousage/...  streams without a usage chunk (the client counts chunks)
  /vllm/...     like ok, with vLLM's spec-decode counters at /vllm/metrics
  /fail/...     HTTP 500 with an OpenAI error body
  /bad/...      HTTP 200 and a stream that is not JSON
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import uvicorn
from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from tidal.server.metrics import ServerMetrics

# per request, what the fake reports to its metrics
TIDAL_DRAFTED, TIDAL_ACCEPTED, TIDAL_CHOSEN_K = [4, 4], [4, 2], [2, 2, 2, 2, 0]
VLLM_DRAFTS, VLLM_DRAFT_TOKENS, VLLM_ACCEPTED = 5, 15, 10


def build_app(ttft: float, itl: float) -> Starlette:
    tidal_metrics = ServerMetrics("fake")
    vllm = {"drafts": 0, "draft_tokens": 0, "accepted": 0}

    def count(kind: str) -> None:
        if kind == "ok":
            tidal_metrics.spec_positions(TIDAL_DRAFTED, TIDAL_ACCEPTED)
            tidal_metrics.observe_chosen_k(TIDAL_CHOSEN_K)
        elif kind == "vllm":
            vllm["drafts"] += VLLM_DRAFTS
            vllm["draft_tokens"] += VLLM_DRAFT_TOKENS
            vllm["accepted"] += VLLM_ACCEPTED

    async def generate(request: Request):
        arrival = time.perf_counter()
        kind = request.path_params["kind"]
        chat = request.url.path.endswith("/chat/completions")
        body = await request.json()
        if kind == "fail":
            return JSONResponse({"error": {"message": "the fake engine broke", "type": "server_error",
                                           "param": None, "code": None}}, status_code=500)
        n = body["max_tokens"]
        usage = kind != "nousage" and (body.get("stream_options") or {}).get("include_usage")

        def chunk(text: str | None, finish: str | None = None) -> str:
            choice = ({"index": 0, "delta": {"content": text} if text is not None else {}, "finish_reason": finish}
                      if chat else {"index": 0, "text": text or "", "finish_reason": finish})
            return f"data: {json.dumps({'id': 'x', 'model': 'fake', 'choices': [choice]})}\n\n"

        async def events():
            if kind == "bad":
                yield "data: {this is not json\n\n"
                return
            if chat:
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant', 'content': ''}}]})}\n\n"
            for i in range(n):
                await asyncio.sleep(max(0.0, arrival + ttft + i * itl - time.perf_counter()))
                yield chunk(f" t{i}")
            yield chunk(None, "length")
            if usage:
                yield f"data: {json.dumps({'choices': [], 'usage': {'prompt_tokens': 3, 'completion_tokens': n, 'total_tokens': n + 3}})}\n\n"
            count(kind)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def metrics(request: Request):
        kind = request.path_params["kind"]
        if kind == "vllm":
            lines = []
            for name, key in (("drafts", "drafts"), ("draft_tokens", "draft_tokens"), ("accepted_tokens", "accepted")):
                lines += [f"# TYPE vllm:spec_decode_num_{name} counter",
                          f'vllm:spec_decode_num_{name}_total{{engine="0",model_name="fake"}} {float(vllm[key])}']
            return PlainTextResponse("\n".join(lines) + "\n")
        return PlainTextResponse(generate_latest(tidal_metrics.registry).decode())

    return Starlette(routes=[
        Route("/{kind}/v1/chat/completions", generate, methods=["POST"]),
        Route("/{kind}/v1/completions", generate, methods=["POST"]),
        Route("/{kind}/v1/models", models),
        Route("/{kind}/metrics", metrics),
        Route("/{kind}/health", lambda r: PlainTextResponse("ok")),
    ])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ttft", type=float, default=0.1)
    ap.add_argument("--itl", type=float, default=0.02)
    args = ap.parse_args()
    uvicorn.run(build_app(args.ttft, args.itl), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False)


if __name__ == "__main__":
    main()
