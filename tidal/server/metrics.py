"""Prometheus metrics in vLLM's naming style under a `tidal:` prefix, one registry per app."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# seconds; vLLM's buckets, cut to what a CPU-to-GPU range of engines needs
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_K_BUCKETS = tuple(range(0, 16))  # num_speculative_tokens is at most 15
_RATE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
_MEAN_K_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 15.0)


def acceptance_class(drafted: int, accepted: int) -> str:
    """A request's class by the share of its drafts accepted: none (never drafted), low (under
    a third), mid, high (two thirds or more)."""
    if not drafted:
        return "none"
    rate = accepted / drafted
    return "low" if rate < 1 / 3 else "high" if rate >= 2 / 3 else "mid"


class ServerMetrics:
    """Every metric the server exports. Counters and histograms are fed by the engine thread
    (prometheus_client is thread-safe); the state gauges read live engine state at scrape time."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels, r = {"model_name": model_name}, self.registry

        def gauge(name, doc):
            return Gauge(f"tidal:{name}", doc, labelnames=list(labels), registry=r).labels(**labels)

        def counter(name, doc):
            return Counter(f"tidal:{name}", doc, labelnames=list(labels), registry=r).labels(**labels)

        def histogram(name, doc, buckets):
            return Histogram(f"tidal:{name}", doc, labelnames=list(labels), buckets=buckets,
                             registry=r).labels(**labels)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first output token.", _TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between two outputs of one request.", _ITL_BUCKETS)
        self.time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Per request: (e2e - ttft) / (output tokens - 1); what speculation lowers.", _ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to last output.", _E2E_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._success = Counter("tidal:request_success", "Finished requests, by finish reason.",
                                labelnames=[*labels, "finished_reason"], registry=r)
        self._labels = labels
        self.spec_drafted = counter("spec_decode_num_drafted_tokens", "Draft tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._drafted_per_pos = Counter(
            "tidal:spec_decode_num_drafted_tokens_per_pos", "Draft tokens verified, by draft position.",
            labelnames=[*labels, "position"], registry=r)
        self._accepted_per_pos = Counter(
            "tidal:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position.",
            labelnames=[*labels, "position"], registry=r)
        self.chosen_k = histogram(
            "spec_decode_chosen_k", "Draft length chosen per request per step (0 = no drafting).",
            _K_BUCKETS)
        self.request_acceptance = histogram(
            "spec_decode_request_acceptance_rate", "Per finished request that drafted: drafts accepted / verified.",
            _RATE_BUCKETS)
        self._request_mean_k = Histogram(
            "tidal:spec_decode_request_mean_k",
            "Per finished request: drafts verified per step it emitted in, by its acceptance class "
            "(none: never drafted; low < 1/3 accepted <= mid < 2/3 <= high).",
            labelnames=[*labels, "acceptance"], buckets=_MEAN_K_BUCKETS, registry=r)

    def bind_state(self, running: Callable[[], float], waiting: Callable[[], float],
                   kv_usage: Callable[[], float]) -> None:
        """Gauges computed when scraped, so they are never stale."""
        self.num_requests_running.set_function(running)
        self.num_requests_waiting.set_function(waiting)
        self.kv_cache_usage_perc.set_function(kv_usage)

    def request_finished(self, reason: str | None) -> None:
        self._success.labels(**self._labels, finished_reason=reason or "unknown").inc()

    def request_speculation(self, steps: int, drafted: int, accepted: int) -> None:
        """A finished request's speculation: the steps it emitted in and its drafts verified / accepted."""
        if drafted:
            self.request_acceptance.observe(accepted / drafted)
        self._request_mean_k.labels(**self._labels, acceptance=acceptance_class(drafted, accepted)).observe(
            drafted / max(1, steps))

    def spec_positions(self, drafted: list[int], accepted: list[int]) -> None:
        """Per-position deltas of drafted and accepted tokens (index = draft position)."""
        for pos, (d, a) in enumerate(zip(drafted, accepted)):
            if d:
                self._drafted_per_pos.labels(**self._labels, position=str(pos)).inc(d)
                self.spec_drafted.inc(d)
            if a:
                self._accepted_per_pos.labels(**self._labels, position=str(pos)).inc(a)
                self.spec_accepted.inc(a)

    def observe_chosen_k(self, ks: Iterable[int]) -> None:
        for k in ks:
            self.chosen_k.observe(k)


def chosen_ks(step_stats) -> list[int]:
    """The per-request draft lengths an engine step chose, if the engine says (via a
    `last_step_stats` with a `chosen_k` list or dict, as attribute or key); [] otherwise."""
    if step_stats is None:
        return []
    ks = step_stats.get("chosen_k") if isinstance(step_stats, dict) else getattr(step_stats, "chosen_k", None)
    if isinstance(ks, dict):
        ks = ks.values()
    if ks is None or isinstance(ks, (str, bytes)):
        return []
    try:
        return [int(k) for k in ks if isinstance(k, (int, float)) and not isinstance(k, bool) and k >= 0]
    except TypeError:  # not iterable
        return []
