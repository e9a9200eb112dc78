"""How far the lossy weight layouts move the bundled model: greedy answers to the shipped chat
prompts with every weight in one layout (fp16, or qblock: the file's 4-bit blocks with
activations rounded to 8 bits; the widest use `--weight-layouts auto` can make of it) against
the dense fp32 weights, one request at a time, both eager.

    python benchmarks/layout_agreement.py [--layout fp16|qblock] [--max-tokens 64] [--prompts 40]

Prints the share of answers identical token for token, the mean length of the agreeing prefix,
and the largest logit difference over the prompts' prefill (the logits reach about 30); the
same for llama.cpp (the llama-cpp-python binding, 2 threads) on the same file and token ids,
whose own rounding of activations to 8 bits the qblock layout copies. Dense fp32 greedy is
transformers' greedy (tests/test_llama_vs_hf.py), so both rows are distances from the oracle.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import numpy as np
import torch

from tidal import LLM, SamplingParams
from tidal.datasets import chat_prompts
from tidal.engine import llm_engine
from tidal.layers.layout_choice import forced
from tidal.models.loader import default_model_path


def prefill_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    eng = llm.engine
    eng.add_request("probe", ids, SamplingParams(max_tokens=1))
    (s,) = eng.scheduler.schedule().scheduled
    input_ids, positions, meta = eng.runner.prepare([s])
    hidden, _ = eng.runner.model(input_ids, positions, eng.runner.kv_caches, meta)
    logits = eng.runner.model.compute_logits(hidden)
    eng.abort("probe")
    return logits


class LlamaCpp:
    """llama.cpp through its Python binding: prefill logits and greedy tokens for token ids."""

    def __init__(self, path: str) -> None:
        from llama_cpp import Llama
        self.llama = Llama(path, logits_all=True, n_ctx=1024, n_threads=2, verbose=False)

    def prefill_logits(self, ids: list[int]) -> torch.Tensor:
        self.llama.reset()
        self.llama.eval(ids)
        return torch.from_numpy(np.array(self.llama.scores[: len(ids)]))

    def greedy(self, ids: list[int], n: int) -> list[int]:
        self.llama.reset()
        self.llama.eval(ids)
        out = []
        for _ in range(n):
            out.append(int(np.argmax(self.llama.scores[self.llama.n_tokens - 1])))
            self.llama.eval(out[-1:])
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--layout", choices=("fp16", "qblock"), default="fp16")
    args = ap.parse_args()
    dense = LLM(dtype="float32", enforce_eager=True, weight_layouts="dense")
    cache = os.environ.get("TIDAL_CACHE_DIR")
    with tempfile.TemporaryDirectory() as tmp:  # the forced choice never reaches the user's cache
        os.environ["TIDAL_CACHE_DIR"], choose = tmp, llm_engine.choose_layouts
        llm_engine.choose_layouts = forced(args.layout)
        try:
            narrow = LLM(dtype="float32", enforce_eager=True, weight_layouts="auto")
        finally:
            llm_engine.choose_layouts = choose
            if cache is None:
                del os.environ["TIDAL_CACHE_DIR"]
            else:
                os.environ["TIDAL_CACHE_DIR"] = cache
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    peer = LlamaCpp(str(dense.engine.config.model or default_model_path()))
    rows = {args.layout: ([], 0.0), "llama.cpp": ([], 0.0)}
    for text in chat_prompts()[: args.prompts]:
        ids = dense.tokenizer.encode(dense.tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        ids = ids[:64]  # one step of the compiled range, where the layout serves
        ref_logits = prefill_logits(dense, ids)
        ref = dense.generate([ids], params)[0].token_ids
        answers = {args.layout: (prefill_logits(narrow, ids), narrow.generate([ids], params)[0].token_ids),
                   "llama.cpp": (peer.prefill_logits(ids), peer.greedy(ids, args.max_tokens))}
        for name, (logits, tokens) in answers.items():
            prefixes, worst = rows[name]
            prefixes.append(next((i for i, (x, y) in enumerate(zip(ref, tokens)) if x != y), len(ref)))
            rows[name] = prefixes, max(worst, (logits - ref_logits).abs().max().item())
    n = args.prompts
    print(f"# against dense fp32 (transformers' greedy), {n} chat prompts, {args.max_tokens} greedy tokens each")
    print("| engine | identical answers | mean agreeing prefix, tokens | max logit difference, prefill |")
    print("|---|---|---|---|")
    for name, (prefixes, worst) in rows.items():
        label = f"tidal, {name} weights" if name != "llama.cpp" else "llama.cpp"
        print(f"| {label} | {sum(p == args.max_tokens for p in prefixes)}/{len(prefixes)} "
              f"| {statistics.mean(prefixes):.1f} | {worst:.4f} |")

if __name__ == "__main__":
    main()
