"""Speculation off vs fixed K vs adaptive, by concurrency, on the bundled model (offline engine).

    python benchmarks/adaptive.py [--concurrency 1,2,4,8,16,32,64,128] [--output-len 128]
                                  [--modes off,fixed:2,fixed:4,adaptive:4] [--method eagle3]

At each concurrency C, every mode serves the same requests (shipped chat prompts, greedy,
exactly `output-len` tokens each) with C of them in flight at all times (closed loop), until
`max(C, min-requests)` are done. Modes take turns per level in a rotating order, so drift in
this machine's speed hits them alike. Prints output tok/s per mode and each mode's ratio to the
best of the others, the adaptive policy's mean chosen K and acceptance, and the crossover.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from tidal import LLM, SamplingParams
from tidal.bench.datasets import chat_prompts
from tidal.config import SpecConfig


def spec_for(mode: str, method: str) -> SpecConfig:
    """'off', 'fixed:K', 'adaptive:K' (K = the most it may choose), 'schedule:1-4:4,5-:0'."""
    name, _, arg = mode.partition(":")
    if name == "off":
        return SpecConfig()
    if name == "schedule":
        return SpecConfig(method, 15, mode="schedule", schedule=arg)
    return SpecConfig(method, int(arg or 4), mode=name)


def closed_loop(llm: LLM, prompts: list[list[int]], concurrency: int, num_requests: int, output_len: int):
    """Keep `concurrency` requests in flight until `num_requests` finish; returns (seconds,
    output tokens, drafted, accepted, chosen-K histogram delta)."""
    eng = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    hist0 = dict(eng.k_histogram)
    started = done = tokens = drafted = accepted = 0
    live = {}
    t0 = time.perf_counter()
    while done < num_requests:
        while len(live) < concurrency and started < num_requests:
            rid = f"r{started}"
            live[rid] = eng.add_request(rid, prompts[started % len(prompts)], params)
            started += 1
        for out in eng.step():
            if out.finished:
                seq = live.pop(out.request_id)
                done += 1
                tokens += len(seq.output_token_ids)
                drafted += seq.spec.num_drafted
                accepted += seq.spec.num_accepted
    seconds = time.perf_counter() - t0
    hist = {k: v - hist0.get(k, 0) for k, v in eng.k_histogram.items()}
    return seconds, tokens, drafted, accepted, hist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--modes", default="off,fixed:2,fixed:4,adaptive:4")
    ap.add_argument("--method", default="eagle3", choices=["eagle3", "ngram"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", default=None, help="also write the records here")
    args = ap.parse_args()
    modes = args.modes.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    engines = {m: LLM(dtype=args.dtype, spec=spec_for(m, args.method)) for m in modes}
    tok = next(iter(engines.values())).tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in chat_prompts()]
    for llm in engines.values():
        closed_loop(llm, prompts, 2, 2, 8)  # warm up
    results = {}
    for li, c in enumerate(levels):
        order = modes[li % len(modes):] + modes[: li % len(modes)]
        for m in order:
            results[m, c] = closed_loop(engines[m], prompts, c, max(c, args.min_requests), args.output_len)
            sec, toks, *_ = results[m, c]
            print(f"  C={c} {m}: {toks / sec:.1f} tok/s", flush=True)
    rate = {key: r[1] / r[0] for key, r in results.items()}
    dtype = next(iter(engines.values())).engine.dtype
    print(f"\n# {args.method}, {args.output_len} greedy tokens per request, shipped chat prompts, "
          f"closed loop; dtype {dtype}, torch {torch.__version__}, {platform.processor() or platform.machine()}")
    print("| concurrency | " + " | ".join(f"{m} tok/s" for m in modes) + " | "
          + " | ".join(f"{m} / best other" for m in modes) + " | adaptive mean K | adaptive acceptance |")
    print("|---" * (2 * len(modes) + 3) + "|")
    adaptive = next((m for m in modes if m.startswith("adaptive")), None)
    for c in levels:
        cells = [f"{rate[m, c]:.1f}" for m in modes]
        cells += [f"{rate[m, c] / max(rate[o, c] for o in modes if o != m):.2f}x" for m in modes]
        if adaptive:
            _, _, drafted, accepted, hist = results[adaptive, c]
            n = sum(hist.values())
            cells += [f"{sum(k * v for k, v in hist.items()) / n:.2f}" if n else "-",
                      f"{accepted / drafted:.0%}" if drafted else "-"]
        else:
            cells += ["-", "-"]
        print(f"| {c} | " + " | ".join(cells) + " |")
    fixed = [m for m in modes if m.startswith("fixed")]
    if "off" in modes and fixed:
        cross = next((c for c in levels if rate["off", c] >= max(rate[f, c] for f in fixed)), None)
        print(f"\ncrossover: plain decoding first beats every fixed K at concurrency {cross}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"mode": m, "concurrency": c, "seconds": r[0], "output_tokens": r[1], "drafted": r[2],
                        "accepted": r[3], "chosen_k": r[4]} for (m, c), r in results.items()], f, indent=1)


if __name__ == "__main__":
    main()
