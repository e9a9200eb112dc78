"""Does `tidal sim` predict what `tidal bench` measures? The simulator, calibrated only on a tidal
server's start-up timing profile (its --step-log rows of kind profile / profile-draft: batches of
1, 4, 16 and 64 requests, K = 0, 2, 4), predicts the sweep the bench measured against the same
servers; printed side by side with the error, concurrencies the profile covered marked.

    tidal bench --launch off,fixed:4,adaptive --concurrency 1,2,4,8,16 --num-prompts 16 \\
        --output-len 64 --output /tmp/val/bench
    python benchmarks/sim_validation.py --bench /tmp/val/bench.json \\
        --profile /tmp/val/bench-logs/steps-adaptive-*.csv

Or, with --logs, leave one level out: each level is predicted from every launched server's step
log (start-up profile and live steps) less the rows written while that level ran (the bench
JSON keeps each round's start and end); the start-up profile's rows are anchors scaled to the
live rows' level, as the engine fits them. The live steps carry what a start-up profile misses:
on this 2-core VM a server's live steps ran 13-60% slower than its own start-up profile at the
same shapes: the profile is one moment of a machine whose speed drifts that much over minutes
(and it holds context still, 48-54 tokens a request). Run the bench with --repeats so that each
level's rounds are spread over the whole run (passes over the sweep).

    tidal bench --launch off,fixed:4,adaptive --concurrency 1,2,4,8,16,32 --num-prompts 8 \
        --output-len 64 --repeats 3 --output /tmp/val/bench
    python benchmarks/sim_validation.py --bench /tmp/val/bench.json --logs /tmp/val/bench-logs/steps-*.csv

Acceptance for the simulated speculative modes: one per-position rate, solved from the acceptance
length the bench measured for the fixed mode (1 + a + ... + a^K = length). Input length: the
chat prompts' mean length under the bundled model's chat template.
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import datetime

from tidal.adaptive.cost import PROFILE_BATCH_SIZES
from tidal.config import SchedulerConfig
from tidal.datasets import chat_prompts
from tidal.models.loader import load_tokenizer
from tidal.sim.measured import MeasuredModel
from tidal.sim.simulator import AcceptanceModel, parse_modes
from tidal.sim.sweep import SweepConfig, simulate


def per_position_rate(length: float, k: int) -> float:
    """a with 1 + a + a^2 + ... + a^k = length (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a ** j for j in range(k + 1)) < length else (lo, a)
    return (lo + hi) / 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True, help="tidal bench's JSON (a --launch sweep)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help="a launched adaptive server's step log: its start-up profile rows")
    src.add_argument("--logs", nargs="+", help="every launched server's step log: each level predicted from "
                     "the rows written outside it")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the servers' (tidal's default)")
    args = ap.parse_args()
    bench = json.load(open(args.bench))
    cfg = bench["config"]
    measured = {(r["target"], r["concurrency"]): r for r in bench["records"]}
    modes = parse_modes(cfg["launch"])
    if args.logs:
        windows = {c: [w for (_, cc), r in measured.items() if cc == c for w in r.get("windows", [])]
                   for c in cfg["concurrency"]}
        if not any(windows.values()):
            raise SystemExit(f"{args.bench} has no round windows: it predates them; rerun tidal bench")
        # rows from before this bench started (an earlier run's logs in the same folder) stay out too
        started = datetime.fromisoformat(bench["created"]).timestamp()
        models = {c: MeasuredModel.load(args.logs, outside=[(0.0, started), *w]) for c, w in windows.items() if w}
        source = (f"the step logs {' '.join(args.logs)} less each level's own rows (the start-up profile's "
                  f"batches of {', '.join(map(str, PROFILE_BATCH_SIZES))} stay in)")
    else:
        model = MeasuredModel.load(args.profile, kinds={"profile", "profile-draft"})
        models = dict.fromkeys(cfg["concurrency"], model)
        source = f"{model.step_cost.num_anchors} profile steps of {args.profile}"
    covered = {c: c in PROFILE_BATCH_SIZES for c in cfg["concurrency"]}
    tok, _ = load_tokenizer()
    input_len = round(statistics.mean(len(tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])))
                                      for p in chat_prompts()))
    fixed = next(m for m in modes if m.mode == "fixed")
    lengths = [r["acceptance_length"] for (t, _), r in measured.items() if t == fixed.label and r["acceptance_length"]]
    rate = per_position_rate(statistics.mean(lengths), fixed.max_k)
    sweep = SweepConfig(tuple(cfg["concurrency"]), input_len, cfg["output_len"], cfg["num_prompts"],
                        AcceptanceModel((rate,)), SchedulerConfig(256, args.max_num_batched_tokens))
    print(f"# simulated from {source}; input {input_len} "
          f"tokens, output {cfg['output_len']}, {cfg['num_prompts']} requests per level, acceptance {rate:.3f} "
          f"per position (measured length {statistics.mean(lengths):.2f} at K={fixed.max_k})")
    print("| mode | concurrency | batch in the start-up profile | measured tok/s | simulated tok/s | error |")
    print("|---|---|---|---|---|---|")
    errors = {True: [], False: []}
    for mode in modes:
        for c in cfg["concurrency"]:
            if (mode.label, c) not in measured or c not in models:
                continue
            got = measured[mode.label, c]["output_tok_s"]
            sim = simulate(models[c], mode, c, sweep).output_tok_s
            err = sim / got - 1
            errors[covered[c]].append(abs(err))
            print(f"| {mode.label} | {c} | {'yes' if covered[c] else 'no'} | {got:.1f} | {sim:.1f} | {err:+.0%} |")
    for inside, errs in errors.items():
        if errs:
            print(f"\n{'in' if inside else 'not in'} the start-up profile: median |error| {statistics.median(errs):.0%}, "
                  f"max {max(errs):.0%} over {len(errs)} points")


if __name__ == "__main__":
    main()
