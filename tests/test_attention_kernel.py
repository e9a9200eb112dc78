"""tidal's short-query attention kernel against torch's SDPA over the same gathered keys: the
same outputs for decode and verification shapes, GQA, masks with holes and padding rows."""

import pytest
import torch
import torch.nn.functional as F

from tidal import kernels
from tidal.engine import profile_cache
from tidal.layers import attention
from tidal.layers.attention import AttentionGroup, AttentionMetadata, paged_attention


@pytest.fixture(scope="module", autouse=True)
def built():
    if not kernels.load(profile_cache.cache_dir() / "kernels"):
        pytest.skip("tidal's kernels did not build here (no C++ compiler)")


def sdpa(q, k_cache, v_cache, slots, mask, scale):
    B, H, R, D = q.shape
    K, Q = slots.shape[1], mask.shape[2]
    kg, vg = (c.index_select(0, slots.flatten()).view(B, K, H, D).transpose(1, 2) for c in (k_cache, v_cache))
    full = mask.unsqueeze(2).expand(B, 1, R // Q, Q, K).reshape(B, 1, R, K)
    return F.scaled_dot_product_attention(q, kg, vg, attn_mask=full, scale=scale)


@pytest.mark.parametrize("B,H,rep,Q,K,D", [(1, 3, 3, 1, 37, 64), (5, 2, 1, 3, 20, 24), (3, 1, 4, 8, 130, 64)])
def test_the_kernel_matches_sdpa(B, H, rep, Q, K, D):
    g = torch.Generator().manual_seed(B * 100 + K)
    slots_total = 300
    k_cache, v_cache = (torch.randn(slots_total, H, D, generator=g) for _ in range(2))
    q = torch.randn(B, H, rep * Q, D, generator=g)
    slots = torch.randint(0, slots_total, (B, K), generator=g)
    mask = torch.rand(B, 1, Q, K, generator=g) > 0.3
    mask[..., 0] = True  # every query sees a key (padding rows see one)
    got = torch.ops.tidal.paged_attention(q, k_cache, v_cache, slots, mask, 0.3)
    torch.testing.assert_close(got, sdpa(q, k_cache, v_cache, slots, mask, 0.3), rtol=1e-5, atol=1e-5)


def test_paged_attention_takes_the_kernel_for_short_queries_only(monkeypatch):
    """A decode group goes to the kernel, a prefill chunk longer than KERNEL_MAX_QUERIES to SDPA;
    both give what SDPA gives."""
    g = torch.Generator().manual_seed(0)
    H, kvh, D, slots_total = 4, 2, 16, 128
    k_cache, v_cache = (torch.zeros(slots_total, kvh, D) for _ in range(2))
    calls = []
    kernel = torch.ops.tidal.paged_attention
    monkeypatch.setattr(torch.ops.tidal, "paged_attention", lambda *a: (calls.append(a[0].shape), kernel(*a))[1])
    for n in (1, attention.KERNEL_MAX_QUERIES + 1):
        q, k, v = torch.randn(n, H, D, generator=g), torch.randn(n, kvh, D, generator=g), torch.randn(n, kvh, D, generator=g)
        slots = torch.arange(n)
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        group = AttentionGroup(torch.arange(n)[None], slots[None], mask, torch.arange(n), torch.arange(n), first=0)
        out = paged_attention(q, k, v, k_cache, v_cache, AttentionMetadata(slots, [group]), 0.25)
        qg = q.view(1, n, kvh, H // kvh, D).permute(0, 2, 3, 1, 4).reshape(1, kvh, H // kvh * n, D)
        want = sdpa(qg, k_cache.view(slots_total, kvh, D), v_cache, slots[None], mask, 0.25)
        want = want.view(1, kvh, H // kvh, n, D).permute(0, 3, 1, 2, 4).reshape(n, H * D)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert calls == [torch.Size([1, kvh, H // kvh, D])]


def test_bad_input_gets_a_clear_error():
    q, cache = torch.randn(1, 2, 2, 8), torch.randn(10, 2, 8)
    mask = torch.ones(1, 1, 1, 3, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.tidal.paged_attention(q, cache, cache, torch.tensor([[0, 4, 10]]), mask, 1.0)
    with pytest.raises(RuntimeError, match="mask must be bool"):
        torch.ops.tidal.paged_attention(q, cache, cache, torch.tensor([[0, 4, 9]]), mask.float(), 1.0)
