"""Continuous batching: which sequences run this step, and how many tokens each feeds.

Knows nothing of torch. Running sequences are served first (oldest first); waiting ones are
admitted while the token budget, the sequence cap and the KV pool allow. Long prompts are
chunked to the token budget. When blocks run out, the newest running sequence is preempted by
recompute: its blocks are freed and it goes back to the waiting queue with its output kept.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import NamedTuple

from tidal.config import SchedulerConfig
from tidal.engine.block_manager import BlockManager
from tidal.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens fed this step, draft tokens included
    num_draft_tokens: int = 0
    samples: bool = False  # this step feeds the sequence's last token, so it gains a token

    def __post_init__(self):
        fed = self.num_new_tokens - self.num_draft_tokens
        self.samples = self.seq.num_computed_tokens + fed == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def decode_drafts(self) -> int | None:
        """Drafts verified in a decode step (each sequence feeds one token and its drafts);
        None when the step also prefills (StepCostModel.observe)."""
        if all(s.num_new_tokens - s.num_draft_tokens == 1 for s in self.scheduled):
            return sum(s.num_draft_tokens for s in self.scheduled)
        return None

    @property
    def verifying(self) -> int:
        """Sequences that verify drafts in this step (StepCostModel's per-sequence term)."""
        return sum(1 for s in self.scheduled if s.num_draft_tokens)


class SpecLoad(NamedTuple):
    """The next step as the speculation policy sees it, before drafts."""

    tokens: int  # one per decoding request plus the prefill the scheduler will feed
    seqs: int  # running sequences
    context: int  # KV tokens they hold
    draft_budget: int  # tokens left in the step's budget for drafts


def _by_arrival(seq: Sequence) -> int:
    return seq.arrival


class Scheduler:
    """Waiting and running queues over one BlockManager."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []  # sorted by arrival
        self.running: list[Sequence] = []  # sorted by arrival

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_by_arrival)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(seq, seq.num_computed_tokens + n, out):
                break  # seq itself was preempted; everything after it already was
            drafts = self._fit_drafts(seq, n, budget)
            n += drafts
            self.block_manager.allocate(seq, seq.num_computed_tokens + n)
            out.scheduled.append(ScheduledSeq(seq, n, drafts))
            budget -= n
            i += 1
        if not out.preempted:
            self._admit(out, budget)
        return out

    def spec_load(self, decoding: list[Sequence]) -> SpecLoad:
        """The next step before drafts: what it feeds anyway, and the room left for drafts
        (drafts placed there never delay pending prefill or an admission)."""
        running = self.running
        ids = set(map(id, decoding))
        pending = sum(s.num_uncomputed_tokens for s in running if id(s) not in ids)
        pending += sum(s.num_uncomputed_tokens for s in self.waiting[: max(0, self.config.max_num_seqs - len(running))])
        budget = self.config.max_num_batched_tokens
        base = min(len(decoding) + pending, budget)
        return SpecLoad(base, len(running), sum(s.num_tokens for s in running), budget - base)

    def reserve_drafts(self, seqs: list[Sequence], num_draft_tokens: list[int]) -> list[int]:
        """Allocate cache slots for each request's drafts (an EAGLE head writes its KV there
        too), as many as fit in the free blocks that no running request needs for the tokens it
        has (its next one, or the rest of its prompt); returns the draft lengths that fit. Taking
        every free block made the next step preempt a request that would have fit without them
        (found in review: two requests, 12 blocks of 4, n-gram K=4)."""
        bm = self.block_manager
        spare = bm.num_free_blocks - sum(bm.num_missing_blocks(s, s.num_tokens) for s in self.running)
        if spare < 0:  # the next step preempts anyway: no drafting work for a request it may drop
            return [0] * len(seqs)
        fitted = []
        for seq, k in zip(seqs, num_draft_tokens):
            own, held = bm.num_missing_blocks(seq, seq.num_tokens), len(seq.block_table)
            fitted.append(bm.num_fitting(seq, seq.num_tokens, k, own + spare))
            if fitted[-1]:
                bm.allocate(seq, seq.num_tokens + fitted[-1])
                spare -= len(seq.block_table) - held - own
        return fitted

    def _fit_drafts(self, seq: Sequence, n: int, budget: int) -> int:
        """How many of seq's drafts ride along: only for a decode step, within the token budget
        and the free blocks (a guess never preempts another request). Drops the rest."""
        keep = 0
        if n == seq.num_uncomputed_tokens == 1:
            keep = self.block_manager.num_fitting(seq, seq.num_computed_tokens + n,
                                                  min(len(seq.draft_token_ids), budget - n))
        del seq.draft_token_ids[keep:]
        if seq.draft_probs is not None:
            seq.draft_probs = seq.draft_probs[:keep]
        return keep

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences until `seq` fits; False if seq went itself."""
        while not self.block_manager.can_allocate(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.can_allocate(seq, seq.num_computed_tokens + n):
                break
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_by_arrival)
            self.block_manager.allocate(seq, seq.num_computed_tokens + n)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.draft_token_ids, seq.draft_probs = [], None  # a drafter forgets it (out.preempted)
        seq.num_preemptions += 1
        self.add(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished and release its blocks, wherever it is queued."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
