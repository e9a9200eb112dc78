"""The simulator schedules exactly as the engine does: same steps, same shapes, under chunked
prefill and preemption (a tiny random model runs the engine; speculation off, so no acceptance
sampling makes the two differ)."""

import pytest

from tidal import SamplingParams
from tidal.config import CacheConfig, SchedulerConfig
from tidal.engine.llm_engine import LLM
from tidal.engine.step_log import read_step_log
from tidal.sim.measured import MeasuredModel
from tidal.sim.simulator import AcceptanceModel, Simulator, Workload, parse_modes

CONCURRENCY, NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 4, 7, 20, 16
SCHEDULER = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32)  # prompts are chunked
NUM_BLOCKS, BLOCK_SIZE = 24, 4  # 4 requests need 36 blocks at the end: some are preempted


def run_closed_loop(eng) -> None:
    """The workload the simulator runs: CONCURRENCY requests in flight until NUM_PROMPTS are done."""
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True)
    sent = 0
    for _ in range(CONCURRENCY):
        eng.add_request(f"r{sent}", [1] * INPUT_LEN, params)
        sent += 1
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished and sent < NUM_PROMPTS:
                eng.add_request(f"r{sent}", [1] * INPUT_LEN, params)
                sent += 1


def engine_steps(model_dir, log_path) -> tuple[list[tuple[int, int, int]], tuple[int, ...]]:
    """The engine's step shapes, read back from its --step-log file, and its step-cost knots."""
    llm = LLM(str(model_dir), dtype="float32", enforce_eager=True, cache=CacheConfig(BLOCK_SIZE, NUM_BLOCKS), scheduler=SCHEDULER,
              step_log=str(log_path))
    run_closed_loop(llm.engine)
    llm.engine.step_log.close()
    rows = read_step_log(log_path)[2]
    assert {r["kind"] for r in rows} == {"step"}  # speculation off: no profile, no drafts
    return [(int(r["tokens"]), int(r["seqs"]), int(r["context"])) for r in rows], tuple(llm.engine.step_cost.knots)


class Recorder:
    def __init__(self):
        self.shapes, self.verifying = [], []

    def step_time(self, shape):
        self.shapes.append((shape.tokens, shape.seqs, shape.context))
        self.verifying.append(shape.verifying)
        return 0.01

    def draft_time(self, ks, catch_up):
        return 0.0


def test_simulated_steps_equal_the_engines(tiny_model_dir, tmp_path):
    rec = Recorder()
    sim = Simulator(rec, parse_modes("off")[0], AcceptanceModel((0.5,)), SCHEDULER, NUM_BLOCKS, BLOCK_SIZE)
    preempted = []
    schedule = sim.scheduler.schedule

    def watch():
        out = schedule()
        preempted.extend(out.preempted)
        return out

    sim.scheduler.schedule = watch
    run = sim.run(Workload(CONCURRENCY, NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN))
    assert preempted, "the case should exercise preemption"
    assert any(t > s for t, s, _ in rec.shapes), "the case should exercise chunked prefill"
    assert [t.num_tokens for t in run.traces] == [OUTPUT_LEN] * NUM_PROMPTS
    log = tmp_path / "steps.csv"
    shapes, knots = engine_steps(tiny_model_dir, log)
    assert shapes == rec.shapes
    assert run.duration == pytest.approx(0.01 * len(rec.shapes))
    measured = MeasuredModel.load(log)  # the step log is a profile tidal sim reads
    assert measured.knots == knots
    assert measured.step_cost.num_samples == len(rec.shapes)


class KnowingDrafter:
    """Drafts the target's own greedy continuation (every request has the same prompt, so the
    same one), wrong wherever the output position is 2 mod 3, so verifications accept 0..k
    drafts; catches up like the EAGLE-3 drafter, so the policy sees the same catch-up."""

    def __init__(self, continuation):
        self.continuation = continuation
        self.caught_up = {}

    def propose(self, seqs, ks):
        drafts = []
        for seq, k in zip(seqs, ks):
            if k:
                self.caught_up[seq] = seq.num_computed_tokens
            n = len(seq.output_token_ids)
            drafts.append([self.continuation[i] if i % 3 != 2 else self.continuation[i] + 1
                           for i in range(n, n + k)])
        return drafts, None

    def available(self, seqs, max_k):
        return [max_k] * len(seqs)

    def draft_class(self, seq):
        return 0

    def catch_up(self, seq):
        return seq.num_computed_tokens - self.caught_up.get(seq, 0)

    def forget(self, seq):
        self.caught_up.pop(seq, None)


class Replay:
    """An acceptance model that replays the engine's verifications in order."""

    def __init__(self, verifications):
        self.verifications = list(verifications)

    def sample(self, num_drafts, rng):
        drafted, accepted = self.verifications.pop(0)
        assert drafted == num_drafts
        return accepted


@pytest.mark.parametrize("mode", ["fixed:3", "schedule:1-2:3,3-:1"])
def test_simulated_speculation_equals_the_engines(tiny_model_dir, mode, monkeypatch):
    from tidal.config import SpecConfig
    from tidal.adaptive.stats import SpecStats

    fades = []  # steps in which a request emitted without drafting (its estimate ages), engine then sim
    fade = SpecStats.fade
    monkeypatch.setattr(SpecStats, "fade", lambda self: (fades.append(1), fade(self)))

    spec_mode = parse_modes(mode)[0]
    spec = SpecConfig("ngram", spec_mode.max_k, mode=spec_mode.mode, schedule=spec_mode.schedule)
    llm = LLM(str(tiny_model_dir), dtype="float32", enforce_eager=True, cache=CacheConfig(BLOCK_SIZE, NUM_BLOCKS),
              scheduler=SCHEDULER, spec=spec)
    continuation = llm.generate([[1] * INPUT_LEN], SamplingParams(max_tokens=OUTPUT_LEN + 8, temperature=0,
                                                                  ignore_eos=True))[0].token_ids
    eng, shapes, verifying, verifications = llm.engine, [], [], []
    eng.drafter = KnowingDrafter(continuation)
    observe, record = eng.step_cost.observe, eng.policy.record
    eng.step_cost.observe = lambda t, s, c, sec, **kw: (shapes.append((t, s, c)), verifying.append(kw["drafting"]),
                                                        observe(t, s, c, sec, **kw))
    eng.policy.record = lambda d, a, c=0: (verifications.append((d, a)), record(d, a, c))

    fades.clear()  # not the continuation's
    run_closed_loop(eng)
    assert {a for _, a in verifications} >= {0, 1, 2}, "the case should accept some drafts, not all"
    engine_fades, fades[:] = len(fades), []

    rec = Recorder()
    sim = Simulator(rec, spec_mode, Replay(verifications), SCHEDULER, NUM_BLOCKS, BLOCK_SIZE)
    run = sim.run(Workload(CONCURRENCY, NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN))
    assert rec.shapes == shapes
    assert rec.verifying == verifying and max(verifying) > 1  # the sequences verifying drafts, step by step
    assert run.num_verifications == len(verifications) and not sim.acceptance.verifications
    assert len(fades) == engine_fades > 0
