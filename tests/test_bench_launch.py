"""`tidal bench --launch`: local `tidal serve` processes on a tiny random model, started one
at a time, measured, and stopped; a server that cannot start is a clear error."""

from __future__ import annotations

import httpx
import pytest

from tidal.cli import main
from tidal.engine.step_log import read_step_log
from tidal.sweeps import report


def test_launch_measures_then_stops_the_servers(tiny_model_dir, tmp_path, capsys):
    prefix = tmp_path / "run"
    rc = main(["bench", "--launch", "off,fixed:2", "--launch-args", f"--model {tiny_model_dir} --dtype float32 --enforce-eager",
               "--endpoint", "completions", "--concurrency", "1,2", "--num-prompts", "2", "--output-len", "8",
               "--warmup", "1", "--output", str(prefix)])
    assert rc == 0, capsys.readouterr().err
    meta, records = report.read_json(prefix.with_suffix(".json"))
    assert meta["complete"] is True and list(meta["targets"]) == ["off", "fixed:2"]
    assert sorted((r.target, r.concurrency) for r in records) == [("fixed:2", 1), ("fixed:2", 2), ("off", 1), ("off", 2)]
    for r in records:
        assert r.errors == 0 and r.completed == r.num_requests == 2 and r.output_tokens == 16, r.error
    off = [r for r in records if r.target == "off"]
    fixed = [r for r in records if r.target == "fixed:2"]
    assert all(r.mean_chosen_k is None for r in off)
    # exported; 0 where the n-gram lookup finds nothing in the tiny model's text to draft from
    assert all(r.mean_chosen_k is not None and 0 <= r.mean_chosen_k <= 2 for r in fixed)
    assert "| 1 | fixed:2 | 2/2 |" in capsys.readouterr().out
    for url in meta["targets"].values():  # stopped on the way out
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
    logs = list((tmp_path / "run-logs").glob("server-*.log"))
    assert len(logs) == 2
    for target in ("off", "fixed-2"):  # each server's step rows fall in its own records' rounds
        [log] = (tmp_path / "run-logs").glob(f"steps-{target}-*.csv")
        rows = read_step_log(log)[2]
        windows = [w for r in records if r.target == target.replace("-", ":") for w in r.windows]
        live = [float(row["time"]) for row in rows if row["kind"] == "step" and float(row["time"]) >= windows[0][0]]
        assert len(windows) == 2 and live  # every step after the warm-up ran inside a round (ms rounding aside)
        assert all(any(a - 0.002 <= t <= b + 0.002 for a, b in windows) for t in live)


def test_a_server_that_cannot_start_is_a_clear_error(tmp_path, capsys):
    rc = main(["bench", "--launch", "off", "--launch-args", f"--model {tmp_path / 'missing.gguf'}",
               "--output", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 1 and "tidal serve (off) exited with 2" in err and "missing.gguf" in err
