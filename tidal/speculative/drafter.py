"""The Drafter interface: proposes draft tokens for the target model to verify."""

from __future__ import annotations

from typing import Protocol

from tidal.sequence import Sequence


class Drafter(Protocol):
    """Proposes up to `num_draft_tokens[i]` tokens to follow each sequence's current tokens.

    Returns one list per sequence (possibly shorter than asked, or empty). Drafters that sample
    from a distribution also return its probabilities per draft position; deterministic ones
    (n-gram) return None, which the verifier treats as a one-hot draft distribution.
    """

    def propose(self, seqs: list[Sequence], num_draft_tokens: list[int]) -> tuple[list[list[int]], list | None]:
        ...

    def available(self, seqs: list[Sequence], max_k: int) -> list[int]:
        """The most drafts `propose` would return for each sequence now (<= max_k), where the
        drafter knows without running a model (n-gram: its match's continuation); else max_k.
        The policy never chooses more: a draft the drafter cannot make adds no verify tokens
        and no chance of a token, so pricing it would be pricing nothing."""
        ...

    def draft_class(self, seq: Sequence) -> int:
        """The drafter's grade of the drafts `available` last found for `seq`, a small integer
        (0: it does not grade). Drafts of one grade are accepted alike, so the policy keeps an
        acceptance prior per grade and a request's counts per grade."""
        ...

    def catch_up(self, seq: Sequence) -> int:
        """Positions the drafter must process before it can draft for `seq` (EAGLE-3 after a
        pause in speculation); the policy charges them to the step."""
        ...

    def forget(self, seq: Sequence) -> None:
        """Drop what the drafter keeps for `seq`: it was preempted (its KV is gone) or ended."""
        ...
