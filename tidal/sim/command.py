"""The `tidal sim` and `tidal tune` commands: arguments and handlers (argparse only at import)."""

from __future__ import annotations

import argparse
import json
import sys


def parse_concurrency(text: str) -> tuple[int, ...]:
    """'1,2,4,...,250' -> 1, 2, 4, 8, ..., 128, 250 (the ratio of the two values before '...'
    continues up to the value after it); plain lists are taken as given."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    out: list[int] = []
    for i, p in enumerate(parts):
        if p != "...":
            out.append(int(p))
            continue
        if len(out) < 2 or i + 1 >= len(parts) or out[-1] <= out[-2]:
            raise ValueError("'...' needs two increasing values before it and one after it")
        ratio, end = out[-1] / out[-2], int(parts[i + 1])
        while round(out[-1] * ratio) < end:
            out.append(round(out[-1] * ratio))
    if not out or min(out) < 1:
        raise ValueError("concurrency levels must be >= 1")
    return tuple(sorted(set(out)))


def _model_arguments(p: argparse.ArgumentParser) -> None:
    from tidal.sim.presets import HARDWARE, MODELS

    p.add_argument("--hardware", default="h100x8", choices=sorted(HARDWARE))
    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS))
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: every GPU of the server)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp8"], help="weight dtype")
    p.add_argument("--drafter", default="eagle3", choices=["eagle3", "eagle3-sglang", "eagle3-sglang-overlap", "none"],
                   help="draft cost: an EAGLE-3 head of the target's width run as tidal runs it, as SGLang does "
                        "(an extend forward after the verify, then K draft forwards), or with SGLang's overlap "
                        "schedule; or none (n-gram)")
    p.add_argument("--profile", default=None,
                   help="measured step times (CSV tokens,seqs,context,seconds or JSON) instead of the roofline")
    p.add_argument("--measured", default=None,
                   help="calibrate the roofline first on LABEL@CONCURRENCY=TOK_S points, e.g. off@1=92.6,eagle3@1=77.5")
    p.add_argument("--calibrate-k", type=int, default=3, help="K of the measured speculative points (eagle3@C = fixed:K)")
    p.add_argument("--acceptance", default="0.7",
                   help="per-position acceptance, e.g. 0.8,0.6,0.5 (P(draft i accepted | drafts < i were)), "
                   "one constant, or a saved /metrics page of tidal or vLLM to read it from")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=None, help="requests per level, at least C (default: 4 x concurrency, at least 8)")
    p.add_argument("--concurrency", default="1,2,4,...,256", help="levels, e.g. 1,2,4,...,250")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--spec-max-running", type=int, default=None, metavar="N",
                   help="cap the running batch of the fixed and schedule modes at N (SGLang's EAGLE default is 48 "
                        "unless --max-running-requests is set)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks of 16 tokens (default: what fits beside the weights; with --profile: enough for all)")
    p.add_argument("--seed", type=int, default=0)


def add_sim_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `tidal sim` options."""
    _model_arguments(p)
    p.add_argument("--speculation", default="off,fixed:3,adaptive",
                   help='modes to compare: off, fixed:K, adaptive[:K], schedule:"1-4:4,5-:0"')
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="K of a bare fixed or adaptive")
    p.add_argument("--calibrate", action="store_true", help="fit the roofline's constants to --measured, then sweep")
    p.add_argument("--explain", default=None, metavar="C[,C...]",
                   help="instead of the sweep: one decode step at each concurrency split into its terms (weights, "
                        "experts, attention, all-reduce, drafting, extend, overhead) for off and the fixed:K modes")
    p.add_argument("--scan-acceptance", default=None, metavar="A[,A...]",
                   help="instead of the sweep: calibrate on --measured and sweep off vs fixed:K (--calibrate-k) "
                        "once per constant per-position acceptance, e.g. 0.3,0.4,...; shows which acceptances "
                        "agree with what was observed at other concurrencies")
    p.add_argument("--json", default=None, help="write the records (and the model) to this JSON file")
    p.add_argument("--plot", default=None, help="write a PNG plot of tok/s vs concurrency")
    return p


