"""`tidal bench`'s command-line arguments (argparse only: the CLI imports it at every start)."""

from __future__ import annotations

import argparse


def add_bench_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--target", action="append", metavar="NAME=URL",
                   help="an OpenAI-compatible server to measure; repeat for each (the first is the baseline)")
    b.add_argument("--launch", default=None, metavar="MODES",
                   help="start local tidal servers in these modes, e.g. off,fixed:4,adaptive (after any --target)")
    b.add_argument("--launch-args", default=None, help='extra `tidal serve` arguments, e.g. "--dtype float32"')
    b.add_argument("--launch-threads", type=int, default=None,
                   help="compute threads per launched server (default: all cores but one)")
    b.add_argument("--keep-servers", action="store_true",
                   help="with --launch and --repeats: one server per mode for every pass (default: fresh "
                        "servers for each pass, as one process's speed can differ from the next one's)")
    b.add_argument("--launch-timeout", type=float, default=300.0, help="seconds a launched server has to get ready")
    b.add_argument("--concurrency", default="1,2,4,8,16,32,64,128", help="levels: requests kept in flight")
    b.add_argument("--num-prompts", type=int, default=None,
                   help="requests per target per level (at least C; default max(8, 2 x C))")
    b.add_argument("--output-len", type=int, default=128, help="tokens asked of every request (ignore_eos)")
    b.add_argument("--request-rate", type=float, default=None,
                   help="open loop: Poisson arrivals at this many requests/s, at most C in flight")
    b.add_argument("--dataset", default="chat", choices=["chat", "rewrite", "mixed", "random", "sharegpt"],
                   help="chat: the shipped chat prompts; rewrite: the shipped repetition-heavy ones; mixed: the "
                        "two taking turns; random: --input-len random tokens; sharegpt: --dataset-path")
    b.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file (first human turn of each)")
    b.add_argument("--input-len", type=int, default=256, help="prompt tokens of the random dataset")
    b.add_argument("--tokenizer", default=None, help="model whose tokenizer sizes random prompts (default: bundled)")
    b.add_argument("--endpoint", default=None, choices=["chat", "completions"],
                   help="default: completions for random prompts, chat otherwise")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--warmup", type=int, default=2, help="unmeasured requests per target before the sweep")
    b.add_argument("--repeats", type=int, default=1,
                   help="passes over the whole sweep, the targets taking turns at each level; each record "
                        "pools its rounds (evens out a machine whose speed drifts)")
    b.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--api-key", default=None, help="bearer token for the targets (default: $TIDAL_API_KEY)")
    b.add_argument("--output", default=None, metavar="PREFIX",
                   help="write PREFIX.json, .csv, .png (default: bench-results/bench-<UTC time>)")
    b.add_argument("--journal", default=None, metavar="FILE.md", help="prepend this run to a Markdown journal")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
