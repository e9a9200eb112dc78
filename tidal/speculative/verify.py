"""Verification of draft tokens against the target's logits: greedy exact match, and lossless
rejection sampling (Leviathan et al.; Chen et al.) for temperature > 0.

For each draft position i with draft token x: accept with probability min(1, p_i(x) / q_i(x));
on the first rejection sample from normalise(max(p_i - q_i, 0)) and stop; if every draft is
accepted, sample a bonus token from p_{k}. The emitted tokens are then distributed exactly as
the target's own samples. p and q are filtered by the same temperature / top-k / top-p.
"""

from __future__ import annotations

import torch

from tidal.layers.sampler import draw, filter_logits


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution to resample from after a rejection: normalise(max(p - q, 0))."""
    r = (p - q).clamp(min=0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-30), p)


def verify_greedy(logits: torch.Tensor, draft: list[int]) -> list[int]:
    """logits [k + 1, V]: accepted prefix of `draft` plus the target's next token."""
    target = logits.argmax(-1).tolist()
    out = []
    for x, t in zip(draft, target):
        if x != t:
            break
        out.append(x)
    out.append(target[len(out)])
    return out


def verify_sampled(logits: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
                   temperature: float, top_k: int, top_p: float, gen: torch.Generator) -> list[int]:
    """Rejection sampling. logits [k + 1, V]; draft_probs [k, V] (None: a one-hot draft)."""
    n = logits.shape[0]
    p = filter_logits(logits.float(), torch.full((n,), temperature, device=logits.device),
                      torch.full((n,), top_k, device=logits.device),
                      torch.full((n,), top_p, device=logits.device)).softmax(-1)
    if draft_probs is None:
        q = torch.zeros_like(p[:-1])
        q[torch.arange(len(draft)), torch.tensor(draft, device=p.device)] = 1.0
    else:
        q = draft_probs.float()
    u = torch.rand(len(draft), generator=gen, device=p.device)
    out = []
    for i, x in enumerate(draft):
        if u[i] * q[i, x] < p[i, x]:  # accept with probability min(1, p / q); never if p = 0
            out.append(x)
        else:
            out.append(int(draw(residual(p[i], q[i]), gen)))
            return out
    out.append(int(draw(p[len(draft)], gen)))
    return out
