"""Per-request acceptance statistics, what the policy reads of a request. Plain Python only."""

from __future__ import annotations

from dataclasses import dataclass, field

RECENT_DECAY = 0.9  # weight of a verification ten steps back ~ 1/3: the estimate follows the text


@dataclass
class SpecStats:
    """Per-request speculation statistics: totals per draft position, and recency-weighted
    counts of verifications that reached / accepted each position, per draft class (the
    drafter's grade of its drafts' confidence, 0 where it does not grade): what the policy reads."""

    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    recent: dict[int, tuple[list[float], list[float]]] = field(default_factory=dict)  # class -> (reached, accepted)
    chosen_k: int | None = None  # the policy's last choice for this request
    draft_class: int = 0  # the class of the drafts chosen last, which the next verification tests

    @property
    def num_drafted(self) -> int:
        return sum(self.drafted_per_position)

    @property
    def num_accepted(self) -> int:
        return sum(self.accepted_per_position)

    def counts(self, draft_class: int) -> tuple[list[float], list[float]]:
        """The recent (reached, accepted) counts per position of drafts of `draft_class`."""
        return self.recent.get(draft_class, ([], []))

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """A verification of `num_drafted` drafts of class `draft_class`, `num_accepted` accepted."""
        reached, accepted = self.recent.setdefault(self.draft_class, ([], []))
        for pos in range(num_drafted):
            if pos == len(self.drafted_per_position):
                self.drafted_per_position.append(0)
                self.accepted_per_position.append(0)
            if pos == len(reached):
                reached.append(0.0)
                accepted.append(0.0)
            self.drafted_per_position[pos] += 1
            self.accepted_per_position[pos] += pos < num_accepted
            if pos <= num_accepted:  # a position after the first rejection was never tested
                reached[pos] = RECENT_DECAY * reached[pos] + 1
                accepted[pos] = RECENT_DECAY * accepted[pos] + (pos < num_accepted)

    def fade(self) -> None:
        """A step in which the request emitted a token without drafting: its recent counts age as
        if a verification had passed, so while it does not draft its estimate returns towards the
        engine-wide prior instead of keeping the reading that stopped it; the text it was measured
        on falls behind either way. Without it a run of early rejections leaves a request at
        K = 0 where only the policy's rare probes could bring it back."""
        for reached, accepted in self.recent.values():
            reached[:] = [RECENT_DECAY * x for x in reached]
            accepted[:] = [RECENT_DECAY * x for x in accepted]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0
