"""Per-request state: token ids, status, block table."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tidal.adaptive.policy import RequestView
from tidal.adaptive.stats import SpecStats
from tidal.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request as the scheduler and runner see it.

    `num_computed_tokens` counts tokens whose KV is in the cache; the tokens after it are
    what the next step must feed (a prefill chunk, or the one last sampled token).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    output_text: str = ""
    detok_offsets: tuple[int, int] = (0, 0)  # (prefix, read) offsets into output_token_ids
    generator: Any = None  # the request's torch.Generator, owned by the sampler
    num_preemptions: int = 0
    # speculation: drafts proposed for the next step, and what verification made of them
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: Any = None  # [k, V] tensor from a sampling drafter; None for n-gram
    spec: "SpecStats" = field(default_factory=lambda: SpecStats())

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def spec_view(self, max_k: int, catch_up: int, draft_class: int = 0) -> RequestView:
        """What the speculation policy sees of this request: at most `max_k` drafts, and never
        more than it may still emit less the verifier's own token; its counts for drafts of
        `draft_class`."""
        s, remaining = self.spec, self.params.max_tokens - len(self.output_token_ids)
        reached, accepted = s.counts(draft_class)
        return RequestView(min(max_k, max(0, remaining - 1)), reached, accepted, catch_up, s.chosen_k, remaining,
                           draft_class)
