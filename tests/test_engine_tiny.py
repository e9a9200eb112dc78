"""Engine, scheduler and block manager on a tiny random HF-layout Llama."""

import pytest
import torch

from tidal import SamplingParams
from tidal.config import CacheConfig, EngineConfig, SchedulerConfig
from tidal.engine.llm_engine import LLM, LLMEngine
from tidal.sampling_params import InvalidParameter
from tests.conftest import make_tiny_llama

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def engine(path, **kw):
    cache = CacheConfig(block_size=4, num_blocks=kw.pop("num_blocks", 512))
    sched = SchedulerConfig(**kw)
    return LLM(str(path), dtype="float32", enforce_eager=True, cache=cache, scheduler=sched)


def test_hf_dir_logits_match_transformers(tmp_path):
    for tie in (False, True):
        d = tmp_path / f"tie{tie}"
        d.mkdir()
        ref = make_tiny_llama(d, tie=tie, seed=1)
        llm = engine(d)
        ids = prompts(1, seed=3)[0]
        eng = llm.engine
        eng.add_request("p", ids, SamplingParams(max_tokens=1))
        out = eng.scheduler.schedule()
        input_ids, positions, meta = eng.runner.prepare(out.scheduled)
        hidden, aux = eng.runner.model(input_ids, positions, eng.runner.kv_caches, meta, aux_layers=(0, 1))
        ours = eng.runner.model.compute_logits(hidden)
        with torch.no_grad():
            expected = ref(torch.tensor([ids]), output_hidden_states=True)
        assert (ours - expected.logits[0]).abs().max().item() < 1e-4
        # the residual stream after layers 0 and 1 (EAGLE-3 drafts from such features);
        # HF's last entry is already normed, so compare the ones before it
        assert len(aux) == 2
        torch.testing.assert_close(aux[0], expected.hidden_states[1][0], atol=1e-5, rtol=1e-5)


def test_greedy_matches_transformers_generate(tiny_model_dir):
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    llm = engine(tiny_model_dir)
    ps = prompts(6)
    outs = llm.generate(ps, GREEDY)
    for p, o in zip(ps, outs):
        x = torch.tensor([p])
        g = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
        assert o.token_ids == g[0, len(p):].tolist()


def test_chunked_prefill_and_preemption_keep_outputs(tiny_model_dir):
    ps = prompts(12, seed=5)
    baseline = engine(tiny_model_dir).generate(ps, GREEDY)
    # 8-token budget forces chunked prefill; 24 blocks of 4 slots cannot hold 12 requests at once.
    small = engine(tiny_model_dir, num_blocks=24, max_num_batched_tokens=8)
    outs = small.generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in baseline]
    eng = small.engine
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert not eng.scheduler.running and not eng.scheduler.waiting


def test_preemption_happens_under_small_pool(tiny_model_dir):
    llm = engine(tiny_model_dir, num_blocks=24)
    eng = llm.engine
    seqs = [eng.add_request(str(i), p, GREEDY) for i, p in enumerate(prompts(12, seed=5))]
    while eng.has_unfinished():
        eng.step()
    assert sum(s.num_preemptions for s in seqs) > 0
    assert all(s.finish_reason == "length" and len(s.output_token_ids) == 24 for s in seqs)


def test_abort_frees_all_blocks(tiny_model_dir):
    llm = engine(tiny_model_dir)
    eng = llm.engine
    for i, p in enumerate(prompts(5)):
        eng.add_request(str(i), p, GREEDY)
    for _ in range(3):
        eng.step()
    assert eng.block_manager.num_free_blocks < eng.block_manager.num_blocks
    for i in range(5):
        assert eng.abort(str(i))
    assert not eng.abort("0")  # already gone
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert not eng.has_unfinished() and eng.step() == []


def test_max_num_seqs_bounds_the_running_batch(tiny_model_dir):
    eng = engine(tiny_model_dir, max_num_seqs=3).engine
    for i, p in enumerate(prompts(7)):
        eng.add_request(str(i), p, GREEDY)
    while eng.has_unfinished():
        assert len(eng.scheduler.running) <= 3
        eng.step()


