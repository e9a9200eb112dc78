"""Speculative decoding at one request at a time: tok/s and mean acceptance length.

    python benchmarks/speculation.py [--prompts 6] [--output-tokens 96] [--ks 1,2,3,4,5,6]

Two workloads: the shipped chat prompts, and repetition-heavy rewrite prompts (the answer
reuses the prompt). For each: speculation off, then the n-gram drafter at each K. Mean
acceptance length = output tokens / target forward steps that produced them (1.0 = off).
"""

from __future__ import annotations

import argparse
import time

import torch

from tidal import LLM, SamplingParams
from tidal.bench.datasets import chat_prompts, rewrite_prompts
from tidal.config import SpecConfig


def run(llm: LLM, prompts: list[list[int]], n_out: int):
    """Each prompt alone; returns (tok/s over all, mean tokens per decode step, mean acceptance)."""
    eng = llm.engine
    params = SamplingParams(max_tokens=n_out, temperature=0)
    tokens = steps = drafted = accepted = 0
    elapsed = 0.0
    for i, p in enumerate(prompts):
        seq = eng.add_request(f"bench-{i}", p, params)
        t = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
            steps += seq.num_computed_tokens >= len(seq.prompt_token_ids)
        elapsed += time.perf_counter() - t
        tokens += len(seq.output_token_ids)
        drafted, accepted = drafted + seq.spec.num_drafted, accepted + seq.spec.num_accepted
    return tokens / elapsed, tokens / steps, accepted / drafted if drafted else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--output-tokens", type=int, default=96)
    ap.add_argument("--ks", default="1,2,3,4,5,6")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    configs = [("off", SpecConfig())] + [(f"ngram K={k}", SpecConfig("ngram", k)) for k in map(int, args.ks.split(","))]
    workloads = {"chat": chat_prompts()[: args.prompts], "rewrite": rewrite_prompts()[: args.prompts]}
    results = {}
    for name, spec in configs:
        llm = LLM(dtype=args.dtype, spec=spec)
        tok = llm.tokenizer
        llm.generate("warm up", SamplingParams(max_tokens=4))
        for w, texts in workloads.items():
            ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
            results[name, w] = run(llm, ids, args.output_tokens)
            rate, tau, acc = results[name, w]
            print(f"  {name:>12} {w:>8}: {rate:6.1f} tok/s, {tau:.2f} tokens/step", flush=True)
        dtype = llm.engine.dtype
        del llm
    print(f"\n# one request at a time, {args.prompts} prompts per workload, up to {args.output_tokens} "
          f"greedy tokens, dtype {dtype}, torch {torch.__version__}")
    print("| config | " + " | ".join(f"{w} tok/s | {w} vs off | {w} tokens/step | {w} acceptance"
                                      for w in workloads) + " |")
    print("|---" * (1 + 4 * len(workloads)) + "|")
    for name, _ in configs:
        cells = []
        for w in workloads:
            rate, tau, acc = results[name, w]
            cells += [f"{rate:.1f}", f"{rate / results['off', w][0]:.2f}x", f"{tau:.2f}",
                      "-" if acc != acc else f"{acc:.0%}"]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
