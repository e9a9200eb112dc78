"""SpecPolicy and the cost models on synthetic costs: pure numbers, no model."""

import random

import numpy as np
import pytest

from tidal.adaptive.cost import DraftCostModel, StepCostModel
from tidal.adaptive.policy import RequestView, SpecPolicy, StepPrice, parse_schedule, scheduled_k


def memory_bound(tokens, seqs, context, verifying=0):  # weights dominate: extra tokens are nearly free
    return 0.020 + 0.00002 * tokens


def compute_bound(tokens, seqs, context, verifying=0):  # every token costs as much as a whole step's worth
    return 0.001 + 0.002 * tokens


def no_draft_cost(forwards, tokens, catch_up):
    return 0.0


def views(alphas_by_request, k=6, prev=None):
    """Requests with `n` observed verifications at the given per-position acceptance."""
    out = []
    for i, a in enumerate(alphas_by_request):
        n = 50.0
        reached = [n] * k
        out.append(RequestView(k, reached, [n * a] * k, prev_k=None if prev is None else prev[i]))
    return out


def test_memory_bound_costs_give_drafts_and_compute_bound_costs_give_none():
    policy = SpecPolicy("adaptive", 6)
    assert all(k > 0 for k in policy.choose(views([0.7] * 4), StepPrice(4, 4, 400, memory_bound, no_draft_cost)))
    assert policy.choose(views([0.7] * 64), StepPrice(64, 64, 6400, compute_bound, no_draft_cost)) == [0] * 64


def test_low_acceptance_gets_fewer_drafts_than_high_in_the_same_batch():
    policy = SpecPolicy("adaptive", 6)

    def moderate(tokens, seqs, context, verifying=0):  # each token costs 4% of a one-token step
        return 0.010 + 0.0004 * tokens

    ks = policy.choose(views([0.1, 0.8] * 4), StepPrice(8, 8, 800, moderate, no_draft_cost))
    low, high = ks[0::2], ks[1::2]
    assert max(low) < min(high) and min(high) > 0


def test_an_unmeasured_request_gets_the_benefit_of_the_doubt():
    """Acceptance 0.3 is just short of paying for a draft that costs 26% of a step (as at one
    request on the bundled model) with the 5% bar: a request not yet measured starts from an
    optimistic prior and drafts, one measured lower does not, one measured higher does."""
    cost = lambda t, s, c, v=0: 0.010 + 0.0026 * (t - 1)  # noqa: E731

    def choose(view, optimism=0.2):
        return SpecPolicy("adaptive", 1, initial_acceptance=0.3, optimism=optimism).choose(
            [view], StepPrice(1, 1, 100, cost, no_draft_cost))
    assert choose(RequestView(1, [], [])) == [1]
    assert choose(RequestView(1, [], []), optimism=0.0) == [0]
    assert choose(RequestView(1, [10.0], [2.0])) == [0]
    assert choose(RequestView(1, [10.0], [5.0])) == [1]


def test_draft_cost_and_catch_up_are_charged():
    policy = SpecPolicy("adaptive", 4)
    cheap = policy.choose(views([0.6]), StepPrice(1, 1, 100, memory_bound, no_draft_cost))
    dear = policy.choose(views([0.6]), StepPrice(1, 1, 100, memory_bound, lambda f, t, c: 0.05 * f))
    assert cheap[0] > 0 and dear == [0]
    r = views([0.6])
    r[0].catch_up = 10_000
    assert policy.choose(r, StepPrice(1, 1, 100, memory_bound, lambda f, t, c: 0.0001 * c)) == [0]


