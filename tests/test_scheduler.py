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


def _two_decoding(num_blocks: int):
    """Block size 4: `a` decodes with 8 tokens in its 2 blocks, `b` has filled its one block and
    needs a second for its next token."""
    bm = BlockManager(num_blocks, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), bm)
    params = SamplingParams(max_tokens=32)
    a, b = Sequence("a", list(range(1, 8)), params, arrival=0), Sequence("b", [1, 2, 3, 4], params, arrival=1)
    for seq in (a, b):
        sched.add(seq)
    sched.schedule()
    for seq in (a, b):
        seq.num_computed_tokens = seq.num_tokens
        seq.output_token_ids.append(5)
    assert bm.num_missing_blocks(a, a.num_tokens) == 0 and bm.num_missing_blocks(b, b.num_tokens) == 1
    return sched, bm, a, b


def test_drafts_never_take_the_blocks_a_running_request_needs_next():
    """Of 3 free blocks one is b's, so two are spare: `a` gets the 8 drafts that fit there, not
    12 (which took b's block and made the next step preempt b); `b` drafts into the rest of its
    own new block."""
    sched, bm, a, b = _two_decoding(6)
    assert sched.reserve_drafts([a, b], [12, 12]) == [8, 3]
    a.draft_token_ids, b.draft_token_ids = [7] * 8, [7] * 3
    out = sched.schedule()
    assert not out.preempted
    assert [(s.seq.request_id, s.num_new_tokens, s.num_draft_tokens) for s in out.scheduled] == [("a", 9, 8), ("b", 4, 3)]


def test_nobody_drafts_when_the_next_step_must_preempt():
    """After one step of drafts, all accepted, both requests need a block for their next token
    and one is free: the next step preempts b whatever happens, so no request drafts (before,
    `a` took that block for 3 drafts)."""
    sched, bm, a, b = _two_decoding(6)
    assert sched.reserve_drafts([a, b], [4, 3]) == [4, 3]
    a.draft_token_ids, b.draft_token_ids = [7] * 4, [7] * 3
    sched.schedule()
    for seq, n in ((a, 4), (b, 3)):  # every draft accepted, and the target's next token
        seq.num_computed_tokens = seq.num_tokens + n
        seq.output_token_ids.extend([5] * (n + 1))
        seq.draft_token_ids = []
    assert bm.num_free_blocks == 1 and bm.num_missing_blocks(a, a.num_tokens) == bm.num_missing_blocks(b, b.num_tokens) == 1
    assert sched.reserve_drafts([a, b], [4, 4]) == [0, 0]
