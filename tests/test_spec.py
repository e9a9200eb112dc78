"""Speculative decoding: n-gram drafting, lossless verification, engine integration."""

from dataclasses import replace

import pytest
import torch

from tidal import SamplingParams
from tidal.config import CacheConfig, SchedulerConfig, SpecConfig
from tidal.engine.llm_engine import LLM
from tidal.speculative import verify
from tidal.speculative.ngram import TokenIndex, match_grade, ngram_match, ngram_propose


def test_ngram_proposes_the_continuation_of_the_latest_match():
    assert ngram_propose([1, 2, 3, 4, 1, 2], k=3) == [3, 4, 1]
    assert ngram_propose([5, 6, 7, 5, 6, 8, 5, 6], k=2) == [8, 5]  # latest match wins
    assert ngram_propose([1, 2, 3, 9, 9, 2, 3], k=5, max_n=2) == [9, 9, 2, 3]
    assert ngram_propose([1, 2, 3, 4], k=3) == []
    assert ngram_propose([7], k=3) == []


def test_ngram_match_length_extends_past_the_suffix_and_grades_it():
    # the 4-token suffix 2 3 4 5 recurs, preceded by 1 there and here: 5 tokens match
    assert ngram_match([1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5], k=2) == ([9, 1], 5)
    assert ngram_match([8, 3, 4, 9, 7, 3, 4], k=1) == ([9], 2)  # only the bigram 3 4 recurs
    assert ngram_match(list(range(20)) + list(range(20)), k=3, longest=16) == ([0, 1, 2], 16)
    assert ngram_match([1, 2, 3], k=2) == ([], 0)
    assert [match_grade(n) for n in (0, 2, 3, 4, 7, 8, 15, 16, 40)] == [0, 1, 1, 2, 2, 3, 3, 4, 4]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_DF5_P001 = 20.52  # chi-square critical value, 5 degrees of freedom, p = 0.001