def test_goodput_choice_is_the_best_allocation_by_brute_force():
    policy = SpecPolicy("adaptive", 3)
    reqs = views([0.9, 0.5, 0.2], k=3)
    cost = lambda t, s, c, v=0: 0.01 + 0.001 * t + 0.004 * (t > 5)  # noqa: E731  a kernel switch at 5
    ks = policy.choose(reqs, StepPrice(3, 3, 300, cost, no_draft_cost))
    worths = [[0.9, 0.81, 0.729], [0.5, 0.25, 0.125], [0.2, 0.04, 0.008]]
    price = StepPrice(3, 3, 300, cost, no_draft_cost)
    g = lambda k: policy.goodput(reqs, worths, [0.0] * 3, price, list(k))  # noqa: E731
    best = max(((a, b, c) for a in range(4) for b in range(4) for c in range(4)), key=g)
    assert g(ks) == pytest.approx(g(best), rel=0.02)


def test_a_backlog_is_spread_over_the_steps_the_request_has_left():
    """Starting to draft after a long prompt costs one catch-up over the prompt; spread over the
    request's remaining steps it pays, charged to one step it never would. A request that drafted
    last step pays its (recurring) catch-up in full."""
    policy = SpecPolicy("adaptive", 4)
    catch_up_cost = lambda f, t, c: 0.0001 * c  # noqa: E731  2000 positions: 0.2 s, ten steps' worth
    fresh = views([0.8])
    fresh[0].catch_up, fresh[0].remaining = 2000, 1000
    assert policy.choose(fresh, StepPrice(1, 1, 2000, memory_bound, catch_up_cost))[0] > 0
    fresh[0].remaining = 3  # nearly done: the backlog is not worth it
    assert policy.choose(fresh, StepPrice(1, 1, 2000, memory_bound, catch_up_cost)) == [0]
    steady = views([0.8], prev=[2])
    steady[0].catch_up, steady[0].remaining = 2000, 1000
    assert policy.choose(steady, StepPrice(1, 1, 2000, memory_bound, catch_up_cost)) == [0]


def test_a_prefill_in_the_step_does_not_make_drafts_look_free():
    """Every token costs 2 ms, so a draft (worth < 1 token) never pays, with or without 1000
    prefill tokens in the same step: the prefill's time is not counted against the drafts."""
    policy = SpecPolicy("adaptive", 4)
    assert policy.choose(views([0.7] * 4), StepPrice(4, 4, 400, compute_bound, no_draft_cost)) == [0] * 4
    assert policy.choose(views([0.7] * 4), StepPrice(1004, 5, 400, compute_bound, no_draft_cost)) == [0] * 4


def test_drafts_stay_within_the_budget_left_by_prefill():
    policy = SpecPolicy("adaptive", 4)
    assert sum(policy.choose(views([0.9] * 4), StepPrice(4, 4, 400, memory_bound, no_draft_cost), draft_budget=3)) == 3
    assert policy.choose(views([0.9] * 4), StepPrice(4, 4, 400, memory_bound, no_draft_cost), draft_budget=0) == [0] * 4


def test_a_request_is_probed_after_a_long_pause_everywhere():
    """With K = 0 chosen everywhere, one request (the cheapest to catch up) gets one draft every
    `probe_every` steps, so acceptance keeps being measured, or later when that probe would cost
    more than `probe_share` of the time since the last drafts."""
    def probes(alpha, cost):
        policy = SpecPolicy("adaptive", 4, probe_every=10, probe_share=0.01)
        reqs = views([alpha] * 3)
        for r, c in zip(reqs, (50, 5, 500)):
            r.catch_up = c
        choices = [policy.choose(reqs, StepPrice(3, 3, 300, cost, no_draft_cost)) for _ in range(60)]
        assert all(ks in ([0, 0, 0], [0, 1, 0]) for ks in choices)
        return [i for i, ks in enumerate(choices) if any(ks)]
    # nearly free to verify, but too rarely accepted to pay: a probe every 10 steps
    assert probes(0.0, memory_bound) == [9, 19, 29, 39, 49, 59]
    # a token costs 2 ms against a 7 ms step: a probe once 1% of the idle time covers 2 ms (29 steps)
    assert probes(0.7, compute_bound) == [28, 57]


