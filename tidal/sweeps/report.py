"""Reports from a list of BenchRecords (measured or simulated): a Markdown table with each
target's ratio to the first, JSON, CSV, a PNG plot, and a results journal."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import statistics
from pathlib import Path

from tidal.sweeps.records import BenchRecord, levels, ratio_to_first, round_ratios_to_first, target_order

LATENCY_FIELDS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _spread(ratios: list[float]) -> str:
    """'1.02x (0.95-1.09)': the median of per-round ratios and their range."""
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def _level_name(c: int, rate: float | None) -> str:
    return f"C={c}" if rate is None else f"C={c} @{rate:g}/s"


# ------------------------------------------------------------------ table


def format_table(records: list[BenchRecord], order: list[str] | None = None) -> str:
    """A Markdown table, one row per level and target (targets in `order`, default: first
    appearance), with output tok/s and its ratio to the first target (pooled over the rounds,
    and where there are several, the median, least and most of the rounds' own ratios), p50
    latencies in ms, speculation figures and errors; the first error message of each failing
    row below it."""
    order = order or target_order(records)
    ratios = ratio_to_first(records, order)
    rounds = round_ratios_to_first(records, order) if any(len(r.round_tok_s) > 1 for r in records) else None
    by = {(r.target, r.concurrency, r.request_rate): r for r in records}
    open_loop = any(r.request_rate is not None for r in records)
    head = ["concurrency", *(["rate req/s"] if open_loop else []), "target", "requests", "tok/s",
            f"vs {order[0]}" if order else "vs first",
            *([f"rounds vs {order[0]}: median (range)"] if rounds is not None else []),
            "req/s", "TTFT p50", "TTFT p99", "TPOT p50", "ITL p50", "e2e p50", "accept len", "mean K", "errors"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for c, rate in levels(records):
        for name in order:
            r = by.get((name, c, rate))
            if r is None:
                continue
            ratio = ratios.get((name, c, rate))
            cells = [str(c), *([_num(rate, "g")] if open_loop else []), name, f"{r.completed}/{r.num_requests}",
                     _num(r.output_tok_s), "-" if ratio is None else f"{ratio:.2f}x",
                     *([_spread(rounds[name, c, rate]) if name != order[0] else "-"] if rounds is not None else []),
                     _num(r.requests_per_s, ".2f"),
                     _num(r.ttft_ms["p50"]), _num(r.ttft_ms["p99"]), _num(r.tpot_ms["p50"]), _num(r.itl_ms["p50"]),
                     _num(r.e2e_ms["p50"]), _num(r.acceptance_length, ".2f"), _num(r.mean_chosen_k, ".2f"),
                     str(r.errors)]
            lines.append("| " + " | ".join(cells) + " |")
            if r.errors:
                notes.append(f"- {name} {_level_name(c, rate)}: {r.errors} errors, first: {r.error}")
    return "\n".join(lines + ([""] + notes if notes else []))


# ------------------------------------------------------------------ files


def write_json(path: str | os.PathLike, records: list[BenchRecord], meta: dict) -> None:
    """`{**meta, "records": [record dicts]}`; meta holds config, tidal version, machine."""
    Path(path).write_text(json.dumps({**meta, "records": [r.to_dict() for r in records]}, indent=1))


def read_json(path: str | os.PathLike) -> tuple[dict, list[BenchRecord]]:
    """(meta, records) of a file write_json wrote."""
    data = json.loads(Path(path).read_text())
    records = [BenchRecord.from_dict(d) for d in data.pop("records")]
    return data, records


def flat_record(r: BenchRecord) -> dict:
    """The record with each latency dict spread into columns like `ttft_ms_p50`."""
    d = r.to_dict()
    d.pop("windows")  # per round: in the JSON only
    d.pop("round_tok_s")
    for name in LATENCY_FIELDS:
        for k, v in d.pop(name).items():
            d[f"{name}_{k}"] = v
    return d


def write_csv(path: str | os.PathLike, records: list[BenchRecord]) -> None:
    """One row per record, latencies flattened (see flat_record)."""
    empty = BenchRecord("", 0, None, 0, 0, 0.0, 0, 0.0, 0.0)
    columns = list(flat_record(empty))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(flat_record(r) for r in records)


def plot(path: str | os.PathLike, records: list[BenchRecord], order: list[str] | None = None,
         title: str | None = None) -> None:
    """PNG: output tok/s against concurrency (log x), one line per target; below it each
    target's ratio to the first target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = order or target_order(records)
    ratios = ratio_to_first(records, order)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 7), sharex=True, height_ratios=[3, 2])
    for name in order:
        rows = sorted((r for r in records if r.target == name), key=lambda r: r.concurrency)
        xs = [r.concurrency for r in rows]
        top.plot(xs, [r.output_tok_s for r in rows], marker="o", label=name)
        rs = [ratios.get((name, r.concurrency, r.request_rate)) for r in rows]
        bottom.plot(xs, [math.nan if x is None else x for x in rs], marker="o", label=name)
    top.set_ylabel("output tokens/s")
    top.set_title(title or "throughput by concurrency")
    top.legend()
    top.grid(True, which="both", alpha=0.3)
    bottom.axhline(1.0, color="grey", linewidth=0.8)
    bottom.set_ylabel(f"ratio to {order[0]}" if order else "ratio")
    bottom.set_xlabel("concurrency (requests in flight)")
    bottom.set_xscale("log", base=2)
    xs = sorted({r.concurrency for r in records})
    bottom.set_xticks(xs, [str(x) for x in xs])
    bottom.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ comparing runs


