"""A compiled step's attention layout: rows of query_width() queries against one row per sequence
padded to the longest one's queries, and against the eager step, on crafted mixed steps.

    python benchmarks/step_layout.py [--context 290] [--requests 32] [--turns 3] [--dtype bfloat16]

Fills `--requests` sequences to `--context` tokens, then times one engine's ModelRunner.execute on
steps that mix plain decodes with requests verifying drafts, or with a prompt chunk (a request
re-feeding its last tokens), the three layouts taking turns `--turns` times (median step, ms).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from tidal import LLM, SamplingParams
from tidal.engine import model_runner
from tidal.engine.scheduler import ScheduledSeq

# verify steps: name -> (count, tokens fed) runs; chunk steps: name -> (chunk tokens, decodes beside it)
VERIFY = {"plain": [(32, 1)], "1 verifies 4": [(1, 5), (31, 1)], "4 verify 4": [(4, 5), (28, 1)],
          "8 verify 2": [(8, 3), (24, 1)], "8 verify 4": [(8, 5), (24, 1)], "all verify 1": [(32, 2)],
          "16 verify 2": [(16, 3), (16, 1)], "12 verify 4": [(12, 5)]}
CHUNKS = {"40-token chunk + 8": (40, 8), "24-token chunk + 30": (24, 30), "48-token chunk + 16": (48, 16),
          "12-token chunk + 24": (12, 24)}


def filled(llm: LLM, requests: int, context: int) -> list:
    engine = llm.engine
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for i in range(requests):
        engine.add_request(f"r{i}", [(7 * i + j) % 30000 + 100 for j in range(context)], params)
    while any(s.num_computed_tokens < len(s.prompt_token_ids) for s in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    return list(engine.scheduler.running)


def fed_of(runs) -> list[int]:
    """Tokens fed per request, from (count, tokens) runs."""
    return [n for count, n in runs for _ in range(count)]


def verify_step(seqs, runs) -> list[ScheduledSeq]:
    out = []
    for s, n in zip(seqs, fed_of(runs)):
        s.draft_token_ids = [101 + j for j in range(n - 1)]
        out.append(ScheduledSeq(s, n, n - 1))
    return out


def timed(runner, scheduled, reps=8) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        runner.execute(scheduled)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts[2:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=290)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype)
    runner = llm.engine.runner
    runner.land_compiled(wait=True)
    seqs = filled(llm, args.requests, args.context)
    step, rows = runner.compiled, model_runner.query_width
    layouts = {"rows": (step, rows), "padded": (step, lambda q_lens: max(2, *q_lens)), "eager": (None, rows)}
    res: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.turns):
        for layout, (compiled, width) in layouts.items():
            runner.compiled, model_runner.query_width = compiled, width
            for name, runs in VERIFY.items():
                res.setdefault((name, layout), []).append(timed(runner, verify_step(seqs, runs)))
            for name, (chunk, decodes) in CHUNKS.items():
                for s in seqs:
                    s.draft_token_ids = []
                last = seqs[decodes]
                last.num_computed_tokens -= chunk - 1
                scheduled = [ScheduledSeq(s, 1) for s in seqs[:decodes]] + [ScheduledSeq(last, chunk)]
                res.setdefault((name, layout), []).append(timed(runner, scheduled))
                last.num_computed_tokens += chunk - 1
    runner.compiled, model_runner.query_width = step, rows
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"{args.requests} requests at {args.context} tokens of context; median step ms")
    print("| step | tokens | width | rows | padded | eager | padded / rows | eager / rows |")
    print("|---|---|---|---|---|---|---|---|")
    for name in [*VERIFY, *CHUNKS]:
        fed = fed_of(VERIFY[name]) if name in VERIFY else [1] * CHUNKS[name][1] + [CHUNKS[name][0]]
        ms = {layout: 1e3 * statistics.median(res[name, layout]) for layout in layouts}
        print(f"| {name} | {sum(fed)} | {min(rows(fed), max(fed))} | {ms['rows']:.1f} | {ms['padded']:.1f} | "
              f"{ms['eager']:.1f} | {ms['padded'] / ms['rows']:.2f}x | {ms['eager'] / ms['rows']:.2f}x |")


if __name__ == "__main__":
    main()
