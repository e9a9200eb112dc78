"""Simulated sweep results as records with `tidal bench`'s fields, and a terminal table.

Latencies follow the bench's definitions: TTFT = arrival to first output chunk; TPOT per request
= (e2e - TTFT) / (output tokens - 1); ITL = gaps between a request's output chunks (a step that
accepts drafts emits several tokens in one chunk); e2e = arrival to last chunk.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from tidal.sim.simulator import SimRun


@dataclass
class SimRecord:
    """One (speculation mode, concurrency) point of a simulated sweep."""

    target: str
    concurrency: int
    output_tok_s: float
    requests_per_s: float
    ttft_ms: dict = field(default_factory=dict)
    tpot_ms: dict = field(default_factory=dict)
    itl_ms: dict = field(default_factory=dict)
    e2e_ms: dict = field(default_factory=dict)
    errors: int = 0
    acceptance_length: float | None = None  # tokens per verification of drafts, bonus included
    mean_chosen_k: float | None = None  # over every decoding request's step, zeros included
    num_requests: int = 0
    duration_s: float = 0.0
    simulated: bool = True

    def to_dict(self) -> dict:
        """The record as plain JSON-able data."""
        return asdict(self)


def summary_ms(values_s: list[float]) -> dict:
    """mean/p50/p90/p99 of seconds, in milliseconds."""
    if not values_s:
        return {}
    a = np.asarray(values_s) * 1e3
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


def make_record(target: str, concurrency: int, run: SimRun) -> SimRecord:
    """Aggregate one simulated run the way `tidal bench` aggregates a measured level."""
    ttft, tpot, itl, e2e = [], [], [], []
    for t in run.traces:
        times = [c for c, _ in t.chunks]
        ttft.append(times[0] - t.arrival)
        e2e.append(times[-1] - t.arrival)
        if t.num_tokens > 1:
            tpot.append((times[-1] - times[0]) / (t.num_tokens - 1))
        itl.extend(b - a for a, b in zip(times, times[1:]))
    tokens = sum(t.num_tokens for t in run.traces)
    duration = max(run.duration, 1e-12)
    return SimRecord(
        target, concurrency, tokens / duration, len(run.traces) / duration,
        summary_ms(ttft), summary_ms(tpot), summary_ms(itl), summary_ms(e2e),
        acceptance_length=(1 + run.num_accepted / run.num_verifications) if run.num_verifications else None,
        mean_chosen_k=(sum(run.chosen_k) / len(run.chosen_k)) if run.chosen_k else None,
        num_requests=len(run.traces), duration_s=run.duration)


def format_table(records: list[SimRecord]) -> str:
    """Markdown table, one row per concurrency, per target: tok/s, TPOT p50, chosen K, and the
    ratio to the first target's tok/s."""
    targets = list(dict.fromkeys(r.target for r in records))
    by = {(r.target, r.concurrency): r for r in records}
    head = ["concurrency"]
    for t in targets:
        head += [f"{t} tok/s", f"{t} TPOT p50 ms", f"{t} mean K"] + ([] if t == targets[0] else [f"{t} / {targets[0]}"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in sorted({r.concurrency for r in records}):
        row = [str(c)]
        base = by.get((targets[0], c))
        for t in targets:
            r = by.get((t, c))
            if r is None:
                row += ["-"] * (3 if t == targets[0] else 4)
                continue
            k = "-" if r.mean_chosen_k is None else f"{r.mean_chosen_k:.2f}"
            row += [f"{r.output_tok_s:.1f}", f"{r.tpot_ms.get('p50', float('nan')):.2f}", k]
            if t != targets[0]:
                row.append(f"{r.output_tok_s / base.output_tok_s:.2f}x" if base else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def crossovers(records: list[SimRecord], base: str) -> dict[str, int | None]:
    """Per target other than `base`: the lowest concurrency from which it stays at or below
    `base`'s tok/s (None: it never falls behind; 1: it never gets ahead)."""
    by = {(r.target, r.concurrency): r.output_tok_s for r in records}
    levels = sorted({r.concurrency for r in records})
    out: dict[str, int | None] = {}
    for t in dict.fromkeys(r.target for r in records):
        if t == base:
            continue
        ahead = [c for c in levels if (t, c) in by and (base, c) in by and by[(t, c)] > by[(base, c)]]
        later = [c for c in levels if not ahead or c > ahead[-1]]
        out[t] = later[0] if later else None
    return out


def plot(records: list[SimRecord], path: str) -> None:
    """PNG: tok/s vs concurrency (log x), one line per target; below, each target's ratio to
    the first. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(dict.fromkeys(r.target for r in records))
    base = {r.concurrency: r.output_tok_s for r in records if r.target == targets[0]}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    for t in targets:
        rs = sorted((r for r in records if r.target == t), key=lambda r: r.concurrency)
        xs = [r.concurrency for r in rs]
        top.plot(xs, [r.output_tok_s for r in rs], marker="o", label=t)
        bottom.plot(xs, [r.output_tok_s / base[r.concurrency] for r in rs if r.concurrency in base], marker="o")
    top.set_xscale("log")
    top.set_ylabel("output tok/s (simulated)")
    top.legend()
    bottom.axhline(1.0, color="gray", lw=0.8)
    bottom.set_ylabel(f"ratio to {targets[0]}")
    bottom.set_xlabel("concurrency")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
