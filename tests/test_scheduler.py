"""The scheduler's view of the next step for the speculation policy: pure bookkeeping, no model."""

from tidal.config import SchedulerConfig
from tidal.engine.block_manager import BlockManager
from tidal.engine.scheduler import Scheduler
from tidal.sampling_params import SamplingParams
from tidal.sequence import Sequence


def test_drafts_within_the_spec_budget_never_delay_an_admission():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16), BlockManager(64, 4))
    params = SamplingParams(max_tokens=32)
    first = Sequence("a", list(range(1, 9)), params, arrival=0)
    sched.add(first)
    sched.schedule()  # its whole prompt
    first.num_computed_tokens = 8
    first.output_token_ids.append(5)  # decoding from now on
    sched.add(Sequence("b", list(range(1, 11)), params, arrival=1))
    load = sched.spec_load([first])
    assert (load.tokens, load.seqs, load.context, load.draft_budget) == (11, 1, 9, 5)
    first.draft_token_ids = [7] * load.draft_budget
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens, s.num_draft_tokens) for s in out.scheduled] == [("a", 6, 5), ("b", 10, 0)]
