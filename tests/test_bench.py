"""`tidal bench` against a fake OpenAI-compatible server on a fixed token schedule
(tests/bench_fake_server.py, in its own process): measured timings match the schedule, failing
targets are reported, Ctrl-C keeps what was measured; the report files; /metrics deltas."""

from __future__ import annotations

import asyncio
import csv
import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client import generate_latest

from tidal.bench.launch import serve_args
from tidal.bench.scrape import parse_spec_counters
from tidal.bench.sweep import SweepConfig, Target, sweep
from tidal.datasets import chat_prompts, mixed_prompts, random_prompts, rewrite_prompts, sharegpt_prompts
from tidal.server.metrics import ServerMetrics
from tidal.sweeps import report
from tidal.sweeps.records import BenchRecord, latency_summary, round_ratios_to_first

TTFT, ITL = 1.0, 0.05  # the fake's schedule, seconds: long beside a loaded machine's ~10 ms HTTP overhead
FAKE = Path(__file__).with_name("bench_fake_server.py")
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fake():
    """Base URL of the fake server; targets are its path prefixes (/ok, /fail, ...)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(FAKE), "--port", str(port), "--ttft", str(TTFT), "--itl", str(ITL)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/ok/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(10)


def _run(targets: list[Target], **cfg) -> list[BenchRecord]:
    records: list[BenchRecord] = []
    asyncio.run(sweep(targets, PROMPTS, SweepConfig(**cfg), records))
    return records


def _close(got: float, want: float, rel: float = 0.05) -> bool:
    return abs(got - want) <= rel * want


# ------------------------------------------------------------------ against the fake server


def test_measured_timings_match_the_fake_schedule(fake):
    out = 8
    e2e = TTFT + (out - 1) * ITL
    # two rounds at C=4: the first round also opens the connections
    records = [*_run([Target("ok", f"{fake}/ok")], concurrency=[1], num_prompts=3, output_len=out, warmup=0),
               *_run([Target("ok", f"{fake}/ok")], concurrency=[4], num_prompts=8, output_len=out, warmup=0)]
    assert [(r.target, r.concurrency, r.num_requests) for r in records] == [("ok", 1, 3), ("ok", 4, 8)]
    for r in records:
        assert r.errors == 0 and r.error is None and r.completed == r.num_requests
        assert r.output_tokens == out * r.num_requests  # the server's usage
        # closed loop, requests a multiple of C: the level lasts (requests / C) request lifetimes
        want_tok_s = out * r.concurrency / e2e
        assert _close(r.output_tok_s, want_tok_s), (r.output_tok_s, want_tok_s)
        assert _close(r.requests_per_s, r.concurrency / e2e)
        for key in ("mean", "p50"):
            assert _close(r.ttft_ms[key], TTFT * 1e3), r.ttft_ms
            assert _close(r.itl_ms[key], ITL * 1e3), r.itl_ms
            assert _close(r.tpot_ms[key], ITL * 1e3), r.tpot_ms
            assert _close(r.e2e_ms[key], e2e * 1e3), r.e2e_ms
        # the fake adds, per request, 4 drafts, 8 draft tokens, 6 accepted, K choices 2,2,2,2,0
        assert r.acceptance_length == pytest.approx(2.5) and r.acceptance_rate == pytest.approx(0.75)
        assert r.mean_chosen_k == pytest.approx(1.6)


def test_repeats_are_passes_over_the_sweep_alternating_targets_and_pooling_rounds(fake):
    out = 4
    e2e = TTFT + (out - 1) * ITL
    order: list[str] = []
    records: list[BenchRecord] = []
    targets = [Target("a", f"{fake}/ok"), Target("b", f"{fake}/ok")]
    cfg = SweepConfig(concurrency=[2, 1], num_prompts=2, output_len=out, warmup=0, repeats=2)
    asyncio.run(sweep(targets, PROMPTS, cfg, records, on_request=order.append))
    runs = [label for i, label in enumerate(order) if i % 2 == 0]  # two requests per run
    # the whole sweep twice, not each level twice in a row; turns rotate per level and per pass
    assert runs == ["a C=2", "b C=2", "b C=1", "a C=1", "b C=2", "a C=2", "a C=1", "b C=1"]
    assert sorted((r.target, r.concurrency) for r in records) == [("a", 1), ("a", 2), ("b", 1), ("b", 2)]
    for r in records:
        c = r.concurrency
        assert r.num_requests == r.completed == 4 and r.output_tokens == 4 * out
        assert _close(r.duration_s, 2 * (2 // c) * e2e, 0.1), r.duration_s  # the rounds' own time, not the gaps
        assert len(r.windows) == 2 and all(_close(b - a, (2 // c) * e2e, 0.1) for a, b in r.windows)
        assert r.windows[0][1] <= r.windows[1][0]  # in order, none overlapping
        assert _close(r.output_tok_s, out * c / e2e, 0.1)
        assert len(r.round_tok_s) == 2 and all(_close(x, out * c / e2e, 0.1) for x in r.round_tok_s)
        assert r.acceptance_length == pytest.approx(2.5)  # the counters' deltas summed over rounds
    table = report.format_table(records, ["a", "b"])
    assert table.splitlines()[0].startswith("| concurrency | target | requests | tok/s | vs a | rounds vs a: median (range) |")
    for row in table.splitlines()[2:]:
        cells = [x.strip() for x in row.strip("|").split("|")]
        if cells[1] == "a":
            assert cells[5] == "-"  # the baseline
        else:  # the same fake server: each round's ratio near 1
            median, lo, hi = map(float, re.fullmatch(r"(\d\.\d\d)x \((\d\.\d\d)-(\d\.\d\d)\)", cells[5]).groups())
            assert lo <= median <= hi and 0.8 < lo and hi < 1.25, row


def test_round_ratios_pair_each_round_with_the_baselines_same_round():
    """A slow spell in one round lands on both sides of that round's ratio: per-round ratios
    see through it where the pooled ratio does not."""
    a = _record("a", 4, 100.0)
    b = _record("b", 4, 100.0)
    a.round_tok_s, b.round_tok_s = [100.0, 100.0, 50.0], [110.0, 110.0, 55.0]  # round 3: the machine at half speed
    assert round_ratios_to_first([a, b]) == {("a", 4, None): [1.0, 1.0, 1.0],
                                                          ("b", 4, None): pytest.approx([1.1, 1.1, 1.1])}
    assert "| 4 | b | 8/8 |" in report.format_table([a, b]) and "1.10x (1.10-1.10)" in report.format_table([a, b])
    c = _record("c", 4, 100.0)  # a target without rounds (a simulated record): no ratios
    assert round_ratios_to_first([a, c])[("c", 4, None)] == []


def test_a_level_given_twice_pools_each_occurrence_on_its_own(fake):
    records = _run([Target("a", f"{fake}/ok")], concurrency=[1, 1], num_prompts=2, output_len=4, warmup=0, repeats=2)
    assert [(r.concurrency, len(r.windows)) for r in records] == [(1, 2), (1, 2)]


def test_a_sweep_cancelled_in_a_later_pass_keeps_the_rounds_that_finished(fake):
    records: list[BenchRecord] = []
    targets = [Target("a", f"{fake}/ok"), Target("b", f"{fake}/ok")]
    # the second pass opens at C=1: its two requests one after the other, so cancelling after the
    # first of them lands inside the round (not in the gap after it, as two at once could)
    cfg = SweepConfig(concurrency=[1, 2], num_prompts=2, output_len=4, warmup=0, repeats=2)

    async def main():
        done = []
        task = asyncio.ensure_future(sweep(targets, PROMPTS, cfg, records, on_request=done.append))
        while len(done) < 9:  # the first pass (8 requests) and one request of the second
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert sorted((r.target, r.concurrency) for r in records) == [("a", 1), ("a", 2), ("b", 1), ("b", 2)]
    assert all(len(r.windows) == 1 and r.completed == 2 for r in records)  # the unfinished round left out


def test_open_loop_follows_the_poisson_schedule(fake):
    rate, n, out = 10.0, 6, 4
    (r,) = _run([Target("ok", f"{fake}/ok")], concurrency=[n], num_prompts=n, output_len=out, warmup=0,
                request_rate=rate, seed=3)
    arrivals = np.cumsum(np.random.default_rng(3).exponential(1 / rate, n))
    assert r.request_rate == rate and r.completed == n and r.errors == 0
    # the last request arrives at arrivals[-1] and then takes one request lifetime (plus the
    # overheads of sleeping and opening connections on a busy machine)
    want = arrivals[-1] + TTFT + (out - 1) * ITL
    assert want - 0.01 <= r.duration_s <= want + 0.15, (r.duration_s, want)
    assert _close(r.ttft_ms["p50"], TTFT * 1e3)


def test_failing_targets_are_reported_and_the_others_measured(fake):
    targets = [Target("ok", f"{fake}/ok"), Target("fail", f"{fake}/fail"), Target("bad", f"{fake}/bad"),
               Target("refused", f"http://127.0.0.1:{_free_port()}"), Target("nousage", f"{fake}/nousage"),
               Target("vllm", f"{fake}/vllm")]
    records = _run(targets, concurrency=[2], num_prompts=2, output_len=4, warmup=0)
    by = {r.target: r for r in records}
    assert list(by) == [t.name for t in targets]
    assert by["fail"].errors == 2 and by["fail"].error == "HTTP 500: the fake engine broke"
    assert by["bad"].errors == 2 and by["bad"].error.startswith("bad stream: not JSON")
    assert by["refused"].errors == 2 and "ConnectError" in by["refused"].error
    for name in ("fail", "bad", "refused"):
        assert by[name].completed == 0 and by[name].output_tok_s == 0 and by[name].ttft_ms["p50"] is None
    for name in ("ok", "nousage", "vllm"):
        assert by[name].errors == 0 and by[name].completed == 2 and by[name].output_tokens == 8
    assert by["nousage"].output_tokens == 8  # no usage chunk: counted from the stream's chunks
    assert by["vllm"].acceptance_length == pytest.approx(3.0) and by["vllm"].mean_chosen_k == pytest.approx(3.0)
    table = report.format_table(records)
    assert "| 2 | fail | 0/2 | 0.0 | - |" in table
    assert "- fail C=2: 2 errors, first: HTTP 500: the fake engine broke" in table


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_writes_what_was_measured(fake, tmp_path, sig):
    prefix, journal = tmp_path / "run", tmp_path / "journal.md"
    cmd = [sys.executable, "-m", "tidal.cli", "bench", "--target", f"ok={fake}/ok", "--concurrency", "2,1",
           "--num-prompts", "4", "--output-len", "4", "--warmup", "0", "--output", str(prefix),
           "--journal", str(journal), "--no-progress"]
    # a SIGINT ignored by whatever started pytest (a shell's background job) would be inherited, and kept
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    json_path = prefix.with_suffix(".json")
    deadline = time.monotonic() + 60
    while not (json_path.exists() and json_path.stat().st_size and json.loads(json_path.read_text())["records"]):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(sig)  # during C=1, which takes four request lifetimes
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    meta, records = report.read_json(json_path)
    assert meta["complete"] is False and [(r.target, r.concurrency) for r in records] == [("ok", 2)]
    assert records[0].completed == 4 and records[0].errors == 0
    assert len(list(csv.DictReader(open(prefix.with_suffix(".csv"))))) == 1
    assert prefix.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 2 | ok | 4/4 |" in stdout and "interrupted" in stderr
    assert "(interrupted)" in journal.read_text()


# ------------------------------------------------------------------ report files


def _record(target: str, c: int, tok_s: float, **kw) -> BenchRecord:
    lat = latency_summary([0.01 * c, 0.02 * c])
    return BenchRecord(target, c, None, 8, 8, 1.0, int(tok_s), tok_s, 8.0, lat, lat, lat, lat, **kw)


def _sweep(ratios: dict[int, float]) -> list[BenchRecord]:
    return [rec for c, x in ratios.items() for rec in (_record("off", c, 100.0), _record("adaptive", c, 100.0 * x))]


def test_journal_finds_the_previous_run_of_the_same_targets_measured_in_another_order(tmp_path):
    journal = tmp_path / "results.md"
    report.update_journal(journal, _sweep({1: 1.5}), when="2026-12-01 10:00:00 UTC", command="A", config={})
    rotated = list(reversed(_sweep({1: 1.2})))  # adaptive measured first at this level
    changed = report.update_journal(journal, rotated, when="2026-12-02 10:00:00 UTC", command="B", config={},
                                    order=["off", "adaptive"])
    assert changed.startswith("versus 2026-12-01 10:00:00 UTC: off, adaptive:") and "C=1 1.50x->1.20x" in changed
    changed = report.update_journal(journal, _sweep({1: 1.0}), when="2026-12-03 10:00:00 UTC", command="C", config={})
    assert changed.startswith("versus 2026-12-02 10:00:00 UTC") and "C=1 1.20x->1.00x" in changed


def test_table_json_csv_and_plot(tmp_path):
    records = _sweep({1: 1.5, 4: 1.2, 16: 0.9})
    records.append(_record("fixed:4", 1, 0.0, errors=8, error="HTTP 500: boom"))
    table = report.format_table(records)
    assert table.splitlines()[0].startswith("| concurrency | target | requests | tok/s | vs off |")
    assert "| 1 | adaptive | 8/8 | 150.0 | 1.50x |" in table and "| 16 | adaptive | 8/8 | 90.0 | 0.90x |" in table
    assert "| 1 | fixed:4 | 8/8 | 0.0 | - |" in table and "- fixed:4 C=1: 8 errors, first: HTTP 500: boom" in table
    report.write_json(tmp_path / "r.json", records, {"tidal_version": "x", "machine": {"cpu": "y"}})
    meta, back = report.read_json(tmp_path / "r.json")
    assert meta == {"tidal_version": "x", "machine": {"cpu": "y"}} and back == records
    rows = list(csv.DictReader(_csv(tmp_path, records)))
    assert len(rows) == len(records) and float(rows[1]["output_tok_s"]) == 150.0
    assert float(rows[0]["ttft_ms_p99"]) == pytest.approx(records[0].ttft_ms["p99"])
    report.plot(tmp_path / "r.png", records)
    png = (tmp_path / "r.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert report.crossovers(records) == {"adaptive": 16, "fixed:4": None}


def _csv(tmp_path: Path, records: list[BenchRecord]):
    report.write_csv(tmp_path / "r.csv", records)
    return open(tmp_path / "r.csv", newline="")


def test_journal_prepends_indexes_and_says_what_changed(tmp_path):
    journal, plot = tmp_path / "results.md", tmp_path / "plots" / "a.png"
    first = report.update_journal(journal, _sweep({1: 1.5, 4: 1.2, 16: 0.9}), when="2026-12-01 10:00:00 UTC",
                                  command="tidal bench A", config={"output_len": 128}, plot_path=str(plot))
    assert first == "first run with targets off, adaptive"
    other = _record("x", 1, 1.0, error="a --> b")  # must not end the records comment
    report.update_journal(journal, [other], when="2026-12-01 11:00:00 UTC", command="tidal bench B", config={})
    changed = report.update_journal(journal, _sweep({1: 1.6, 4: 0.95, 16: 0.8}), when="2026-12-02 09:00:00 UTC",
                                    command="tidal bench C", config={})
    assert changed == ("versus 2026-12-01 10:00:00 UTC: off, adaptive: adaptive/off: crossover C=16 -> C=4; "
                       "C=1 1.50x->1.60x, C=4 1.20x->0.95x, C=16 0.90x->0.80x")
    text = journal.read_text()
    index = text[text.index("## Index"):text.index("<!-- tidal-bench section -->")]
    assert index.splitlines()[2:5] == [
        "- [2026-12-02 09:00:00 UTC: off, adaptive](#run-2026-12-02-09-00-00-utc)",
        "- [2026-12-01 11:00:00 UTC: x](#run-2026-12-01-11-00-00-utc)",
        "- [2026-12-01 10:00:00 UTC: off, adaptive](#run-2026-12-01-10-00-00-utc)"]
    assert text.index("tidal bench C") < text.index("tidal bench B") < text.index("tidal bench A")
    assert text.count("# tidal bench journal") == 1 and "![plot](plots/a.png)" in text
    assert f"**What changed:** {changed}" in text
    sections = report._split_sections(text)
    assert report._section_records(sections[1]) == [other]


# ------------------------------------------------------------------ metrics, datasets, launch


def test_spec_counters_delta_from_tidal_and_vllm_metrics():
    m = ServerMetrics("m")
    m.spec_positions([3, 1], [2, 0])
    m.observe_chosen_k([2, 0])
    before = parse_spec_counters(generate_latest(m.registry).decode())
    for _ in range(5):  # per step: two requests drafting 2 and 1, one at K=0
        m.spec_positions([2, 1], [1, 1])
        m.observe_chosen_k([2, 1, 0])
    delta = parse_spec_counters(generate_latest(m.registry).decode()) - before
    assert (delta.drafts, delta.draft_tokens, delta.accepted_tokens) == (10, 15, 10)
    assert delta.acceptance_length == pytest.approx(2.0) and delta.acceptance_rate == pytest.approx(10 / 15)
    assert delta.mean_chosen_k == pytest.approx(1.0)
    off = parse_spec_counters(generate_latest(ServerMetrics("off").registry).decode())
    assert off is not None and (off - off).acceptance_length is None and off.mean_chosen_k is None
    vllm = ('# TYPE vllm:spec_decode_num_drafts counter\nvllm:spec_decode_num_drafts_total{engine="0"} 4\n'
            'vllm:spec_decode_num_drafts_total{engine="1"} 6\n'
            '# TYPE vllm:spec_decode_num_draft_tokens counter\nvllm:spec_decode_num_draft_tokens_total 30\n'
            '# TYPE vllm:spec_decode_num_accepted_tokens counter\nvllm:spec_decode_num_accepted_tokens_total 12\n')
    v = parse_spec_counters(vllm)
    assert v.acceptance_length == pytest.approx(2.2) and v.mean_chosen_k == pytest.approx(3.0)
    assert parse_spec_counters("# TYPE other counter\nother_total 3\n") is None


def test_sharegpt_and_random_datasets(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi there"},
                           {"from": "gpt", "value": "hello"}, {"from": "human", "value": "second"}]},
        {"conversations": [{"from": "gpt", "value": "no human turn"}]},
        {"conversations": [{"from": "human", "value": "another"}]}]))
    assert sharegpt_prompts(str(path)) == ["hi there", "another"]
    from tidal.models.loader import load_tokenizer

    tok, vocab = load_tokenizer()
    prompts = random_prompts(tok, vocab, 6, 100, seed=1)
    assert len(set(prompts)) == 6 and [len(tok.encode(p)) for p in prompts] == [100] * 6
    assert prompts == random_prompts(tok, vocab, 6, 100, seed=1)


def test_mixed_prompts_alternate_chat_and_rewrite():
    chat, rewrite, mixed = chat_prompts(), rewrite_prompts(), mixed_prompts()
    assert mixed[0::2] == [chat[i % len(chat)] for i in range(len(mixed) // 2)]
    assert mixed[1::2] == [rewrite[i % len(rewrite)] for i in range(len(mixed) // 2)]
    assert len(mixed) == 2 * max(len(chat), len(rewrite))


def test_launch_modes():
    assert serve_args("off") == ["--speculation", "off"]
    assert serve_args("fixed:4") == ["--speculation", "fixed", "--num-speculative-tokens", "4"]
    assert serve_args("adaptive") == ["--speculation", "adaptive"]
    assert serve_args("adaptive:6") == ["--speculation", "adaptive", "--num-speculative-tokens", "6"]
    for bad in ("fixed", "off:2", "fast", "fixed:x"):
        with pytest.raises(ValueError):
            serve_args(bad)


def test_bad_arguments_are_clear_errors(capsys):
    from tidal.cli import main

    assert main(["bench"]) == 2 and "--target" in capsys.readouterr().err
    assert main(["bench", "--target", "a=http://127.0.0.1:1", "--output-len", "0"]) == 2
    assert "--output-len must be >= 1" in capsys.readouterr().err
    assert main(["bench", "--target", "a=127.0.0.1:1"]) == 2 and "NAME=http" in capsys.readouterr().err
    assert main(["bench", "--target", "a=http://127.0.0.1:1", "--launch", "a"]) == 2
    assert main(["bench", "--target", "a=http://127.0.0.1:1", "--concurrency", "1,0"]) == 2