def first_tokens(p, q, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.log(p).expand(2, -1)
    counts = torch.zeros(len(p))
    for _ in range(n):
        x = int(torch.multinomial(q, 1, generator=gen))
        counts[verify.verify_sampled(logits, [x], q[None], 1.0, -1, 1.0, gen)[0]] += 1
    return counts


P = torch.tensor([0.05, 0.10, 0.40, 0.20, 0.15, 0.10])
Q = torch.tensor([0.30, 0.30, 0.10, 0.10, 0.10, 0.10])


def test_rejection_sampling_is_lossless():
    counts = first_tokens(P, Q, 20_000)
    assert chi_square(counts, P) < CHI2_DF5_P001
    assert chi_square(counts, Q) > 100  # the draft distribution is clearly not what came out


def test_a_broken_rejection_sampler_fails_the_same_test(monkeypatch):
    monkeypatch.setattr(verify, "residual", lambda p, q: p)  # resample from p, not max(p - q, 0)
    assert chi_square(first_tokens(P, Q, 20_000), P) > CHI2_DF5_P001


def test_one_hot_draft_is_lossless():
    gen = torch.Generator().manual_seed(1)
    logits = torch.log(P).expand(2, -1)
    counts = torch.zeros(len(P))
    for _ in range(20_000):
        counts[verify.verify_sampled(logits, [2], None, 1.0, -1, 1.0, gen)[0]] += 1
    assert chi_square(counts, P) < CHI2_DF5_P001


def test_greedy_verification_accepts_the_matching_prefix():
    logits = torch.full((4, 10), -5.0)
    for i, t in enumerate([3, 4, 7, 1]):
        logits[i, t] = 5.0
    assert verify.verify_greedy(logits, [3, 4, 5]) == [3, 4, 7]
    assert verify.verify_greedy(logits, [3, 4, 7]) == [3, 4, 7, 1]
    assert verify.verify_greedy(logits, [9, 4, 7]) == [3]


REPEAT = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def repetitive_prompts(n):
    g = torch.Generator().manual_seed(4)
    out = []
    for i in range(n):
        motif = torch.randint(0, 256, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
        out.append(motif * (2 + i % 4))
    return out


def tiny(path, spec="none", num_blocks=512, max_num_batched_tokens=2048):
    return LLM(str(path), dtype="float32", enforce_eager=True, spec=SpecConfig(method=spec, num_speculative_tokens=4),
               cache=CacheConfig(block_size=4, num_blocks=num_blocks),
               scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens))


def test_ngram_greedy_equals_no_speculation_on_tiny_model(tiny_model_dir):
    ps = repetitive_prompts(10)
    plain = tiny(tiny_model_dir).generate(ps, REPEAT)
    spec_llm = tiny(tiny_model_dir, "ngram")
    eng = spec_llm.engine
    seqs = [eng.add_request(str(i), p, REPEAT) for i, p in enumerate(ps)]
    published = {str(i): [0, 0] for i in range(len(ps))}  # what the step results say, per request
    while eng.has_unfinished():
        for out in eng.step():
            published[out.request_id][0] += out.num_draft_tokens
            published[out.request_id][1] += out.num_accepted_tokens
    assert [s.output_token_ids for s in seqs] == [o.token_ids for o in plain]
    assert sum(s.spec.num_accepted for s in seqs) > 0
    assert all(s.spec.num_accepted <= s.spec.num_drafted for s in seqs)
    assert [published[s.request_id] for s in seqs] == [[s.spec.num_drafted, s.spec.num_accepted] for s in seqs]
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.parametrize("num_blocks, budget", [(40, 2048), (512, 7)])
def test_ngram_under_preemption_or_small_budget_keeps_outputs(tiny_model_dir, num_blocks, budget):
    ps = repetitive_prompts(10)
    plain = tiny(tiny_model_dir).generate(ps, REPEAT)
    eng = tiny(tiny_model_dir, "ngram", num_blocks=num_blocks, max_num_batched_tokens=budget).engine
    seqs = [eng.add_request(str(i), p, REPEAT) for i, p in enumerate(ps)]
    max_fed = 0
    while eng.has_unfinished():
        before = sum(s.spec.num_drafted for s in seqs)
        eng.step()
        max_fed = max(max_fed, sum(s.spec.num_drafted for s in seqs) - before)
    assert [s.output_token_ids for s in seqs] == [o.token_ids for o in plain]
    if num_blocks == 40:
        assert sum(s.num_preemptions for s in seqs) > 0
    else:
        assert 0 < max_fed < budget  # drafts rode along, trimmed to the step's token budget
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_sampled_speculation_is_reproducible_with_a_seed(tiny_model_dir):
    llm = tiny(tiny_model_dir, "ngram")
    sp = SamplingParams(max_tokens=30, temperature=0.8, top_k=20, seed=7, ignore_eos=True)
    ps = repetitive_prompts(3)
    a = [o.token_ids for o in llm.generate(ps, sp)]
    b = [o.token_ids for o in llm.generate(ps, sp)]
    assert a == b and all(len(x) == 30 for x in a)


@pytest.fixture(scope="module")
def spec_prompts(llm):
    from tidal.datasets import chat_prompts, rewrite_prompts

    texts = chat_prompts()[:10] + rewrite_prompts()[:10]
    return [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": t}]))
            for t in texts]


@pytest.fixture(scope="module")
def plain_outputs(llm, spec_prompts):
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    return [llm.generate([p], params)[0].token_ids for p in spec_prompts]


@pytest.fixture(scope="module")
def random_bundled_head(llm, tmp_path_factory):
    """An untrained EAGLE-3 head shaped for SmolLM2: drafts are mostly wrong, which exercises
    rejection on the real model (acceptance is covered on the tiny model in test_eagle.py)."""
    from tidal.models.eagle3 import Eagle3Config, Eagle3Head, save_eagle3

    t = llm.engine.model_config
    layer = replace(t, num_layers=1, intermediate_size=1024)
    head = Eagle3Head(Eagle3Config(layer, 4096, t.hidden_size, Eagle3Config.default_aux_layers(t.num_layers)),
                      llm.engine.runner.model.embed)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    path = tmp_path_factory.mktemp("smollm2-random-eagle3")
    save_eagle3(head, path)
    return str(path)


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_greedy_is_lossless_on_the_bundled_model(spec_prompts, plain_outputs, random_bundled_head, method):
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    plain = plain_outputs
    draft = random_bundled_head if method == "eagle3" else None
    spec = LLM(dtype="float32", enforce_eager=True, spec=SpecConfig(method=method, num_speculative_tokens=4, draft_model=draft))
    alone = [spec.generate([p], params)[0].token_ids for p in spec_prompts]
    assert alone == plain
    eng = spec.engine
    seqs = []
    for i in range(0, len(spec_prompts), 8):  # 8 concurrent requests at a time
        group = [eng.add_request(f"c8-{i + j}", p, params) for j, p in enumerate(spec_prompts[i:i + 8])]
        while eng.has_unfinished():
            eng.step()
        seqs += group
    assert [s.output_token_ids for s in seqs] == plain
    assert all(s.spec.num_drafted > 0 for s in seqs)
    if method == "ngram":
        assert sum(s.spec.num_accepted for s in seqs) > 20  # the rewrite prompts get drafts accepted


def test_ngram_match_agrees_with_a_brute_force_search():
    """The latest earlier occurrence of the longest suffix of 4..2 tokens, searched naively."""
    import random

    def naive(tokens, k):
        for n in range(min(4, len(tokens) - 1), 1, -1):
            hits = [i for i in range(len(tokens) - n) if tokens[i:i + n] == tokens[-n:]]
            if hits:
                end = hits[-1] + n - 1
                m = n
                while m < 16 and end - m >= 0 and tokens[end - m] == tokens[-1 - m]:
                    m += 1
                return tokens[end + 1:end + 1 + k], m
        return [], 0
    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randrange(rng.randint(2, 5)) for _ in range(rng.randint(1, 60))]
        k = rng.randint(1, 5)
        assert ngram_match(tokens, k) == naive(tokens, k), tokens
    for _ in range(50):  # one index grown with the sequence, as the drafter keeps it per request
        tokens, index = [], TokenIndex()
        for _ in range(rng.randint(1, 80)):
            tokens.append(rng.randrange(4))
            assert ngram_match(tokens, 3, index=index) == naive(tokens, 3), tokens
