"""Weight layouts chosen per machine: the fp16 layout's numbers, the timing that chooses it, its
cache, and compiled steps that keep the dense weights."""

import pytest
import torch

from tidal import SamplingParams
from tidal.config import CacheConfig, EngineConfig
from tidal.engine import llm_engine, profile_cache
from tidal.engine.llm_engine import LLM
from tidal.layers import layout_choice
from tidal.layers.linear import EVERY_STEP, Fp16Weight, linear

needs_fbgemm = pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines,
                                  reason="fbgemm's fp16 GEMM is x86-only")
EDGES = (1, 4, 8, 64, 256)


@needs_fbgemm
def test_fp16_weight_is_the_weight_rounded_to_fp16_up_to_its_rows():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 160, generator=g) * 0.05
    fp16 = Fp16Weight(w, max_rows=8)
    rounded = w.half().float()
    for rows in (1, 3, 8):
        x = torch.randn(rows, 160, generator=g)
        torch.testing.assert_close(linear(x, w, fp16=fp16), x @ rounded.t(), atol=1e-5, rtol=1e-5)
    x = torch.randn(4, 320, generator=g)[:, ::2]  # a strided view, as attention's output can be
    torch.testing.assert_close(linear(x, w, fp16=fp16), x @ rounded.t(), atol=1e-5, rtol=1e-5)
    big = torch.randn(9, 160, generator=g)  # past max_rows: the dense weight, bit for bit
    assert torch.equal(linear(big, w, fp16=fp16), torch.nn.functional.linear(big, w))


@needs_fbgemm
def test_the_chosen_rows_end_on_a_graph_edge():
    assert layout_choice.fp16_max_rows((256, 128), EDGES, repeats=3) in (0, *EDGES)


@pytest.mark.parametrize("ratio, beyond, rows", [(1.05, True, EVERY_STEP), (1.05, False, EDGES[-1]), (1.2, True, 0)])
def test_a_layout_within_the_margin_at_every_edge_serves_every_step_beyond(monkeypatch, ratio, beyond, rows):
    """Timings within MARGIN of dense keep the narrower layout; one that won every range serves
    every step size where its cost follows dense past the last edge (`beyond`: the block kernel)."""
    monkeypatch.setattr(layout_choice, "_median_seconds", lambda fn, x, other, repeats: (ratio, 1.0))
    dense = lambda w: (lambda x: torch.nn.functional.linear(x, w))  # noqa: E731
    assert layout_choice.max_rows(dense, (64, 32), EDGES, repeats=1, beyond=beyond) == rows


def test_without_the_kernel_the_weights_stay_dense(monkeypatch):
    monkeypatch.setattr(Fp16Weight, "supported", staticmethod(lambda w: False))
    assert layout_choice.fp16_max_rows((256, 128), EDGES, repeats=1) == 0


def test_the_choice_is_measured_once_per_machine_and_cached(monkeypatch):
    calls = []

    def measure(shapes, block_bits, edges):
        calls.append(edges)
        return {"fp16": {s: 4 for s in shapes}, "qblock": {}}

    monkeypatch.setattr(llm_engine, "choose_layouts", measure)
    shapes = [(48, 16), (48, 16), (16, 32)]
    cpu = torch.device("cpu")
    chosen = {"fp16": {(48, 16): 4, (16, 32): 4}, "qblock": {}}
    assert llm_engine.weight_layouts(shapes, {}, cpu, torch.float32, "auto") == chosen
    assert llm_engine.weight_layouts(shapes, {}, cpu, torch.float32, "auto") == chosen
    assert calls == [EDGES]
    assert llm_engine.weight_layouts(shapes, {}, cpu, torch.float32, "dense") == {}
    assert llm_engine.weight_layouts(shapes, {}, cpu, torch.bfloat16, "auto") == {}
    with pytest.raises(ValueError, match="weight_layouts"):
        EngineConfig(weight_layouts="int3")


@needs_fbgemm
def test_compiled_steps_keep_the_dense_weights(tiny_model_dir, monkeypatch, tmp_path):
    """fp16 serves eager steps only: the compiled ones give the eager dense engine's tokens."""
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(llm_engine, "choose_layouts", layout_choice.forced("fp16"))
    kw = dict(dtype="float32", cache=CacheConfig(block_size=4, num_blocks=256))
    compiled = LLM(str(tiny_model_dir), **kw)
    dense = LLM(str(tiny_model_dir), enforce_eager=True, weight_layouts="dense", **kw)
    model = compiled.engine.runner.model
    assert len(model.fp16_weights()) == 4 * len(model.layers) + 1
    assert set(compiled.engine.runner.compiled.graphs) == {"one", "few", "many", "wide"}
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[1 + i, 2, 3, 4 + i] for i in range(12)]
    for n in (1, 3, 12):
        assert ([o.token_ids for o in compiled.generate(prompts[:n], params)]
                == [o.token_ids for o in dense.generate(prompts[:n], params)])
