"""tidal's short-query attention kernel against torch's SDPA in the same engine, one run.

    python benchmarks/attention_kernel.py [--requests 1,16] [--tokens 96] [--rounds 4]

Eager steps (`enforce_eager`, so that both paths are the Python dispatch in
tidal/layers/attention.py, not a compiled package), the bundled model, chat prompts, greedy;
at each level the two paths take turns round by round in one process
(`attention.KERNEL_MAX_QUERIES` 64 for the kernel, 0 for SDPA). Prints tok/s medians, their
ratio, and the CPU.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from tidal import LLM, SamplingParams
from tidal.datasets import chat_prompts
from tidal.layers import attention


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default="1,16", help="concurrent requests per level, comma-separated")
    ap.add_argument("--tokens", type=int, default=96, help="greedy tokens a request")
    ap.add_argument("--rounds", type=int, default=4, help="turns per path and level")
    args = ap.parse_args()
    llm = LLM(enforce_eager=True)
    prompts = chat_prompts()
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    paths = {"kernel": attention.KERNEL_MAX_QUERIES, "sdpa": 0}
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"CPU {cpu}; torch ISA {torch.backends.cpu.get_cpu_capability()}; {torch.get_num_threads()} threads")
    print("| requests | kernel tok/s | SDPA tok/s | kernel / SDPA |\n|---|---|---|---|")
    for n in (int(x) for x in args.requests.split(",")):
        ids = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}])
               for p in (prompts * n)[:n]]
        rates: dict[str, list[float]] = {name: [] for name in paths}
        for r in range(args.rounds):
            for name in list(paths)[r % 2:] + list(paths)[:r % 2]:
                attention.KERNEL_MAX_QUERIES = paths[name]
                start = time.perf_counter()
                outs = llm.generate(ids, params)
                rates[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
        attention.KERNEL_MAX_QUERIES = paths["kernel"]
        k, s = statistics.median(rates["kernel"]), statistics.median(rates["sdpa"])
        print(f"| {n} | {k:.1f} | {s:.1f} | {k / s:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
