"""`tidal bench`: parse the targets and the dataset, run the sweep (launching local servers if
asked), and write the table, JSON, CSV, plot and journal, also for a sweep cut short."""

from __future__ import annotations

import asyncio
import os
import platform
import shlex
import signal
import sys
from contextlib import ExitStack
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from tidal.version import __version__
from tidal.bench.sweep import SweepConfig, Target, sweep
from tidal.sweeps import report
from tidal.sweeps.records import BenchRecord

EXIT_INTERRUPTED = 130


def parse_targets(specs: list[str]) -> list[Target]:
    """`NAME=URL` (or a bare URL, named by its host:port) for each --target."""
    targets = []
    for spec in specs:
        name, sep, url = spec.partition("=")
        if not sep:
            name, url = spec.split("://", 1)[-1].rstrip("/"), spec
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--target {spec!r}: expected NAME=http://HOST:PORT")
        targets.append(Target(name, url.rstrip("/")))
    return targets


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--concurrency {text!r}: expected whole numbers like 1,2,4,8") from None
    if not levels or min(levels) < 1:
        raise ValueError("--concurrency: every level must be >= 1")
    return levels


def load_prompts(args, cfg: SweepConfig) -> list[str]:
    """The prompt texts of the chosen dataset; random ones are token-exact for the tokenizer,
    one per request of the largest level."""
    from tidal import datasets
    from tidal.models.loader import load_tokenizer

    shipped = {"chat": datasets.chat_prompts, "rewrite": datasets.rewrite_prompts, "mixed": datasets.mixed_prompts}
    if args.dataset in shipped:
        return shipped[args.dataset]()
    if args.dataset == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset sharegpt needs --dataset-path FILE.json")
        return datasets.sharegpt_prompts(args.dataset_path)
    tokenizer, vocab_size = load_tokenizer(args.tokenizer)
    num = max(cfg.num_requests(c) for c in cfg.concurrency)
    return datasets.random_prompts(tokenizer, vocab_size, num, args.input_len, args.seed)


