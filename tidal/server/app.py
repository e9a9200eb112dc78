"""The OpenAI-compatible HTTP app (FastAPI) over an AsyncEngine, and `serve()` to run it."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from tidal.version import __version__
from tidal.engine.llm_engine import LLMEngine, RequestOutput
from tidal.sampling_params import InvalidParameter, SamplingParams
from tidal.server import protocol as p
from tidal.server.async_engine import AsyncEngine, ComputeThread, EngineDead, RequestStream
from tidal.server.metrics import ServerMetrics

log = logging.getLogger("tidal.server")


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


def error_response(status: int, message: str, type: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None, headers: dict | None = None):
    body = p.ErrorResponse(error=p.ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(InvalidParameter)
    async def _invalid(_, e: InvalidParameter):
        return error_response(400, str(e), param=e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e: RequestValidationError):  # FastAPI's 422, as OpenAI's 400
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ())][1:]  # after "body"
        where = loc[0] if loc else None  # OpenAI names the top-level field; the message has the path
        msg = first.get("msg", "invalid request").removeprefix("Value error, ")
        message = f"{'.'.join(loc)}: {msg}" if loc else msg
        if first.get("type") == "json_invalid":
            message, where = f"the body is not valid JSON: {first.get('ctx', {}).get('error', msg)}", None
        return error_response(400, message, param=where)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), kind, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_, e: Exception):
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(e).__name__}", "server_error")


def build_app(engine: LLMEngine, *, model_name: str, api_key: str | None = None,
              max_waiting: int = 1024, compute: ComputeThread | None = None) -> FastAPI:
    """The app. It owns its AsyncEngine (started and stopped with the app's lifespan) and its
    metrics registry, so two apps in one process share nothing. `compute`: the thread that
    built `engine`, to step it on too."""
    metrics = ServerMetrics(model_name)
    aengine = AsyncEngine(engine, metrics, compute)

    @asynccontextmanager
    async def lifespan(_app):
        aengine.start()
        yield
        await asyncio.to_thread(aengine.shutdown)

    app = FastAPI(title="tidal", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible completions and chat completions.")
    app.state.engine = aengine
    app.state.metrics = metrics
    _install_error_handlers(app)
    bearer = HTTPBearer(auto_error=False)

    async def authorize(cred: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if api_key is None:
            return
        if cred is None or not hmac.compare_digest(cred.credentials.encode(), api_key.encode()):
            raise APIError(401, "Incorrect or missing API key; send 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")

    gen = _Generation(aengine, engine, model_name, max_waiting)
    auth = [Depends(authorize)]

    @app.get("/health", responses={503: {"model": p.ErrorResponse}})
    async def health() -> Response:
        if not aengine.alive:
            raise APIError(503, "the engine is not running", "server_error")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=auth, response_model=p.ModelList)
    async def models() -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=model_name, created=gen.created,
                                             max_model_len=gen.context_limit)])

    errors = {s: {"model": p.ErrorResponse} for s in (400, 401, 404, 503)}

    @app.post("/v1/completions", dependencies=auth, response_model=p.CompletionResponse, responses=errors)
    async def completions(body: p.CompletionRequest, request: Request):
        return await gen.completion(body, request)

    @app.post("/v1/chat/completions", dependencies=auth, response_model=p.ChatCompletionResponse,
              responses=errors)
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        return await gen.chat(body, request)

    return app


class _Generation:
    """The two generation endpoints: admission, streaming, and the response shapes."""

    def __init__(self, aengine: AsyncEngine, engine: LLMEngine, model_name: str, max_waiting: int):
        self.aengine, self.tokenizer = aengine, engine.tokenizer
        self.model_name, self.max_waiting = model_name, max_waiting
        self.created = p.now()
        self.context_limit = engine.max_context_len

    # ------------------------------------------------------------ endpoints

    async def completion(self, body: p.CompletionRequest, request: Request):
        arrival = time.monotonic()
        self._check_model(body.model)
        body.check_supported()
        prompt = body.single_prompt()
        ids = await asyncio.to_thread(self.tokenizer.encode, prompt) if isinstance(prompt, str) else prompt
        params = body.sampling_params(self._max_tokens(body.max_tokens, ids, "prompt"))
        rid = p.new_id("cmpl")
        stream = await self._admit(rid, ids, params, arrival)
        if body.stream:
            chunks = self._completion_chunks(rid, stream, params, body.include_usage)
            return self._sse(chunks, stream)
        out = await self._collect(stream, request)
        return p.CompletionResponse(
            id=rid, created=p.now(), model=self.model_name,
            choices=[p.CompletionChoice(text=out.text, finish_reason=out.finish_reason)],
            usage=_usage(out))

    async def chat(self, body: p.ChatCompletionRequest, request: Request):
        arrival = time.monotonic()
        self._check_model(body.model)
        body.check_supported()
        conversation = body.conversation()
        ids = await asyncio.to_thread(self._render, conversation)
        params = body.sampling_params(self._max_tokens(body.requested_max_tokens, ids, "messages"))
        rid = p.new_id("chatcmpl")
        stream = await self._admit(rid, ids, params, arrival)
        if body.stream:
            chunks = self._chat_chunks(rid, stream, params, body.include_usage)
            return self._sse(chunks, stream)
        out = await self._collect(stream, request)
        return p.ChatCompletionResponse(
            id=rid, created=p.now(), model=self.model_name,
            choices=[p.ChatChoice(message=p.ChatResponseMessage(content=out.text),
                                  finish_reason=out.finish_reason)],
            usage=_usage(out))

    # ------------------------------------------------------------ request checks

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")

    def _render(self, conversation: list[dict]) -> list[int]:
        try:
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(conversation))
        except InvalidParameter:
            raise
        except ValueError as e:  # a template that rejects the messages
            raise InvalidParameter("messages", str(e)) from e

    def _max_tokens(self, requested: int | None, ids: list[int], what: str) -> int:
        """The request's own max_tokens, or else what is left of the context."""
        if requested is not None:
            return requested
        room = self.context_limit - len(ids)
        if room < 1:
            raise InvalidParameter(what, f"is too long: {len(ids)} tokens, and this model's maximum "
                                         f"context length is {self.context_limit} tokens")
        return room

    async def _admit(self, rid: str, ids: list[int], params: SamplingParams,
                     arrival: float) -> RequestStream:
        """Queue the request with the engine and wait until it is taken (or refused)."""
        aengine = self.aengine
        if aengine.draining or not aengine.alive:
            raise APIError(503, "the server is shutting down" if aengine.draining
                           else "the engine is not running", "server_error", code="unavailable")
        if aengine.num_waiting >= self.max_waiting:
            raise APIError(503, f"too many requests waiting ({aengine.num_waiting}); retry later",
                           "server_error", code="overloaded", headers={"Retry-After": "1"})
        stream = aengine.submit(rid, list(ids), params, arrival)
        try:
            await stream.next()  # ACCEPTED, or the engine's reason to refuse
        except InvalidParameter:
            raise
        except ValueError as e:
            raise APIError(400, str(e)) from e
        except EngineDead as e:
            raise APIError(503, str(e), "server_error", code="unavailable") from e
        except Exception as e:  # the engine refused it for a reason of its own
            raise APIError(500, f"the engine could not take the request: {type(e).__name__}: {e}",
                           "server_error") from e
        except BaseException:  # cancelled while queued: the engine must drop it
            aengine.abort(stream)
            raise
        return stream

    # ------------------------------------------------------------ non-streaming

    async def _collect(self, stream: RequestStream, request: Request) -> RequestOutput:
        """The final output; if the client goes away first, abort the request."""

        async def final() -> RequestOutput:
            while True:
                out = await stream.next()
                if out.finished:
                    return out

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.ensure_future(final()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                self.aengine.abort(stream)
        if not work.done() or work.cancelled():
            raise APIError(499, "client disconnected")
        try:
            return work.result()
        except EngineDead as e:
            raise APIError(500, str(e), "server_error") from e

    # ------------------------------------------------------------ streaming

    def _sse(self, chunks: AsyncIterator[dict], stream: RequestStream) -> StreamingResponse:
        async def body():
            try:
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            except EngineDead as e:
                err = p.ErrorResponse(error=p.ErrorInfo(message=str(e), type="server_error"))
                yield f"data: {err.model_dump_json()}\n\n"
            finally:  # a client that went away (cancellation lands here) frees its blocks
                if not stream.done:
                    self.aengine.abort(stream)
            yield "data: [DONE]\n\n"

        return _AbortingStream(self.aengine, stream, body(), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _completion_chunks(self, rid: str, stream: RequestStream, params: SamplingParams,
                                 include_usage: bool) -> AsyncIterator[dict]:
        head = {"id": rid, "object": "text_completion", "created": p.now(), "model": self.model_name}
        extra = {"usage": None} if include_usage else {}
        async for text, out in _text_deltas(stream, params):
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": out.finish_reason if out.finished else None}
            yield {**head, "choices": [choice], **extra}
        if include_usage:
            yield {**head, "choices": [], "usage": _usage(out).model_dump()}

    async def _chat_chunks(self, rid: str, stream: RequestStream, params: SamplingParams,
                           include_usage: bool) -> AsyncIterator[dict]:
        head = {"id": rid, "object": "chat.completion.chunk", "created": p.now(), "model": self.model_name}
        extra = {"usage": None} if include_usage else {}

        def chunk(delta: dict, finish_reason: str | None) -> dict:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**head, "choices": [choice], **extra}

        yield chunk({"role": "assistant", "content": ""}, None)
        async for text, out in _text_deltas(stream, params):
            if text:
                yield chunk({"content": text}, None)
            if out.finished:
                yield chunk({}, out.finish_reason)
        if include_usage:
            yield {**head, "choices": [], "usage": _usage(out).model_dump()}


class _AbortingStream(StreamingResponse):
    """A streaming response that aborts its request however it ends, even when the client left
    before the body generator first ran (and so before its own `finally` could)."""

    def __init__(self, aengine: AsyncEngine, stream: RequestStream, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._aengine, self._stream = aengine, stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._stream.done:
                self._aengine.abort(self._stream)


async def _text_deltas(stream: RequestStream, params: SamplingParams):
    """(new text, output) per engine output, the last one finished. While a stop string could
    still be forming, its possible start is held back, so no text is sent that the stop cuts."""
    hold = max((len(s) for s in params.stop), default=1) - 1
    sent = 0
    while True:
        out = await stream.next()
        end = len(out.text) if out.finished else max(sent, len(out.text) - hold)
        text, sent = out.text[sent:end], max(sent, end)
        if text or out.finished:
            yield text, out
        if out.finished:
            return


def _usage(out: RequestOutput) -> p.Usage:
    return p.Usage.of(len(out.prompt_token_ids), len(out.token_ids))


# ------------------------------------------------------------------ running it


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, shutdown_grace_s: float = 30.0,
          log_level: str = "info", access_log: bool = True) -> None:
    """Run the app under uvicorn until SIGINT/SIGTERM. On the signal: stop accepting, let
    in-flight requests finish for `shutdown_grace_s`, abort the rest, stop the engine, return."""
    import uvicorn

    aengine: AsyncEngine = app.state.engine

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            aengine.drain(shutdown_grace_s)  # streams end with finish_reason "abort" at the deadline
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=shutdown_grace_s + 5, timeout_keep_alive=5)
    _quietly_handled(Server(config).run)


def _quietly_handled(run: Callable[[], None]) -> None:
    # uvicorn re-raises the signal it caught once it has shut down, which would kill the
    # process with that signal; a graceful stop on request should exit 0 instead.
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda *_: None) for s in handled}
    try:
        run()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
