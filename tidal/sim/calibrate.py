"""Fit the roofline's free constants (tidal.sim.roofline.Efficiency) to measured throughput.

Points are `LABEL@CONCURRENCY=TOK_PER_S`, LABEL being off, fixed:K, or a drafter name such as
eagle3 (read as fixed:K with the K given). Only modes whose schedule does not depend on step
times can be calibrated on (off, fixed, schedule): for those the simulated sequence of steps is
the same whatever the constants, so each point is simulated once, its steps recorded, and the
fit re-times the recorded steps. Adaptive runs cannot be re-timed that way.

The fit minimises the squared log error of predicted tok/s plus a weak pull of each constant
towards its starting value (three points cannot pin six constants; the pull picks the
solution nearest the preset). It is a small Nelder-Mead: scipy is not a dependency, and the
objective (a max() inside, a handful of parameters, cheap to evaluate) needs no gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tidal.sim.roofline import Efficiency, RooflineModel, StepShape, Terms
from tidal.sim.simulator import SpecMode, Simulator, parse_mode
from tidal.sim.sweep import SweepConfig


@dataclass(frozen=True)
class MeasuredPoint:
    """A measured output tok/s of one speculation mode at one concurrency."""

    label: str
    mode: SpecMode
    concurrency: int
    tok_s: float


def parse_points(text: str, spec_k: int = 3) -> list[MeasuredPoint]:
    """'off@1=92.6,off@250=772.1,eagle3@1=77.5' (a label that is not a mode means fixed:spec_k)."""
    points = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            where, value = part.rsplit("=", 1)
            label, conc = where.strip().rsplit("@", 1)
            mode = parse_mode(label) if label.split(":")[0] in ("off", "fixed", "schedule", "adaptive") \
                else SpecMode(f"fixed:{spec_k}", "fixed", spec_k)
            point = MeasuredPoint(label, mode, int(conc), float(value))
        except ValueError as e:
            raise ValueError(f"bad measured point {part!r}: want LABEL@CONCURRENCY=TOK_PER_S ({e})") from None
        if mode.mode == "adaptive":
            raise ValueError(f"{part!r}: adaptive points cannot be calibrated on (its steps depend on the constants)")
        points.append(point)
    if not points:
        raise ValueError("no measured points given")
    return points


class _Recorder:
    """A step-time model that times with `model` and remembers every call."""

    def __init__(self, model: RooflineModel):
        self.model, self.steps, self.drafts = model, [], []

    def step_time(self, shape: StepShape) -> float:
        self.steps.append(shape)
        return self.model.step_time(shape)

    def draft_time(self, ks: list[int], catch_up: int) -> float:
        self.drafts.append((list(ks), catch_up))
        return self.model.draft_time(ks, catch_up)


class _Trace:
    """A point's recorded forwards as arrays of their efficiency-free terms, re-timed cheaply."""

    def __init__(self, model: RooflineModel, point: MeasuredPoint, tokens: int, rec: _Recorder):
        self.point, self.tokens = point, tokens
        hw = model.hardware
        self.peak_flops, self.bandwidth, self.launch = model.peak_flops, hw.memory_bandwidth, hw.launch_overhead
        self.draft_host = not model.overlaps_drafting  # see RooflineModel.draft_host_seconds
        self.steps = self._arrays([model.step_terms(s) for s in rec.steps])
        self.host_steps = sum(model.pays_host(s.draft_tokens > 0) for s in rec.steps)  # steps that wait for the host
        self.drafts = self._arrays([t for ks, c in rec.drafts for t in model.draft_terms(ks, c)])

    @staticmethod
    def _arrays(terms: list[Terms]) -> tuple[np.ndarray, ...]:
        return tuple(np.array([getattr(t, f) for t in terms], dtype=float) for f in ("flops", "bytes", "comm", "tokens"))

    def _seconds(self, arrays, e: Efficiency, per_forward: float, per_token: float) -> float:
        flops, bytes_, comm, tokens = arrays
        roof = np.maximum(flops / (self.peak_flops * e.flops), bytes_ / (self.bandwidth * e.bandwidth))
        return float(roof.sum() + comm.sum() / e.link + len(flops) * per_forward + per_token * tokens.sum())

    def tok_s(self, e: Efficiency) -> float:
        drafting = self.launch + e.draft_overhead if self.draft_host else 0.0
        seconds = (self._seconds(self.steps, e, 0.0, e.token_overhead) + self.host_steps * (self.launch + e.step_overhead)
                   + self._seconds(self.drafts, e, drafting, 0.0))
        return self.tokens / seconds


