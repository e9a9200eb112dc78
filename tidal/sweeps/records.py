"""The benchmark record: one target at one load level, in plain numbers.

`tidal bench` measures these against servers; a simulator can produce the same records, and
report.py turns any list of them into a table, CSV, plot and journal section.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import numpy as np

LATENCY_KEYS = ("mean", "p50", "p90", "p99")


def latency_summary(seconds: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 of `seconds`, in milliseconds (None when there is nothing)."""
    if not seconds:
        return dict.fromkeys(LATENCY_KEYS)
    ms = np.asarray(seconds, dtype=float) * 1000.0
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"mean": float(ms.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


@dataclass
class BenchRecord:
    """One target at one level (concurrency, and request rate when open loop).

    Rates are over the level's wall time, from its first request sent to its last one done.
    Latencies are dicts of mean/p50/p90/p99 in ms: `ttft_ms` send to first content chunk,
    `tpot_ms` per request (e2e - ttft) / (output tokens - 1), `itl_ms` gaps between content
    chunks of all requests pooled (a chunk can carry several tokens, e.g. under speculation),
    `e2e_ms` send to last chunk. `errors` counts failed requests, `error` keeps the first
    message. `acceptance_length` (1 + accepted / drafts: tokens per verify step that drafted),
    `acceptance_rate` (accepted / drafted tokens) and `mean_chosen_k` come from the server's
    speculative-decoding metrics over the level, None where it exports none. `windows`: when
    each of its rounds ran, [start, end] in Unix seconds (to match a server's step log to it);
    `round_tok_s`: each round's own output tok/s, in the same order.
    """

    target: str
    concurrency: int
    request_rate: float | None
    num_requests: int
    completed: int
    duration_s: float
    output_tokens: int
    output_tok_s: float
    requests_per_s: float
    ttft_ms: dict = field(default_factory=lambda: latency_summary([]))
    tpot_ms: dict = field(default_factory=lambda: latency_summary([]))
    itl_ms: dict = field(default_factory=lambda: latency_summary([]))
    e2e_ms: dict = field(default_factory=lambda: latency_summary([]))
    errors: int = 0
    error: str | None = None
    acceptance_length: float | None = None
    acceptance_rate: float | None = None
    mean_chosen_k: float | None = None
    windows: list = field(default_factory=list)
    round_tok_s: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "BenchRecord":
        """A record from its dict; keys this version does not know are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def target_order(records: list[BenchRecord]) -> list[str]:
    """Target names in order of first appearance; the first is the baseline of ratios."""
    return list(dict.fromkeys(r.target for r in records))


def levels(records: list[BenchRecord]) -> list[tuple[int, float | None]]:
    """The (concurrency, request rate) levels present, sorted."""
    return sorted({(r.concurrency, r.request_rate) for r in records},
                  key=lambda lv: (lv[0], lv[1] if lv[1] is not None else float("inf")))


def ratio_to_first(records: list[BenchRecord], order: list[str] | None = None) -> dict:
    """{(target, concurrency, rate): output tok/s over the first target's at that level}; a
    level where either side has no throughput gets None."""
    order = order or target_order(records)
    by = {(r.target, r.concurrency, r.request_rate): r for r in records}
    out = {}
    for (name, c, rate), r in by.items():
        base = by.get((order[0], c, rate))
        ok = base is not None and base.output_tok_s > 0 and r.output_tok_s > 0
        out[name, c, rate] = r.output_tok_s / base.output_tok_s if ok else None
    return out


def round_ratios_to_first(records: list[BenchRecord], order: list[str] | None = None) -> dict:
    """{(target, concurrency, rate): [each round's output tok/s over the first target's in the
    same round]}: the targets take turns within a round, so a slow spell of the machine lands on
    both sides of a ratio, where the pooled ratio lets it land on one. Rounds are paired in
    order; a level where either side has none gets []."""
    order = order or target_order(records)
    by = {(r.target, r.concurrency, r.request_rate): r for r in records}
    out = {}
    for (name, c, rate), r in by.items():
        base = by.get((order[0], c, rate))
        pairs = zip(r.round_tok_s, base.round_tok_s) if base is not None else ()
        out[name, c, rate] = [x / b for x, b in pairs if b > 0]
    return out
