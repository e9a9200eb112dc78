"""Adaptive speculation inside the engine (tiny model): lossless, measured, and off is off."""

import pytest

from tidal import SamplingParams
from tidal.config import CacheConfig, SpecConfig
from tidal.engine.llm_engine import LLM
from tests.test_spec import REPEAT, repetitive_prompts


def engine(path, **spec):
    return LLM(str(path), dtype="float32", enforce_eager=True, spec=SpecConfig(method="ngram", num_speculative_tokens=4, **spec),
               cache=CacheConfig(block_size=4, num_blocks=512)).engine


def run(eng, prompts, params=None):
    params = params or [REPEAT] * len(prompts)
    seqs = [eng.add_request(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    steps = []
    while eng.has_unfinished():
        eng.step()
        steps.append(eng.last_step_stats)
    return [s.output_token_ids for s in seqs], steps


def test_adaptive_is_lossless_and_reports_its_choices(tiny_model_dir):
    ps = repetitive_prompts(8)
    plain, _ = run(LLM(str(tiny_model_dir), dtype="float32", enforce_eager=True).engine, ps)
    eng = engine(tiny_model_dir, mode="adaptive")
    assert eng.step_cost.predict(1, 1, 50) > 0  # seeded by the start-up profile
    outs, steps = run(eng, ps)
    assert outs == plain
    assert sum(eng.k_histogram.values()) > 0 and set(eng.k_histogram) <= set(range(5))
    # every step is priced as it runs, prefill and arrivals included (the first one too)
    assert all(s.predicted_seconds is not None and s.predicted_seconds > 0 for s in steps)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_step_log_has_each_steps_drafts_and_prediction(tiny_model_dir, tmp_path):
    from tidal.engine.step_log import read_step_log

    log = tmp_path / "steps.csv"
    eng = LLM(str(tiny_model_dir), dtype="float32", enforce_eager=True, spec=SpecConfig(method="ngram", num_speculative_tokens=4, mode="fixed"),
              cache=CacheConfig(block_size=4, num_blocks=512), step_log=str(log)).engine
    _, steps = run(eng, repetitive_prompts(4))
    eng.step_log.close()
    rows = [r for r in read_step_log(log)[2] if r["kind"] == "step"]
    assert len(rows) == len(steps)
    for r, s in zip(rows, steps):
        assert float(r["predicted"]) == pytest.approx(s.predicted_seconds, rel=1e-3, abs=1e-6)
        if r["drafts"]:  # a decode step: every sequence fed one token plus its drafts
            assert int(r["tokens"]) == int(r["seqs"]) + int(r["drafts"]) and int(r["drafts"]) == s.spec.num_drafted
            # the sequences verifying them: at least one each when there are drafts, none without
            assert min(1, int(r["drafts"])) <= int(r["verifying"]) <= min(int(r["drafts"]), int(r["seqs"]))
    assert any(r["drafts"] and int(r["drafts"]) > 0 for r in rows) and any(not r["drafts"] for r in rows)
    assert all(r["verifying"] != "" for r in rows)  # prefill steps too: the engine fits every step with it


def test_policy_zero_skips_the_drafter(tiny_model_dir, monkeypatch):
    """A step where the policy gives every request 0 drafts makes no drafter call at all."""
    eng = engine(tiny_model_dir, mode="schedule", schedule="1-2:3,3-:0")
    calls, looked_up = [], []
    real, real_available = eng.drafter.propose, eng.drafter.available
    monkeypatch.setattr(eng.drafter, "propose", lambda seqs, ks: calls.append(ks) or real(seqs, ks))
    monkeypatch.setattr(eng.drafter, "available",
                        lambda seqs, k: looked_up.append(len(seqs)) or real_available(seqs, k))
    lengths = [SamplingParams(max_tokens=6 + 6 * i, temperature=0, ignore_eos=True) for i in range(6)]
    run(eng, repetitive_prompts(6), lengths)  # 6 decoding at once: K = 0 until only 1-2 remain
    assert calls and all(len(ks) <= 2 for ks in calls)
    assert looked_up and all(n <= 2 for n in looked_up)  # no n-gram lookup in the K = 0 steps either
    assert eng.k_histogram[0] > 0 and eng.k_histogram.get(3, 0) > 0


def test_a_paused_requests_acceptance_counts_age_every_step(tiny_model_dir):
    """A step in which a request emits a token without drafting ages its recent acceptance counts
    as a verification would (SpecStats.fade): while paused, its estimate returns towards the prior."""
    eng = engine(tiny_model_dir, mode="schedule", schedule="1-1:3,2-:0")  # alone it drafts, with others not
    ps = repetitive_prompts(4)
    a = eng.add_request("a", ps[0], SamplingParams(max_tokens=80, temperature=0, ignore_eos=True))
    while a.spec.num_drafted == 0 or len(a.output_token_ids) < 8:
        eng.step()
    for i, p in enumerate(ps[1:]):
        eng.add_request(f"b{i}", p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    faded = 0
    while not a.is_finished and faded < 10:
        recent = {c: (list(r), list(x)) for c, (r, x) in a.spec.recent.items()}
        drafted, emitted = a.spec.num_drafted, len(a.output_token_ids)
        eng.step()
        if a.spec.num_drafted == drafted and len(a.output_token_ids) == emitted + 1:
            assert a.spec.recent.keys() == recent.keys()
            for c, (reached, accepted) in recent.items():
                assert a.spec.counts(c)[0] == pytest.approx([0.9 * x for x in reached])
                assert a.spec.counts(c)[1] == pytest.approx([0.9 * x for x in accepted])
            faded += 1
        else:
            assert a.spec.num_drafted > drafted  # it verified drafts: counted, not faded
    assert faded == 10 and sum(sum(r) for r, _ in a.spec.recent.values()) > 0


def test_bad_speculation_config_is_rejected():
    for bad in (dict(mode="sometimes"), dict(mode="schedule"), dict(schedule="1-4:2"),
                dict(mode="schedule", schedule="4-1:2")):
        with pytest.raises(ValueError):
            SpecConfig(method="ngram", **bad)


def test_ngram_choices_never_exceed_the_drafts_that_exist(tiny_model_dir):
    """The policy prices only the drafts the n-gram drafter can make: each request's chosen K
    is what it then drafts (the drafter's match may be shorter than K, or absent)."""
    eng = engine(tiny_model_dir, mode="fixed")
    seqs = [eng.add_request(str(i), p, REPEAT) for i, p in enumerate(repetitive_prompts(4))]
    seen = set()
    while eng.has_unfinished():
        eng.step()
        for s in seqs:
            if not s.is_finished and s.spec.chosen_k is not None:
                assert len(s.draft_token_ids) == s.spec.chosen_k
                seen.add(s.spec.chosen_k)
    assert 4 in seen and len(seen) > 1  # full drafts, and fewer where the match ran short