def test_a_position_no_request_drafts_is_probed_too():
    """Drafting one token a step, nobody's second draft is ever verified, so an early low estimate
    of position 2 (two rejections) would stand for good: once `probe_every` steps' chains stopped
    at position 1 since one last reached 2, the request likeliest to reach 2 gets a second draft
    for a step, if that costs at most `probe_share` of those steps' time."""
    def verify(tokens, seqs, context, verifying=0):  # a draft costs a fifth of a plain step
        return 0.010 + 0.0025 * tokens

    def run(reqs_per_step, cost=verify):
        policy = SpecPolicy("adaptive", 4, probe_every=10, probe_share=0.05)
        return [policy.choose(reqs, StepPrice(len(reqs), len(reqs), 100, cost, no_draft_cost))
                for reqs in reqs_per_step]

    # 0.6 at position 1; position 2 accepted 0.1 of 2 times, 0.3 once smoothed: one draft pays, two do not
    one = RequestView(4, [50.0, 2.0, 0.0, 0.0], [30.0, 0.2, 0.0, 0.0])
    choices = run([[one]] * 30)
    assert [i for i, ks in enumerate(choices) if ks != [1]] == [9, 19, 29] and choices[9] == [2]
    # too dear for 5% of 10 steps (12.5 ms against 7.5): it waits until 5% covers it (17 steps)
    dear = lambda t, s, c, v=0: verify(t, s, c) + (0.01 if t >= 3 else 0.0)  # noqa: E731
    assert [i for i, ks in enumerate(run([[one]] * 30, dear)) if ks != [1]] == [16]
    # chains that reach position 2 by choice (steps 6-8) start the count again
    two = RequestView(4, [50.0, 50.0, 2.0, 0.0], [45.0, 45.0, 0.2, 0.0])
    choices = run([[one]] * 6 + [[two]] * 3 + [[one]] * 12)
    assert [i for i, ks in enumerate(choices) if ks != [1]] == [6, 7, 8, 18] and choices[6] == [2]
    # of two requests drafting one token, the probe goes to the one that accepts more
    likely = RequestView(4, [50.0, 2.0, 0.0, 0.0], [45.0, 0.2, 0.0, 0.0])
    choices = run([[one, likely]] * 10)
    assert choices[:9] == [[1, 1]] * 9 and choices[9] == [1, 2]
    # chains reach position 3 by choice: positions 1-3 measured every step, position 4 probed
    three = RequestView(4, [50.0, 50.0, 50.0, 2.0], [45.0, 45.0, 45.0, 0.2])
    assert [ks[0] for ks in run([[three]] * 20)] == [3] * 9 + [4] + [3] * 9 + [4]


def test_a_paused_requests_estimate_returns_towards_the_prior():
    """Ten rejections in a row put a request's estimate far under the engine-wide rate; the steps it
    then spends without drafting age those counts (SpecStats.fade), so its estimate climbs back
    towards the prior rather than keeping it at K = 0 until a probe happens to be accepted."""
    from tidal.adaptive.stats import SpecStats
    from tidal.adaptive.policy import acceptance_curve

    stats = SpecStats()
    for _ in range(10):
        stats.record(1, 0)
    estimate = lambda: acceptance_curve(*stats.counts(0), [0.4], 2.0)[0]  # noqa: E731
    readings = [estimate()]
    for _ in range(4):
        for _ in range(10):
            stats.fade()
        readings.append(estimate())
    assert readings[0] < 0.1 and readings == sorted(readings) and 0.38 < readings[-1] < 0.4


def test_a_drafting_policy_measures_a_plain_step_now_and_then():
    """Drafts paying every step, one step in `plain_every` + 1 has none: the plain step's cost is
    measured live, not read off the start-up profile forever."""
    policy = SpecPolicy("adaptive", 4, probe_every=3, plain_every=10)
    choices = [policy.choose(views([0.7] * 4), StepPrice(4, 4, 400, memory_bound, no_draft_cost)) for _ in range(30)]
    assert [i for i, ks in enumerate(choices) if not any(ks)] == [10, 21]


