"""A step-time model from measured points, fitted with the engine's own cost models.

The file is CSV with a header `tokens,seqs,context,seconds` (an optional `verifying` column:
sequences verifying drafts in the step; a step log from before that column counts min(drafts,
seqs) from its `drafts` column; optional further rows may be draft points, see below), or
JSON: {"steps": [[tokens, seqs, context, seconds(, verifying)], ...],
"drafts": [[forwards, tokens, catch_up, seconds], ...], "knots": [1, 2, 4, ...]} (knots: the
token counts where the step time may bend, default StepCostModel's; the engine adds 5, 8 and 9
on CPUs with the int4 kernel, and the last token count of its compiled steps and the next one,
and the simulated policy's cost model uses them too). A CSV row whose `kind` column ends in
"draft" reads its columns as forwards, tokens, catch_up, seconds; a leading comment
`# knots=1,2,4,...` sets the knots. The engine's `--step-log` file is such a CSV
(tidal.engine.step_log): its rows of kind "profile" / "profile-draft" (the start-up profile) are
fitted as the engine fits them, as anchors rescaled to the level of the live rows ("step" /
"draft"). Without draft points the drafter costs nothing (an n-gram drafter, or a profile that did
not time it).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tidal.adaptive.cost import DEFAULT_KNOTS, DraftCostModel, StepCostModel
from tidal.engine.step_log import read_step_log
from tidal.sim.roofline import StepShape


def _total_ratio(predict, points) -> float:
    """Measured seconds over predicted, summed over `points` (features..., seconds)."""
    columns = np.array(points, dtype=float).T
    predicted = float(np.sum(predict(*columns[:-1])))
    return float(columns[-1].sum()) / predicted if predicted > 0 else 1.0


def _step_points(points) -> list[tuple[int, int, int, int, float]]:
    """(tokens, seqs, context, verifying, seconds) of step points given as (tokens, seqs, context,
    seconds) or (tokens, seqs, context, seconds, verifying); verifying empty or absent: 0."""
    return [(int(p[0]), int(p[1]), int(p[2]), int(p[4] or 0) if len(p) > 4 else 0, float(p[3])) for p in points]


def _fitted_steps(model: StepCostModel, anchors, points) -> StepCostModel:
    """`model` fed the anchors, then the points (see _step_points), as the engine feeds its fit
    (not its draft bias, which a simulated engine learns from its own steps)."""
    for rows, anchor in ((anchors, True), (points, False)):
        for tokens, seqs, context, verifying, seconds in rows:
            model.observe(tokens, seqs, context, seconds, anchor=anchor, drafting=verifying)
    return model


def _fitted_drafts(model: DraftCostModel, anchors, points) -> DraftCostModel:
    """`model` fed the anchors, then the points: each (forwards, tokens, catch_up, seconds)."""
    for rows, anchor in ((anchors, True), (points, False)):
        for a, b, c, seconds in rows:
            model.observe(int(a), int(b), int(c), float(seconds), anchor=anchor)
    return model


class MeasuredModel:
    """Step and draft times predicted by StepCostModel / DraftCostModel fitted to the points."""

    def __init__(self, steps: list[tuple], drafts: list[tuple[int, int, int, float]] = (),
                 knots=DEFAULT_KNOTS, profile_steps: list[tuple] = (),
                 profile_drafts: list[tuple[int, int, int, float]] = ()):
        """`steps` / `profile_steps`: (tokens, seqs, context, seconds) with an optional fifth,
        the sequences verifying drafts (StepCostModel's term for them; 0 when absent or empty).
        `profile_steps` / `profile_drafts`: an engine's start-up profile, fitted as the engine
        fits it: anchors that give the shape where the other points have none, rescaled to the
        other points' level (StepCostModel; the engine rescales by its last 256 live steps, this by
        all of them). On this 2-core VM a server's live steps ran 13-60% slower than its start-up
        profile at the same shapes (the profile is one moment of a machine whose speed drifts by
        that much; one engine's profile and live steps, taken together, matched); as plain points
        the profile made the shapes it alone covered look that much cheaper."""
        if not steps and not profile_steps:
            raise ValueError("a measured profile needs at least one step point")
        self.knots = tuple(knots)
        steps, profile_steps = _step_points(steps), _step_points(profile_steps)
        # the window must hold every point: these are the whole profile, not a recent slice
        self.step_cost = _fitted_steps(StepCostModel(knots, window=max(1, len(steps))), profile_steps, steps)
        self.draft_cost = _fitted_drafts(DraftCostModel(window=max(1, len(drafts))), profile_drafts, drafts)
        self.has_drafts = bool(drafts or profile_drafts)
        # The fits weigh relative errors (right for the policy, which compares steps), and so come
        # out below the mean of noisy, right-skewed step times; a simulated run's length is their
        # sum. So both are scaled to give the measured points' (live ones if any) total time.
        self.step_scale = _total_ratio(self.step_cost.predict, steps or profile_steps)
        self.draft_scale = _total_ratio(self.draft_cost.predict, drafts or profile_drafts) if self.has_drafts else 1.0

    @classmethod
    def load(cls, path: str | Path | list, kinds: set[str] | None = None,
             outside: list[tuple[float, float]] = ()) -> "MeasuredModel":
        """Read a CSV or JSON profile (see the module docstring), or several CSVs pooled (the
        step logs of servers on one machine); from a CSV with a `kind` column, only the rows of
        `kinds` when given (e.g. {"profile", "profile-draft"}: the engine's start-up profile
        alone), and with a `time` column, none written within one of the `outside` windows
        (start, end): a benchmark level left out of the calibration."""
        paths = [Path(p) for p in path] if isinstance(path, (list, tuple)) else [Path(path)]
        if any(p.suffix == ".json" for p in paths):
            if len(paths) > 1 or outside:
                raise ValueError("a JSON profile is read alone, without time windows")
            data = json.loads(paths[0].read_text())
            return cls([tuple(p) for p in data["steps"]], [tuple(p) for p in data.get("drafts", [])],
                       data.get("knots", DEFAULT_KNOTS))
        points = {kind: [] for kind in ("step", "draft", "profile", "profile-draft")}
        knots = DEFAULT_KNOTS
        for p in paths:
            file_knots, columns, rows = read_step_log(p)
            knots = file_knots or knots
            if outside and "time" not in columns:
                raise ValueError(f"{p} has no time column: its rows cannot be matched to time windows")
            for row in rows:
                kind = row.get("kind") or "step"  # a CSV without the column holds steps
                if kind not in points:
                    raise ValueError(f"{p}: unknown row kind {kind!r}; want one of {', '.join(points)}")
                if kinds is not None and kind not in kinds:
                    continue
                if outside and any(a <= float(row["time"]) <= b for a, b in outside):
                    continue
                if kind.endswith("draft"):
                    points[kind].append((row["forwards"], row["tokens"], row["catch_up"], row["seconds"]))
                else:
                    verifying = row.get("verifying")
                    if verifying is None and row.get("drafts"):  # a log from before the column:
                        verifying = min(int(row["drafts"]), int(row["seqs"]))  # at most one per draft
                    points[kind].append((row["tokens"], row["seqs"], row["context"], row["seconds"], verifying))
        return cls(points["step"], points["draft"], knots, points["profile"], points["profile-draft"])

    def step_time(self, shape: StepShape) -> float:
        """StepCostModel's prediction for the step's tokens, sequences, context and sequences
        verifying drafts, scaled."""
        return self.step_scale * float(self.step_cost.predict(shape.tokens, shape.seqs, shape.context, shape.verifying))

    def draft_time(self, ks: list[int], catch_up: int) -> float:
        """DraftCostModel's prediction, scaled (0 when the profile has no draft points)."""
        if not self.has_drafts:
            return 0.0
        return self.draft_scale * float(self.draft_cost.predict(max(ks, default=0), sum(ks), catch_up))

    def describe(self) -> str:
        """One line saying where the step times come from."""
        n = self.step_cost.num_samples + self.step_cost.num_anchors
        return f"measured profile: {n} step points fitted by StepCostModel"
