"""Attention over the paged KV cache for one ragged batch of tokens, with torch SDPA.

The cache of a layer is two tensors [num_slots, kv_heads, head_dim]; slot = block * block_size
+ offset. Sequences of a step are split into groups (all short-query sequences together, each
long prefill chunk alone) so that padding to a rectangle wastes little; each group gathers its
keys by slot and runs one SDPA call with a causal-and-length mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    token_index: torch.Tensor  # [B, Q] flat index of each query token (padding: 0)
    kv_slots: torch.Tensor  # [B, K] cache slot of each key position (padding: 0)
    mask: torch.Tensor  # [B, 1, Q, K] True where the query may attend
    out_index: torch.Tensor  # [n] flat token index of the valid queries, in flat order
    valid: torch.Tensor  # [B * Q] which padded query rows are real


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    groups: list[AttentionGroup]


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, attend, and return [T, heads * head_dim]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    num_tokens, heads, head_dim = q.shape
    out = q.new_empty(num_tokens, heads * head_dim)
    # On CPU, torch's fp32 SDPA kernel is several times faster than its bf16 one for batched
    # decode (measured: 0.46 vs 4.0 ms at 64 sequences x 100 keys), so attend in fp32 there.
    dtype = torch.float32 if q.device.type == "cpu" else q.dtype
    for g in meta.groups:
        qg = q[g.token_index].transpose(1, 2).to(dtype)  # [B, heads, Q, D]
        kg = k_cache[g.kv_slots].transpose(1, 2).to(dtype)  # [B, kv_heads, K, D]
        vg = v_cache[g.kv_slots].transpose(1, 2).to(dtype)
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale, enable_gqa=True)
        og = og.transpose(1, 2).reshape(-1, heads * head_dim)[g.valid].to(q.dtype)
        out.index_copy_(0, g.out_index, og)
    return out
