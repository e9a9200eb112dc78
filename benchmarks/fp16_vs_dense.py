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

import torch
from int4_vs_dense import alternate

from tidal import LLM
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

    def use(path: str) -> None:
        for w, rows_ in zip(weights, chosen):
            w.max_rows = rows_ if path == "fp16" else 0

    try:
        rows = alternate(eng, prompt, [int(x) for x in args.batches.split(",")], args.steps, ("fp16", "dense"), use)
    finally:
        use("fp16")
    cpu = cpu_identity()
    print(f"\n# eager decode step (target forward and sampling), median of {args.steps}; {cpu['cpu']} "
          f"({cpu['arch']}, torch ISA {cpu['isa']}), {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| requests | fp16 ms | dense fp32 ms | dense / fp16 |")
    print("|---|---|---|---|")
    for c, t16, td in rows:
        print(f"| {c} | {t16 * 1e3:.1f} | {td * 1e3:.1f} | {td / t16:.2f}x |")


if __name__ == "__main__":
    main()
