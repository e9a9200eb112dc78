"""Per-request state: token ids, status, block table."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tidal.sampling_params import SamplingParams
from tidal.spec.policy import RequestView


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


RECENT_DECAY = 0.9  # weight of a verification ten steps back ~ 1/3: the estimate follows the text


@dataclass
class SpecStats:
    """Per-request speculation statistics: totals per draft position, and recency-weighted
    counts of verifications that reached / accepted each position (what the policy reads)."""

    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    recent_reached: list[float] = field(default_factory=list)
    recent_accepted: list[float] = field(default_factory=list)
    chosen_k: int | None = None  # the policy's last choice for this request

    @property
    def num_drafted(self) -> int:
        return sum(self.drafted_per_position)

    @property
    def num_accepted(self) -> int:
        return sum(self.accepted_per_position)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        for pos in range(num_drafted):
            if pos == len(self.drafted_per_position):
                self.drafted_per_position.append(0)
                self.accepted_per_position.append(0)
                self.recent_reached.append(0.0)
                self.recent_accepted.append(0.0)
            self.drafted_per_position[pos] += 1
            self.accepted_per_position[pos] += pos < num_accepted
            if pos <= num_accepted:  # a position after the first rejection was never tested
                self.recent_reached[pos] = RECENT_DECAY * self.recent_reached[pos] + 1
                self.recent_accepted[pos] = RECENT_DECAY * self.recent_accepted[pos] + (pos < num_accepted)

    def fade(self) -> None:
        """A step in which the request emitted a token without drafting: its recent counts age as
        if a verification had passed, so while it does not draft its estimate returns towards the
        engine-wide prior instead of keeping the reading that stopped it; the text it was measured
        on falls behind either way. Without it, at one request with the shipped EAGLE-3 head, a
        run of rejections (acceptance is about 0.4 a draft) put requests at K = 0 for 13-74% of
        their steps, where only the policy's probes (one draft every 16 steps or more) could
        bring them back; with it 4-14%, 1.02x-1.03x of adaptive without it and 0.98x-1.01x of
        fixed K = 2 (throwaway A/B, engines stepped in turn, 2026-12-04)."""
        self.recent_reached[:] = [RECENT_DECAY * x for x in self.recent_reached]
        self.recent_accepted[:] = [RECENT_DECAY * x for x in self.recent_accepted]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0


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
    draft_num_computed: int = 0  # positions whose draft-head KV is valid (EAGLE)
    draft_features: list = field(default_factory=list)  # target features the head has not seen
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

    def spec_view(self, max_k: int, catch_up: int) -> RequestView:
        """What the speculation policy sees of this request: at most `max_k` drafts, and never
        more than it may still emit less the verifier's own token."""
        s, remaining = self.spec, self.params.max_tokens - len(self.output_token_ids)
        return RequestView(min(max_k, max(0, remaining - 1)), s.recent_reached, s.recent_accepted, catch_up,
                           s.chosen_k, remaining)