def run_noisy(margin: float, fitted: bool) -> tuple[int, list[int]]:
    """300 steps near the break-even point with step times off by up to +-20% and measured
    into the fitted cost model (`fitted`), or estimates off by up to +-2% seen raw by the policy. Returns how often
    the choice changed, and the drafts per step."""
    rng = random.Random(0)
    model = StepCostModel(window=64)
    policy = SpecPolicy("adaptive", 4, margin=margin, probe_every=10**9)  # probes change K on purpose
    true = lambda t, s, c, v=0: 0.010 + 0.002 * t  # noqa: E731  one draft each barely pays at 0.6
    for t in (1, 2, 4, 8, 16, 32):
        model.observe(t, 4, 400, true(t, 4, 400), anchor=True)
    prev, changes, drafts = None, 0, []
    for _ in range(300):
        noise = {}
        noisy = np.vectorize(lambda t: noise[t] if t in noise else noise.setdefault(t, rng.uniform(0.98, 1.02)))
        raw = lambda t, s, c, v=0: true(t, s, c) * noisy(t)  # noqa: E731
        price = StepPrice(4, 4, 400, model.predict if fitted else raw, no_draft_cost)
        ks = policy.choose(views([0.6] * 4, k=4, prev=prev if margin else None), price)
        changes += prev is not None and ks != prev
        prev = ks
        drafts.append(sum(ks))
        tokens = 4 + sum(ks)
        model.observe(tokens, 4, 400, true(tokens, 4, 400) * rng.uniform(0.8, 1.2))
    return changes, drafts


def test_noisy_step_times_do_not_make_k_flap():
    changes, drafts = run_noisy(0.03, fitted=True)
    assert changes <= 3 and len(set(drafts[-100:])) == 1  # settled
    # the hysteresis alone holds the choice even when every estimate is noisy
    assert run_noisy(0.03, fitted=False)[0] <= 0.2 * run_noisy(0.0, fitted=False)[0]


def test_fixed_and_schedule_modes():
    assert SpecPolicy("fixed", 4).choose(views([0.1, 0.9]), StepPrice(2, 2, 0, compute_bound, no_draft_cost)) == [4, 4]
    reqs = views([0.5] * 6)
    reqs[0].max_k = 1
    schedule = SpecPolicy("schedule", 6, "1-4:4,5-16:2,17-:0")
    assert schedule.choose(reqs, StepPrice(6, 6, 0, memory_bound, no_draft_cost)) == [1] + [2] * 5
    sched = parse_schedule("1-4:4, 5-16:2, 17-:0")
    assert [scheduled_k(sched, n) for n in (1, 4, 5, 16, 17, 500)] == [4, 4, 2, 2, 0, 0]
    for bad in ("4-1:2", "1-4:2,3-8:1", "a:1", "1-4", "17-:0,20-:1", "0-3:1", "1-2:-1"):
        with pytest.raises(ValueError):
            parse_schedule(bad)


def test_acceptance_prior_tracks_what_the_engine_records():
    policy = SpecPolicy("adaptive", 3, initial_acceptance=0.5)
    for _ in range(200):
        policy.record(3, 3)  # every draft accepted
    assert all(p > 0.95 for p in policy.prior)
    for _ in range(200):
        policy.record(3, 0)  # first draft rejected: positions 2 and 3 never reached
    assert policy.prior[0] < 0.05 and policy.prior[1] > 0.9


def test_step_cost_model_fits_a_piecewise_cost_and_extrapolates():
    model = StepCostModel(knots=(1, 2, 4, 8, 16, 17, 32, 64, 128))
    true = lambda t, s, c, v=0: 0.01 + 0.0002 * t + (0.02 if t > 16 else 0.0) + 0.00001 * s + 1e-6 * c  # noqa: E731
    rng = random.Random(1)
    for _ in range(200):
        t, s = rng.randint(1, 128), rng.randint(1, 32)
        c = s * rng.randint(10, 200)
        model.observe(t, s, c, true(t, s, c))
    for t in (1, 3, 16, 17, 50, 128):
        assert model.predict(t, 8, 800) == pytest.approx(true(t, 8, 800), rel=0.05)
    assert model.predict(200, 8, 800) == pytest.approx(true(200, 8, 800), rel=0.1)  # past the last knot