def record(model: RooflineModel, point: MeasuredPoint, config: SweepConfig) -> _Trace:
    """Simulate one point once and keep its forwards for re-timing."""
    rec = _Recorder(model)
    sim = Simulator(rec, point.mode, config.acceptance, config.scheduler_for(point.mode),
                    config.blocks(point.concurrency, point.mode.max_k), config.block_size, config.seed)
    run = sim.run(config.workload(point.concurrency))
    return _Trace(model, point, sum(t.num_tokens for t in run.traces), rec)


# free constants as unconstrained numbers: efficiencies through a logistic (0 < e < 1),
# overheads through exp (> 0, spanning microseconds to milliseconds evenly)
def _to_x(e: Efficiency) -> list[float]:
    logit = lambda p: math.log(p / (1 - p))  # noqa: E731
    return [logit(e.bandwidth), logit(e.flops), math.log(e.step_overhead), math.log(e.token_overhead),
            math.log(e.draft_overhead), math.log(e.link)]


def _from_x(x: list[float]) -> Efficiency:
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    return Efficiency(sig(x[0]), sig(x[1]), math.exp(x[2]), math.exp(x[3]), math.exp(x[4]), math.exp(x[5]))


START = Efficiency(bandwidth=0.8, flops=0.6, step_overhead=2e-4, token_overhead=1e-6, draft_overhead=2e-4, link=1.0)


def nelder_mead(f, x0: list[float], step: float = 1.0, iters: int = 2000, tol: float = 1e-10) -> list[float]:
    """Minimise f from x0 with the standard reflect/expand/contract/shrink simplex moves."""
    n = len(x0)
    simplex = [list(x0)] + [[x0[j] + (step if j == i else 0.0) for j in range(n)] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centroid = [sum(p[j] for p in simplex[:-1]) / n for j in range(n)]
        toward = lambda t: [c + t * (w - c) for c, w in zip(centroid, simplex[-1])]  # noqa: E731
        xr = toward(-1.0)
        fr = f(xr)
        if fr < values[0]:
            xe = toward(-2.0)
            fe = f(xe)
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            xc = toward(0.5)
            fc = f(xc)
            if fc < values[-1]:
                simplex[-1], values[-1] = xc, fc
            else:  # shrink towards the best
                simplex = [simplex[0]] + [[b + 0.5 * (v - b) for b, v in zip(simplex[0], p)] for p in simplex[1:]]
                values = [values[0]] + [f(p) for p in simplex[1:]]
    return simplex[min(range(n + 1), key=values.__getitem__)]


@dataclass
class Calibration:
    """The fitted model and how it reproduces each measured point."""

    model: RooflineModel  # with the fitted efficiency
    predictions: list[tuple[MeasuredPoint, float]]  # (measured, predicted tok/s)

    def table(self) -> str:
        """Markdown: measured vs simulated tok/s per point."""
        lines = ["| point | measured tok/s | simulated tok/s | error |", "|---|---|---|---|"]
        for p, pred in self.predictions:
            label = p.label if p.label == p.mode.label else f"{p.label} ({p.mode.label})"
            lines.append(f"| {label}@{p.concurrency} | {p.tok_s:.1f} | {pred:.1f} | {100 * (pred / p.tok_s - 1):+.1f}% |")
        return "\n".join(lines)


def calibrate(model: RooflineModel, points: list[MeasuredPoint], config: SweepConfig,
              prior_weight: float = 1e-3, start: Efficiency = START) -> Calibration:
    """Fit `model`'s Efficiency to the measured points (see the module docstring)."""
    traces = [record(model, p, config) for p in points]
    x0 = _to_x(start)

    def loss(x: list[float]) -> float:
        e = _from_x(x)
        err = sum(math.log(t.tok_s(e) / t.point.tok_s) ** 2 for t in traces)
        return err + prior_weight * sum((a - b) ** 2 for a, b in zip(x, x0))

    x = x0
    for _ in range(3):  # restarts: a simplex can collapse before it reaches the minimum
        x = nelder_mead(loss, x)
    fitted = _from_x(x)
    return Calibration(model.with_efficiency(fitted), [(t.point, t.tok_s(fitted)) for t in traces])