def machine_info() -> dict:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = None
    return {"platform": platform.platform(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch}


def command_line(args) -> str:
    """The command as typed, rebuilt from the arguments that differ from their defaults."""
    import argparse

    from tidal.bench.arguments import add_bench_arguments

    fresh = argparse.ArgumentParser()
    add_bench_arguments(fresh)
    defaults = vars(fresh.parse_args([]))
    parts = ["tidal", "bench"]
    for key, value in vars(args).items():
        if key not in defaults or key == "api_key" or value == defaults[key]:
            continue
        flag = "--" + key.replace("_", "-")
        values = value if isinstance(value, list) else [value]
        parts += [flag] if value is True else [x for v in values for x in (flag, str(v))]
    return shlex.join(parts)


def main(args) -> int:
    """Run `tidal bench`; 0 when done, 130 when interrupted by Ctrl-C or SIGTERM (what was
    measured is written either way)."""
    if not args.target and not args.launch:
        raise ValueError("give at least one --target NAME=URL or --launch MODES")
    _check_numbers(args)
    targets = parse_targets(args.target or [])
    launch_modes = [m for m in (args.launch or "").split(",") if m]
    names = [t.name for t in targets] + launch_modes
    if len(set(names)) != len(names):
        raise ValueError(f"target names must differ: {names}")
    cfg = _sweep_config(args)
    prompts = load_prompts(args, cfg)
    when = datetime.now(timezone.utc)
    prefix = Path(args.output or f"bench-results/bench-{when:%Y%m%d-%H%M%S}")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    meta = {"tidal_version": __version__, "created": when.isoformat(timespec="seconds"),
            "command": command_line(args), "config": _config_record(args, cfg), "machine": machine_info()}
    records: list[BenchRecord] = []
    stopped = None  # "interrupted" (Ctrl-C, SIGTERM) or "failed": the outputs say the run is incomplete
    previous = signal.signal(signal.SIGTERM, _interrupt)  # launched servers must not outlive us
    try:
        with ExitStack() as stack:
            pass_targets = None
            if launch_modes:
                from tidal.bench.launch import launched

                servers = stack.enter_context(launched(
                    launch_modes, shlex.split(args.launch_args or ""), prefix.parent / f"{prefix.name}-logs",
                    args.launch_threads, args.launch_timeout))
                pass_targets = _launching(targets, servers, not args.keep_servers, meta)
            meta["targets"] = {t.name: t.url for t in targets}
            _run_sweep(targets, prompts, cfg, records, prefix, meta, args.no_progress, pass_targets, len(names))
    except KeyboardInterrupt:
        stopped = "interrupted"
        print("\ninterrupted: writing what was measured so far", file=sys.stderr)
    except BaseException:
        stopped = "failed"
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        _write_outputs(records, names, prefix, meta, args.journal, when, stopped)
    return EXIT_INTERRUPTED if stopped else 0


def _launching(remote: list[Target], servers, fresh: bool, meta: dict):
    """The sweep's `pass_targets`: `remote` plus the launched servers, started before the first
    pass and, when `fresh`, again before every later one."""
    launched: list[Target] = []

    async def pass_targets(rep: int) -> list[Target]:
        if rep == 0 or fresh:
            again = " afresh" if rep else ""
            print(f"starting tidal serve{again}: {', '.join(servers.modes)} (one at a time)", file=sys.stderr)
            launched[:] = await servers.start()
            meta["targets"] = {t.name: t.url for t in remote + launched}
        return remote + launched

    return pass_targets


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def _sweep_config(args) -> SweepConfig:
    return SweepConfig(
        concurrency=parse_levels(args.concurrency), output_len=args.output_len,
        endpoint=args.endpoint or ("completions" if args.dataset == "random" else "chat"),
        num_prompts=args.num_prompts, request_rate=args.request_rate, temperature=args.temperature,
        timeout_s=args.timeout, warmup=args.warmup, repeats=args.repeats, seed=args.seed,
        api_key=args.api_key or os.environ.get("TIDAL_API_KEY") or None)


def _config_record(args, cfg: SweepConfig) -> dict:
    """The sweep's settings as recorded with its results (no API key)."""
    return {"concurrency": cfg.concurrency, "num_prompts": args.num_prompts, "output_len": cfg.output_len,
            "request_rate": cfg.request_rate, "dataset": args.dataset, "dataset_path": args.dataset_path,
            "input_len": args.input_len if args.dataset == "random" else None, "endpoint": cfg.endpoint,
            "temperature": cfg.temperature, "warmup": cfg.warmup, "repeats": cfg.repeats, "seed": cfg.seed,
            "launch": args.launch, "launch_args": args.launch_args, "keep_servers": args.keep_servers}


def _path(prefix: Path, ext: str) -> Path:
    return prefix.with_name(prefix.name + ext)  # not with_suffix: a prefix may contain dots


def _check_numbers(args) -> None:
    for flag, value, low in (("--output-len", args.output_len, 1), ("--num-prompts", args.num_prompts, 1),
                             ("--launch-threads", args.launch_threads, 1), ("--warmup", args.warmup, 0),
                             ("--repeats", args.repeats, 1),
                             ("--input-len", args.input_len, 1)):
        if value is not None and value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    for flag, value in (("--request-rate", args.request_rate), ("--timeout", args.timeout),
                        ("--launch-timeout", args.launch_timeout)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value}")


def _run_sweep(targets, prompts, cfg, records, prefix: Path, meta: dict, no_progress: bool, pass_targets,
               num_targets: int) -> None:
    from tqdm import tqdm

    total = num_targets * cfg.repeats * sum(cfg.num_requests(c) for c in cfg.concurrency)
    with tqdm(total=total, unit="req", disable=True if no_progress else None, file=sys.stderr) as bar:
        shown = [""]

        def on_request(label: str) -> None:
            if shown[0] != label:
                shown[0] = label
                bar.set_description(label)
            bar.update()

        def on_record(r: BenchRecord) -> None:  # saved as each record completes (with --repeats, in the last pass)
            errors = f", {r.errors} errors: {r.error}" if r.errors else ""
            tqdm.write(f"{r.target} C={r.concurrency}: {r.output_tok_s:.1f} tok/s, TTFT p50 "
                       f"{r.ttft_ms['p50'] or 0:.0f} ms, TPOT p50 {r.tpot_ms['p50'] or 0:.1f} ms{errors}",
                       file=sys.stderr)
            report.write_json(_path(prefix, ".json"), records, {**meta, "complete": False})
            report.write_csv(_path(prefix, ".csv"), records)

        if asyncio.run(_stoppable(sweep(targets, prompts, cfg, records, on_request, on_record, pass_targets))):
            raise KeyboardInterrupt


async def _stoppable(coro) -> bool:
    """Run `coro`; True if SIGINT or SIGTERM cancelled it. The signal is handled inside the event
    loop, which cancels the sweep between two of its steps, so open connections close cleanly. A
    handler raising KeyboardInterrupt wherever the signal lands (what this replaced, for SIGTERM)
    could land inside httpx's connection pool: 1 of 14 SIGTERMs left asyncio's clean-up waiting
    for ever. A second signal raises KeyboardInterrupt at once (a sweep that does not stop). A
    SIGINT this process was started ignoring (a shell's background job) stays ignored."""
    loop, task, stopped = asyncio.get_running_loop(), asyncio.current_task(), []
    signals = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not signal.SIG_IGN]
    before = {s: signal.getsignal(s) for s in signals}

    def stop() -> None:
        if stopped:
            raise KeyboardInterrupt
        stopped.append(True)
        task.cancel()

    for s in signals:
        loop.add_signal_handler(s, stop)
    try:
        await coro
    except asyncio.CancelledError:
        if not stopped:
            raise
        task.uncancel()  # ours: a later cancel (asyncio.run's own SIGINT handler) must still count
    finally:
        # blocked while the handlers change hands: remove_signal_handler leaves the default action
        # (SIGTERM would kill us without writing what was measured or stopping launched servers)
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        try:
            for s in signals:
                loop.remove_signal_handler(s)
                signal.signal(s, before[s])
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # as it was (a caller may block them too)
    return bool(stopped)


def _write_outputs(records: list[BenchRecord], order: list[str], prefix: Path, meta: dict,
                   journal: str | None, when: datetime, stopped: str | None) -> None:
    order = [n for n in order if any(r.target == n for r in records)]
    report.write_json(_path(prefix, ".json"), records, {**meta, "complete": stopped is None})
    report.write_csv(_path(prefix, ".csv"), records)
    if not records:
        print("nothing was measured", file=sys.stderr)
        return
    plot_path = _path(prefix, ".png")
    report.plot(plot_path, records, order, title=f"tidal bench {when:%Y-%m-%d %H:%M} UTC")
    print(report.format_table(records, order))
    print(f"\nwrote {_path(prefix, '.json')}, {_path(prefix, '.csv')}, {plot_path}", file=sys.stderr)
    if journal:
        title = f"{when:%Y-%m-%d %H:%M:%S} UTC" + (f" ({stopped})" if stopped else "")
        changed = report.update_journal(journal, records, when=title, command=meta["command"],
                                        config=meta["config"], plot_path=str(plot_path), order=order)
        print(f"journal {journal}: {changed}", file=sys.stderr)
