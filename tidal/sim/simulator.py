"""Discrete-event simulation of the engine: the real Scheduler, BlockManager and SpecPolicy (fed
by the real StepCostModel / DraftCostModel, fitted online as in the engine), with a step-time
model in place of the model forward and an acceptance model in place of the verifier.

A simulated step is the engine's own (EngineCore.step): schedule, time the forward, feed every
scheduled sequence its tokens, accept a sampled prefix of each request's drafts plus the bonus
token, finish requests at their output length, then let the policy choose the next draft
lengths and time the drafter. Closed-loop clients keep `concurrency` requests in flight: a finished request
is replaced at once until `num_prompts` have been sent, as `tidal bench` does.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tidal.adaptive.cost import DEFAULT_KNOTS, PROFILE_MAX_TOKENS, PROFILE_PROMPT_LEN
from tidal.adaptive.policy import SpecPolicy, parse_schedule
from tidal.config import SchedulerConfig
from tidal.engine.block_manager import BlockManager
from tidal.engine.core import EngineCore
from tidal.engine.scheduler import ScheduledSeq, Scheduler
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


class _SimExecutor:
    """The step's forward as the step-time model prices it (the simulated clock moves by it),
    and each verification's accepted prefix drawn from the acceptance model."""

    def __init__(self, sim: "Simulator"):
        self.sim = sim

    def execute(self, scheduled: list[ScheduledSeq]) -> tuple[list[list[int]], None]:
        sim = self.sim
        sim.now += sim.step_model.step_time(step_shape(scheduled))
        return [[1] * (1 + (sim.acceptance.sample(s.num_draft_tokens, sim.rng) if s.num_draft_tokens else 0))
                for s in scheduled if s.samples], None


class _SimDrafter:
    """A drafter that costs what the step-time model says and proposes placeholder tokens; its
    head (EAGLE-3) is caught up on a sequence whenever it drafts for it (Eagle3Drafter.catch_up)."""

    def __init__(self, sim: "Simulator"):
        self.sim = sim
        self._caught_up: dict[Sequence, int] = {}  # positions the head has seen, per request

    def available(self, seqs: list[Sequence], max_k: int) -> list[int]:
        return [max_k] * len(seqs)

    def draft_class(self, seq: Sequence) -> int:
        return 0  # the acceptance model does not grade drafts

    def catch_up(self, seq: Sequence) -> int:
        return seq.num_computed_tokens - self._caught_up.get(seq, 0)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[list[int]], None]:
        self.sim.now += self.sim.step_model.draft_time(ks, sum(self.catch_up(s) for s, k in zip(seqs, ks) if k))
        for seq, k in zip(seqs, ks):
            if k:
                self._caught_up[seq] = seq.num_computed_tokens
        return [[1] * k for k in ks], None

    def forget(self, seq: Sequence) -> None:
        self._caught_up.pop(seq, None)

    def observe(self, seq: Sequence, features) -> None:
        pass


class Simulator(EngineCore):
    """Runs a workload through the engine's own step loop (EngineCore) on simulated time."""

    def __init__(self, step_model: StepTimeModel, mode: SpecMode, acceptance: AcceptanceModel,
                 scheduler: SchedulerConfig = SchedulerConfig(), num_blocks: int = 1 << 16,
                 block_size: int = 16, seed: int = 0, knots=DEFAULT_KNOTS):
        self.step_model, self.mode, self.acceptance = step_model, mode, acceptance
        self.block_manager = BlockManager(num_blocks, block_size)
        self.rng = random.Random(seed)
        self.now = 0.0  # simulated seconds
        super().__init__(Scheduler(scheduler, self.block_manager), _SimExecutor(self), _SimDrafter(self),
                         mode.make_policy(), lambda: self.now, knots)
        self._ids = itertools.count()
        self._run = SimRun([], 0.0)
        self._workload, self._sent, self._traces = None, 0, {}
        if self.policy is not None and self.policy.mode == "adaptive":
            self.profile()

    # ------------------------------------------------------------ workload

    def run(self, workload: Workload) -> SimRun:
        """Simulate the closed loop to the last request; times are simulated seconds."""
        self._run = run = SimRun([], 0.0)
        self._workload, self._sent, self._traces, start = workload, 0, {}, self.now
        for _ in range(min(workload.concurrency, workload.num_prompts)):
            self._send()
        while self.scheduler.has_unfinished():
            self.step()
        run.traces = list(self._traces.values())
        run.duration = self.now - start
        return run

    def _send(self) -> None:
        w = self._workload
        if self._sent >= w.num_prompts:
            return
        self._sent += 1
        seq = self._add([1] * w.input_len, w.output_len)
        self._traces[seq.request_id] = RequestTrace(self.now)

    def _add(self, prompt: list[int], max_tokens: int) -> Sequence:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        n = next(self._ids)
        seq = Sequence(f"sim-{n}", prompt, params, arrival=n)
        self.scheduler.add(seq)
        return seq

    # ------------------------------------------------------------ the owner's part of a step

    def step(self) -> list[tuple[Sequence, int, int]]:
        """One engine step on simulated time (EngineCore.step), counted into the run."""
        sampled = super().step()
        if sampled is None:
            raise RuntimeError("nothing could be scheduled: the KV cache is too small for one request")
        run, stats = self._run, self.last_step_stats
        run.num_steps += 1
        if stats.spec.drafted_per_position:  # every verification drafts position 0
            run.num_verifications += stats.spec.drafted_per_position[0]
            run.num_drafted += stats.spec.num_drafted
            run.num_accepted += stats.spec.num_accepted
        if not self.profiling:
            run.chosen_k.extend(stats.chosen_k)
        return sampled

    def emit(self, seq: Sequence, tokens: list[int]) -> None:
        n = min(len(tokens), seq.params.max_tokens - len(seq.output_token_ids))
        seq.output_token_ids.extend([1] * n)
        trace = self._traces.get(seq.request_id) if not self.profiling else None
        if trace is not None:
            trace.chunks.append((self.now, n))
        if len(seq.output_token_ids) >= seq.params.max_tokens:
            self.scheduler.finish(seq, "length")
            if trace is not None:
                self._send()

    def profile(self) -> None:
        """LLMEngine's start-up profile (EngineCore.profile); the simulated clock does not move."""
        now, run = self.now, self._run
        try:
            super().profile(lambda _: self._add([1] * PROFILE_PROMPT_LEN, PROFILE_MAX_TOKENS))
        finally:
            self.now, self._run = now, run


def step_shape(scheduled: list[ScheduledSeq]) -> StepShape:
    """The step-time model's view of a scheduled batch (before the step updates it); `context`
    is what the engine feeds StepCostModel."""
    tokens = context = drafts = logits = pairs = verifying = 0
    for s in scheduled:
        n, done = s.num_new_tokens, s.seq.num_computed_tokens
        tokens += n
        context += done + n
        drafts += s.num_draft_tokens
        logits += (1 + s.num_draft_tokens) if s.samples else 0
        pairs += n * done + n * (n + 1) // 2
        verifying += s.num_draft_tokens > 0
    return StepShape(tokens, len(scheduled), context, drafts, logits, pairs, verifying)
