"""How far the lossy weight layouts move the bundled model: greedy answers to the shipped chat
prompts with every weight in the fp16 layout (the widest use `--weight-layouts auto` can make
of it) against the dense fp32 weights, one request at a time, both eager.

    python benchmarks/layout_agreement.py [--max-tokens 64] [--prompts 40]

Prints the share of answers identical token for token, the mean length of the agreeing prefix,
and the largest logit difference over the prompts' prefill (the logits reach about 30).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch

from tidal import LLM, SamplingParams
from tidal.datasets import chat_prompts
from tidal.engine import llm_engine


def prefill_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    eng = llm.engine
    eng.add_request("probe", ids, SamplingParams(max_tokens=1))
    (s,) = eng.scheduler.schedule().scheduled
    input_ids, positions, meta = eng.runner.prepare([s])
    hidden, _ = eng.runner.model(input_ids, positions, eng.runner.kv_caches, meta)
    logits = eng.runner.model.compute_logits(hidden)
    eng.abort("probe")
    return logits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=40)
    args = ap.parse_args()
    dense = LLM(dtype="float32", enforce_eager=True, weight_layouts="dense")
    cache = os.environ.get("TIDAL_CACHE_DIR")
    with tempfile.TemporaryDirectory() as tmp:  # the forced choice never reaches the user's cache
        os.environ["TIDAL_CACHE_DIR"], choose = tmp, llm_engine.choose_fp16_rows
        llm_engine.choose_fp16_rows = lambda shapes, edges: {s: edges[-1] for s in shapes}
        try:
            fp16 = LLM(dtype="float32", enforce_eager=True, weight_layouts="auto")
        finally:
            llm_engine.choose_fp16_rows = choose
            if cache is None:
                del os.environ["TIDAL_CACHE_DIR"]
            else:
                os.environ["TIDAL_CACHE_DIR"] = cache
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    prefixes, worst = [], 0.0
    for text in chat_prompts()[: args.prompts]:
        ids = dense.tokenizer.encode(dense.tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        ids = ids[:64]  # one step of the compiled range, where fp16 serves
        worst = max(worst, (prefill_logits(fp16, ids) - prefill_logits(dense, ids)).abs().max().item())
        a = dense.generate([ids], params)[0].token_ids
        b = fp16.generate([ids], params)[0].token_ids
        prefixes.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)))
    n = len(prefixes)
    print(f"# fp16 weights vs dense fp32, {n} chat prompts, {args.max_tokens} greedy tokens each")
    print("| identical answers | mean agreeing prefix, tokens | max logit difference, prefill |")
    print("|---|---|---|")
    print(f"| {sum(p == args.max_tokens for p in prefixes)}/{n} | {statistics.mean(prefixes):.1f} | {worst:.4f} |")


if __name__ == "__main__":
    main()
