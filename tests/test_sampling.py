"""SamplingParams validation and the sampler's filtering against transformers' warpers."""

import pytest
import torch

from tidal.layers.sampler import filter_logits, sample
from tidal.sampling_params import InvalidParameter, SamplingParams


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(top_k=-2), "top_k"),
    (dict(seed="x"), "seed"),
    (dict(stop=[""]), "stop"),
])
def test_bad_values_are_rejected_with_the_parameter_named(kwargs, param):
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in str(e.value)


def test_stop_string_is_normalised():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(temperature=0).greedy


def test_filter_matches_transformers_warpers():
    transformers = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g) * 3
    temp = torch.tensor([0.7, 1.0, 1.3, 0.5, 1.0, 2.0])
    top_k = torch.tensor([0, 10, 50, -1, 299, 5])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.3, 0.95, 1.0])
    ours = filter_logits(logits, temp, top_k, top_p)
    for i in range(6):
        row = logits[i:i + 1] / temp[i]
        if top_k[i] > 0:
            row = transformers.TopKLogitsWarper(int(top_k[i]))(None, row)
        if top_p[i] < 1:
            row = transformers.TopPLogitsWarper(float(top_p[i]))(None, row)
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(row[0]))
        kept = ~torch.isinf(row[0])
        torch.testing.assert_close(ours[i][kept], row[0][kept])


def test_sample_greedy_rows_and_distribution():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.7], [0.5, 0.3, 0.2]]))
    one = torch.ones(2)
    off_k, off_p = torch.zeros(2, dtype=torch.long), torch.ones(2)
    assert sample(logits, one, off_k, off_p, [None, None]).tolist() == [2, 0]
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(logits[:1], one[:1], off_k[:1], off_p[:1], [gen]) for _ in range(4000)])
    freq = torch.bincount(draws.flatten(), minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.1, 0.2, 0.7]), atol=0.03)


def test_none_stop_values_and_tiny_temperature():
    p = SamplingParams(stop=None, stop_token_ids=None, temperature=1e-45)
    assert p.stop == () and p.stop_token_ids == () and p.greedy


@pytest.mark.parametrize("kwargs, param", [
    (dict(seed=2**64), "seed"),
    (dict(seed=True), "seed"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(stop_token_ids=["a"]), "stop_token_ids"),
    (dict(stop_token_ids=5), "stop_token_ids"),
])
def test_more_bad_values(kwargs, param):
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_top_p_one_rows_are_untouched_beside_top_p_rows():
    logits = torch.randn(2, 49152, generator=torch.Generator().manual_seed(0)) * 4
    out = filter_logits(logits, torch.ones(2), torch.zeros(2, dtype=torch.long), torch.tensor([1.0, 0.5]))
    assert torch.isfinite(out[0]).all()
    assert torch.isinf(out[1]).any()
