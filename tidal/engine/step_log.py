"""The step-time log: every measured target step and draft proposal as one CSV row.

Columns: kind, tokens, seqs, context, forwards, catch_up, seconds, time, drafts, predicted,
verifying. A step
row (kind "step", or "profile" during the start-up profile) is what StepCostModel fits: tokens fed,
running sequences, KV tokens held, seconds of the target forward with verification and sampling;
`drafts`, for a decode step (no prefill), how many drafts it verified, `predicted`, the cost
model's forecast of it, and `verifying`, how many of its sequences verified drafts, prefill steps
included (the cost model's per-sequence drafting term); all three empty where the engine has no
speculation policy. A draft
row (kind "draft", or "profile-draft") is what DraftCostModel fits: head forwards in the chain,
draft tokens, catch-up positions, seconds. `time` is when the row was written, right after the
step or proposal (Unix seconds), so rows can be matched to the load a benchmark ran at that moment
(benchmarks/sim_validation.py). A new file starts with a comment line `# knots=1,2,4,...`: the
token counts where the engine's step-time fit may bend. `tidal sim --profile FILE` reads it
(tidal.sim.measured, through `read_step_log`) to simulate this engine.
"""

from __future__ import annotations

import csv
import time
from pathlib import Path

COLUMNS = ("kind", "tokens", "seqs", "context", "forwards", "catch_up", "seconds", "time", "drafts", "predicted",
           "verifying")
KNOTS_PREFIX = "# knots="


def read_step_log(path: str | Path) -> tuple[tuple[int, ...] | None, list[str], list[dict[str, str]]]:
    """(knots or None, column names, rows as dicts) of a step-log CSV (or any CSV with a header,
    `#` comment lines skipped)."""
    lines = Path(path).read_text().splitlines()
    knots = next((tuple(int(k) for k in line.removeprefix(KNOTS_PREFIX).split(","))
                  for line in lines if line.startswith(KNOTS_PREFIX)), None)
    reader = csv.DictReader(line for line in lines if not line.startswith("#"))
    rows = list(reader)
    return knots, list(reader.fieldnames or []), rows


class StepLog:
    """Appends rows to a CSV file, writing the header when the file is new or empty."""

    def __init__(self, path: str | Path, knots: tuple[int, ...]):
        path = Path(path)
        new = not path.exists() or path.stat().st_size == 0
        if not new and (columns := read_step_log(path)[1]) != list(COLUMNS):
            raise ValueError(f"step log {path} has columns {','.join(columns)!r}, not {','.join(COLUMNS)!r}: "
                             "give a new file")
        self._file = open(path, "a", newline="", buffering=1)  # line-buffered: readable while serving
        self._writer = csv.writer(self._file)
        if new:
            self._file.write(KNOTS_PREFIX + ",".join(map(str, knots)) + "\n")
            self._writer.writerow(COLUMNS)

    def step(self, tokens: int, seqs: int, context: int, seconds: float, profile: bool = False,
             drafts: int | None = None, predicted: float | None = None, verifying: int | None = None) -> None:
        self._writer.writerow(("profile" if profile else "step", tokens, seqs, context, "", "", f"{seconds:.6f}",
                               f"{time.time():.3f}", "" if drafts is None else drafts,
                               "" if predicted is None else f"{predicted:.6f}", "" if verifying is None else verifying))

    def draft(self, forwards: int, tokens: int, catch_up: int, seconds: float, profile: bool = False) -> None:
        self._writer.writerow(("profile-draft" if profile else "draft", tokens, "", "", forwards, catch_up,
                               f"{seconds:.6f}", f"{time.time():.3f}", "", "", ""))

    def close(self) -> None:
        self._file.close()
