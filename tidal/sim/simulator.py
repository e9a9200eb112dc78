"""Discrete-event simulation of the engine: the real Scheduler, BlockManager and SpecPolicy (fed
by the real StepCostModel / DraftCostModel, fitted online as in the engine), with a step-time
model in place of the model forward and an acceptance model in place of the verifier.

One simulated step mirrors `LLMEngine.step()`: schedule, time the forward, feed every scheduled
sequence its tokens, accept a sampled prefix of each request's drafts plus the bonus token,
finish requests at their output length, then let the policy choose the next draft lengths and
time the drafter. Closed-loop clients keep `concurrency` requests in flight: a finished request
is replaced at once until `num_prompts` have been sent, as `tidal bench` does.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tidal.adaptive.cost import (DEFAULT_KNOTS, PROFILE_MAX_TOKENS, PROFILE_PROMPT_LEN, DraftCostModel,
                                 StepCostModel, profile_grid)
from tidal.adaptive.policy import SpecPolicy, parse_schedule
from tidal.config import SchedulerConfig
from tidal.engine.block_manager import BlockManager
from tidal.engine.scheduler import Scheduler, SchedulerOutput
from tidal.sampling_params import SamplingParams
from tidal.sequence import Sequence
from tidal.sim.roofline import StepShape


class StepTimeModel(Protocol):
    """What the simulator asks of a step-time model (RooflineModel, MeasuredModel)."""

    def step_time(self, shape: StepShape) -> float: ...

    def draft_time(self, ks: list[int], catch_up: int) -> float: ...


@dataclass(frozen=True)
class SpecMode:
    """A speculation setting as the CLI spells it: off, fixed:K, adaptive[:K], schedule:TABLE."""

    label: str
    mode: str  # off | fixed | adaptive | schedule
    max_k: int = 0
    schedule: str | None = None

    def make_policy(self) -> SpecPolicy | None:
        """The SpecPolicy the engine builds for this setting (LLMEngine._make_policy)."""
        return None if self.mode == "off" else SpecPolicy(self.mode, self.max_k, self.schedule)


def parse_mode(text: str, default_k: int = 4) -> SpecMode:
    """'off' | 'fixed[:K]' | 'adaptive[:K]' | 'schedule:1-4:4,5-:0' (K defaults to `default_k`)."""
    text = text.strip().replace('"', "").replace("'", "")  # the shell may leave a schedule's quotes in
    name, _, arg = text.partition(":")
    if name == "off" and not arg:
        return SpecMode("off", "off")
    if name in ("fixed", "adaptive"):
        k = int(arg) if arg else default_k
        if not 1 <= k <= 15:
            raise ValueError(f"{text!r}: K must be in 1..15")
        return SpecMode(text, name, k)
    if name == "schedule" and arg:
        return SpecMode(text, "schedule", max(k for *_, k in parse_schedule(arg)), arg)
    raise ValueError(f"bad speculation mode {text!r}: want off, fixed:K, adaptive[:K] or schedule:LO-HI:K,...")


def parse_modes(text: str, default_k: int = 4) -> list[SpecMode]:
    """A comma-separated list of modes; a schedule's own entries (they start with a digit)
    stay with it: 'off,fixed:3,schedule:1-4:4,5-:0,adaptive'."""
    parts: list[str] = []
    for part in text.split(","):
        if parts and parts[-1].strip().startswith("schedule:") and part.strip()[:1].isdigit():
            parts[-1] += "," + part
        else:
            parts.append(part)
    return [parse_mode(p, default_k) for p in parts if p.strip()]


_METRIC = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)$", re.M)
_POSITION = re.compile(r'position="(\d+)"')


@dataclass(frozen=True)
class AcceptanceModel:
    """Per-position conditional acceptance: draft position i is accepted with probability
    curve[i] given positions < i were (positions past the curve use its last value)."""

    curve: tuple[float, ...]

    def __post_init__(self):
        if not self.curve or not all(0.0 <= a <= 1.0 for a in self.curve):
            raise ValueError("acceptance probabilities must be in [0, 1], at least one")

    @classmethod
    def parse(cls, text: str) -> "AcceptanceModel":
        """'0.8,0.6,0.5', one constant '0.7', or the path of a saved /metrics page."""
        if Path(text).is_file():
            return cls.from_metrics(Path(text).read_text())
        return cls(tuple(float(x) for x in text.split(",") if x.strip()))

    @classmethod
    def from_metrics(cls, text: str) -> "AcceptanceModel":
        """From a Prometheus scrape of tidal (drafted and accepted tokens per position) or vLLM
        (accepted per position and the number of drafts). A position's unconditional rate is
        accepted / drafted there; the conditional one divides by the previous position's, which
        assumes how far a request drafts does not depend on whether its drafts are accepted."""
        accepted, drafted, num_drafts = {}, {}, None
        for name, labels, value in _METRIC.findall(text):
            pos = _POSITION.search(labels)
            if name.endswith("spec_decode_num_accepted_tokens_per_pos_total") and pos:
                accepted[int(pos.group(1))] = float(value)
            elif name.endswith("spec_decode_num_drafted_tokens_per_pos_total") and pos:
                drafted[int(pos.group(1))] = float(value)
            elif name.endswith("spec_decode_num_drafts_total"):
                num_drafts = float(value)
        curve, prev = [], 1.0
        for i in sorted(accepted):
            n = drafted.get(i, num_drafts)
            if not n or i != len(curve):
                break
            rate = accepted[i] / n
            curve.append(min(1.0, rate / prev) if prev > 0 else 0.0)
            prev = rate
        if not curve:
            raise ValueError("no per-position acceptance counters in that metrics page")
        return cls(tuple(curve))

    def sample(self, num_drafts: int, rng: random.Random) -> int:
        """Accepted drafts: the length of the accepted prefix of `num_drafts` drafts."""
        for i in range(num_drafts):
            if rng.random() >= self.curve[min(i, len(self.curve) - 1)]:
                return i
        return num_drafts

    def expected_tokens(self, k: int) -> float:
        """Tokens a verification of k drafts emits on average, the bonus token included."""
        out, w = 1.0, 1.0
        for i in range(k):
            w *= self.curve[min(i, len(self.curve) - 1)]
            out += w
        return out


@dataclass(frozen=True)
class Workload:
    """Closed loop: `concurrency` requests in flight, `num_prompts` in all, fixed lengths."""

    concurrency: int
    num_prompts: int
    input_len: int
    output_len: int

    def __post_init__(self):
        if min(self.concurrency, self.num_prompts, self.input_len, self.output_len) < 1:
            raise ValueError("concurrency, num_prompts, input_len and output_len must be >= 1")


@dataclass
class RequestTrace:
    """When one simulated request arrived and when each of its output chunks came out."""

    arrival: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.chunks)


@dataclass
class SimRun:
    """What one simulated sweep point produced."""

    traces: list[RequestTrace]
    duration: float
    num_steps: int = 0
    num_verifications: int = 0  # request-steps that verified at least one draft
    num_drafted: int = 0
    num_accepted: int = 0
    chosen_k: list[int] = field(default_factory=list)  # every choice of the policy, per request per step


class Simulator:
    """Runs a workload through the real scheduler and policy on simulated time."""

    def __init__(self, step_model: StepTimeModel, mode: SpecMode, acceptance: AcceptanceModel,
                 scheduler: SchedulerConfig = SchedulerConfig(), num_blocks: int = 1 << 16,
                 block_size: int = 16, seed: int = 0, knots=DEFAULT_KNOTS):
        self.step_model, self.mode, self.acceptance = step_model, mode, acceptance
        self.block_manager = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(scheduler, self.block_manager)
        self.policy = mode.make_policy()
        self.step_cost, self.draft_cost = StepCostModel(knots), DraftCostModel()
        self.rng = random.Random(seed)
        self.clock = 0.0
        self._profiling = False
        self._ids = itertools.count()
        self._run = SimRun([], 0.0)
        self._workload, self._sent, self._traces = None, 0, {}
        if self.policy is not None and self.policy.mode == "adaptive":
            self.profile()

    # ------------------------------------------------------------ workload

    def run(self, workload: Workload) -> SimRun:
        """Simulate the closed loop to the last request; times are simulated seconds."""
        self._run = run = SimRun([], 0.0)
        self._workload, self._sent, self._traces, start = workload, 0, {}, self.clock
        for _ in range(min(workload.concurrency, workload.num_prompts)):
            self._send()
        while self.scheduler.has_unfinished():
            self.step()
        run.traces = list(self._traces.values())
        run.duration = self.clock - start
        return run

    def _send(self) -> None:
        w = self._workload
        if self._sent >= w.num_prompts:
            return
        self._sent += 1
        seq = self._add([1] * w.input_len, w.output_len)
        self._traces[seq.request_id] = RequestTrace(self.clock)

    def _add(self, prompt: list[int], max_tokens: int) -> Sequence:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        n = next(self._ids)
        seq = Sequence(f"sim-{n}", prompt, params, arrival=n)
        self.scheduler.add(seq)
        return seq

    # ------------------------------------------------------------ one step (LLMEngine.step)

    def step(self) -> None:
        """One engine step on simulated time (see the module docstring)."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            raise RuntimeError("nothing could be scheduled: the KV cache is too small for one request")
        shape = step_shape(out)
        seconds = self.step_model.step_time(shape)
        self.step_cost.observe(shape.tokens, shape.seqs, shape.context, seconds, anchor=self._profiling,
                               drafts=out.decode_drafts, drafting=shape.verifying)
        self.clock += seconds
        self._run.num_steps += 1
        decoding = []
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens - s.num_draft_tokens
            if not s.samples:
                continue
            accepted = self.acceptance.sample(s.num_draft_tokens, self.rng) if s.num_draft_tokens else 0
            if s.num_draft_tokens:  # accepted drafts already have their KV written
                seq.spec.record(s.num_draft_tokens, accepted)
                self.policy.record(s.num_draft_tokens, accepted)
                self._run.num_verifications += 1
                self._run.num_drafted += s.num_draft_tokens
                self._run.num_accepted += accepted
                seq.num_computed_tokens += accepted
                seq.draft_token_ids = []
            elif self.policy is not None:
                seq.spec.fade()  # as the engine does
            self._emit(seq, accepted + 1)
            if not seq.is_finished:
                decoding.append(seq)
        if self.policy is not None and decoding:
            self._propose(decoding)

    def _emit(self, seq: Sequence, n: int) -> None:
        n = min(n, seq.params.max_tokens - len(seq.output_token_ids))
        seq.output_token_ids.extend([1] * n)
        trace = self._traces.get(seq.request_id) if not self._profiling else None
        if trace is not None:
            trace.chunks.append((self.clock, n))
        if len(seq.output_token_ids) >= seq.params.max_tokens:
            self.scheduler.finish(seq, "length")
            if trace is not None:
                self._send()

    def _propose(self, seqs: list[Sequence]) -> None:
        """LLMEngine._propose with the drafter replaced by the step-time model's draft time."""
        ks = self._choose_k(seqs)
        if not self._profiling:
            self._run.chosen_k.extend(ks)
        for seq, k in zip(seqs, ks):
            seq.spec.chosen_k = k
        ks = self.scheduler.reserve_drafts(seqs, ks)
        if not any(ks):
            return  # speculation off this step: no drafter call at all
        catch_up = sum(catch_up_positions(s) for s, k in zip(seqs, ks) if k)
        seconds = self.step_model.draft_time(ks, catch_up)
        self.draft_cost.observe(max(ks), sum(ks), catch_up, seconds, anchor=self._profiling)
        self.clock += seconds
        for seq, k in zip(seqs, ks):
            seq.draft_token_ids = [1] * k
            if k:
                seq.draft_num_computed = seq.num_computed_tokens  # the drafter caught up

    def _choose_k(self, seqs: list[Sequence]) -> list[int]:
        """LLMEngine._choose_k: the policy's draft lengths for the step about to be built."""
        load = self.scheduler.spec_load(seqs)
        views = [s.spec_view(self.policy.max_k, catch_up_positions(s)) for s in seqs]
        return self.policy.choose(views, load.tokens, load.seqs, load.context, self.step_cost.pricing(load.tokens),
                                  self.draft_cost.predict, load.draft_budget)

    def profile(self) -> None:
        """LLMEngine.profile(): anchor the cost models with steps over dummy requests at the
        batch sizes and draft lengths of cost.profile_grid; the simulated clock does not move."""
        policy, clock, run = self.policy, self.clock, self._run
        self._profiling = True
        try:
            for n, k in profile_grid(self.block_manager.num_blocks * self.block_manager.block_size):
                self.policy = SpecPolicy("fixed", k) if k else None
                for _ in range(n):
                    self._add([1] * PROFILE_PROMPT_LEN, PROFILE_MAX_TOKENS)
                while self.scheduler.has_unfinished():
                    self.step()
        finally:
            self.policy, self.clock, self._run, self._profiling = policy, clock, run, False


def catch_up_positions(seq: Sequence) -> int:
    """Verified positions an EAGLE-3 head has not seen (Eagle3Drafter.catch_up)."""
    return seq.num_computed_tokens - seq.draft_num_computed


def step_shape(out: SchedulerOutput) -> StepShape:
    """The step-time model's view of a scheduled batch (before the step updates it); `context`
    is what the engine feeds StepCostModel."""
    tokens = context = drafts = logits = pairs = 0
    for s in out.scheduled:
        n, done = s.num_new_tokens, s.seq.num_computed_tokens
        tokens += n
        context += done + n
        drafts += s.num_draft_tokens
        logits += (1 + s.num_draft_tokens) if s.samples else 0
        pairs += n * done + n * (n + 1) // 2
    return StepShape(tokens, len(out.scheduled), context, drafts, logits, pairs, out.verifying)
