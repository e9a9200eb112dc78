"""`tidal sim --scan-acceptance A,B,...`: the calibration and the off vs fixed:K sweep repeated
at each assumed per-position acceptance. A measured speculative point pins the product of the
drafts' value and their cost, not either one: at low acceptance the fit makes drafting cheap, at
high acceptance dear, and the two say different things at other concurrencies. The scan shows
which acceptances are consistent with what was observed elsewhere (for example, plain decoding
ahead at every level), so a measured acceptance length can confirm or refute the model."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tidal.sim.calibrate import Calibration, MeasuredPoint, calibrate
from tidal.sim.explain import emitted_per_step
from tidal.sim.roofline import RooflineModel
from tidal.sim.simulator import AcceptanceModel, parse_modes
from tidal.sim.sweep import SweepConfig, sweep


MISS = 0.05  # a fit further than this from a measured point does not reproduce it


@dataclass
class ScanRow:
    """One assumed acceptance: its calibration and fixed:K's tok/s over plain decoding's per level."""

    acceptance: float
    calibration: Calibration
    ratios: dict[int, float]

    @property
    def worst_error(self) -> float:
        """The largest relative miss of a measured point."""
        return max(abs(pred / p.tok_s - 1) for p, pred in self.calibration.predictions)

    @property
    def ahead(self) -> list[int]:
        """Concurrencies where fixed:K beats plain decoding."""
        return [c for c, r in self.ratios.items() if r > 1.0]


def parse_acceptances(text: str) -> list[float]:
    """'0.3,0.5,0.7' -> sorted distinct values, each in (0, 1]."""
    try:
        values = sorted({float(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise ValueError(f"bad --scan-acceptance {text!r}: want comma-separated numbers in (0, 1]") from None
    if not values or not all(0.0 < v <= 1.0 for v in values):
        raise ValueError(f"bad --scan-acceptance {text!r}: want comma-separated numbers in (0, 1]")
    return values


def scan_acceptance(model: RooflineModel, points: list[MeasuredPoint], config: SweepConfig, k: int,
                    values: list[float], progress=None) -> list[ScanRow]:
    """Calibrate `model` on `points` and sweep off and fixed:k, once per constant acceptance."""
    off, fixed = parse_modes(f"off,fixed:{k}")
    rows = []
    for a in values:
        at = replace(config, acceptance=AcceptanceModel((a,)))
        cal = calibrate(model, points, at)
        records = {(r.target, r.concurrency): r.output_tok_s for r in sweep(cal.model, [off, fixed], at)}
        rows.append(ScanRow(a, cal, {c: records[fixed.label, c] / records[off.label, c] for c in at.concurrency}))
        if progress is not None:
            progress(rows[-1])
    return rows


def format_scan(rows: list[ScanRow], k: int) -> str:
    """A Markdown table (one row per acceptance) and which acceptances keep plain decoding ahead."""
    levels = list(rows[0].ratios)
    lines = [f"| acceptance per position | tokens per verify (K={k}) | per draft forward ms | worst point error | "
             + " | ".join(str(c) for c in levels) + " |", "|---" * (4 + len(levels)) + "|"]
    for r in rows:
        e, hw = r.calibration.model.efficiency, r.calibration.model.hardware
        lines.append(f"| {r.acceptance:.2f} | {emitted_per_step((r.acceptance,), k):.2f} | "
                     f"{1e3 * (hw.launch_overhead + e.draft_overhead):.2f} | {100 * r.worst_error:.1f}% | "
                     + " | ".join(f"{r.ratios[c]:.2f}x" for c in levels) + " |")
    behind = [r for r in rows if not r.ahead]
    if behind:
        lines.append(f"plain decoding ahead of fixed:{k} at every level at acceptance " + ", ".join(
            f"{r.acceptance:.2f}" + (f" (its fit misses a point by {100 * r.worst_error:.0f}%)"
                                     if r.worst_error > MISS else "") for r in behind))
    else:
        lines.append(f"fixed:{k} ahead of plain decoding somewhere at every scanned acceptance")
    return "\n".join(lines)
