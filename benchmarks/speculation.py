"""Speculative decoding at one request at a time: tok/s and mean acceptance length.

    python benchmarks/speculation.py [--prompts 6] [--output-tokens 96] [--ks 1,2,3,4,5,6]
                                     [--methods ngram,eagle3]

Two workloads: the shipped chat prompts, and repetition-heavy rewrite prompts (the answer
reuses the prompt); neither is in the drafter's training prompts. For each: speculation off,
then each drafter (n-gram; EAGLE-3 with the head shipped for the bundled model) at each K. Mean
acceptance length = output tokens / target forward steps that produced them (1.0 = off).
"""

from __future__ import annotations

import argparse
import time

import torch

from tidal import LLM, SamplingParams
from tidal.config import CacheConfig, SpecConfig
from tidal.datasets import chat_prompts, rewrite_prompts


def run_one(llm: LLM, prompt: list[int], n_out: int, rid: str) -> tuple[float, int, int, int, int]:
    """One request alone: (seconds, output tokens, decode steps, drafted, accepted)."""
    eng = llm.engine
    seq = eng.add_request(rid, prompt, SamplingParams(max_tokens=n_out, temperature=0))
    steps = 0
    t = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
        steps += seq.num_computed_tokens >= len(seq.prompt_token_ids)
    return (time.perf_counter() - t, len(seq.output_token_ids), steps,
            seq.spec.num_drafted, seq.spec.num_accepted)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--output-tokens", type=int, default=96)
    ap.add_argument("--ks", default="1,2,3,4,5,6")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--methods", default="ngram,eagle3", help="drafters to compare (eagle3: the shipped head)")
    args = ap.parse_args()
    configs = {"off": SpecConfig()}
    for method in args.methods.split(","):
        configs.update({f"{method} K={k}": SpecConfig(method, k) for k in map(int, args.ks.split(","))})
    # One engine per config, all loaded at once, and each prompt run on every engine in turn
    # (rotating the order), so that drift in this machine's speed hits every config alike.
    cache = CacheConfig(kv_cache_bytes=256 << 20)
    engines = {name: LLM(dtype=args.dtype, spec=spec, cache=cache) for name, spec in configs.items()}
    tok = next(iter(engines.values())).tokenizer
    for llm in engines.values():
        llm.generate("warm up", SamplingParams(max_tokens=4))
    workloads = {"chat": chat_prompts()[: args.prompts], "rewrite": rewrite_prompts()[: args.prompts]}
    totals = {(name, w): [0.0, 0, 0, 0, 0] for name in configs for w in workloads}
    names = list(configs)
    for w, texts in workloads.items():
        for i, text in enumerate(texts):
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
            for name in names[i % len(names):] + names[: i % len(names)]:
                one = run_one(engines[name], ids, args.output_tokens, f"{w}-{i}")
                totals[name, w] = [a + b for a, b in zip(totals[name, w], one)]
            print(f"  {w} prompt {i + 1}/{len(texts)} done", flush=True)
    dtype = next(iter(engines.values())).engine.dtype
    print(f"\n# one request at a time, {args.prompts} prompts per workload, up to {args.output_tokens} "
          f"greedy tokens, dtype {dtype}, torch {torch.__version__}; configs interleaved per prompt")
    print("| config | " + " | ".join(f"{w} tok/s | {w} vs off | {w} tokens/step | {w} acceptance"
                                      for w in workloads) + " |")
    print("|---" * (1 + 4 * len(workloads)) + "|")
    for name in configs:
        cells = []
        for w in workloads:
            sec, toks, steps, drafted, accepted = totals[name, w]
            off = totals["off", w]
            cells += [f"{toks / sec:.1f}", f"{(toks / sec) / (off[1] / off[0]):.2f}x", f"{toks / steps:.2f}",
                      f"{accepted / drafted:.0%}" if drafted else "-"]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
