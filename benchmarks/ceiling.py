"""How often must drafts be right for a given speed-up at one request, on this machine?

    python benchmarks/ceiling.py [--prompts 8] [--output-len 128] [--ks 1,2,3,4]
                                 [--rates 0.4,0.5,0.6,0.7,0.8]

One request at a time (the shipped chat prompts, greedy, `output-len` tokens, ignore_eos as in
`benchmarks/adaptive.py`), the engine's real fixed-K speculation path, three kinds of drafter:
- `eagle3`: the shipped head as it is;
- `eagle3@a`: the shipped head runs as usual (its forwards, cache and catch-up are paid), then
  each of its drafts is replaced by the token the target will produce there with probability
  a, else by a wrong one: a head with the same cost whose drafts are each accepted with
  probability a given the ones before (acceptance length 1 + a + ... + a^K);
- `free@a`: the same tokens from a drafter that costs nothing (no head forward): what verifying
  drafts costs, with the speculative step's own bookkeeping (cost models, verification).
The target's own greedy answer (the `off` run of the same prompt) says what "right" is. In bf16 a
verify step's kernels round differently from a one-row step's, so at a near-tie a speculative
run can pick another token than plain decoding did (README, correctness); from there the target's
answer is taken again by plain decoding from the run's own tokens, a pause not counted in its
time (how often, printed); near such ties a "right" draft can also be rejected, so the rates are
nominal and the measured tokens/step say what was reached. `off` runs first for each prompt (its
answer is the truth); the other configs run interleaved, in an order rotated across prompts, so
that drift in this machine's speed hits them alike. Prints each
config's tok/s over `off` and its measured acceptance length, per K, and the best K.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from tidal import LLM, SamplingParams
from tidal.config import CacheConfig, SpecConfig
from tidal.datasets import chat_prompts
from tidal.sequence import Sequence


class OracleDrafts:
    """Wraps an engine's drafter (or none: free drafts): its drafts become the target's own
    tokens with probability `rate` each, else a wrong token; `rate` None leaves them alone."""

    def __init__(self, inner, vocab_size: int, answer, seed: int = 0):
        self.inner, self.vocab_size, self.answer = inner, vocab_size, answer
        self.rate: float | None = None
        self.answers: dict[str, list[int]] = {}  # request id -> the target's tokens (prompt + answer)
        self.rng = random.Random(seed)
        self.paused, self.reanswered = 0.0, 0  # seconds spent (and times) answering again

    def __getattr__(self, name):  # observe etc.: the wrapped drafter's
        return getattr(self.inner, name)

    def available(self, seqs: list[Sequence], max_k: int) -> list[int]:
        return self.inner.available(seqs, max_k) if self.inner else [max_k] * len(seqs)

    def draft_class(self, seq: Sequence) -> int:
        return self.inner.draft_class(seq) if self.inner else 0

    def catch_up(self, seq: Sequence) -> int:
        return self.inner.catch_up(seq) if self.inner else 0

    def forget(self, seq: Sequence) -> None:
        if self.inner:
            self.inner.forget(seq)

    def propose(self, seqs: list[Sequence], num_draft_tokens: list[int]):
        drafts, probs = self.inner.propose(seqs, num_draft_tokens) if self.inner else ([[] for _ in seqs], None)
        if self.rate is None:
            return drafts, probs
        out = []
        for s, k in zip(seqs, num_draft_tokens):
            known = self.answers[s.request_id]
            if known[:s.num_tokens] != s.token_ids:  # a near-tie went the other way: answer again
                t = time.perf_counter()
                rest = max(1, s.params.max_tokens - len(s.output_token_ids))
                known = self.answers[s.request_id] = s.token_ids + self.answer(s.token_ids, rest)
                self.paused += time.perf_counter() - t
                self.reanswered += 1
            truth = known[s.num_tokens:s.num_tokens + k]
            out.append([t if self.rng.random() < self.rate else (t + 1) % self.vocab_size for t in truth])
        return out, None  # greedy: one-hot drafts


def run_one(llm: LLM, prompt: list[int], n_out: int, rid: str) -> tuple[float, list[int], int, int]:
    """One request alone: (seconds, output tokens, drafted, accepted); an oracle's pauses to
    answer again are not counted."""
    eng = llm.engine
    seq = eng.add_request(rid, prompt, SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True))
    paused = getattr(eng.drafter, "paused", 0.0)
    t = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    seconds = time.perf_counter() - t - (getattr(eng.drafter, "paused", 0.0) - paused)
    return seconds, list(seq.output_token_ids), seq.spec.num_drafted, seq.spec.num_accepted


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--rates", default="0.4,0.5,0.6,0.7,0.8", help="per-draft acceptance rates to emulate")
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    if not all(0 <= r <= 1 for r in rates) or not all(k >= 1 for k in ks):
        raise SystemExit("--rates must lie in [0, 1] and --ks be >= 1")
    cache = CacheConfig(kv_cache_bytes=256 << 20)
    off = LLM(cache=cache)
    engines = {("off", 0): off}  # one engine per drafter kind and K; the rate is switched per run
    for k in ks:
        engines["eagle3", k] = LLM(spec=SpecConfig("eagle3", k, mode="fixed"), cache=cache)
        engines["free", k] = LLM(spec=SpecConfig("ngram", k, mode="fixed"), cache=cache)

    def answer(tokens: list[int], n: int) -> list[int]:  # plain decoding's continuation, n tokens at most
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        return off.generate([tokens], params)[0].token_ids

    tok = off.tokenizer
    warm = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say hello."}]))
    warm_answer = answer(warm, 16)
    for (kind, k), llm in engines.items():  # every engine through its verify path before timing
        eng = llm.engine
        if kind != "off":
            eng.drafter = OracleDrafts(eng.drafter if kind == "eagle3" else None, eng.model_config.vocab_size, answer)
            eng.drafter.rate, eng.drafter.answers = 0.5, {f"warm-{kind}-{k}": warm + warm_answer}
        run_one(llm, warm, 16, f"warm-{kind}-{k}")
    configs = [("off", 0, None)] + [("eagle3", k, None) for k in ks]
    configs += [(kind, k, r) for r in rates for kind in ("eagle3", "free") for k in ks]
    totals = {c: [0.0, 0, 0, 0] for c in configs}
    diverged = 0
    for i, text in enumerate(chat_prompts()[: args.prompts]):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        sec, plain, _, _ = run_one(off, ids, args.output_len, f"p{i}-off")  # the truth for this prompt
        totals[configs[0]] = [a + b for a, b in zip(totals[configs[0]], (sec, len(plain), 0, 0))]
        order, shift = configs[1:], i * (len(configs) - 1) // args.prompts  # rotated across the whole list
        for n, (kind, k, rate) in enumerate(order[shift:] + order[:shift]):
            eng = engines[kind, k].engine
            rid = f"p{i}-{kind}-{k}-{rate}-{n}"
            eng.drafter.rate, eng.drafter.answers = rate, {rid: ids + plain}
            sec, out, drafted, accepted = run_one(engines[kind, k], ids, args.output_len, rid)
            diverged += out != plain
            totals[kind, k, rate] = [a + b for a, b in zip(totals[kind, k, rate], (sec, len(out), drafted, accepted))]
        print(f"  prompt {i + 1}/{args.prompts} done", flush=True)
    base = totals[configs[0]][1] / totals[configs[0]][0]
    print(f"\n# one request at a time, {args.prompts} chat prompts, {args.output_len} greedy tokens (ignore_eos), "
          f"dtype {off.engine.dtype}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"configs interleaved per prompt; plain decoding {base:.1f} tok/s; {diverged} of "
          f"{args.prompts * (len(configs) - 1)} speculative runs left plain decoding's text at a near-tie, "
          f"the oracle answered again {sum(e.engine.drafter.reanswered for (kd, _), e in engines.items() if kd != 'off')} times")
    print("| drafter | " + " | ".join(f"K={k}: vs off (tokens/step)" for k in ks) + " | best |")
    print("|---" * (len(ks) + 2) + "|")
    for kind, rate in [("eagle3", None)] + [(kind, r) for r in rates for kind in ("eagle3", "free")]:
        cells, best = [], 0.0
        for k in ks:
            sec, toks, drafted, accepted = totals[kind, k, rate]
            ratio = toks / sec / base
            steps = toks - accepted  # one target token per step, plus the accepted drafts
            cells.append(f"{ratio:.2f}x ({toks / steps:.2f})")
            best = max(best, ratio)
        name = kind if rate is None else f"{kind}@{rate:g}"
        print(f"| {name} | " + " | ".join(cells) + f" | {best:.2f}x |")


if __name__ == "__main__":
    main()
