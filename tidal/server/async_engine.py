"""The engine on its own thread, fed through a thread-safe inbox, streaming to asyncio queues.

Only the engine thread touches the LLMEngine. The event loop submits and aborts requests by
putting commands in the inbox (processed between steps) and receives outputs on one
asyncio.Queue per request, filled via loop.call_soon_threadsafe once per step. So the HTTP side
never waits on model compute, and tokens reach clients as soon as a step produces them.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass

from tidal.engine.llm_engine import EngineLoad, LLMEngine, RequestOutput
from tidal.sampling_params import SamplingParams
from tidal.server.metrics import ServerMetrics, chosen_ks

log = logging.getLogger("tidal.server")

ACCEPTED = object()  # first item of a stream whose request the engine took


class EngineDead(RuntimeError):
    """The engine thread failed; the server can no longer serve."""


class RequestStream:
    """The HTTP side of one request: the engine's outputs (cumulative), in order, on a queue.

    The first item is ACCEPTED or the exception add_request raised; then RequestOutputs, the
    last one `finished`; or an EngineDead.
    """

    def __init__(self, request_id: str, arrival: float):
        self.request_id = request_id
        self.arrival = arrival  # time.monotonic() when the HTTP request came in
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False  # finished, failed or aborted: the engine holds nothing for it

    async def next(self):
        """The next item; consecutive outputs are coalesced into the latest (they are
        cumulative), so a slow reader costs no extra work."""
        item = await self.queue.get()
        while isinstance(item, RequestOutput) and not item.finished and not self.queue.empty():
            item = self.queue.get_nowait()
        if isinstance(item, BaseException):
            raise item
        return item


@dataclass
class _Add:
    stream: RequestStream
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Drain:
    deadline: float


@dataclass
class _Stop:
    pass


@dataclass
class _Tracked:
    """What the engine thread keeps per request, for streaming and metrics."""

    stream: RequestStream
    last_output: float | None = None
    first_token: float | None = None
    num_tokens: int = 0
    num_outputs: int = 0  # engine steps that gave it tokens
    num_drafted: int = 0
    num_accepted: int = 0


class ComputeThread:
    """One daemon thread that runs a server's torch work in order: building the engine, then its
    step loop. OpenMP gives every thread that runs parallel work a team of its own, and a second
    team on the same cores stalls the first (steps 3x slower with two threads on two cores)."""

    def __init__(self, name: str = "tidal-engine"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._work, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 -- handed to whoever waits on it
                    future.set_exception(e)


class AsyncEngine:
    """Runs `engine.step()` in a loop on its compute thread (the one that built the engine, where
    given); `start()` inside the event loop."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, compute: ComputeThread | None = None):
        self.engine = engine
        self.metrics = metrics
        self._compute = compute
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._unstarted: set[RequestStream] = set()  # event loop only: accepted, no token yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: Future | None = None  # the step loop
        self._drain_deadline: float | None = None
        self._last_step_stats = None
        self.draining = False
        self.error: BaseException | None = None
        self.load = EngineLoad()  # what the engine published after its last step (engine thread writes)
        metrics.bind_state(running=lambda: self.load.running, waiting=lambda: self.load.waiting,
                           kv_usage=lambda: self.load.kv_cache_usage)

    # ------------------------------------------------------------ event-loop side

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._compute = self._compute or ComputeThread()
        self._running = self._compute.submit(self._run)

    @property
    def alive(self) -> bool:
        return self._running is not None and not self._running.done() and self.error is None

    @property
    def num_waiting(self) -> int:
        """Requests accepted by the server that have not produced a token yet."""
        return len(self._unstarted)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               arrival: float) -> RequestStream:
        stream = RequestStream(request_id, arrival)
        self._unstarted.add(stream)
        self._inbox.put(_Add(stream, prompt_token_ids, params))
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Stop the request (if still running) and free its KV blocks; safe to call twice."""
        self._unstarted.discard(stream)
        if not stream.done:
            stream.done = True
            self._inbox.put(_Abort(stream.request_id))

    def drain(self, grace_s: float) -> None:
        """Stop taking requests; abort those still running after `grace_s`. Signal-safe."""
        self.draining = True
        self._inbox.put(_Drain(time.monotonic() + grace_s))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort whatever is left, stop the thread and wait for it."""
        self.draining = True
        self._inbox.put(_Stop())
        if self._running is not None:
            wait([self._running], timeout_s)

    def _deliver(self, batch: list[tuple[RequestStream, object]]) -> None:
        for stream, item in batch:
            if item is not ACCEPTED:
                self._unstarted.discard(stream)
            if isinstance(item, BaseException) or (isinstance(item, RequestOutput) and item.finished):
                stream.done = True
            stream.queue.put_nowait(item)

    # ------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while self._serve_once():
                pass
        except BaseException as e:  # noqa: BLE001 -- report, fail every request, stop
            log.exception("engine thread failed")
            self.error = e
            dead = EngineDead(f"engine failed: {type(e).__name__}: {e}")
            self._send([(t.stream, dead) for t in self._tracked.values()])
            self._tracked.clear()
            self._fail_inbox(dead)

    def _serve_once(self) -> bool:
        """Handle commands, run one step, publish. False when told to stop."""
        engine, batch = self.engine, []
        idle = not engine.has_unfinished()
        while True:
            try:
                cmd = self._inbox.get(timeout=0.5) if idle else self._inbox.get_nowait()
            except queue.Empty:
                break
            idle = False
            if isinstance(cmd, _Stop):
                self._abort_all(batch)
                self._send(batch)
                self._fail_inbox(EngineDead("server is shutting down"))
                return False
            self._handle(cmd, batch)
        if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
            self._abort_all(batch)
        if engine.has_unfinished():
            outputs = engine.step()
            self._publish(outputs, batch)
        self.load = engine.load()
        self._send(batch)
        return True

    def _handle(self, cmd, batch: list) -> None:
        if isinstance(cmd, _Add):
            stream = cmd.stream
            if stream.done:  # aborted before it reached the engine
                return
            try:
                self.engine.add_request(stream.request_id, cmd.prompt_token_ids, cmd.params)
            except Exception as e:  # noqa: BLE001 -- refuses this request only (ValueError: a 400)
                batch.append((stream, e))
                return
            self._tracked[stream.request_id] = _Tracked(stream)
            batch.append((stream, ACCEPTED))
        elif isinstance(cmd, _Abort):
            t = self._tracked.pop(cmd.request_id, None)
            if t is not None:
                self.engine.abort(cmd.request_id)
                self.metrics.request_finished("abort")
        elif isinstance(cmd, _Drain):
            self._drain_deadline = cmd.deadline

    def _abort_all(self, batch: list) -> None:
        for rid, t in list(self._tracked.items()):
            out = self.engine.abort(rid) or RequestOutput(rid, [], [], "", True, "abort")
            batch.append((t.stream, out))
            self.metrics.request_finished("abort")
        self._tracked.clear()

    def _publish(self, outputs: list[RequestOutput], batch: list) -> None:
        now, m = time.monotonic(), self.metrics
        for out in outputs:
            t = self._tracked.get(out.request_id)
            if t is None:
                continue
            new_tokens = len(out.token_ids) - t.num_tokens
            t.num_tokens = len(out.token_ids)
            if t.first_token is None:
                t.first_token = now
                m.time_to_first_token.observe(now - t.stream.arrival)
                m.prompt_tokens.inc(len(out.prompt_token_ids))
            else:
                m.inter_token_latency.observe(now - t.last_output)
            t.last_output = now
            m.generation_tokens.inc(max(0, new_tokens))
            t.num_outputs += 1
            if out.num_draft_tokens:
                d, a = out.num_draft_tokens, out.num_accepted_tokens
                m.spec_positions([1] * d, [1] * a + [0] * (d - a))
                t.num_drafted, t.num_accepted = t.num_drafted + d, t.num_accepted + a
            if out.finished:
                del self._tracked[out.request_id]
                m.e2e_request_latency.observe(now - t.stream.arrival)
                if t.num_tokens > 1:
                    m.time_per_output_token.observe((now - t.first_token) / (t.num_tokens - 1))
                m.request_finished(out.finish_reason)
                m.request_speculation(t.num_outputs, t.num_drafted, t.num_accepted)
            batch.append((t.stream, out))
        stats = self.engine.last_step_stats  # the step's published result
        if stats is not None and stats is not self._last_step_stats:  # a fresh step's, not stale
            self._last_step_stats = stats
            m.observe_chosen_k(chosen_ks(stats))

    def _fail_inbox(self, error: BaseException) -> None:
        """Answer requests still queued for the engine, which will never take them now."""
        batch = []
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                batch.append((cmd.stream, error))
        self._send(batch)

    def _send(self, batch: list) -> None:
        if not batch:
            return
        try:
            self._loop.call_soon_threadsafe(self._deliver, list(batch))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass
        batch.clear()
