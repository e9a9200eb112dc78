"""EAGLE-3: the head's checkpoint layout, and drafting inside the engine on a tiny target."""

import json

import pytest
import torch

from tidal import SamplingParams
from tidal.config import CacheConfig, ModelConfig, SpecConfig
from tidal.engine.llm_engine import LLM
from tidal.models.eagle3 import Eagle3Config, Eagle3Head, load_eagle3, save_eagle3
from tidal.speculative.eagle import Eagle3Drafter
from tests.conftest import make_tiny_llama

TARGET = ModelConfig(vocab_size=258, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                     num_kv_heads=2, head_dim=16, max_model_len=512)


def random_head(seed=0, draft_vocab=200):
    g = torch.Generator().manual_seed(seed)
    layer = ModelConfig(vocab_size=258, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                        num_kv_heads=2, head_dim=16, max_model_len=512)
    cfg = Eagle3Config(layer, draft_vocab, 64, (1, 2, 3))
    head = Eagle3Head(cfg, torch.randn(258, 64, generator=g))
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        head.d2t.copy_(torch.randint(0, 58, (draft_vocab,), generator=g).sort().values)
    return head


def test_checkpoint_roundtrip_in_public_layout(tmp_path):
    head = random_head()
    save_eagle3(head, tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 200
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight",
            "midlayer.mlp.gate_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    loaded = load_eagle3(tmp_path, TARGET, head.embed)
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    t2d = load_file(str(tmp_path / "model.safetensors"))["t2d"]
    assert int(t2d.sum()) == len(set((torch.arange(200) + head.d2t).tolist()))


def test_bad_head_configs_are_rejected(tmp_path):
    save_eagle3(random_head(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for bad in ({"architectures": ["LlamaForCausalLM"]}, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 1, 2]}},
                {"vocab_size": 999}):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **bad}))
        with pytest.raises(ValueError):
            load_eagle3(tmp_path, TARGET, torch.zeros(258, 64))


@pytest.fixture(scope="module")
def eagle_setup(tmp_path_factory):
    target = tmp_path_factory.mktemp("tiny4")
    make_tiny_llama(target, layers=4)
    head_dir = tmp_path_factory.mktemp("head")
    save_eagle3(random_head(), head_dir, dtype=torch.float32)
    return target, head_dir


def prompts(n, seed=4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)


def make(target, head_dir=None, k=4, num_blocks=512):
    spec = SpecConfig("eagle3", k, draft_model=str(head_dir)) if head_dir else SpecConfig()
    return LLM(str(target), dtype="float32", enforce_eager=True, spec=spec,
               cache=CacheConfig(block_size=4, num_blocks=num_blocks))


def test_random_head_is_lossless(eagle_setup):
    target, head_dir = eagle_setup
    ps = prompts(8)
    plain = [o.token_ids for o in make(target).generate(ps, GREEDY)]
    llm = make(target, head_dir)
    eng = llm.engine
    seqs = [eng.add_request(str(i), p, GREEDY) for i, p in enumerate(ps)]
    while eng.has_unfinished():
        eng.step()
    assert [s.output_token_ids for s in seqs] == plain
    assert all(s.spec.num_drafted > 0 for s in seqs)