def test_cost_model_refits_every_few_samples_after_its_first_ones():
    model = StepCostModel(window=16)
    for _ in range(8):  # the first refit_every samples count at once
        model.observe(8, 1, 8, 0.010)
        assert model.predict(8, 1, 8) == pytest.approx(0.010, rel=1e-3)
    for _ in range(7):
        model.observe(8, 1, 8, 0.020)
    assert model.predict(8, 1, 8) == pytest.approx(0.010, rel=1e-3)  # not refitted yet (a refit now: 11.8 ms)
    model.observe(8, 1, 8, 0.020)  # the 8th: refitted on 8 samples at 10 ms and 8 at 20 ms
    assert model.predict(8, 1, 8) == pytest.approx(0.012, rel=1e-3)  # least squares of the relative error
    for _ in range(8):  # the window (16) now holds 20 ms samples only
        model.observe(8, 1, 8, 0.020)
    assert model.predict(8, 1, 8) == pytest.approx(0.020, rel=1e-3)


def test_cost_models_price_a_number_as_they_price_an_array():
    """The policy prices candidates one at a time (plain Python); the simulator and the engine's
    checks pass arrays. Both paths give the same seconds, past either end of the knots too."""
    rng = np.random.default_rng(0)
    step, draft = StepCostModel((1, 2, 4, 8, 9, 16, 32)), DraftCostModel()
    for _ in range(40):
        t = int(rng.integers(1, 60))
        step.observe(t, 3, 300, 0.01 + 0.001 * t + 1e-3 * rng.random())
        draft.observe(int(rng.integers(1, 5)), int(rng.integers(1, 9)), int(rng.integers(0, 40)), 0.002 + 1e-3 * rng.random())
    for t in (0, 1, 3, 8, 9, 16.5, 40, 100):
        assert step.predict(t, 3, 310) == pytest.approx(step.predict(np.array([t]), 3, np.array([310]))[0], rel=1e-12)
    for f, t, c in ((0, 0, 0), (1, 1, 3), (3, 8, 40.5)):
        assert draft.predict(f, t, c) == pytest.approx(draft.predict(np.array([f]), np.array([t]), np.array([c]))[0],
                                                       rel=1e-12, abs=1e-15)
    assert isinstance(step.predict(4, 3, 310), float) and draft.predict(0, 0, 0) == 0.0


def test_step_cost_never_falls_as_sequences_or_context_grow():
    """Fitted on decode steps of up to 64 sequences whose times happen to fall with sequences
    and context, the model holds those terms at 0 rather than extrapolate a cheaper step."""
    model = StepCostModel()
    for s in (1, 2, 4, 8, 16, 32, 64):
        for extra in (0, 2, 4):
            t = s * (1 + extra)
            model.observe(t, s, 50 * s, 0.02 + 0.001 * t - 0.0002 * s - 1e-6 * 50 * s)
    for t in (1, 64, 256):
        assert model.predict(t, 128, 128 * 50) >= model.predict(t, 1, 50)
    assert model.predict(128, 128, 6400) > 0.1


def test_draft_cost_model_fits_forwards_tokens_and_catch_up():
    model = DraftCostModel()
    true = lambda f, t, c: 0.001 + 0.003 * f + 0.0001 * t + 0.00002 * c  # noqa: E731
    for f, t, c in [(1, 1, 0), (4, 4, 10), (2, 16, 100), (6, 60, 5), (3, 9, 400), (1, 32, 50)]:
        model.observe(f, t, c, true(f, t, c))
    assert model.predict(5, 20, 30) == pytest.approx(true(5, 20, 30), rel=1e-6)
    assert model.predict(0, 0, 0) == 0.0


