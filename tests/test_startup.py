"""Start-up: the GGUF header read as gguf-py reads it, and the stored step-cost profile."""

import numpy as np
import pytest
import torch

from tidal import SamplingParams
from tidal.config import CacheConfig, SpecConfig
from tidal.engine.llm_engine import LLM, LLMEngine
from tidal.models.gguf_file import GGUFFile
from tidal.models.loader import default_model_path


def test_gguf_header_matches_gguf_py():
    gguf = pytest.importorskip("gguf")
    path = default_model_path()
    ref, ours = gguf.GGUFReader(str(path)), GGUFFile(path)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # the reader's own header fields
    assert keys == list(ours.metadata)
    for k in keys:
        assert ref.fields[k].contents() == ours.metadata[k], k
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        o = ours.tensors[t.name]
        assert (tuple(int(x) for x in t.shape), t.tensor_type) == (o.shape, o.tensor_type)
        assert o.data.dtype == t.data.dtype and np.array_equal(np.asarray(t.data), o.data), t.name


def test_not_a_gguf_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(bad)


@pytest.fixture
def profiles(monkeypatch):
    """One entry per start-up profile measured (not read from the store)."""
    calls, real = [], LLMEngine.profile
    monkeypatch.setattr(LLMEngine, "profile", lambda self: (calls.append(1), real(self)))
    return calls


def adaptive(path, **kw) -> LLM:
    """An adaptive n-gram engine on the tiny model."""
    spec = SpecConfig(method="ngram", num_speculative_tokens=4, mode="adaptive")
    return LLM(str(path), dtype="float32", enforce_eager=True, spec=spec, cache=CacheConfig(block_size=4, num_blocks=512), **kw)


def test_start_up_profile_is_stored_and_reused_per_set_up(tiny_model_dir, profiles, monkeypatch, tmp_path):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    first = adaptive(tiny_model_dir).engine
    assert profiles == [1] and len(list(tmp_path.glob("profile-*.json"))) == 1
    second = adaptive(tiny_model_dir).engine
    assert profiles == [1]  # reused: the same anchors, no steps timed
    assert second.step_cost.num_anchors == first.step_cost.num_anchors > 0
    for tokens in (1, 4, 16, 64):
        assert second.step_cost.predict(tokens, 1, 64) == pytest.approx(first.step_cost.predict(tokens, 1, 64))
    assert second.draft_cost.predict(2, 2, 0) == pytest.approx(first.draft_cost.predict(2, 2, 0))
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        adaptive(tiny_model_dir)  # another thread count: measured again
    finally:
        torch.set_num_threads(threads)
    assert profiles == [1, 1] and len(list(tmp_path.glob("profile-*.json"))) == 2


def test_if_cached_start_up_profile_never_measures(tiny_model_dir, profiles, monkeypatch, tmp_path):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    llm = adaptive(tiny_model_dir, startup_profile="if-cached")
    assert profiles == [] and llm.engine.step_cost.num_anchors == 0
    out = llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 12 and llm.engine.step_cost.num_samples > 0  # it learns from live steps


def test_unreadable_stored_profile_is_measured_again(tiny_model_dir, profiles, monkeypatch, tmp_path):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    adaptive(tiny_model_dir)
    (stored,) = tmp_path.glob("profile-*.json")
    stored.write_text('{"steps": [[1, 2]], "drafts": []}')
    adaptive(tiny_model_dir)
    assert profiles == [1, 1]