@pytest.mark.parametrize("num_blocks", [512, 60])
def test_catch_up_keeps_the_head_kv_equal_to_one_full_pass(eagle_setup, monkeypatch, num_blocks):
    """With drafts forced right two times in three (so chains get accepted, rejected, caught
    up, and under a small pool preempted), outputs stay equal and the head's KV for every
    verified position equals one fresh pass of the head over the same target features."""
    target, head_dir = eagle_setup
    ps = prompts(6, seed=5)
    plain = [o.token_ids for o in make(target).generate(ps, GREEDY)]
    truth = {tuple(p): p + o for p, o in zip(ps, plain)}
    llm = make(target, head_dir, num_blocks=num_blocks)
    eng, drafter = llm.engine, llm.engine.drafter
    seen: dict[int, list] = {}
    real_observe, real_choose = Eagle3Drafter.observe, Eagle3Drafter._choose

    def observe(self, spans, features):
        offset = 0
        for seq, start, n in spans:
            if start == 0:
                seen[id(seq)] = []  # (re)started from position 0, e.g. after a preemption
            seen[id(seq)].append(features[offset:offset + n].clone())
            offset += n
        real_observe(self, spans, features)

    def choose(self, seqs, logits):
        (seq,) = seqs  # propose below runs one sequence at a time
        pos = seq.num_tokens + len(seq.draft_token_ids)  # filled in as the chain grows
        full = truth[tuple(seq.prompt_token_ids)]
        n = len(self._chain)
        self._chain.append(0)
        right = full[seq.num_tokens + n] if seq.num_tokens + n < len(full) else 0
        return [((right if (pos + n) % 3 else (right + 1) % 256), None)]

    monkeypatch.setattr(Eagle3Drafter, "observe", observe)
    monkeypatch.setattr(Eagle3Drafter, "_choose", choose)
    real_propose = Eagle3Drafter.propose

    def propose(self, seqs, ks):
        out = [], []
        for s, k in zip(seqs, ks):  # one at a time so the chain counter is per sequence
            self._chain = []
            d, p = real_propose(self, [s], [k])
            out[0].append(d[0])
            out[1].append(p[0])
        return out

    monkeypatch.setattr(Eagle3Drafter, "propose", propose)
    seqs = [eng.add_request(str(i), p, GREEDY) for i, p in enumerate(ps)]
    checked = 0
    while eng.has_unfinished():
        eng.step()
        for s in eng.scheduler.running:
            m, pending = drafter.state(s).num_computed, drafter.catch_up(s)
            if m < 4 or pending:
                continue
            feats = torch.cat(seen[id(s)])[:m]
            positions, meta = eng.runner.metadata([(s, 0, m)])
            kv = (torch.zeros_like(drafter.kv[0]), torch.zeros_like(drafter.kv[1]))
            drafter.head(torch.tensor(s.token_ids[1:m + 1]), drafter.head.fuse(feats), positions, kv, meta)
            slots = meta.slot_mapping
            torch.testing.assert_close(drafter.kv[0][slots], kv[0][slots], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(drafter.kv[1][slots], kv[1][slots], atol=1e-5, rtol=1e-5)
            checked += 1
    assert checked > 10
    assert not drafter._states  # each request's head state dropped when it ended (or was preempted)
    assert [s.output_token_ids for s in seqs] == plain
    assert sum(s.spec.num_accepted for s in seqs) > 30
    if num_blocks == 60:
        assert sum(s.num_preemptions for s in seqs) > 0


def test_paused_requests_features_wait_in_their_slots(eagle_setup, monkeypatch):
    """Speculation off while two or more requests decode (a schedule): the long request's
    features wait for the head for dozens of steps, in the feature cache at its positions' slots,
    exactly as the target gave them, while shorter requests come and go; no tensor is kept per
    request; outputs stay equal to plain decoding."""
    target, head_dir = eagle_setup
    spec = SpecConfig("eagle3", 4, draft_model=str(head_dir), mode="schedule", schedule="1-1:4,2-:0")
    eng = LLM(str(target), dtype="float32", enforce_eager=True, spec=spec,
              cache=CacheConfig(block_size=4, num_blocks=512)).engine
    given: dict[int, torch.Tensor] = {}  # the long request's features, by position
    real_observe = Eagle3Drafter.observe

    def observe(self, spans, features):
        offset = 0
        for seq, start, n in spans:
            if seq.request_id == "long":
                given.update({start + j: features[offset + j].clone() for j in range(n)})
            offset += n
        real_observe(self, spans, features)

    monkeypatch.setattr(Eagle3Drafter, "observe", observe)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    ps = prompts(12, seed=6)
    long = eng.add_request("long", ps[0], params)
    paused, i = 0, 1
    while eng.has_unfinished():
        while i < len(ps) and len(eng.scheduler.running) + len(eng.scheduler.waiting) < 4 and long.output_token_ids:
            # three more, ending at different steps: one still decodes while another prefills
            eng.add_request(str(i), ps[i], SamplingParams(max_tokens=8 + i % 3, temperature=0, ignore_eos=True))
            i += 1
        eng.step()
        pending = eng.drafter.catch_up(long)
        if pending and not long.is_finished:
            paused = max(paused, pending)
            end = long.num_computed_tokens
            _, slots = eng.runner.slots([(long, end - pending, pending)])
            want = torch.stack([given[p] for p in range(end - pending, end)])
            torch.testing.assert_close(eng.drafter.features[slots], want, rtol=0, atol=0)
            assert not any(isinstance(v, (list, torch.Tensor)) for v in vars(eng.drafter.state(long)).values())
    assert paused >= 24 and long.spec.num_drafted > 0  # paused for 24 steps or more, then drafted
    plain = make(target).generate([ps[0]], params)[0].token_ids
    assert long.output_token_ids == plain


def test_sampled_eagle_is_reproducible(eagle_setup):
    target, head_dir = eagle_setup
    llm = make(target, head_dir)
    sp = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=3, ignore_eos=True)
    a = [o.token_ids for o in llm.generate(prompts(3), sp)]
    assert a == [o.token_ids for o in llm.generate(prompts(3), sp)]
    assert all(len(x) == 20 for x in a)


def test_a_head_packed_to_blocks_keeps_no_dense_weights_and_proposes_near_them():
    """Where the target's weights are blocks (CPU fp32), the head's become 8-bit blocks at every
    step size and its dense ones go (they only shape proposals; verification keeps the output
    exact): its logits and fused features within the 8-bit rounding of weights and activations."""
    from tidal import kernels
    from tidal.engine import profile_cache

    if not kernels.load(profile_cache.cache_dir() / "kernels"):
        pytest.skip("the block kernel does not build here (no compiler or ninja)")
    head = random_head()
    g = torch.Generator().manual_seed(5)
    x, aux = torch.randn(70, 64, generator=g), torch.randn(3, 192, generator=g)
    with torch.no_grad():
        want = head.logits(x[:3]), head.fuse(aux), head.mid._linear("gate_up_proj", x[:5])
    head.pack(blocks=True)
    assert set(head.qblock) == {"fc", "lm_head"} and len(head.mid.qblock) == 4
    assert all(p.untyped_storage().nbytes() == 4 for p in (head.fc, head.lm_head, head.mid.qkv_proj, head.mid.down_proj))
    with torch.no_grad():
        got = head.logits(x[:3]), head.fuse(aux), head.mid._linear("gate_up_proj", x[:5])
    for a, b in zip(got, want):
        assert ((a - b).norm() / b.norm()).item() < 0.03
    assert head.logits(x).shape == (70, 200)  # a catch-up's width: the GEMM path, no dense weight
