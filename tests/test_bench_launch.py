"""`tidal bench --launch`: local `tidal serve` processes on a tiny random model, started one
at a time, measured, and stopped; a server that cannot start is a clear error."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tidal.bench.run import _launching
from tidal.bench.sweep import Target
from tidal.cli import main
from tidal.engine.step_log import read_step_log
from tidal.sweeps import report


def test_launch_measures_then_stops_the_servers(tiny_model_dir, tmp_path, capsys):
    prefix = tmp_path / "run"
    rc = main(["bench", "--launch", "off,fixed:2", "--launch-args", f"--model {tiny_model_dir} --dtype float32 --enforce-eager",
               "--endpoint", "completions", "--concurrency", "1,2", "--num-prompts", "2", "--output-len", "8",
               "--warmup", "1", "--repeats", "2", "--output", str(prefix)])
    assert rc == 0, capsys.readouterr().err
    meta, records = report.read_json(prefix.with_suffix(".json"))
    assert meta["complete"] is True and list(meta["targets"]) == ["off", "fixed:2"]
    assert sorted((r.target, r.concurrency) for r in records) == [("fixed:2", 1), ("fixed:2", 2), ("off", 1), ("off", 2)]
    for r in records:
        assert r.errors == 0 and r.completed == r.num_requests == 4 and r.output_tokens == 32, r.error
    off = [r for r in records if r.target == "off"]
    fixed = [r for r in records if r.target == "fixed:2"]
    assert all(r.mean_chosen_k is None for r in off)
    # exported; 0 where the n-gram lookup finds nothing in the tiny model's text to draft from
    assert all(r.mean_chosen_k is not None and 0 <= r.mean_chosen_k <= 2 for r in fixed)
    assert "| 1 | fixed:2 | 4/4 |" in capsys.readouterr().out
    for url in meta["targets"].values():  # stopped on the way out
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
    assert len(list((tmp_path / "run-logs").glob("server-*.log"))) == 4  # fresh servers for each pass
    for target in ("off", "fixed-2"):  # each server's step rows fall in its own pass's rounds
        logs = sorted((tmp_path / "run-logs").glob(f"steps-{target}-*.csv"), key=lambda p: p.stat().st_mtime)
        windows = sorted(w for r in records if r.target == target.replace("-", ":") for w in r.windows)
        assert len(logs) == 2 and len(windows) == 4
        for first, log in enumerate(logs):
            rounds = windows[2 * first:2 * first + 2]  # its pass's two levels
            rows = read_step_log(log)[2]
            live = [float(row["time"]) for row in rows if row["kind"] == "step" and float(row["time"]) >= rounds[0][0]]
            assert live  # every step after its warm-up ran inside a round of its pass (ms rounding aside)
            assert all(any(a - 0.002 <= t <= b + 0.002 for a, b in rounds) for t in live)
            assert all(float(row["time"]) < windows[2][0] for row in rows) == (first == 0)  # one pass each


def test_launched_servers_start_before_the_first_pass_and_again_for_each_fresh_one():
    class Servers:
        modes = ["off"]
        starts = 0

        async def start(self):
            self.starts += 1
            return [Target("off", f"http://127.0.0.1:{self.starts}")]

    remote = [Target("peer", "http://127.0.0.1:9")]
    for fresh, starts in ((True, 3), (False, 1)):
        servers, meta = Servers(), {}
        hook = _launching(remote, servers, fresh, meta)
        got = [asyncio.run(hook(rep)) for rep in range(3)]
        assert servers.starts == starts and [t.name for t in got[-1]] == ["peer", "off"]
        assert meta["targets"] == {"peer": "http://127.0.0.1:9", "off": f"http://127.0.0.1:{starts}"}


def test_a_server_that_cannot_start_is_a_clear_error(tmp_path, capsys):
    rc = main(["bench", "--launch", "off", "--launch-args", f"--model {tmp_path / 'missing.gguf'}",
               "--output", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 1 and "tidal serve (off) exited with 2" in err and "missing.gguf" in err
