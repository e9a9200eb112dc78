"""Token sampling: greedy, temperature, top-k, top-p, each row with its own generator."""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """Scale by temperature, then mask to -inf outside top-k, then outside top-p.

    logits [N, V] float32; temperature [N] > 0; top_k [N] (<= 0: off); top_p [N] (1: off).
    The draft and target distributions of the verifier go through this same function.
    """
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    if bool((k < vocab).any()) or bool((top_p < 1).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks[None] >= k[:, None], float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # keep a token while the mass before it < p
        cut = (mass_before >= top_p[:, None]) & (top_p < 1)[:, None]  # float error must not cut top_p=1 rows
        sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Index drawn from `probs` (last dim) by the exponential race: argmax p / E, E ~ Exp(1)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row. Rows with temperature 0 are greedy and use no randomness.

    Sampling uses the exponential race (argmax p / E, E ~ Exp(1)), so a row's draw depends only
    on its own generator, never on what else is in the batch.
    """
    tokens = logits.argmax(dim=-1)
    rows = [i for i, g in enumerate(generators) if g is not None]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        probs = filter_logits(logits[idx].float(), temperature[idx], top_k[idx], top_p[idx]).softmax(-1)
        tokens[idx] = torch.stack([draw(probs[j], generators[i]) for j, i in enumerate(rows)])
    return tokens
