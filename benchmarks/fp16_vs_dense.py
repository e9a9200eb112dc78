"""Eager steps with the fp16 weight layout against the dense fp32 weights: decode steps of the
bundled model at C requests, the two alternated step by step on one engine (so a slow spell of
the machine hits both alike), fp32 as on CPUs without native bf16.

    python benchmarks/fp16_vs_dense.py [--batches 1,2,4,8,16,32,64] [--steps 30]

Uses the layout choice measured for this machine (`--weight-layouts auto`), so a weight whose
fp16 copy lost the timing at some step size stays dense there in both columns' fp16 path.
Prints the median step time per path and batch and the dense / fp16 ratio.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from tidal import LLM, SamplingParams
from tidal.engine.profile_cache import cpu_identity


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per path and batch")
    args = ap.parse_args()
    llm = LLM(dtype="float32", enforce_eager=True)
    eng = llm.engine
    weights = eng.runner.model.fp16_weights()
    if not weights:
        raise SystemExit("no fp16 copies here (no fbgemm, or dense won every timing on this machine)")
    chosen = [w.max_rows for w in weights]
    prompt = llm.tokenizer.encode("Tell me about the history of the printing press in Europe.")
    rows = []
    try:
        for c in [int(x) for x in args.batches.split(",")]:
            params = SamplingParams(max_tokens=2 * args.steps + 2, temperature=0, ignore_eos=True)
            for i in range(c):
                eng.add_request(f"b{c}-{i}", prompt, params)
            eng.step()  # the prefill
            times: dict[str, list[float]] = {"fp16": [], "dense": []}
            for k in range(2 * args.steps):
                path = "fp16" if k % 2 == 0 else "dense"
                for w, rows_ in zip(weights, chosen):
                    w.max_rows = rows_ if path == "fp16" else 0
                eng.step()
                times[path].append(eng.last_step_stats.seconds)
            while eng.has_unfinished():
                eng.step()
            rows.append((c, statistics.median(times["fp16"]), statistics.median(times["dense"])))
            print(f"  C={c}: fp16 {rows[-1][1] * 1e3:.1f} ms, dense {rows[-1][2] * 1e3:.1f} ms", flush=True)
    finally:
        for w, rows_ in zip(weights, chosen):
            w.max_rows = rows_
    cpu = cpu_identity()
    print(f"\n# eager decode step (target forward and sampling), median of {args.steps}; {cpu['cpu']} "
          f"({cpu['arch']}, torch ISA {cpu['isa']}), {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| requests | fp16 ms | dense fp32 ms | dense / fp16 |")
    print("|---|---|---|---|")
    for c, t16, td in rows:
        print(f"| {c} | {t16 * 1e3:.1f} | {td * 1e3:.1f} | {td / t16:.2f}x |")


if __name__ == "__main__":
    main()