def crossovers(records: list[BenchRecord], order: list[str] | None = None) -> dict[str, int | None]:
    """For each target after the first: the lowest concurrency at which its ratio to the
    first target is on the other side of 1 than at the lowest level (None: never)."""
    order = order or target_order(records)
    ratios = ratio_to_first(records, order)
    out = {}
    for name in order[1:]:
        series = [(c, ratios[name, c, rate]) for c, rate in levels(records)
                  if ratios.get((name, c, rate)) is not None]
        if not series:
            out[name] = None
            continue
        above = series[0][1] >= 1.0
        out[name] = next((c for c, x in series if (x >= 1.0) != above), None)
    return out


def what_changed(previous: list[BenchRecord], current: list[BenchRecord], order: list[str] | None = None) -> str:
    """One line: how each target's crossover and ratio to the first target moved between two
    runs of the same targets, at the levels both have."""
    order = order or target_order(current)
    before, now = ratio_to_first(previous, order), ratio_to_first(current, order)
    cross_before, cross_now = crossovers(previous, order), crossovers(current, order)
    shared = [lv for lv in levels(current) if lv in set(levels(previous))]
    parts = []
    for name in order[1:]:
        a, b = cross_before.get(name), cross_now.get(name)
        cross = (f"crossover {_c(a)} -> {_c(b)}" if a != b else f"crossover unchanged ({_c(b)})")
        steps = [f"{_level_name(c, rate)} {_x(before.get((name, c, rate)))}->{_x(now.get((name, c, rate)))}"
                 for c, rate in shared]
        parts.append(f"{name}/{order[0]}: {cross}; " + ", ".join(steps))
    return "; ".join(parts) if parts else "a single target: no ratios to compare"


def _c(c: int | None) -> str:
    return "none" if c is None else f"C={c}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


# ------------------------------------------------------------------ journal

_SECTION = "<!-- tidal-bench section -->"
_RECORDS = re.compile(r"<!-- tidal-bench records: (.*?) -->")
_JOURNAL_HEAD = ("# tidal bench journal\n\nNewest first. Each section: when, the command, its config, "
                 "the table, the plot, and what changed since the previous section with the same targets.\n")


def update_journal(path: str | os.PathLike, records: list[BenchRecord], *, when: str, command: str,
                   config: dict, plot_path: str | None = None, order: list[str] | None = None) -> str:
    """Prepend a section for this run to the Markdown journal at `path` (created if missing)
    and regenerate its index; returns the section's "what changed" line."""
    path = Path(path)
    order = order or target_order(records)
    sections = _split_sections(path.read_text()) if path.exists() else []
    # the same targets, in whatever order they were measured (the servers take turns, rotating who goes first)
    prev = next((s for s in sections if set(target_order(_section_records(s))) == set(order)), None)
    changed = (f"versus {_section_title(prev)}: {what_changed(_section_records(prev), records, order)}"
               if prev else f"first run with targets {', '.join(order)}")
    anchor = "run-" + re.sub(r"[^0-9A-Za-z]+", "-", when).strip("-").lower()
    title = f"{when}: {', '.join(order)}"
    plot_line = ""
    if plot_path:
        rel = os.path.relpath(Path(plot_path).resolve(), path.parent.resolve())
        plot_line = f"\n![plot]({rel})\n"
    payload = json.dumps([r.to_dict() for r in records]).replace(">", "\\u003e")  # never ends the comment
    section = (f'{_SECTION}\n<a id="{anchor}"></a>\n\n## {title}\n\n**What changed:** {changed}\n\n'
               f"```\n{command}\n```\n\nconfig: `{json.dumps(config, sort_keys=True)}`\n\n"
               f"{format_table(records, order)}\n{plot_line}\n<!-- tidal-bench records: {payload} -->\n")
    sections.insert(0, section)
    index = ["## Index", ""] + [f"- [{_section_title(s)}](#{_section_anchor(s)})" for s in sections]
    path.write_text(_JOURNAL_HEAD + "\n" + "\n".join(index) + "\n\n" + "\n".join(sections))
    return changed


def _split_sections(text: str) -> list[str]:
    return [_SECTION + part.rstrip("\n") + "\n" for part in text.split(_SECTION)[1:]]


def _section_records(section: str) -> list[BenchRecord]:
    m = _RECORDS.search(section)
    return [BenchRecord.from_dict(d) for d in json.loads(m.group(1))] if m else []


def _section_title(section: str) -> str:
    m = re.search(r"^## (.+)$", section, re.M)
    return m.group(1) if m else "(untitled)"


def _section_anchor(section: str) -> str:
    m = re.search(r'<a id="([^"]+)"></a>', section)
    return m.group(1) if m else ""
