"""Per-request acceptance statistics, what the policy reads of a request. Plain Python only."""

from __future__ import annotations

from dataclasses import dataclass, field

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
        on falls behind either way. Without it a run of early rejections leaves a request at
        K = 0 where only the policy's rare probes could bring it back."""
        self.recent_reached[:] = [RECENT_DECAY * x for x in self.recent_reached]
        self.recent_accepted[:] = [RECENT_DECAY * x for x in self.recent_accepted]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0