def test_requests_that_cannot_fit_are_rejected(tiny_model_dir):
    eng = engine(tiny_model_dir, num_blocks=8).engine  # 32 slots
    with pytest.raises(InvalidParameter, match="max_tokens"):
        eng.add_request("a", [1] * 20, SamplingParams(max_tokens=20))
    with pytest.raises(InvalidParameter, match="context length"):
        eng.add_request("b", [1] * 10, SamplingParams(max_tokens=600))
    with pytest.raises(InvalidParameter, match="prompt"):
        eng.add_request("c", [], SamplingParams())
    with pytest.raises(InvalidParameter, match="token ids"):
        eng.add_request("d", [10_000], SamplingParams())
    assert not eng.has_unfinished()


def test_stop_conditions(tiny_model_dir):
    llm = engine(tiny_model_dir)
    p = prompts(1, seed=9)[0]
    free = llm.generate([p], GREEDY)[0]
    target = free.token_ids[5]
    stopped = llm.generate([p], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                               stop_token_ids=(target,)))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == target
    assert len(stopped.token_ids) == free.token_ids.index(target) + 1
    text = free.text
    stop_str = text[len(text) // 2: len(text) // 2 + 2]
    if stop_str.strip():
        out = llm.generate([p], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=stop_str))[0]
        assert out.finish_reason == "stop" and stop_str not in out.text and text.startswith(out.text)


def test_seeded_sampling_reproducible_alone_and_batched(tiny_model_dir):
    llm = engine(tiny_model_dir)
    ps = prompts(4, seed=2)
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=1234)
    alone = llm.generate([ps[0]], sp)[0].token_ids
    assert llm.generate([ps[0]], sp)[0].token_ids == alone
    mixed = llm.generate(ps, [sp] + [SamplingParams(max_tokens=16, temperature=0.8)] * 3)
    assert mixed[0].token_ids == alone
    other = llm.generate([ps[0]], SamplingParams(max_tokens=16, temperature=1.0, seed=99))[0].token_ids
    assert other != alone


def test_bad_input_is_rejected_and_loses_nothing(tiny_model_dir):
    llm = engine(tiny_model_dir)
    eng = llm.engine
    with pytest.raises(InvalidParameter, match="prompt"):
        eng.add_request("x", None, GREEDY)
    with pytest.raises(InvalidParameter, match="token ids"):
        eng.add_request("y", [True, False], GREEDY)
    with pytest.raises(TypeError):
        eng.add_request("z", [1, 2], {"max_tokens": 3})
    assert not eng.has_unfinished()
    ok = llm.generate([[1, 2, 3]], GREEDY)[0]  # the engine still serves
    assert len(ok.token_ids) == 24
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_bos_is_added_once_when_the_model_asks(tmp_path):
    import json

    make_tiny_llama(tmp_path)
    tc = tmp_path / "tokenizer_config.json"
    tc.write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    tok = engine(tmp_path).tokenizer
    assert tok.encode("hi")[0] == 256 and tok.encode("<s>hi").count(256) == 1
    tc.write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    assert 256 not in engine(tmp_path).tokenizer.encode("hi")


def test_one_token_sequences_get_their_own_attention_call_when_drafts_would_pad_them(tiny_model_dir, monkeypatch):
    """Twelve decoding sequences and one verifying four drafts: padded to five queries in one
    attention call they would do 5x the work, so they run as two calls, with the same result."""
    from tidal.engine import model_runner
    from tidal.engine.scheduler import ScheduledSeq

    eng = engine(tiny_model_dir).engine
    for i, p in enumerate(prompts(13, seed=3)):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    eng.step()  # prefill: every sequence now has one token to feed
    seqs = list(eng.scheduler.running)
    seqs[0].draft_token_ids = [5, 6, 7, 8]
    for i, s in enumerate(seqs):
        eng.block_manager.allocate(s, s.num_tokens + (4 if i == 0 else 0))
    step = [ScheduledSeq(seqs[0], 5, 4)] + [ScheduledSeq(s, 1) for s in seqs[1:]]
    runner = eng.runner

    def forward():
        ids, positions, meta = runner.prepare(step)
        return len(meta.groups), runner.model(ids, positions, runner.kv_caches, meta, ())[0]

    groups, split = forward()
    monkeypatch.setattr(model_runner, "SPLIT_PAD_ROWS", 10**9)
    one, padded = forward()
    assert (groups, one) == (2, 1)
    torch.testing.assert_close(split, padded)
