"""Speculative-decoding counters from a server's /metrics (tidal's or vLLM's names), and
their change over a level: acceptance length, acceptance rate, mean chosen K."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class SpecCounters:
    """Cumulative counters. `drafts`: verify steps of a request that had drafts;
    `k_steps`/`k_sum`: per-request draft-length choices (K = 0 included) and their sum,
    where the server exports them (tidal's chosen-K histogram)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    k_steps: float = 0.0
    k_sum: float = 0.0

    def __sub__(self, other: "SpecCounters") -> "SpecCounters":
        return SpecCounters(*(a - b for a, b in zip(self._values(), other._values())))

    def __add__(self, other: "SpecCounters") -> "SpecCounters":
        return SpecCounters(*(a + b for a, b in zip(self._values(), other._values())))

    def _values(self) -> tuple[float, ...]:
        return self.drafts, self.draft_tokens, self.accepted_tokens, self.k_steps, self.k_sum

    @property
    def acceptance_length(self) -> float | None:
        """Tokens per verify step that drafted: 1 + accepted / drafts (vLLM's definition)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts > 0 else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens > 0 else None

    @property
    def mean_chosen_k(self) -> float | None:
        """Mean draft length chosen per request step (0s included) where the server says,
        else the mean draft length of the steps that drafted."""
        if self.k_steps > 0:
            return self.k_sum / self.k_steps
        return self.draft_tokens / self.drafts if self.drafts > 0 else None


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The counters in a Prometheus text exposition, summed over label sets (engines,
    models); None when it has no speculative-decoding metrics at all."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name.removesuffix("_total")
            if name == "tidal:spec_decode_num_drafted_tokens_per_pos":
                if s.labels.get("position") != "0":  # drafts at position 0 = steps that drafted
                    continue
            totals[name] = totals.get(name, 0.0) + s.value
    if "tidal:spec_decode_num_drafted_tokens" in totals:
        return SpecCounters(
            drafts=totals.get("tidal:spec_decode_num_drafted_tokens_per_pos", 0.0),
            draft_tokens=totals["tidal:spec_decode_num_drafted_tokens"],
            accepted_tokens=totals.get("tidal:spec_decode_num_accepted_tokens", 0.0),
            k_steps=totals.get("tidal:spec_decode_chosen_k_count", 0.0),
            k_sum=totals.get("tidal:spec_decode_chosen_k_sum", 0.0))
    if "vllm:spec_decode_num_drafts" in totals:
        return SpecCounters(
            drafts=totals["vllm:spec_decode_num_drafts"],
            draft_tokens=totals.get("vllm:spec_decode_num_draft_tokens", 0.0),
            accepted_tokens=totals.get("vllm:spec_decode_num_accepted_tokens", 0.0))
    return None


async def scrape_spec_counters(client: httpx.AsyncClient, base_url: str) -> SpecCounters | None:
    """GET /metrics and parse it; None when the server has no usable /metrics."""
    try:
        r = await client.get(base_url.rstrip("/") + "/metrics", timeout=10)
        return parse_spec_counters(r.text) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):  # no server, or text that is not Prometheus format
        return None
