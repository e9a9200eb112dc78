"""Command line: `tidal generate`."""

from __future__ import annotations

import argparse
import logging
import sys

from tidal.bench.arguments import add_bench_arguments
from tidal.config import DTYPES, STARTUP_PROFILES, WEIGHT_LAYOUTS


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file or a HF Llama directory (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--speculation", default="adaptive", choices=["off", "fixed", "adaptive"],
                   help="adaptive: the policy picks 0..K drafts per request each step; fixed: always K")
    p.add_argument("--speculative-method", default="auto", choices=["auto", "ngram", "eagle3"],
                   help="auto: eagle3 with the shipped head on the bundled model, ngram otherwise")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="K: fixed draft length, or the most the adaptive policy may choose (default 4)")
    p.add_argument("--spec-schedule", default=None,
                   help='batch size to K, vLLM-style, e.g. "1-4:4,5-16:2,17-:0" (replaces --speculation)')
    p.add_argument("--draft-model", default=None, help="EAGLE-3 head directory (HF layout)")
    p.add_argument("--startup-profile", default=None, choices=STARTUP_PROFILES,
                   help="adaptive speculation's start-up timing of steps: auto reuses the one stored for "
                        "this set-up or measures and stores it, if-cached never measures (default: "
                        "auto for serve, if-cached for generate)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly; by default decode and verify steps of up to 64 tokens run "
                        "compiled (the first start with a model, dtype and thread count answers eagerly and "
                        "compiles them in the background, minutes each; later starts load them from the cache "
                        "in about a second)")
    p.add_argument("--weight-layouts", default="auto", choices=WEIGHT_LAYOUTS,
                   help="auto: also keep each weight in the narrower layouts that time faster on this CPU "
                        "(measured at the first start, cached); dense: the dtype's dense weights only")
    p.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                   help="GiB for the paged KV cache (as vLLM's VLLM_CPU_KVCACHE_SPACE; default 2); pages are "
                        "taken from the OS only as requests fill them")
    p.add_argument("--wait-compiled", action="store_true",
                   help="on a first start, be ready only once every compiled step is (as benchmarks want)")
    p.add_argument("--step-log", default=None,
                   help="append every measured step and draft proposal to this CSV (tidal sim --profile reads it)")


def _engine_kwargs(args) -> dict:
    from tidal.config import CacheConfig, SpecConfig

    if args.speculation == "off" and args.spec_schedule is None:
        spec = SpecConfig()
    else:
        method = args.speculative_method
        if method == "auto":
            method = "eagle3" if args.model is None or args.draft_model else "ngram"
        mode = "schedule" if args.spec_schedule else args.speculation
        spec = SpecConfig(method, args.num_speculative_tokens or 4, draft_model=args.draft_model,
                          mode=mode, schedule=args.spec_schedule)
    profile = args.startup_profile or ("auto" if args.command == "serve" else "if-cached")
    if args.kv_cache_memory is not None and not args.kv_cache_memory > 0:
        raise ValueError(f"--kv-cache-memory must be a positive number of GiB, got {args.kv_cache_memory}")
    cache = CacheConfig() if args.kv_cache_memory is None else CacheConfig(kv_cache_bytes=int(args.kv_cache_memory * 2**30))
    return dict(cache=cache, dtype=args.dtype, device=args.device, spec=spec, step_log=args.step_log, startup_profile=profile,
                enforce_eager=args.enforce_eager, wait_compiled=args.wait_compiled,
                weight_layouts=args.weight_layouts)


def _generate(args) -> int:
    from tidal import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    llm = LLM(args.model, **_engine_kwargs(args))
    if args.no_chat:
        out = llm.generate(args.prompt, params)[0]
    else:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    print(out.text)
    runner = llm.engine.runner
    if not runner.land_compiled():
        print(f"tidal: compiling the steps {', '.join(runner.compiling)} goes on in the background (minutes); "
              "later starts load them", file=sys.stderr)
    return 0


def _serve(args) -> int:
    import os
    from pathlib import Path

    from tidal.config import EngineConfig, SchedulerConfig
    from tidal.engine.llm_engine import LLMEngine
    from tidal.models.loader import DEFAULT_MODEL_FILE
    from tidal.server import build_app, serve
    from tidal.server.async_engine import ComputeThread

    if args.max_waiting < 1 or args.shutdown_timeout < 0:
        raise ValueError("--max-waiting must be >= 1 and --shutdown-timeout >= 0")
    api_key = args.api_key or os.environ.get("TIDAL_API_KEY") or None
    name = args.served_model_name or (args.model and Path(args.model).name) or DEFAULT_MODEL_FILE.split(".")[0]
    scheduler = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    config = EngineConfig(**{"model": args.model, **_engine_kwargs(args), "scheduler": scheduler})
    compute = ComputeThread()  # builds the engine and steps it: all torch work on one thread
    engine = compute.submit(LLMEngine, config).result()
    app = build_app(engine, model_name=name, api_key=api_key, max_waiting=args.max_waiting, compute=compute)
    serve(app, args.host, args.port, shutdown_grace_s=args.shutdown_timeout,
          log_level=args.log_level, access_log=not args.no_access_log)
    return 0


