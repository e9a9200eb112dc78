"""A simulated run as a `tidal bench` record (tidal.sweeps.records.BenchRecord), so the bench's
table, JSON, CSV and plot take simulated sweeps as they are.

Latencies follow the bench's definitions: TTFT = arrival to first output chunk; TPOT per request
= (e2e - TTFT) / (output tokens - 1); ITL = gaps between a request's output chunks (a step that
accepts drafts emits several tokens in one chunk); e2e = arrival to last chunk.
"""

from __future__ import annotations

from tidal.sim.simulator import SimRun
from tidal.sweeps.records import BenchRecord, latency_summary


def make_record(target: str, concurrency: int, run: SimRun) -> BenchRecord:
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
    return BenchRecord(
        target, concurrency, None, len(run.traces), len(run.traces), run.duration, tokens,
        tokens / duration, len(run.traces) / duration,
        latency_summary(ttft), latency_summary(tpot), latency_summary(itl), latency_summary(e2e),
        acceptance_length=(1 + run.num_accepted / run.num_verifications) if run.num_verifications else None,
        acceptance_rate=(run.num_accepted / run.num_drafted) if run.num_drafted else None,
        mean_chosen_k=(sum(run.chosen_k) / len(run.chosen_k)) if run.chosen_k else None)
