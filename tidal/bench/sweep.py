"""The sweep: for each load level, every target in turn (order rotated per level and per
repeat), each run closed loop (exactly C requests in flight) or open loop (Poisson arrivals, at
most C in flight), with the server's speculative-decoding counters read before and after. With
`repeats` > 1 the whole sweep runs that many passes, the targets taking turns at each level, and a
target's record pools its rounds at that level: on a machine whose speed drifts over minutes,
targets measured one after another differ by the drift (22-35% between two identical tidal
servers on a 2-core VM), and alternating spreads each target over the same stretches of time.
Passes rather than each level's rounds back to back, so that each level too is spread over the
whole run: a level measured in one slow or fast spell misleads a fit across levels (tidal sim
calibrated on the other levels' step logs, benchmarks/sim_validation.py). `tidal bench --launch`
starts its servers afresh for each pass (`pass_targets`; not with --keep-servers), so a process
that happens to run slow for its whole life weighs one pass, not all."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
import numpy as np

from tidal.bench.client import RequestResult, build_payload, stream_request
from tidal.bench.scrape import SpecCounters, scrape_spec_counters
from tidal.sweeps.records import BenchRecord, latency_summary


@dataclass
class Target:
    """A server to measure. `model` is the id sent with requests (found at /v1/models when
    not given; omitted when the server does not say)."""

    name: str
    url: str
    model: str | None = None


@dataclass
class SweepConfig:
    """What every target is asked, at every level."""

    concurrency: list[int]
    output_len: int
    endpoint: str = "chat"  # "chat" or "completions"
    num_prompts: int | None = None  # requests per target per level; None: max(8, 2 * C)
    request_rate: float | None = None  # requests/s, Poisson; None: closed loop
    temperature: float = 0.0
    timeout_s: float = 600.0
    warmup: int = 2  # unmeasured requests per target before the first level
    repeats: int = 1  # passes over the levels, the targets taking turns; a record pools its target's rounds
    seed: int = 0
    api_key: str | None = None

    def num_requests(self, concurrency: int) -> int:
        """Requests per target at this level: never fewer than C, so C can be in flight."""
        return max(self.num_prompts, concurrency) if self.num_prompts else max(8, 2 * concurrency)


@dataclass
class Run:
    """One target's requests at one level, once: results, spec-counter delta, and when it ran
    (Unix seconds: first request sent, last one done)."""

    results: list[RequestResult]
    spec: SpecCounters | None
    window: tuple[float, float]

    @property
    def duration_s(self) -> float:
        return self.window[1] - self.window[0]


def rotated(targets: list[Target], turn: int) -> list[Target]:
    """The order targets run in: shifted by one each level and each repeat, so drift in the
    machine's speed does not always favour the same target."""
    k = turn % len(targets)
    return targets[k:] + targets[:k]


