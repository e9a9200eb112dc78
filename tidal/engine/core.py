"""The step loop that the engine and the simulator share: schedule -> execute -> verify/append ->
choose K -> reserve drafts -> propose, over an executor (the model runner, or a step-time model)
and a drafter (a real one, or an acceptance model's stand-in). Time comes from `clock`, so the
same loop runs on the wall clock or on simulated time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from tidal.adaptive.cost import DraftCostModel, StepCostModel, profile_grid
from tidal.adaptive.policy import SpecPolicy, StepPrice
from tidal.adaptive.stats import SpecStats
from tidal.engine.scheduler import ScheduledSeq, Scheduler
from tidal.sequence import Sequence
from tidal.speculative.drafter import Drafter


class Executor(Protocol):
    def execute(self, scheduled: list[ScheduledSeq]) -> tuple[list[list[int]], Any]:
        """Run one step: the tokens each sampling sequence gains, in order (its accepted drafts
        plus the target's next token), and the fed tokens' features for a drafter (or None)."""
        ...


@dataclass
class StepStats:
    """What one step did, for metrics and for checking the cost model."""

    num_tokens: int = 0  # fed to the target, drafts included
    num_seqs: int = 0
    seconds: float = 0.0  # measured target forward, verification and sampling
    predicted_seconds: float | None = None  # the cost model's forecast of this step as scheduled (with a policy)
    draft_seconds: float = 0.0  # the drafter's proposal at the end of this step
    chosen_k: list[int] = field(default_factory=list)  # draft lengths for the next step, per decoding request
    spec: SpecStats = field(default_factory=SpecStats)  # the verifications of this step


class EngineCore:
    """One step of continuous batching with per-request speculation. The owner (LLMEngine, the
    simulator) appends what a step emits (`emit`) and may log what it measures (`record_step`,
    `record_draft`, both also feeding the cost models)."""

    def __init__(self, scheduler: Scheduler, executor: Executor, drafter: Drafter | None,
                 policy: SpecPolicy | None, clock: Callable[[], float], knots: tuple[int, ...]):
        self.scheduler, self.executor, self.drafter, self.policy = scheduler, executor, drafter, policy
        self.clock = clock
        self.step_cost, self.draft_cost = StepCostModel(knots), DraftCostModel()
        self.last_step_stats = StepStats()
        self.k_histogram: dict[int, int] = {}  # how often each draft length was chosen, all steps
        self.profiling = False  # measured steps are anchors of the cost fits

    # ------------------------------------------------------------ the owner's part

    def emit(self, seq: Sequence, tokens: list[int]) -> None:
        """Append a step's tokens to `seq` (finishing it when it ends)."""
        raise NotImplementedError

    def record_step(self, tokens: int, seqs: int, context: int, seconds: float, drafts: int | None,
                    verifying: int, predicted: float | None) -> None:
        self.step_cost.observe(tokens, seqs, context, seconds, anchor=self.profiling, drafts=drafts,
                               drafting=verifying)

    def record_draft(self, forwards: int, tokens: int, catch_up: int, seconds: float) -> None:
        self.draft_cost.observe(forwards, tokens, catch_up, seconds, anchor=self.profiling)

    # ------------------------------------------------------------ the step

    def step(self) -> list[tuple[Sequence, int, int]] | None:
        """Schedule and run one step; for each sequence that sampled (got tokens), in order, the
        drafts it verified and how many were accepted; None when nothing could be scheduled."""
        out = self.scheduler.schedule()
        if self.drafter is not None:
            for seq in out.preempted:  # its drafter state went with its KV
                self.drafter.forget(seq)
        if not out.scheduled:
            return None
        stats = StepStats(sum(s.num_new_tokens for s in out.scheduled), len(out.scheduled))
        context = sum(s.seq.num_computed_tokens + s.num_new_tokens for s in out.scheduled)
        verifying = out.verifying  # sequences verifying drafts: the cost model's feature, the log's column
        if self.policy is not None:  # the step as it runs, arrivals included (the policy chose before them)
            stats.predicted_seconds = self.step_cost.predict(stats.num_tokens, stats.num_seqs, context, verifying)
        start = self.clock()
        results, features = self.executor.execute(out.scheduled)
        stats.seconds = self.clock() - start
        # the draft bias needs a prediction per step (and so the fit's refits): not without a policy
        drafts = out.decode_drafts if self.policy is not None else None
        self.record_step(stats.num_tokens, stats.num_seqs, context, stats.seconds, drafts, verifying,
                         stats.predicted_seconds)
        self.last_step_stats = stats
        gained = iter(results)
        sampled, decoding = [], []
        observed, rows = [], []  # (seq, first position, count) verified, and their feature rows
        offset = 0
        for s in out.scheduled:
            seq = s.seq
            fed = s.num_new_tokens - s.num_draft_tokens
            seq.num_computed_tokens += fed
            tokens = next(gained) if s.samples else []
            if s.num_draft_tokens:  # accepted drafts already have their KV written
                seq.spec.record(s.num_draft_tokens, len(tokens) - 1)
                self.policy.record(s.num_draft_tokens, len(tokens) - 1, seq.spec.draft_class)
                stats.spec.record(s.num_draft_tokens, len(tokens) - 1)
                seq.num_computed_tokens += len(tokens) - 1
                seq.draft_token_ids, seq.draft_probs = [], None
            elif s.samples and self.policy is not None:
                seq.spec.fade()  # a token without drafts: its acceptance estimate ages (SpecStats.fade)
            if features is not None:  # the verified positions' features, for the draft head
                n = fed + max(0, len(tokens) - 1)
                observed.append((seq, seq.num_computed_tokens - n, n))
                rows.append((offset, n))
            offset += s.num_new_tokens
            if not s.samples:
                continue
            self.emit(seq, tokens)
            sampled.append((seq, s.num_draft_tokens, max(0, len(tokens) - 1) if s.num_draft_tokens else 0))
            if not seq.is_finished:
                decoding.append(seq)
            elif self.drafter is not None:
                self.drafter.forget(seq)
        if observed:
            self._observe(observed, rows, features)
        if self.policy is not None and decoding:
            self._propose(decoding)
        return sampled

    def _observe(self, observed: list, rows: list[tuple[int, int]], features) -> None:
        """Hand the drafter the features of the positions verified this step, in one call (a
        finished request's blocks are gone, and the head will not need its features)."""
        keep = [i for i, (seq, _, _) in enumerate(observed) if not seq.is_finished]
        if len(keep) == len(observed) and sum(n for _, n in rows) == len(features):
            self.drafter.observe(observed, features)  # every row, in order: no gather
        elif keep:
            index = [r for i in keep for r in range(rows[i][0], rows[i][0] + rows[i][1])]
            self.drafter.observe([observed[i] for i in keep], features[index])

    def _propose(self, seqs: list[Sequence]) -> None:
        """Drafts for the next step, as many per request as the policy chooses."""
        ks, classes = self._choose_k(seqs)
        stats = self.last_step_stats
        stats.chosen_k = list(ks)  # the policy's choice; ks is trimmed to free blocks below
        for k in ks:
            self.k_histogram[k] = self.k_histogram.get(k, 0) + 1
        for seq, k, c in zip(seqs, ks, classes):
            seq.spec.chosen_k, seq.spec.draft_class = k, c
        if any(ks):
            ks = self.scheduler.reserve_drafts(seqs, ks)
        if not any(ks):
            return  # speculation off this step: no drafter call at all
        catch_up = sum(self.drafter.catch_up(s) for s, k in zip(seqs, ks) if k)
        start = self.clock()
        drafts, probs = self.drafter.propose(seqs, ks)
        stats.draft_seconds = self.clock() - start
        self.record_draft(max(ks), sum(ks), catch_up, stats.draft_seconds)
        for i, (seq, draft) in enumerate(zip(seqs, drafts)):
            seq.draft_token_ids = list(draft)
            seq.draft_probs = None if probs is None else probs[i]

    def _choose_k(self, seqs: list[Sequence]) -> tuple[list[int], list[int]]:
        """The policy's draft lengths, given the step the scheduler is about to build (the
        decoding requests' one token each plus the prefill it will feed next), and the
        drafter's grade of each request's drafts."""
        load = self.scheduler.spec_load(seqs)
        most = self.policy.most(len(seqs))  # 0 (a schedule's): no lookup, K = 0 costs the drafter nothing
        caps = self.drafter.available(seqs, most) if most else [0] * len(seqs)
        classes = [self.drafter.draft_class(s) if most else 0 for s in seqs]
        views = [s.spec_view(cap, self.drafter.catch_up(s), c) for s, cap, c in zip(seqs, caps, classes)]
        price = StepPrice(load.tokens, load.seqs, load.context, self.step_cost.predict, self.draft_cost.predict)
        return self.policy.choose(views, price, load.draft_budget), classes

    # ------------------------------------------------------------ start-up profile

    def profile(self, add: Callable[[str], None]) -> None:
        """Anchor the cost models with real steps over dummy requests at the batch sizes and
        draft lengths of cost.profile_grid (`add(request_id)` queues one, of PROFILE_PROMPT_LEN
        tokens asking PROFILE_MAX_TOKENS); they stay in the fits where the live load has no
        samples. The policy's acceptance prior is left as it was."""
        policy, profiling = self.policy, self.profiling
        self.profiling = True
        try:
            for n, k in profile_grid(self.scheduler.block_manager.num_blocks * self.scheduler.block_manager.block_size):
                self.policy = SpecPolicy("fixed", k) if k else None
                for i in range(n):
                    add(f"profile-{n}-{k}-{i}")
                while self.scheduler.has_unfinished():
                    self.step()
        finally:
            self.policy, self.profiling = policy, profiling
            self.last_step_stats = StepStats()
            self.k_histogram.clear()