def _train_drafter(args) -> int:
    import json
    from pathlib import Path

    from tidal.train.eagle3 import train_drafter

    prompts = json.loads(Path(args.prompts).read_text()) if args.prompts else None
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train_log.txt", "w") as f:
        def log(line: str) -> None:
            print(line, flush=True)
            f.write(line + "\n")
            f.flush()

        log("tidal train-drafter " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                               if k not in ("func", "command") and v is not None))
        train_drafter(str(out), model=args.model, prompts=prompts, max_tokens=args.max_tokens,
                      draft_vocab_size=args.draft_vocab_size, epochs=args.epochs, num_steps=args.num_steps,
                      lr=args.lr, batch_tokens=args.batch_tokens, seed=args.seed, dtype=args.dtype,
                      data=args.data, sampled_answers=args.sampled_answers,
                      answer_temperature=args.answer_temperature, log=log)
    return 0


def _bench(args) -> int:
    from tidal.bench.run import main as run_bench

    try:
        return run_bench(args)
    except RuntimeError as e:  # a launched server that did not start
        print(f"tidal: error: {e}", file=sys.stderr)
        return 1


def _sim(args) -> int:
    from tidal.sim.command import run_sim

    return run_sim(args)


def _tune(args) -> int:
    from tidal.sim.command import run_tune

    return run_tune(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tidal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="answer one prompt with the chat template applied")
    g.add_argument("prompt")
    _engine_args(g)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--no-chat", action="store_true", help="send the prompt as raw text")
    g.set_defaults(func=_generate)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (default: $TIDAL_API_KEY)")
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model's file name)")
    s.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one running batch")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048, help="most tokens in one engine step")
    s.add_argument("--max-waiting", type=int, default=1024, help="requests queued before the first token; beyond it: 503")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get after SIGTERM")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--no-access-log", action="store_true")
    s.set_defaults(func=_serve)
    t = sub.add_parser("train-drafter", help="self-distil an EAGLE-3 head for the target (CPU is fine)")
    t.add_argument("--output", required=True, help="directory for config.json, model.safetensors, train_log.txt")
    t.add_argument("--model", default=None, help="target: a .gguf file or a HF Llama directory (default: bundled)")
    t.add_argument("--dtype", default="auto", choices=DTYPES, help="the target's dtype while it answers")
    t.add_argument("--prompts", default=None, help="JSON list of prompts (default: the shipped training set)")
    t.add_argument("--max-tokens", type=int, default=160, help="longest target answer per prompt")
    t.add_argument("--draft-vocab-size", type=int, default=8192)
    t.add_argument("--epochs", type=int, default=3)
    t.add_argument("--num-steps", type=int, default=6, help="training-time-test steps (chain length trained)")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--batch-tokens", type=int, default=4096, help="tokens per optimiser step")
    t.add_argument("--data", default=None,
                   help="file for the target's answers and features: written once, reused by later runs")
    t.add_argument("--sampled-answers", type=int, default=0,
                   help="answers per prompt sampled at --answer-temperature, besides the greedy one (more data)")
    t.add_argument("--answer-temperature", type=float, default=0.7)
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=_train_drafter)
    b = sub.add_parser("bench", help="concurrency sweep over OpenAI-compatible servers, side by side")
    add_bench_arguments(b)
    b.set_defaults(func=_bench)
    from tidal.sim.command import add_sim_arguments, add_tune_arguments  # argparse and presets only

    add_sim_arguments(sub.add_parser("sim", help="simulate the scheduler and speculation policy on GPU servers")
                      ).set_defaults(func=_sim)
    add_tune_arguments(sub.add_parser("tune", help="batch-size-to-K schedules for tidal, vLLM and SGLang")
                       ).set_defaults(func=_tune)
    args = parser.parse_args(argv)
    if args.command in ("generate", "serve"):  # start-up phases and the server's own lines
        level = args.log_level.upper() if args.command == "serve" else logging.INFO
        logging.basicConfig(level=level, format="%(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # InvalidParameter and bad config values
        print(f"tidal: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
