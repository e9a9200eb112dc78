"""tidal sim / tune: roofline numbers, the simulator over the real scheduler and policy,
calibration, and the emitted schedules. Pure Python, no model."""

import json
import math
import time

import pytest

from tidal.adaptive.policy import parse_schedule
from tidal.cli import main
from tidal.config import SchedulerConfig
from tidal.sim.calibrate import calibrate, parse_points
from tidal.sim.command import parse_concurrency
from tidal.sim.measured import MeasuredModel
from tidal.sim.presets import HARDWARE, MODELS, expected_distinct_experts
from tidal.sim.report import make_record
from tidal.sim.roofline import Efficiency, RooflineModel, StepShape
from tidal.sim.simulator import AcceptanceModel, Simulator, Workload, parse_modes
from tidal.sim.sweep import SweepConfig, simulate
from tidal.sim.tune import tune

IDEAL = Efficiency(bandwidth=1.0, flops=1.0)


def test_roofline_llama8b_decode_on_one_h100_is_weights_over_bandwidth():
    m = RooflineModel(HARDWARE["h100x8"], MODELS["llama-3.1-8b"], tp=1, efficiency=IDEAL)
    # per layer: q and o 4096x4096, k and v 4096x1024, MLP 3 x 4096x14336; plus the lm_head
    params = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 4096 * 128256
    assert params == 7_504_658_432
    kv_one_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 heads of 128, bf16
    expected = (params * 2 + kv_one_token) / 3.35e12 + 1e-3  # + the preset's launch overhead
    got = m.step_time(StepShape(tokens=1, seqs=1, context=0, logits=1, attention_pairs=1))
    assert got == pytest.approx(expected, rel=1e-9)
    assert got == pytest.approx(5.48e-3, abs=0.01e-3)  # 15.0 GB at 3.35 TB/s = 4.48 ms, + 1 ms