def test_drafting_must_promise_the_minimum_gain():
    """One draft per request at acceptance 0.6 promises +11% over plain decoding here: taken
    with a 10% bar, not with a 20% one."""
    cost = lambda t, s, c, v=0: 0.010 + 0.002 * t  # noqa: E731
    price = StepPrice(4, 4, 400, cost, no_draft_cost)
    assert sum(SpecPolicy("adaptive", 1, min_gain=0.1).choose(views([0.6] * 4), price)) == 4
    assert SpecPolicy("adaptive", 1, min_gain=0.2).choose(views([0.6] * 4), price) == [0] * 4


def test_live_steps_set_the_level_of_the_start_up_profile():
    """Profiled on an idle machine, then every live step (all plain decodes of 32 tokens) takes
    1.5x as long: the steps only the profile measured (64 tokens) are predicted 1.5x too."""
    true = lambda t, s, c, v=0: 0.05 + 0.002 * t  # noqa: E731
    model = StepCostModel()
    for t in (1, 4, 16, 32, 64, 128):
        model.observe(t, 32, 3200, true(t, 32, 3200), anchor=True)
    for _ in range(50):
        model.observe(32, 32, 3200, 1.5 * true(32, 32, 3200))
    assert model.predict(64, 32, 3200) == pytest.approx(1.5 * true(64, 32, 3200), rel=0.03)
    assert model.predict(32, 32, 3200) == pytest.approx(1.5 * true(32, 32, 3200), rel=0.03)


def test_drafting_steps_the_fit_underprices_are_priced_by_their_measured_bias():
    """Live steps at 32 sequences: mostly plain decodes, one in ten verifying 4 drafts, which
    costs a fixed 8 ms more than the token curve (a second attention call, say). The fit, one
    curve for every token and anchored by a profile without that cost, underprices those steps;
    draft_bias brings their price to what they measured, and leaves plain steps' price alone."""
    true = lambda t, s, c, v=0: 0.030 + 0.0005 * t  # noqa: E731
    model = StepCostModel()
    for t in (1, 4, 16, 32, 64, 128):
        model.observe(t, 32, 3200, true(t, 32, 3200), anchor=True)
    for i in range(200):
        drafting = i % 10 == 9
        tokens = 36 if drafting else 32
        model.observe(tokens, 32, 3200, true(tokens, 32, 3200) + 0.008 * drafting, drafts=tokens - 32)
    assert model.predict(36, 32, 3200) < 0.93 * (true(36, 32, 3200) + 0.008)  # the fit alone
    assert model.predict(36, 32, 3200, 1) == pytest.approx(true(36, 32, 3200) + 0.008, rel=0.03)
    assert model.predict(32, 32, 3200) == pytest.approx(true(32, 32, 3200), rel=0.03)
    bias = model.draft_bias
    assert bias > 0.1
    model.observe(60, 32, 3200, 0.5, drafts=None)  # a step that also prefills: not a decode step
    assert model.draft_bias == bias


def test_the_optimistic_prior_shrinks_with_the_batch():
    """The benefit of the doubt is one request's share of a step: a new request alone drafts on
    it, eight new requests in a batch do not."""
    cost = lambda t, s, c, v=0: 0.010 * s + 0.003 * (t - s)  # noqa: E731  a token per request 0.01 s, a draft 0.003 s
    policy = SpecPolicy("adaptive", 1, initial_acceptance=0.3)
    assert policy.choose([RequestView(1, [], [])], StepPrice(1, 1, 100, cost, no_draft_cost)) == [1]
    eight = [RequestView(1, [], []) for _ in range(8)]
    assert policy.choose(eight, StepPrice(8, 8, 800, cost, no_draft_cost)) == [0] * 8


