"""Where the 4-bit kernel stops paying: decode steps of the bundled model at batch C with the int4
weights vs the dense bf16 ones, alternated step by step on one engine (so a slow spell of the
machine hits both alike). Also the price of verifying drafts: a step of C tokens is what a
verify of C - 1 drafts for one request costs.

    python benchmarks/int4_vs_dense.py [--batches 1,2,3,4,6,8,12,16,24] [--steps 40]

Prints the median step time per path and batch, each batch's time over batch 1's (int4), and
the dense/int4 ratio; `tidal.layers.linear.INT4_MAX_TOKENS` should sit where it crosses 1.
"""

from __future__ import annotations

import argparse
import platform
import statistics

import torch

import tidal.layers.linear as linear
from tidal import LLM, SamplingParams


def alternate(eng, prompt: list[int], batches: list[int], steps: int, paths: tuple[str, str],
              use) -> list[tuple[int, float, float]]:
    """(C, median step seconds of paths[0], of paths[1]) for decode steps of C requests, the two
    paths alternated step by step (`use(path)` switches the engine to one)."""
    rows = []
    for c in batches:
        params = SamplingParams(max_tokens=2 * steps + 2, temperature=0, ignore_eos=True)
        for i in range(c):
            eng.add_request(f"b{c}-{i}", prompt, params)
        eng.step()  # the prefill
        times: dict[str, list[float]] = {p: [] for p in paths}
        for k in range(2 * steps):
            use(paths[k % 2])
            eng.step()
            times[paths[k % 2]].append(eng.last_step_stats.seconds)
        while eng.has_unfinished():
            eng.step()
        rows.append((c, statistics.median(times[paths[0]]), statistics.median(times[paths[1]])))
        print(f"  C={c}: {paths[0]} {rows[-1][1] * 1e3:.1f} ms, {paths[1]} {rows[-1][2] * 1e3:.1f} ms", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,3,4,6,8,12,16,24")
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per path and batch")
    args = ap.parse_args()
    llm = LLM()
    eng = llm.engine
    if not any(layer.int4 for layer in eng.runner.model.layers):
        raise SystemExit("the model runs without int4 weights here (needs a CPU with bf16 support)")
    prompt = llm.tokenizer.encode("Tell me about the history of the printing press in Europe.")
    default = linear.INT4_MAX_TOKENS

    def use(path: str) -> None:
        linear.INT4_MAX_TOKENS = 1 << 30 if path == "int4" else 0

    try:
        rows = alternate(eng, prompt, [int(x) for x in args.batches.split(",")], args.steps, ("int4", "dense"), use)
    finally:
        linear.INT4_MAX_TOKENS = default
    print(f"\n# decode step (target forward and sampling), median of {args.steps}; dtype {eng.dtype}, "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}, INT4_MAX_TOKENS={default}")
    print("| tokens in the step | int4 ms | dense bf16 ms | int4 / int4 at 1 | dense / int4 |")
    print("|---|---|---|---|---|")
    for c, t4, td in rows:
        print(f"| {c} | {t4 * 1e3:.1f} | {td * 1e3:.1f} | {t4 / rows[0][1]:.2f}x | {td / t4:.2f}x |")


if __name__ == "__main__":
    main()
