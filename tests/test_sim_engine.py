"""The simulator schedules exactly as the engine does: same steps, same shapes, under chunked
prefill and preemption (a tiny random model runs the engine; speculation off, so no acceptance
sampling makes the two differ)."""

import pytest

from tidal import SamplingParams
from tidal.config import CacheConfig, SchedulerConfig
from tidal.engine.llm_engine import LLM
from tidal.sim.simulator import AcceptanceModel, Simulator, Workload, parse_modes

CONCURRENCY, NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 4, 7, 20, 16
SCHEDULER = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32)  # prompts are chunked
NUM_BLOCKS, BLOCK_SIZE = 24, 4  # 4 requests need 36 blocks at the end: some are preempted


def engine_steps(model_dir) -> list[tuple[int, int, int]]:
    llm = LLM(str(model_dir), dtype="float32", cache=CacheConfig(BLOCK_SIZE, NUM_BLOCKS), scheduler=SCHEDULER)
    eng, shapes, sent = llm.engine, [], [0]
    observe = eng.step_cost.observe

    def spy(tokens, seqs, context, seconds, anchor=False):
        shapes.append((tokens, seqs, context))
        observe(tokens, seqs, context, seconds, anchor)

    eng.step_cost.observe = spy
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True)

    def send():
        eng.add_request(f"r{sent[0]}", [1] * INPUT_LEN, params)
        sent[0] += 1

    for _ in range(CONCURRENCY):
        send()
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished and sent[0] < NUM_PROMPTS:
                send()
    return shapes


class Recorder:
    def __init__(self):
        self.shapes = []

    def step_time(self, shape):
        self.shapes.append((shape.tokens, shape.seqs, shape.context))
        return 0.01

    def draft_time(self, ks, catch_up):
        return 0.0


def test_simulated_steps_equal_the_engines(tiny_model_dir):
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
    assert engine_steps(tiny_model_dir) == rec.shapes
    assert run.duration == pytest.approx(0.01 * len(rec.shapes))