def test_roofline_compute_bound_and_tensor_parallel_terms():
    one = RooflineModel(HARDWARE["h100x8"], MODELS["llama-3.1-8b"], tp=1, efficiency=IDEAL)
    big = StepShape(tokens=8192, seqs=8, context=8192, logits=8, attention_pairs=8 * 1024 * 1025 // 2)
    flops = 2 * 8192 * (one.model.active_params - one.model.lm_head_params) + 2 * 8 * one.model.lm_head_params \
        + 4 * 32 * 32 * 128 * big.attention_pairs
    assert one.step_time(big) == pytest.approx(flops / 989e12 + 1e-3, rel=1e-9)  # compute bound
    eight = RooflineModel(HARDWARE["h100x8"], MODELS["llama-3.1-8b"], efficiency=IDEAL)
    decode = StepShape(tokens=1, seqs=1, context=0, logits=1, attention_pairs=1)
    comm = 65 * (10e-6 + 2 * 7 / 8 * 4096 * 2 / 450e9)  # ring all-reduces: 2 per layer and the embedding's
    comm += 10e-6 + 7 / 8 * 128256 * 2 / 450e9  # the ring all-gather of one position's bf16 logits
    memory = (7_504_658_432 * 2 / 8 + 2 * 32 * 1 * 128 * 2) / 3.35e12  # weights and one KV head per GPU
    assert eight.step_time(decode) == pytest.approx(memory + comm + 1e-3, rel=1e-9)


def test_moe_reads_more_experts_as_the_batch_grows():
    assert expected_distinct_experts(128, 8, 1) == pytest.approx(8)
    assert expected_distinct_experts(128, 8, 1000) == pytest.approx(128, rel=1e-6)
    m = RooflineModel(HARDWARE["h100x8"], MODELS["qwen3-30b-a3b"], tp=1)
    assert m.weight_bytes_read(1) < m.weight_bytes_read(16) < m.weight_bytes_read(4096)
    assert m.model.active_params < 0.15 * m.model.total_params


def test_glm_4_6_preset_counts_its_dense_layers_shared_and_routed_experts():
    m = MODELS["glm-4.6"]
    attention = 5120 * 12288 * 2 + 2 * 5120 * 1024  # q, o (96 heads of 128) and k, v (8 heads)
    expert = 3 * 5120 * 1536
    dense = 3 * 5120 * 12288
    lm_head = 5120 * 151552
    moe_layer = lambda experts: (experts + 1) * expert + 5120 * 160  # noqa: E731  + the shared expert, router
    assert m.active_params == 92 * attention + 3 * dense + 89 * moe_layer(8) + lm_head
    assert m.total_params == 92 * attention + 3 * dense + 89 * moe_layer(160) + 2 * lm_head
    assert 352e9 < m.total_params < 354e9 and 32e9 < m.active_params < 34e9
    r = RooflineModel(HARDWARE["rtx-pro-6000x8-pcie"], m, dtype="fp8", efficiency=IDEAL)
    always, routed = r.weight_parts(1)  # one token: 8 experts per MoE layer, a byte each, an eighth per GPU
    assert always == pytest.approx((92 * attention + 3 * dense + 89 * (expert + 5120 * 160) + lm_head) / 8)
    assert routed == pytest.approx(89 * 8 * expert / 8)
    t = 64  # E * (1 - (1 - k/E)^T) distinct experts per layer
    assert r.weight_parts(t)[1] == pytest.approx(89 * 160 * (1 - (1 - 8 / 160) ** t) * expert / 8)
    assert r.weight_parts(10_000)[1] == pytest.approx(89 * 160 * expert / 8)  # every expert read


def test_all_reduce_over_pcie_for_target_and_each_head_forward():
    r = RooflineModel(HARDWARE["rtx-pro-6000x8-pcie"], MODELS["glm-4.6"], dtype="fp8", efficiency=IDEAL)
    one = 25e-6 + 2 * 7 / 8 * 16 * 5120 * 2 / 64e9  # latency + ring bytes of 16 bf16 hidden vectors
    gather = lambda rows, vocab: 25e-6 + 7 / 8 * rows * vocab * 2 / 64e9  # noqa: E731  bf16 logits, all-gathered
    # 2 per layer and the embedding's; a plain step gathers 16 rows of logits, a verify of 4 x 4 rows 16 too
    assert r.step_terms(StepShape(16, 16, 16000)).comm == pytest.approx(185 * one + gather(16, 151552))
    assert r.step_terms(StepShape(16, 4, 4000, draft_tokens=12, logits=16)).comm == \
        pytest.approx(185 * one + gather(16, 151552))
    assert gather(16, 151552) == pytest.approx(25e-6 + 66.3e-6, rel=1e-3)
    assert r.draft_forward_terms(16, False).comm == pytest.approx(3 * one + gather(16, 32000))  # one layer: its own
    extend = r.draft_forward_terms(16, True, logits=4)  # 16 verified positions, 4 requests drafting from their last
    assert extend.comm == pytest.approx(3 * one + gather(4, 32000))


def test_eagle3_as_sglang_runs_it_an_extend_then_k_forwards_and_the_overlap_schedule():
    shape = StepShape(4, 4, 4000)
    verify = StepShape(16, 4, 4012, draft_tokens=12)
    tidal = RooflineModel(HARDWARE["rtx-pro-6000x8-pcie"], MODELS["glm-4.6"], dtype="fp8", efficiency=IDEAL)
    sglang = RooflineModel(HARDWARE["rtx-pro-6000x8-pcie"], MODELS["glm-4.6"], dtype="fp8", efficiency=IDEAL,
                           drafter="eagle3-sglang")
    overlap = RooflineModel(HARDWARE["rtx-pro-6000x8-pcie"], MODELS["glm-4.6"], dtype="fp8", efficiency=IDEAL,
                            drafter="eagle3-sglang-overlap")
    assert len(tidal.draft_terms([3] * 4, 10)) == 3 and len(sglang.draft_terms([3] * 4, 10)) == 4
    assert [t.tokens for t in sglang.draft_terms([3] * 4, 10)] == [10, 4, 4, 4]  # extend, then the batch K times
    host = 1e-3  # the preset's launch overhead; the efficiency's step and draft overheads are 0 here
    assert sglang.step_time(shape) == pytest.approx(tidal.step_time(shape) - host)  # overlap scheduler
    assert sglang.step_time(verify) == pytest.approx(tidal.step_time(verify))  # off while drafting
    assert overlap.step_time(verify) == pytest.approx(tidal.step_time(verify) - host)
    assert overlap.draft_time([3] * 4, 10) == pytest.approx(sglang.draft_time([3] * 4, 10) - 4 * host)


def test_speculative_modes_can_run_a_capped_batch():
    config = SweepConfig((64,), 64, 16, spec_max_running=48)
    off, fixed = parse_modes("off,fixed:3")
    assert config.scheduler_for(off).max_num_seqs == 256 and config.scheduler_for(fixed).max_num_seqs == 48
    model = RooflineModel(HARDWARE["rtx-pro-6000x8-pcie"], MODELS["glm-4.6"], dtype="fp8", drafter="eagle3-sglang")
    capped = simulate(model, fixed, 64, config)
    free = simulate(model, fixed, 64, SweepConfig((64,), 64, 16))
    assert capped.ttft_ms["p99"] > free.ttft_ms["p99"]  # requests wait for one of the 48 slots


def test_explain_splits_a_decode_step_into_terms_that_sum_to_it():
    from tidal.sim.explain import breakdown, decode_shape, emitted_per_step, explain

    assert emitted_per_step((0.8, 0.5), 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    model = RooflineModel(HARDWARE["rtx-pro-6000x8-pcie"], MODELS["glm-4.6"], dtype="fp8", drafter="eagle3-sglang")
    for k in (0, 3):
        b = breakdown(model, 250, k, (0.7,), 1024, 128)
        parts = b["target roof = max(memory, compute)"] + b["all-reduce"] + b["overhead"] + b["extend"] + b["drafting"]
        assert b["step"] == pytest.approx(parts)
        shape = decode_shape(250, k, 1024, 128)
        drafts = model.draft_time([k] * 250, round(250 * b["tokens per request per step"])) if k else 0.0
        assert b["step"] == pytest.approx(model.step_time(shape) + drafts)
        assert b["tok/s"] == pytest.approx(250 * emitted_per_step((0.7,), k) / b["step"])
    text = explain(model, 250, [0, 3], (0.7,), 1024, 128, spec_max_running=48)
    assert "| requests running | 250 | 48 |" in text and "| experts |" in text and "vs off: fixed:3" in text


class Flat:
    """Verification is free: a step costs the same whatever it feeds; drafting costs nothing."""

    def step_time(self, shape):
        return 0.01

    def draft_time(self, ks, catch_up):
        return 0.0


class PerToken:
    """Every token fed costs 1 ms, so a draft (worth < 1 token) never pays."""

    def step_time(self, shape):
        return 1e-3 * shape.tokens

    def draft_time(self, ks, catch_up):
        return 0.0


def _sim(model, mode, acceptance=0.8, concurrency=4, prompts=8, input_len=32, output_len=32, seed=0):
    sim = Simulator(model, parse_modes(mode)[0], AcceptanceModel((acceptance,)), SchedulerConfig(64, 2048),
                    num_blocks=4096, seed=seed)
    return sim.run(Workload(concurrency, prompts, input_len, output_len))


def test_adaptive_takes_k_max_when_verification_is_free():
    run = _sim(Flat(), "adaptive:4", acceptance=0.8)
    capped = sum(k < 4 for k in run.chosen_k)  # only where the request may emit fewer than 5 tokens
    assert run.chosen_k and capped <= 8 * 3
    assert sum(k == 4 for k in run.chosen_k) >= 0.8 * len(run.chosen_k)


def test_adaptive_takes_zero_when_verification_is_expensive():
    run = _sim(PerToken(), "adaptive:4", acceptance=0.8)
    # nothing but the probes: one draft after every `probe_every` (16) steps with none
    assert run.chosen_k and set(run.chosen_k) <= {0, 1} and 0 < sum(run.chosen_k) <= run.num_steps // 16
    assert run.num_verifications == sum(run.chosen_k)


def test_off_and_fixed_emit_the_expected_tokens():
    off = _sim(Flat(), "off", concurrency=1, prompts=1, output_len=16)
    assert off.num_steps == 16 and [t.num_tokens for t in off.traces] == [16]  # prefill gives the first
    assert off.duration == pytest.approx(0.16)
    full = _sim(Flat(), "fixed:3", acceptance=1.0, concurrency=1, prompts=1, output_len=16)
    assert [t.num_tokens for t in full.traces] == [16]
    assert [n for _, n in full.traces[0].chunks] == [1, 4, 4, 4, 3]  # the last draft capped at what is left
    assert make_record("fixed:3", 1, full).acceptance_length == pytest.approx(15 / 4)
    none = _sim(Flat(), "fixed:3", acceptance=0.0, concurrency=1, prompts=1, output_len=16)
    assert none.num_steps == 16 and make_record("fixed:3", 1, none).acceptance_length == 1.0


def test_closed_loop_keeps_concurrency_and_is_reproducible():
    a = _sim(Flat(), "fixed:2", acceptance=0.6, concurrency=3, prompts=7, seed=5)
    b = _sim(Flat(), "fixed:2", acceptance=0.6, concurrency=3, prompts=7, seed=5)
    assert len(a.traces) == 7 and all(t.num_tokens == 32 for t in a.traces)
    assert [t.chunks for t in a.traces] == [t.chunks for t in b.traces]
    assert sorted(t.arrival for t in a.traces)[:3] == [0.0, 0.0, 0.0]  # three in flight from the start
    c = _sim(Flat(), "fixed:2", acceptance=0.6, concurrency=3, prompts=7, seed=6)
    assert [t.chunks for t in a.traces] != [t.chunks for t in c.traces]


def test_a_level_never_has_fewer_requests_than_its_concurrency():
    from tidal.sim.sweep import SweepConfig

    cfg = SweepConfig((1, 16), num_prompts=8)  # as tidal bench: 8 requests per level, 16 at C=16
    assert [cfg.workload(c).num_prompts for c in (1, 16)] == [8, 16]
    assert SweepConfig((2,)).workload(2).num_prompts == 8


def test_schedule_mode_follows_the_batch_size():
    run = _sim(Flat(), 'schedule:"1-2:3,3-:0"', concurrency=4, prompts=4)
    assert set(run.chosen_k) == {0}
    run = _sim(Flat(), 'schedule:"1-2:3,3-:0"', concurrency=1, prompts=2)
    assert set(run.chosen_k) - {0, 1, 2} == {3}


def test_measured_profile_is_fitted_by_the_engines_cost_model():
    points = [(t, s, s * 100, 0.002 + 1e-4 * t + 1e-6 * s * 100) for t in (1, 2, 4, 8, 16, 64, 256) for s in (1, 4)]
    m = MeasuredModel(points)
    assert m.step_time(StepShape(16, 4, 400)) == pytest.approx(0.002 + 16e-4 + 4e-4, rel=0.05)
    assert m.draft_time([3], 5) == 0.0  # no draft points: a drafter with no cost
    rec = simulate(m, parse_modes("off")[0], 2, SweepConfig((2,), input_len=16, output_len=8))
    assert rec.output_tok_s > 0 and rec.num_requests == 8


def test_parsers():
    assert parse_concurrency("1,2,4,...,250") == (1, 2, 4, 8, 16, 32, 64, 128, 250)
    assert [m.label for m in parse_modes('off,fixed:3,schedule:"1-4:4,5-:0",adaptive')] == \
        ["off", "fixed:3", "schedule:1-4:4,5-:0", "adaptive"]
    assert parse_modes("adaptive")[0].max_k == 4 and parse_modes("schedule:1-4:4,5-:0")[0].max_k == 4
    assert [(p.label, p.mode.label) for p in parse_points("off@1=92.6,eagle3@1=77.5", 3)] == \
        [("off", "off"), ("eagle3", "fixed:3")]
    with pytest.raises(ValueError):
        parse_points("adaptive@4=10")


def test_calibration_reproduces_the_8_gpu_report():
    """RTX PRO 6000 x8 over PCIe: plain 92.6 tok/s at 1 request, 772.1 at 250; EAGLE-3 77.5 at 1."""
    model = RooflineModel(HARDWARE["rtx-pro-6000x8-pcie"], MODELS["llama-3.1-70b"], dtype="fp8")
    cal = calibrate(model, parse_points("off@1=92.6,off@250=772.1,eagle3@1=77.5", 3), SweepConfig((1, 250)))
    for point, predicted in cal.predictions:
        assert predicted == pytest.approx(point.tok_s, rel=0.03), cal.table()
    e = cal.model.efficiency
    assert 0 < e.bandwidth < 1 and 0 < e.flops < 1
    # the fitted model predicts what a fresh simulation measures, not just the re-timed traces
    rec = simulate(cal.model, parse_modes("off")[0], 1, SweepConfig((1,)))
    assert rec.output_tok_s == pytest.approx(92.6, rel=0.03)


def _check_vllm_schedule(config: dict) -> None:
    """The rules vLLM's dynamic speculative decoding checks its schedule against."""
    entries = config["num_speculative_tokens_per_batch_size"]
    assert isinstance(entries, list) and entries
    assert all(isinstance(e, list) and len(e) == 3 and all(type(v) is int for v in e) for e in entries)
    assert entries[0][0] == 1
    assert all(0 < s <= e for s, e, _ in entries) and all(k >= 0 for *_, k in entries)
    assert all(a[1] < b[0] for a, b in zip(entries, entries[1:]))
    assert config["num_speculative_tokens"] == max(k for *_, k in entries) > 0


def test_tune_emits_vllm_sglang_and_tidal_schedules(capsys):
    assert main(["tune", "--hardware", "h100x8", "--model", "llama-3.1-8b", "--concurrency", "1,16,64",
                 "--max-k", "3", "--input-len", "64", "--output-len", "16", "--num-prompts", "64",
                 "--acceptance", "0.8", "--max-num-seqs", "128"]) == 0
    out = json.loads(capsys.readouterr().out)
    config = out["vllm"]["speculative_config"]
    _check_vllm_schedule(config)
    assert config["num_speculative_tokens_per_batch_size"][-1][1] == 128
    parse_schedule(out["tidal"]["spec_schedule"])
    assert out["sglang"]["args"][:2] == ["--speculative-algorithm", "EAGLE3"]


def test_tune_from_records_and_when_speculation_never_pays():
    recs = [dict(target=t, concurrency=c, output_tok_s=v) for t, c, v in
            [("off", 1, 10), ("fixed:3", 1, 20), ("fixed:1", 1, 15), ("off", 16, 100), ("fixed:1", 16, 110),
             ("fixed:3", 16, 90), ("off", 64, 300), ("fixed:1", 64, 290), ("adaptive", 64, 999)]]
    out = tune(recs, 256)
    assert out["tidal"]["spec_schedule"] == "1-4:3,5-32:1,33-:0"
    assert out["vllm"]["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 4, 3], [5, 32, 1], [33, 256, 0]]
    assert out["sglang"]["adaptive_config"] == {"1": {"candidate_steps": [3]}, "5": {"candidate_steps": [1]},
                                                "33": {"candidate_steps": [0]}}
    never = tune([dict(target="off", concurrency=1, output_tok_s=10), dict(target="fixed:2", concurrency=1, output_tok_s=5)])
    assert never["vllm"]["speculative_config"] is None and never["tidal"]["spec_schedule"] == "1-:0"


def test_sim_command_prints_the_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "sim.json"
    assert main(["sim", "--hardware", "rtx-pro-6000x8-pcie", "--model", "llama-3.1-8b", "--speculation",
                 "off,fixed:3,adaptive", "--concurrency", "1,4", "--input-len", "64", "--output-len", "32",
                 "--num-prompts", "8", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "SIMULATED" in out and "| 4 | fixed:3 |" in out and "vs off" in out
    records = json.loads(path.read_text())["records"]
    assert {(r["target"], r["concurrency"]) for r in records} == {(t, c) for t in ("off", "fixed:3", "adaptive") for c in (1, 4)}
    assert json.loads(path.read_text())["simulated"] is True
    for r in records:
        assert set(r["ttft_ms"]) == {"mean", "p50", "p90", "p99"} and r["errors"] == 0
        assert r["completed"] == r["num_requests"] == 8 and r["output_tokens"] == 8 * 32
        assert math.isfinite(r["output_tok_s"]) and r["output_tok_s"] > 0
    assert main(["tune", "--from", str(path)]) == 0
    tuned = json.loads(capsys.readouterr().out)
    assert set(tuned["best_k_by_concurrency"]) == {"1", "4"} and set(tuned["best_k_by_concurrency"].values()) <= {0, 3}


def test_acceptance_curve_from_metrics_pages():
    tidal_page = "\n".join([
        "# HELP tidal:spec_decode_num_drafted_tokens_per_pos_total Draft tokens verified, by draft position.",
        'tidal:spec_decode_num_drafted_tokens_per_pos_total{model_name="m",position="0"} 100.0',
        'tidal:spec_decode_num_drafted_tokens_per_pos_total{model_name="m",position="1"} 50.0',
        'tidal:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 80.0',
        'tidal:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 24.0'])
    assert AcceptanceModel.from_metrics(tidal_page).curve == pytest.approx((0.8, 0.6))  # 0.48 / 0.8
    vllm_page = "\n".join([
        'vllm:spec_decode_num_drafts_total{model_name="m"} 200.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 150.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 90.0'])
    assert AcceptanceModel.from_metrics(vllm_page).curve == pytest.approx((0.75, 0.6))
    a = AcceptanceModel((0.8, 0.6))
    assert a.expected_tokens(2) == pytest.approx(1 + 0.8 + 0.48)


def test_measured_json_profile_with_drafts_and_knots(tmp_path):
    steps = [[t, 1, 64, 0.01 + (0.0 if t <= 16 else 1e-3 * (t - 16))] for t in (1, 4, 8, 16, 17, 32, 64)]
    drafts = [[f, f, c, 1e-3 + 2e-3 * f + 1e-5 * c] for f in (1, 2, 4) for c in (1, 50)]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"steps": steps, "drafts": drafts, "knots": [1, 2, 4, 8, 16, 17, 32, 64]}))
    m = MeasuredModel.load(path)
    assert m.knots == (1, 2, 4, 8, 16, 17, 32, 64)
    assert m.step_time(StepShape(16, 1, 64)) == pytest.approx(0.01, rel=0.02)
    assert m.step_time(StepShape(48, 1, 64)) == pytest.approx(0.042, rel=0.02)  # the bend after 16 is kept
    assert m.draft_time([2], 10) == pytest.approx(1e-3 + 4e-3 + 1e-4, rel=0.02)


def test_step_logs_pooled_less_the_rows_written_in_a_window(tmp_path):
    from tidal.engine.step_log import StepLog
    slow, fast = tmp_path / "slow.csv", tmp_path / "fast.csv"
    for path, seconds in ((fast, 0.01), (slow, 0.05)):
        time.sleep(0.01)  # the two files' rows apart in time (the column has milliseconds)
        log = StepLog(path, (1, 2, 4, 8))
        for t in (1, 2, 4, 8):
            log.step(t, 1, 64, seconds)
        log.close()
    from tidal.engine.step_log import read_step_log
    times = [float(r["time"]) for r in read_step_log(slow)[2]]
    pooled = MeasuredModel.load([slow, fast])
    assert pooled.step_cost.num_samples == 8
    assert 0.01 < pooled.step_time(StepShape(2, 1, 64)) < 0.05
    without_slow = MeasuredModel.load([slow, fast], outside=[(times[0], times[-1])])
    assert without_slow.step_cost.num_samples == 4
    assert without_slow.step_time(StepShape(2, 1, 64)) == pytest.approx(0.01, rel=0.02)
    old = tmp_path / "old.csv"  # a log from before the time column
    old.write_text("kind,tokens,seqs,context,forwards,catch_up,seconds\nstep,1,1,64,,,0.01\n")
    with pytest.raises(ValueError, match="no time column"):
        MeasuredModel.load([old, fast], outside=[(0.0, 1.0)])
    with pytest.raises(ValueError, match="columns"):
        StepLog(old, (1, 2))  # appending new rows under the old header would misalign them


def test_measured_steps_price_the_sequences_verifying_drafts(tmp_path):
    """A step log's `verifying` column reaches the step model's per-sequence drafting term, as in
    the engine: 32 sequences, a step costs 20 ms + 0.1 ms a token + 0.5 ms a verifying sequence."""
    from tidal.engine.step_log import StepLog
    path = tmp_path / "steps.csv"
    log = StepLog(path, (1, 2, 4, 8, 16, 32, 64))
    for verifying in (0, 0, 4, 8, 16, 0, 32, 0):
        for drafts in {verifying, 2 * verifying}:
            tokens = 32 + drafts
            log.step(tokens, 32, 2048, 0.020 + 1e-4 * tokens + 5e-4 * verifying, drafts=drafts, verifying=verifying)
    log.close()
    m = MeasuredModel.load(path)
    assert m.step_time(StepShape(48, 32, 2048, verifying=16)) == pytest.approx(0.020 + 48e-4 + 8e-3, rel=0.03)
    assert m.step_time(StepShape(48, 32, 2048, verifying=8)) == pytest.approx(0.020 + 48e-4 + 4e-3, rel=0.03)
    old = MeasuredModel([(t, 32, 2048, x) for t, x in ((32, 0.0232), (64, 0.0264))])  # no fifth column: none
    assert old.step_time(StepShape(64, 32, 2048, verifying=32)) == pytest.approx(0.0264, rel=0.03)
    before = tmp_path / "before.csv"  # a step log from before the column: min(drafts, seqs) verify
    rows = [f"step,{t},32,2048,,,{0.020 + 1e-4 * t:.6f},0,0," for t in (32, 40, 48, 64)]  # plain: the token curve
    rows += [f"step,{32 + v},32,2048,,,{0.020 + 1e-4 * (32 + v) + 5e-4 * v:.6f},0,{v}," for v in (4, 8, 16, 32)]
    before.write_text("kind,tokens,seqs,context,forwards,catch_up,seconds,time,drafts,predicted\n" + "\n".join(rows) + "\n")
    m = MeasuredModel.load(before)
    assert m.step_time(StepShape(48, 32, 2048, verifying=16)) == pytest.approx(0.020 + 48e-4 + 8e-3, rel=0.03)


def test_measured_steps_keep_their_total_time():
    """The fits weigh relative errors, which puts them under the mean of right-skewed times; the
    simulator sums step times, so the model gives the measured total back."""
    times = [0.010] * 9 + [0.030]  # one slow step in ten: mean 12 ms
    points = [(t, 1, 64, x) for t in (1, 4) for x in times]
    m = MeasuredModel(points)
    assert float(m.step_cost.predict(1, 1, 64)) < 0.0115  # the relative fit alone sits near the typical step
    assert m.step_time(StepShape(1, 1, 64)) == pytest.approx(0.012, rel=0.02)
    assert m.step_time(StepShape(4, 1, 64)) == pytest.approx(0.012, rel=0.02)


def test_start_up_profile_gives_the_shape_and_live_steps_the_level(tmp_path):
    """As in the engine: the profile's rows are anchors, rescaled to the live steps' level, so a
    shape only the profile measured is priced at the live level (live steps ran slower here)."""
    from tidal.engine.step_log import StepLog
    path = tmp_path / "steps.csv"
    log = StepLog(path, (1, 2, 4, 8, 16, 32, 64))
    for t in (1, 4, 16, 64):  # profile: a flat 10 ms up to 16 tokens, then 1 ms a token more
        log.step(t, 1, 64, 0.01 + 1e-3 * max(0, t - 16), profile=True)
    log.draft(1, 1, 0, 0.002, profile=True)
    for _ in range(3):
        log.step(1, 1, 64, 0.015)  # live steps: 1.5x the profile, and only at one token
    log.close()
    m = MeasuredModel.load(path)
    assert m.step_cost.num_samples == 3 and m.step_cost.num_anchors == 4
    assert m.step_time(StepShape(1, 1, 64)) == pytest.approx(0.015, rel=0.02)
    assert m.step_time(StepShape(64, 1, 64)) == pytest.approx(1.5 * 0.058, rel=0.05)
    assert m.draft_time([1], 0) == pytest.approx(0.002, rel=0.02)  # a profile's drafts alone still count
    profile_only = MeasuredModel.load(path, kinds={"profile", "profile-draft"})
    assert profile_only.step_time(StepShape(64, 1, 64)) == pytest.approx(0.058, rel=0.05)
    bare = tmp_path / "bare.csv"  # no kind column: every row is a step, kept when steps are asked for
    bare.write_text("tokens,seqs,context,seconds\n1,1,64,0.015\n4,1,64,0.016\n")
    assert MeasuredModel.load(bare, kinds={"step"}).step_cost.num_samples == 2
    path.write_text(path.read_text().replace("profile-draft", "warmup"))
    with pytest.raises(ValueError, match="unknown row kind 'warmup'"):
        MeasuredModel.load(path)


class DearCatchUp:
    """Verification is nearly free, but the draft head's catch-up costs 10 us a position: a
    1000-token prompt costs one step's worth to catch up on, once."""

    def step_time(self, shape):
        return 0.01 + 1e-5 * shape.tokens

    def draft_time(self, ks, catch_up):
        return 1e-3 + 1e-5 * catch_up


def test_adaptive_drafts_after_a_long_prompt():
    """The prompt's catch-up is a one-off, spread over the request's steps: it must not keep a
    request that would gain from drafting at K = 0 for good."""
    run = _sim(DearCatchUp(), "adaptive:4", acceptance=0.8, concurrency=1, prompts=2, input_len=1000, output_len=128)
    assert sum(run.chosen_k) / len(run.chosen_k) > 3  # 1.7 when the whole prompt is charged to one step


def test_acceptance_scan_refits_the_draft_cost_at_each_acceptance(capsys):
    """One measured speculative point pins acceptance times cost: the scan refits both per value."""
    from tidal.sim.scan import parse_acceptances

    assert parse_acceptances("0.7, 0.4,0.4") == [0.4, 0.7]
    for bad in ("", "0", "1.5", "x"):
        with pytest.raises(ValueError):
            parse_acceptances(bad)
    args = ["sim", "--measured", "off@1=92.6,off@250=772.1,eagle3@1=77.5", "--hardware", "rtx-pro-6000x8-pcie",
            "--model", "glm-4.6", "--dtype", "fp8", "--drafter", "eagle3-sglang", "--spec-max-running", "48",
            "--concurrency", "1,32,250", "--scan-acceptance", "0.2,0.5,0.9"]
    assert main(args) == 0
    out = capsys.readouterr().out
    rows = {float(line.split("|")[1]): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| 0.")}
    assert set(rows) == {0.2, 0.5, 0.9}
    draft_ms = {a: float(r[1]) for a, r in rows.items()}
    assert draft_ms[0.2] < draft_ms[0.5] < draft_ms[0.9]  # more value per draft: the fit makes drafting dearer
    assert float(rows[0.5][2].rstrip("%")) < 3 and float(rows[0.9][2].rstrip("%")) < 3  # the points reproduced
    assert float(rows[0.2][2].rstrip("%")) > 5  # too little value for 77.5 tok/s even at the cheapest drafting
    at_32 = {a: float(r[4].rstrip("x")) for a, r in rows.items()}
    assert at_32[0.2] < 1.0 < at_32[0.9]
    assert "plain decoding ahead of fixed:3 at every level at acceptance 0.20 (its fit misses a point by" in out
    assert main(args[:1] + args[3:]) != 0  # no --measured: a clear error, no table
    captured = capsys.readouterr()
    assert "needs --measured" in captured.err and "|" not in captured.out
