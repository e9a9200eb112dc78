"""EAGLE-3 training: the training-time-test unroll sees exactly what inference drafting sees."""

import pytest
import torch

from tidal import SamplingParams
from tidal.sequence import Sequence
from tidal.train.eagle3 import (Example, draft_vocab, load_examples, save_examples, target_answers, ttt_forward,
                                ttt_loss)
from tests.test_eagle import eagle_setup, make  # noqa: F401  (fixture)


def test_ttt_unroll_matches_the_inference_chain(eagle_setup):  # noqa: F811
    """Step j of the unroll at position m + j - 1 equals the j-th chain step of the drafter after a
    catch-up over positions < m, on the paged cache, for chains started at several m."""
    target, head_dir = eagle_setup
    eng = make(target, head_dir).engine
    head = eng.drafter.head
    g = torch.Generator().manual_seed(0)
    N, steps = 24, 4
    ids = torch.randint(0, 256, (N,), generator=g)
    feats = torch.randn(N, 3 * 64, generator=g)
    with torch.no_grad():
        unrolled = ttt_forward(head, ids[None], feats[None], steps)
    seq = Sequence("t", ids.tolist(), SamplingParams())
    eng.block_manager.allocate(seq, N)
    for m in (1, 5, 17):
        kv = (torch.zeros_like(eng.drafter.kv[0]), torch.zeros_like(eng.drafter.kv[1]))
        positions, meta = eng.runner.metadata([(seq, 0, m)])
        logits, out = head(ids[1:m + 1], head.fuse(feats[:m]), positions, kv, meta)
        torch.testing.assert_close(logits[-1], unrolled[0][0, m - 1], atol=1e-4, rtol=1e-4)
        out = out[-1:]
        for j in range(1, steps):
            p = m + j - 1
            positions, meta = eng.runner.metadata([(seq, p, 1)])
            logits, out = head(ids[m + j:m + j + 1], out, positions, kv, meta)
            torch.testing.assert_close(logits[0], unrolled[j][0, p], atol=1e-4, rtol=1e-4)


def test_ttt_loss_trains_a_head_towards_the_target(eagle_setup):  # noqa: F811
    """A few optimiser steps on synthetic examples lower the loss; agreement is a fraction."""
    target, head_dir = eagle_setup
    head = make(target, head_dir).engine.drafter.head
    for p in head.parameters():
        p.requires_grad_(True)
    g = torch.Generator().manual_seed(1)
    examples = [Example(torch.randint(0, 256, (20,), generator=g), torch.randn(20, 192, generator=g),
                        torch.randn(20, 64, generator=g), 4) for _ in range(4)]
    unembed = torch.randn(head.cfg.draft_vocab_size, 64, generator=g)
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    first = None
    for _ in range(20):
        loss, per_step, agree = ttt_loss(head, unembed, examples, 3)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first if first is not None else loss.item()
        assert len(per_step) == len(agree) == 3 and all(0 <= a <= 1 for a in agree)
    assert loss.item() < 0.8 * first


def test_draft_vocab_is_the_most_frequent_answer_tokens():
    ex = [Example(torch.tensor([9, 9, 9, 5, 5, 7, 7, 7, 3]), torch.zeros(9, 3), torch.zeros(9, 1), 3)]
    assert draft_vocab(ex, 2, 16).tolist() == [5, 7]  # answers only: 9 is the prompt's


def test_saved_examples_load_back_only_for_the_same_key(tmp_path):
    g = torch.Generator().manual_seed(0)
    examples = [Example(torch.randint(0, 50, (n,), generator=g), torch.randn(n, 6, generator=g),
                        torch.randn(n, 2, generator=g), p) for n, p in ((5, 2), (3, 1))]
    key = {"model": "m", "max_tokens": 8, "prompts": "abc"}
    path = str(tmp_path / "data.pt")
    save_examples(path, examples, key)
    loaded = load_examples(path, dict(key))
    assert [e.prompt_len for e in loaded] == [2, 1]
    for a, b in zip(loaded, examples):
        assert torch.equal(a.ids, b.ids) and torch.equal(a.features, b.features) and torch.equal(a.hidden, b.hidden)
    with pytest.raises(ValueError, match="generated for"):
        load_examples(path, {**key, "max_tokens": 16})


def test_sampled_answers_are_seeded_and_not_the_greedy_ones():
    from tidal import LLM
    from tidal.config import CacheConfig

    llm = LLM(enforce_eager=True, cache=CacheConfig(kv_cache_bytes=64 << 20))  # the bundled model: it has a chat template
    texts = ["Name a colour.", "Write a word that rhymes with cat.", "Say something about rivers."]
    greedy = target_answers(llm, texts, 12)
    sampled = target_answers(llm, texts, 12, temperature=1.0, seed=3)
    assert sampled == target_answers(llm, texts, 12, temperature=1.0, seed=3)  # reproducible
    assert [p for p, _ in sampled] == [p for p, _ in greedy] and sampled != greedy
    assert sampled != target_answers(llm, texts, 12, temperature=1.0, seed=4)
