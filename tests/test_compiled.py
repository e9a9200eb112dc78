"""The compiled decode/verify step: the same greedy tokens as the eager forward, and no compile
after start-up whatever the mix of small steps."""

import pytest

from tidal import SamplingParams
from tidal.config import CacheConfig, SpecConfig
from tidal.engine.llm_engine import LLM
from tests.test_spec import REPEAT, repetitive_prompts


def compiles() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["frames"].values()) if "frames" in counters else 0


def test_compiled_steps_match_eager_greedy_on_the_tiny_model(tiny_model_dir):
    """Plain decode at 1..6 requests and n-gram verification (drafts of 1..4 tokens beside
    plain decoding, padded in one group) all go through the two graphs captured at start-up."""
    spec = SpecConfig(method="ngram", num_speculative_tokens=3, mode="fixed")
    kw = dict(dtype="float32", cache=CacheConfig(block_size=4, num_blocks=512), spec=spec)
    eager = LLM(str(tiny_model_dir), **kw)
    compiled = LLM(str(tiny_model_dir), compile=True, **kw)
    after_warm_up = compiles()
    assert after_warm_up >= 2  # the two graphs
    prompts = repetitive_prompts(6)
    for n in (1, 2, 6):
        want = eager.generate(prompts[:n], [REPEAT] * n)
        got = compiled.generate(prompts[:n], [REPEAT] * n)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert compiles() == after_warm_up


@pytest.mark.slow
def test_compiled_steps_match_eager_greedy_on_the_bundled_model():
    eager, compiled = LLM(dtype="float32"), LLM(dtype="float32", compile=True)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    for n in (1, 3):
        assert ([o.token_ids for o in compiled.generate(prompts[:n], params)]
                == [o.token_ids for o in eager.generate(prompts[:n], params)])