def test_sequences_verifying_drafts_are_priced_beyond_their_tokens():
    """Each sequence verifying drafts costs 0.5 ms beyond its tokens (an attention call with a
    causal mask, say). Fitted on a profile like the engine's start-up one (batch sizes 1-64 at
    K = 0, 2, 4; prefill then decode), a step where 16 of 32 sequences verify one draft is priced
    within 4% (the token curve alone says 10% less), and so is a plain step."""
    true = lambda t, s, c, g: 0.005 + 0.0008 * t + 0.0008 * s + 2e-6 * c + 0.0005 * g  # noqa: E731
    model = StepCostModel()
    for n in (1, 4, 16, 64):
        model.observe(48 * n, n, 48 * n, true(48 * n, n, 48 * n, 0), anchor=True)  # the prompts
        for k in (0, 2, 4):
            t, c, g = n * (1 + k), n * (60 + k), n if k else 0
            model.observe(t, n, c, true(t, n, c, g), anchor=True, drafting=g)
    assert model.predict(48, 32, 2240, 16) == pytest.approx(true(48, 32, 2240, 16), rel=0.04)
    assert true(48, 32, 2240, 0) < 0.91 * true(48, 32, 2240, 16)
    assert model.predict(32, 32, 2240, 0) == pytest.approx(true(32, 32, 2240, 0), rel=0.04)
    assert model.predict(33, 32, 2240, 1) > model.predict(33, 32, 2240, 0)


def test_requests_accepting_0_9_and_0_2_in_one_step_get_different_k():
    """A draft costs 20% of a one-token step: worth it at acceptance 0.9, not at 0.2; the
    request that accepts gets drafts, the other none, in the same step."""
    def step(tokens, seqs, context, verifying=0):
        return 0.010 + 0.002 * (tokens - 2)
    ks = SpecPolicy("adaptive", 4).choose(views([0.9, 0.2], k=4), StepPrice(2, 2, 200, step, no_draft_cost))
    assert ks[0] > 0 and ks[1] == 0


def test_the_drafters_grade_moves_k_before_the_request_has_counts():
    """Drafts of grade 4 have been accepted, of grade 1 rejected, elsewhere in the engine: two
    new requests (no counts of their own) whose next drafts are of those grades get different
    K; ungraded drafts (grade 0) keep the engine-wide prior."""
    def step(tokens, seqs, context, verifying=0):
        return 0.010 + 0.002 * (tokens - 2)
    policy = SpecPolicy("adaptive", 4, optimism=0.0)
    for _ in range(30):
        policy.record(4, 4, draft_class=4)
        policy.record(4, 0, draft_class=1)
    assert policy.class_prior(4)[0] > 0.9 > 0.1 > policy.class_prior(1)[0]
    assert policy.class_prior(0) == policy.prior
    fresh = [RequestView(4, [], [], draft_class=4), RequestView(4, [], [], draft_class=1)]
    ks = policy.choose(fresh, StepPrice(2, 2, 200, step, no_draft_cost))
    assert ks[0] >= 2 and ks[1] == 0


def test_a_requests_counts_are_kept_per_draft_grade():
    from tidal.adaptive.stats import SpecStats

    stats = SpecStats()
    stats.draft_class = 4
    stats.record(2, 2)
    stats.draft_class = 1
    stats.record(2, 0)
    assert stats.counts(4) == ([1.0, 1.0], [1.0, 1.0])
    assert stats.counts(1) == ([1.0, 0.0], [0.0, 0.0])
    assert stats.counts(3) == ([], []) and stats.num_drafted == 4 and stats.num_accepted == 2


def test_drafts_of_one_request_pay_for_one_verifying_sequence():
    """Each sequence verifying drafts costs 10 ms beyond its tokens. Four drafts of the one
    request that accepts (0.95) pay that once: worth it. Priced as four verifying sequences
    (one per draft) they would not be."""
    def step(tokens, seqs, context, verifying=0):
        return 0.050 + 0.001 * tokens + 0.010 * verifying
    reqs = views([0.95] + [0.05] * 7, k=4)
    policy = SpecPolicy("adaptive", 4, probe_every=10**9)
    assert policy.choose(reqs, StepPrice(8, 8, 800, step, no_draft_cost)) == [4] + [0] * 7
    per_draft = lambda t, s, c, v=0: step(t, s, c, min(t - 8, s))  # noqa: E731
    assert SpecPolicy("adaptive", 4, probe_every=10**9).choose(reqs, StepPrice(8, 8, 800, per_draft, no_draft_cost)) == [0] * 8