async def sweep(targets: list[Target], prompts: list[str], cfg: SweepConfig, records: list[BenchRecord],
                on_request: Callable[[str], None] = lambda _: None,
                on_record: Callable[[BenchRecord], None] = lambda _: None,
                pass_targets: Callable[[int], Awaitable[list[Target]]] | None = None) -> None:
    """Run every level for every target, appending a record to `records` when a target's last
    round at a level ends (with `repeats` > 1, in the last pass); cancelled or failed, the rounds
    that finished still make records (a level's targets may then hold different numbers of
    rounds: each record's `windows` says how many). `on_request(description)` is called per
    finished request, `on_record` per record. `pass_targets(pass)`, when given, replaces `targets`
    with each pass's own (servers started afresh for it: the same names, new URLs); a target not
    seen before is warmed up before the pass."""
    limits = httpx.Limits(max_connections=max(cfg.concurrency) + 8, max_keepalive_connections=max(cfg.concurrency) + 8)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    timeout = httpx.Timeout(cfg.timeout_s, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        warmed: set[str] = set()

        async def ready(these: list[Target]) -> list[Target]:
            for t in these:
                if t.url not in warmed:
                    t.model = t.model or await discover_model(client, t.url)
                    await warm_up(client, t, prompts, cfg)
                    warmed.add(t.url)
            return these

        runs: dict[tuple[str, int], list[Run]] = {}  # (target, level index): its finished rounds

        def emit(name: str, li: int) -> None:
            record = summarize(name, cfg.concurrency[li], cfg.request_rate, runs.pop((name, li)))
            records.append(record)
            on_record(record)

        try:
            for rep in range(cfg.repeats):
                these = await ready(targets if pass_targets is None else await pass_targets(rep))
                for li, c in enumerate(cfg.concurrency):
                    for t in rotated(these, li + rep):
                        run = await run_level(client, t, prompts, cfg, c, on_request)
                        runs.setdefault((t.name, li), []).append(run)
                        if rep == cfg.repeats - 1:  # the target's last round: its record is complete
                            emit(t.name, li)
        finally:  # cancelled in an earlier pass: the rounds that finished still make records
            for key in list(runs):
                emit(*key)


async def discover_model(client: httpx.AsyncClient, url: str) -> str | None:
    """The first model id the server lists at /v1/models, or None."""
    try:
        r = await client.get(url.rstrip("/") + "/v1/models", timeout=10)
        return r.json()["data"][0]["id"] if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


async def warm_up(client: httpx.AsyncClient, target: Target, prompts: list[str], cfg: SweepConfig) -> None:
    """A few short unmeasured requests, one at a time (first-request costs stay out of the
    numbers); their failures show up again, measured, in the first level."""
    for i in range(cfg.warmup):
        payload = build_payload(cfg.endpoint, prompts[i % len(prompts)], min(cfg.output_len, 16),
                                target.model, cfg.temperature)
        await stream_request(client, target.url, cfg.endpoint, payload)


async def run_level(client: httpx.AsyncClient, target: Target, prompts: list[str], cfg: SweepConfig,
                    concurrency: int, on_request: Callable[[str], None] = lambda _: None) -> Run:
    """One target at one level, once: its requests, timings and spec-counter delta."""
    n = cfg.num_requests(concurrency)
    payloads = [build_payload(cfg.endpoint, prompts[i % len(prompts)], cfg.output_len, target.model,
                              cfg.temperature) for i in range(n)]
    label = f"{target.name} C={concurrency}"

    async def send(payload: dict) -> RequestResult:
        result = await stream_request(client, target.url, cfg.endpoint, payload)
        on_request(label)
        return result

    before = await scrape_spec_counters(client, target.url)
    wall_start, start = time.time(), time.perf_counter()
    if cfg.request_rate is None:
        results = await closed_loop(send, payloads, concurrency)
    else:
        results = await open_loop(send, payloads, concurrency, cfg.request_rate, cfg.seed)
    end = max(r.done for r in results)
    after = await scrape_spec_counters(client, target.url)
    spec = after - before if before is not None and after is not None else None
    return Run(results, spec, (wall_start, wall_start + end - start))


async def closed_loop(send, payloads: list[dict], concurrency: int) -> list[RequestResult]:
    """`concurrency` workers, each sending its next request as soon as its last one ends."""
    pending = iter(enumerate(payloads))
    results: list[RequestResult | None] = [None] * len(payloads)

    async def worker() -> None:
        for i, payload in pending:  # one shared iterator: each request is taken once
            results[i] = await send(payload)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(payloads)))))
    return results


async def open_loop(send, payloads: list[dict], concurrency: int, rate: float, seed: int) -> list[RequestResult]:
    """Requests arrive at Poisson times (mean `rate` per second, the same schedule for every
    target); at most `concurrency` are in flight, later arrivals wait their turn."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(payloads))
    gate = asyncio.Semaphore(concurrency)

    async def one(payload: dict) -> RequestResult:
        async with gate:
            return await send(payload)

    tasks = []
    try:
        for gap, payload in zip(gaps, payloads):
            await asyncio.sleep(gap)
            tasks.append(asyncio.ensure_future(one(payload)))
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


def summarize(name: str, concurrency: int, rate: float | None, runs: list[Run]) -> BenchRecord:
    """The record of a target's runs at one level, pooled: rates over their summed wall time,
    latencies of the requests that succeeded, errors with the first message, and the spec
    counters' summed delta if every run has one."""
    results = [r for run in runs for r in run.results]
    duration_s = sum(run.duration_s for run in runs)
    spec = None if any(run.spec is None for run in runs) else sum((run.spec for run in runs), SpecCounters())
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    tokens = sum(r.output_tokens for r in ok)
    duration_s = max(duration_s, 1e-9)
    return BenchRecord(
        target=name, concurrency=concurrency, request_rate=rate, num_requests=len(results),
        completed=len(ok), duration_s=duration_s, output_tokens=tokens,
        output_tok_s=tokens / duration_s, requests_per_s=len(ok) / duration_s,
        ttft_ms=latency_summary([r.ttft for r in ok if r.ttft is not None]),
        tpot_ms=latency_summary([t for r in ok if (t := r.tpot()) is not None]),
        itl_ms=latency_summary([g for r in ok for g in r.itls()]),
        e2e_ms=latency_summary([r.e2e for r in ok]),
        errors=len(failed), error=failed[0].error if failed else None,
        acceptance_length=spec.acceptance_length if spec else None,
        acceptance_rate=spec.acceptance_rate if spec else None,
        mean_chosen_k=spec.mean_chosen_k if spec else None,
        windows=[list(run.window) for run in runs],
        round_tok_s=[sum(r.output_tokens for r in run.results if r.ok) / max(run.duration_s, 1e-9) for run in runs])
