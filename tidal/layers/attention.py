"""Attention over the paged KV cache for one ragged batch of tokens: tidal's kernel for short
queries (tidal/kernels/attention.cpp, keys read from the cache by slot), torch SDPA otherwise.

The cache of a layer is two tensors [num_slots, kv_heads, head_dim]; slot = block * block_size
+ offset. Sequences of a step are split into groups (short-query sequences together, the
one-token ones apart from those verifying drafts once padding them would cost more than a call,
each long prefill chunk alone; ModelRunner.metadata) so that padding to a rectangle wastes little;
each group attends in one call with a causal-and-length mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tidal import kernels

# groups of at most this many queries a sequence (decode, verification, the compiled steps)
# use tidal's kernel where it is loaded and the cache is an fp32 CPU one; longer ones (prefill) SDPA
KERNEL_MAX_QUERIES = 64


@dataclass
class AttentionGroup:
    token_index: torch.Tensor  # [B, Q] flat index of each query token (padding: 0)
    kv_slots: torch.Tensor  # [B, K] cache slot of each key position (padding: 0)
    mask: torch.Tensor  # [B, 1, Q, K] True where the query may attend
    out_index: torch.Tensor  # [n] flat token index of the valid queries, in flat order
    rows: torch.Tensor  # [n] the padded query row (b * Q + j) of each of them
    first: int | None = None  # set when the group is tokens first..first + B * Q in flat order, unpadded


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    groups: list[AttentionGroup]


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys and values [T, kv_heads, head_dim] at their cache slots."""
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


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
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    num_tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    rep = heads // kv_heads
    flat_k, flat_v = k_cache.view(k_cache.shape[0], -1), v_cache.view(v_cache.shape[0], -1)
    out = None
    for g in meta.groups:
        B, K = g.kv_slots.shape
        Q = g.token_index.shape[1]
        # an unpadded group in flat order is a slice: no gather of its queries, no scatter of its outputs
        qg = q[g.token_index] if g.first is None else q[g.first:g.first + B * Q]
        qg = qg.reshape(B, Q, kv_heads, rep, head_dim).permute(0, 2, 3, 1, 4).reshape(B, kv_heads, rep * Q, head_dim)
        if (Q <= KERNEL_MAX_QUERIES and kernels.available() and q.device.type == "cpu"
                and q.dtype == k_cache.dtype == torch.float32):
            og = torch.ops.tidal.paged_attention(qg, k_cache, v_cache, g.kv_slots, g.mask, scale)
        else:
            # index_select on flat rows, in the cache's dtype, and the query heads of one KV head
            # folded into the query axis (no GQA expansion of K/V): on CPU faster for batched decode
            # than advanced indexing plus an fp32 SDPA with enable_gqa (docs/results/notebook.md)
            kg, vg = (x.index_select(0, g.kv_slots.flatten()).view(B, K, kv_heads, head_dim).transpose(1, 2)
                      .to(q.dtype) for x in (flat_k, flat_v))  # .to: the EAGLE head may run in fp32 over a bf16 cache
            mask = g.mask.unsqueeze(2).expand(B, 1, rep, Q, K).reshape(B, 1, rep * Q, K)
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
        og = og.view(B, kv_heads, rep, Q, head_dim).permute(0, 3, 1, 2, 4).reshape(B * Q, heads * head_dim)
        if g.first == 0 and B * Q == num_tokens:  # the whole step in one group, unpadded
            return og
        if g.out_index.shape[0] == num_tokens:  # the whole step in one group (shape: len() would specialise in export)
            return og.index_select(0, g.rows)
        if out is None:
            out = q.new_empty(num_tokens, heads * head_dim)
        if g.first is None:
            out.index_copy_(0, g.out_index, og.index_select(0, g.rows))
        else:
            out[g.first:g.first + B * Q] = og
    return out