def add_tune_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `tidal tune` options."""
    _model_arguments(p)
    p.add_argument("--from", dest="from_json", default=None,
                   help="a sweep's JSON (tidal sim --json or tidal bench) with off and fixed:K targets, instead of simulating")
    p.add_argument("--max-k", type=int, default=4, help="simulate off and fixed:1..max-k")
    p.add_argument("--method", default="eagle3", help="vLLM speculative method to name in the config")
    p.add_argument("--draft-model", default=None, help="draft model path or id to name in the emitted settings")
    return p


# ------------------------------------------------------------------ handlers


def _sweep_config(args, max_k: int):
    from tidal.config import SchedulerConfig
    from tidal.sim.simulator import AcceptanceModel
    from tidal.sim.sweep import SweepConfig

    return SweepConfig(parse_concurrency(args.concurrency), args.input_len, args.output_len, args.num_prompts,
                       AcceptanceModel.parse(args.acceptance),
                       SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens), args.num_blocks, 16, args.seed,
                       args.spec_max_running)


def _roofline(args, config):
    """The preset roofline the arguments name, and `config` with its KV blocks where unset."""
    from dataclasses import replace

    from tidal.sim.presets import HARDWARE, MODELS
    from tidal.sim.roofline import RooflineModel

    model = RooflineModel(HARDWARE[args.hardware], MODELS[args.model], args.tp, args.dtype, drafter=args.drafter)
    if config.num_blocks is None:
        config = replace(config, num_blocks=model.kv_capacity_tokens() // config.block_size)
    return model, config


def _step_model(args, config, calibrate: bool):
    """The roofline (calibrated when asked) or the measured profile; and its KV block count."""
    from tidal.sim.measured import MeasuredModel

    if args.profile:
        if calibrate:
            raise ValueError("--calibrate fits the roofline; it does not go with --profile")
        return MeasuredModel.load(args.profile), config
    model, config = _roofline(args, config)
    if calibrate:
        from tidal.sim.calibrate import calibrate as fit, parse_points

        if not args.measured:
            raise ValueError("--calibrate needs --measured points")
        cal = fit(model, parse_points(args.measured, args.calibrate_k), config)
        print("calibration (simulated vs measured):")
        print(cal.table())
        model = cal.model
    print(model.describe())
    return model, config


def _progress(record) -> None:
    print(f"  {record.target} @ {record.concurrency}: {record.output_tok_s:.1f} tok/s", file=sys.stderr, flush=True)


def run_sim(args) -> int:
    """`tidal sim`: print the sweep table (the bench's) and the crossovers; optionally JSON and a plot."""
    from tidal.sweeps.report import crossovers, format_table, plot, write_json
    from tidal.sim.simulator import parse_modes
    from tidal.sim.sweep import sweep

    modes = parse_modes(args.speculation, args.num_speculative_tokens)
    config = _sweep_config(args, max(m.max_k for m in modes))
    if args.scan_acceptance:
        return _scan(args, config)
    model, config = _step_model(args, config, args.calibrate or bool(args.measured))
    if args.explain:
        from tidal.sim.explain import explain
        from tidal.sim.roofline import RooflineModel

        if not isinstance(model, RooflineModel):
            raise ValueError("--explain splits the roofline's terms; a measured --profile has none")
        ks = [0] + sorted({m.max_k for m in modes if m.mode == "fixed"} or {args.num_speculative_tokens})
        for c in parse_concurrency(args.explain):
            print("\nSIMULATED (not measured): " + explain(model, c, ks, config.acceptance.curve, args.input_len,
                                                         args.output_len, args.spec_max_running))
        return 0
    print(f"acceptance per position: {args.acceptance}; {args.input_len} in / {args.output_len} out; "
          f"closed loop, {config.num_prompts or '4 x C (>= 8)'} requests per level")
    records = sweep(model, modes, config, progress=_progress)
    print("\nSIMULATED (not measured):")
    print(format_table(records))
    for target, c in crossovers(records).items():
        print(f"{target} vs {modes[0].label}: " + ("no crossover in this range" if c is None else f"crossover at concurrency {c}"))
    if args.json:
        write_json(args.json, records, {"simulated": True, "model": model.describe(), "command": " ".join(sys.argv)})
    if args.plot:
        plot(args.plot, records, title=f"SIMULATED: {model.describe().split(':')[0]}")
    return 0


def _scan(args, config) -> int:
    """`tidal sim --scan-acceptance`: one calibration and off vs fixed:K sweep per acceptance."""
    from tidal.sim.calibrate import parse_points
    from tidal.sim.scan import format_scan, parse_acceptances, scan_acceptance

    values = parse_acceptances(args.scan_acceptance)
    if args.profile or not args.measured:
        raise ValueError("--scan-acceptance calibrates the roofline: it needs --measured points and no --profile")
    model, config = _roofline(args, config)
    k = args.calibrate_k
    rows = scan_acceptance(model, parse_points(args.measured, k), config, k, values,
                           progress=lambda r: print(f"  acceptance {r.acceptance:.2f}: fitted", file=sys.stderr,
                                                    flush=True))
    print(f"SIMULATED (not measured): fixed:{k} tok/s over plain decoding's, calibrated on {args.measured} at "
          f"each acceptance; {args.input_len} in / {args.output_len} out; {model.describe().split(':')[0]}, "
          f"drafter {args.drafter}")
    print(format_scan(rows, k))
    return 0


def run_tune(args) -> int:
    """`tidal tune`: print the schedules as one JSON object."""
    from tidal.sim.simulator import parse_modes
    from tidal.sim.sweep import sweep
    from tidal.sim.tune import tune

    if args.from_json:
        from tidal.sweeps.report import read_json

        _, records = read_json(args.from_json)
    else:
        if not 1 <= args.max_k <= 15:
            raise ValueError("--max-k must be in 1..15")
        modes = parse_modes(",".join(["off"] + [f"fixed:{k}" for k in range(1, args.max_k + 1)]))
        config = _sweep_config(args, args.max_k)
        with _stdout_to_stderr():
            model, config = _step_model(args, config, bool(args.measured))
            records = sweep(model, modes, config, progress=_progress)
    print(json.dumps(tune(records, args.max_num_seqs, args.method, args.draft_model), indent=1))
    return 0


class _stdout_to_stderr:
    """Keeps stdout pure JSON for `tidal tune`: model descriptions go to stderr."""

    def __enter__(self):
        self._stdout, sys.stdout = sys.stdout, sys.stderr

    def __exit__(self, *exc):
        sys.stdout = self._stdout
