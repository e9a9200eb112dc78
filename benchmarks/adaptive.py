"""Speculation off vs fixed K vs adaptive, by concurrency, on the bundled model (offline engine).

    python benchmarks/adaptive.py [--concurrency 1,2,4,8,16,32,64,128] [--output-len 128]
                                  [--modes off,fixed:2,fixed:4,adaptive:4] [--method eagle3]
                                  [--workload chat|rewrite|mixed] [--modes ...,schedule,oracle:4]

At each concurrency C, every mode serves the same requests (shipped chat prompts, or the
repetition-heavy rewrite prompts where an n-gram drafter has something to copy; greedy,
`output-len` tokens each) with C of them in flight at all times (closed loop). A first round of C
requests with staggered lengths brings each engine to a steady state (see ClosedLoop); then
`max(C, min-requests)` requests are measured. All modes' engines are loaded at once and run
interleaved, one engine step each in turn; a mode's tok/s is its output tokens over the time
spent inside its own steps (drafting and policy included). So a slow spell of this noisy machine
slows every mode alike instead of whichever ran then (run one after another, two modes doing the
very same work differed by 1.4x). `oracle:K` (n-gram): fixed:K with the drafts the target
would reject cut off in advance (see AcceptedOnly). Prints output tok/s per mode and each
mode's ratio to the best of the others, the adaptive policy's mean chosen K and acceptance, and
the crossover.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time

import torch

from tidal import LLM, SamplingParams
from tidal.config import SpecConfig
from tidal.datasets import chat_prompts, mixed_prompts, rewrite_prompts
from tidal.sim.tune import best_k, k_of, schedule_ranges, tidal_schedule
from tidal.speculative.ngram import NgramDrafter


def spec_for(mode: str, method: str) -> SpecConfig:
    """'off', 'fixed:K', 'adaptive:K' (K = the most it may choose), 'schedule:1-4:4,5-:0',
    'oracle:K' (fixed:K with AcceptedOnly drafts)."""
    name, _, arg = mode.partition(":")
    if name == "off":
        return SpecConfig()
    if name == "schedule":
        return SpecConfig(method, 15, mode="schedule", schedule=arg)
    return SpecConfig(method, int(arg or 4), mode="fixed" if name == "oracle" else name)


class AcceptedOnly(NgramDrafter):
    """n-gram continuations cut to the tokens the target's greedy output has there (`references`:
    prompt -> prompt and greedy output, from a plain run), so no draft is rejected: what choosing
    each request's K with foresight would give this drafter, the ceiling of any policy's choice
    (a policy could still do better only by declining accepted drafts where a step costs more)."""

    def __init__(self, references: dict[tuple[int, ...], list[int]]):
        super().__init__()
        self.references = references
        self.diverged: set[str] = set()  # requests whose output left the reference (bf16: batch shapes)

    def available(self, seqs, max_k: int) -> list[int]:
        super().available(seqs, max_k)
        for s in seqs:
            length, continuation, grade = self._found[s.request_id]
            reference = self.references[tuple(s.prompt_token_ids)]
            if reference[:s.num_tokens] != s.token_ids:
                self.diverged.add(s.request_id)
            truth = reference[s.num_tokens:]
            same = next((i for i, (a, b) in enumerate(zip(continuation, truth)) if a != b),
                        min(len(continuation), len(truth)))
            self._found[s.request_id] = (length, continuation[:same], grade)
        return [len(self._found[s.request_id][1]) for s in seqs]


def with_oracle(engines: dict[str, LLM], prompts: list[list[int]], output_len: int, dtype: str) -> None:
    """Give the oracle:K engines AcceptedOnly drafters, from one plain greedy run of `prompts`."""
    oracles = [llm for m, llm in engines.items() if m.startswith("oracle")]
    if not oracles:
        return
    plain = LLM(dtype=dtype)
    outputs = plain.generate(prompts, SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True))
    references = {tuple(p): p + o.token_ids for p, o in zip(prompts, outputs)}
    del plain, outputs
    gc.collect()  # its weights and cache, before the sweep's engines run
    for llm in oracles:
        llm.engine.drafter = AcceptedOnly(references)


class ClosedLoop:
    """Keeps `concurrency` requests in flight on one engine, one engine step per `step()` call,
    and measures its steady state. The first `concurrency` requests get staggered lengths
    (output_len * i / C for i = 1..C), so requests end one at a time as in a server that has been
    running a while, not all in the same step: started together at one length, plain decoding
    finishes a whole batch in one step while speculation, whose requests advance unevenly, ends
    with a tail at ever lower concurrency. Measured with one such wave of 64 rewrite requests
    (n-gram, throwaway per-step timing): adaptive lost 4% to plain decoding overall while its
    steps at the full batch emitted 7% more tokens per second than plain decoding's (265 vs 248)
    and its steps at 32-63 requests 204. The window opens once `concurrency` requests have
    finished and closes when `num_requests` more have; every request then running is aborted.
    Counted: the output tokens emitted in the window (a running request's too) over the time
    spent inside this engine's steps in it."""

    def __init__(self, llm: LLM, prompts: list[list[int]], concurrency: int, num_requests: int, output_len: int):
        self.eng, self.prompts, self.concurrency, self.num_requests = llm.engine, prompts, concurrency, num_requests
        self.output_len = output_len
        self.started = self.done = self.tokens = self.drafted = self.accepted = 0
        self.seconds = 0.0
        self.live: dict[str, int] = {}  # request id -> output tokens seen so far
        self.hist0: dict[int, int] | None = None  # the chosen-K histogram when the window opened

    @property
    def measuring(self) -> bool:
        return self.hist0 is not None

    @property
    def finished(self) -> bool:
        return self.done >= self.concurrency + self.num_requests

    def _admit(self) -> None:
        while len(self.live) < self.concurrency:
            i = self.started
            n = self.output_len if i >= self.concurrency else max(1, self.output_len * (i + 1) // self.concurrency)
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            self.eng.add_request(f"r{i}", self.prompts[i % len(self.prompts)], params)
            self.live[f"r{i}"] = 0
            self.started += 1

    def step(self) -> None:
        t0 = time.perf_counter()
        self._admit()
        before = self.eng.last_step_stats
        outputs = self.eng.step()
        stats = self.eng.last_step_stats
        emitted = 0
        for out in outputs:
            emitted += len(out.token_ids) - self.live[out.request_id]
            self.live[out.request_id] = len(out.token_ids)
            if out.finished:
                del self.live[out.request_id]
                self.done += 1
        if self.measuring:
            self.seconds += time.perf_counter() - t0
            self.tokens += emitted
            if stats is not before:
                self.drafted += stats.spec.num_drafted
                self.accepted += stats.spec.num_accepted
        elif self.done >= self.concurrency:
            self.hist0 = dict(self.eng.k_histogram)
        if self.finished:
            for rid in self.live:
                self.eng.abort(rid)
            self.live.clear()

    def result(self):
        """(seconds, output tokens, drafted, accepted, chosen-K histogram), all in the window."""
        hist = {k: v - self.hist0.get(k, 0) for k, v in self.eng.k_histogram.items()}
        return self.seconds, self.tokens, self.drafted, self.accepted, hist


def interleaved(loops: list[ClosedLoop]) -> None:
    """Step the engines in turn, one step each, the first one changing every round, until all are
    done: a slow spell of this machine lands on every mode alike, not on whichever ran then."""
    rounds = 0
    while not all(loop.finished for loop in loops):
        k = rounds % len(loops)
        for loop in loops[k:] + loops[:k]:
            if not loop.finished:
                loop.step()
        rounds += 1


def run_levels(engines: dict[str, LLM], prompts, levels: list[int], args) -> dict:
    """(mode, concurrency) -> ClosedLoop.result(), every mode's engine interleaved at each level."""
    results = {}
    for c in levels:
        loops = {m: ClosedLoop(llm, prompts, c, max(c, args.min_requests), args.output_len) for m, llm in engines.items()}
        interleaved(list(loops.values()))
        for m, loop in loops.items():
            results[m, c] = loop.result()
        print(f"  C={c}: " + ", ".join(f"{m} {results[m, c][1] / results[m, c][0]:.1f}" for m in engines)
              + " tok/s", flush=True)
    return results


def derived_schedule(rate: dict, modes: list[str], levels: list[int]) -> str:
    """The batch-size -> K schedule `tidal tune` derives from the off and fixed:K runs: at each
    concurrency the K with the most tok/s, as a vLLM user's num_speculative_tokens_per_batch_size."""
    records = [{"target": m, "concurrency": c, "output_tok_s": rate[m, c]} for m in modes for c in levels
               if k_of(m) is not None]
    return tidal_schedule(schedule_ranges(best_k(records), max(levels)))


def print_table(results: dict, modes: list[str], levels: list[int]) -> None:
    rate = {key: r[1] / r[0] for key, r in results.items()}
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--modes", default="off,fixed:2,fixed:4,adaptive:4",
                    help="off, fixed:K, adaptive:K, schedule:RANGES, or a bare `schedule`: the schedule "
                         "derived from this run's off and fixed:K results, run in a second pass beside "
                         "the adaptive modes; oracle:K (n-gram only): fixed:K with every draft the "
                         "target would reject cut off, the ceiling of choosing K per request")
    ap.add_argument("--method", default="eagle3", choices=["eagle3", "ngram"])
    ap.add_argument("--workload", default="chat", choices=["chat", "rewrite", "mixed"],
                    help="mixed: chat and rewrite prompts taking turns")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", default=None, help="also write the records here")
    args = ap.parse_args()
    modes = args.modes.split(",")
    derive = "schedule" in modes
    first = [m for m in modes if m != "schedule"]
    if derive and not any(k_of(m) is not None for m in first):
        ap.error("a bare `schedule` mode derives from off / fixed:K modes: name some")
    if any(m.startswith("oracle") for m in first) and args.method != "ngram":
        ap.error("oracle:K cuts n-gram drafts: use it with --method ngram")
    levels = [int(c) for c in args.concurrency.split(",")]
    engines = {m: LLM(dtype=args.dtype, spec=spec_for(m, args.method)) for m in first}
    tok = next(iter(engines.values())).tokenizer
    texts = {"chat": chat_prompts, "rewrite": rewrite_prompts, "mixed": mixed_prompts}[args.workload]()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in texts]
    with_oracle(engines, prompts, args.output_len, args.dtype)
    interleaved([ClosedLoop(llm, prompts, 2, 2, 8) for llm in engines.values()])  # warm up
    results = run_levels(engines, prompts, levels, args)
    rate = {key: r[1] / r[0] for key, r in results.items()}
    for m, llm in engines.items():
        if isinstance(llm.engine.drafter, AcceptedOnly) and llm.engine.drafter.diverged:
            print(f"{m}: {len(llm.engine.drafter.diverged)} requests left their reference output (batch-shape "
                  "numerics), so some of its drafts were cut wrongly: use --dtype float32")
    dtype = next(iter(engines.values())).engine.dtype
    print(f"\n# {args.method}, {args.output_len} greedy tokens per request, shipped {args.workload} prompts, "
          f"closed loop; dtype {dtype}, torch {torch.__version__}, {platform.processor() or platform.machine()}")
    print_table(results, first, levels)
    fixed = [m for m in first if m.startswith("fixed")]
    if "off" in first and fixed:
        cross = next((c for c in levels if rate["off", c] >= max(rate[f, c] for f in fixed)), None)
        print(f"\ncrossover: plain decoding first beats every fixed K at concurrency {cross}")
    records = [{"mode": m, "concurrency": c, "seconds": r[0], "output_tokens": r[1], "drafted": r[2],
                "accepted": r[3], "chosen_k": r[4]} for (m, c), r in results.items()]
    if derive:
        schedule = derived_schedule(rate, first, levels)
        print(f"\nschedule derived from the off / fixed:K runs: {schedule}; second pass beside the adaptive modes")
        second = {"schedule": LLM(dtype=args.dtype, spec=spec_for("schedule:" + schedule, args.method))}
        second.update({m: engines[m] for m in first if m.startswith("adaptive")})
        interleaved([ClosedLoop(llm, prompts, 2, 2, 8) for llm in second.values()])
        again = run_levels(second, prompts, levels, args)
        print_table(again, list(second), levels)
        records += [{"mode": m, "concurrency": c, "pass": 2, "schedule": schedule, "seconds": r[0],
                     "output_tokens": r[1], "drafted": r[2], "accepted": r[3], "chosen_k": r[4]}
                    for (m, c), r in again.items()]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
