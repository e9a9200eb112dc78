"""What a longer draft saves over a request's whole life, against what one step's acceptance promises.

    python benchmarks/draft_lifetime.py [--method ngram] [--workload rewrite] [--ks 1,2,3,4]

Each request runs alone (greedy, `--output-len` tokens: the same text at every K, up to bf16 ties) with
speculation fixed at each K; counted, not timed: decode steps, drafts and accepted drafts over
the request's life, and per draft position the share of drafts accepted. The policy values the
K-th draft of a step at its acceptance (the tokens it adds to this step); over a life, going from
K-1 to K drafts saves (steps at K-1 - steps at K) / (drafts at K - drafts at K-1) steps per extra
draft. The two agree when acceptance does not depend on what was drafted before (each step a
fresh chance); they part when drafting further now only takes tokens that the next step would
have drafted anyway, as with a prompt lookup copying a phrase of limited length.
"""

from __future__ import annotations

import argparse

from tidal import LLM, SamplingParams
from tidal.config import SpecConfig
from tidal.datasets import chat_prompts, rewrite_prompts


def lifetime(llm: LLM, prompts: list[list[int]], output_len: int, k: int) -> tuple[int, int, int, list[int], list[int]]:
    """Decode steps, drafts, accepted drafts, and drafts / accepted per position (of `k`),
    summed over `prompts`, each run alone."""
    eng = llm.engine
    steps = drafted = accepted = 0
    per_drafted, per_accepted = [0] * k, [0] * k
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        eng.add_request(f"life-{i}", prompt, params)
        first = True
        while eng.has_unfinished():
            eng.step()
            if first:  # the prefill step: its token is not a decode step
                first = False
                continue
            spec = eng.last_step_stats.spec
            steps += 1
            drafted += spec.num_drafted
            accepted += spec.num_accepted
            for pos, (d, a) in enumerate(zip(spec.drafted_per_position, spec.accepted_per_position)):
                per_drafted[pos] += d
                per_accepted[pos] += a
    return steps, drafted, accepted, per_drafted, per_accepted


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="ngram", choices=["ngram", "eagle3"])
    ap.add_argument("--workload", default="rewrite", choices=["chat", "rewrite"])
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    texts = (rewrite_prompts() if args.workload == "rewrite" else chat_prompts())[:args.num_prompts]
    results, prompts = {}, None
    for k in ks:
        llm = LLM(spec=SpecConfig(args.method, k, mode="fixed"))
        if prompts is None:
            tok = llm.tokenizer
            prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
        results[k] = lifetime(llm, prompts, args.output_len, k)
        del llm
    print(f"\n# {args.method}, {len(texts)} {args.workload} prompts run alone, {args.output_len} greedy tokens each")
    print("| K | decode steps | drafts | accepted | K-th draft accepted (one step's promise) "
          "| steps saved per extra draft vs K-1 (over the life) |")
    print("|---|---|---|---|---|---|")
    prev = None
    for k in ks:
        steps, drafted, accepted, per_d, per_a = results[k]
        promise = f"{per_a[k - 1] / per_d[k - 1]:.2f}" if per_d[k - 1] else "-"
        saved = "-"
        if prev is not None and drafted > prev[1]:
            saved = f"{(prev[0] - steps) / (drafted - prev[1]):.2f}"
        print(f"| {k} | {steps} | {drafted} | {accepted} | {promise} | {saved} |")
        prev = results[k]


if __name__ == "__main__":
    main()
