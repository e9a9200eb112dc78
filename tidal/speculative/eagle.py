"""EAGLE-3 drafting: catch the head's KV up on the target features it has not seen, then
extend a chain of up to k draft tokens per request, one head forward per draft position.

The head's KV cache has one slot per target slot and shares the target's block tables, so
draft position p of a request lives where the target's position p does. The target's features
of each verified position wait in the same slot of a feature cache until the next proposal, and
the head runs over all of them then, in one ragged forward. A cache, not tensors kept per
request and step: thousands of small long-lived tensors (64 requests paused for a hundred steps)
scatter the allocator's heap, and the target's own steps slowed down as they piled up. A request
that is not speculating (k = 0) is skipped: its features wait and are caught up lazily, in that
one forward, the next time it drafts, so a pause in speculation costs the head nothing while it
lasts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.layers.sampler import draw, filter_logits
from tidal.models.eagle3 import Eagle3Head
from tidal.sequence import Sequence

@dataclass
class HeadState:
    """The head's part of one request: positions whose head KV is valid (the features of the
    positions after them wait in the drafter's feature cache)."""

    num_computed: int = 0


class Eagle3Drafter:
    """Proposes with an EAGLE-3 head; needs the target's features at `aux_layers`."""

    def __init__(self, head: Eagle3Head, runner):
        self.head, self.runner = head, runner
        c = head.cfg.layer
        shape = (runner.num_blocks * runner.block_size, c.num_kv_heads, c.head_dim)
        self.kv = (runner.cache_zeros(shape), runner.cache_zeros(shape))
        self.features = runner.cache_zeros((shape[0], 3 * head.cfg.target_hidden_size))  # per slot
        self.aux_layers = head.cfg.target_output_layers
        self._states: dict[Sequence, HeadState] = {}

    def state(self, seq: Sequence) -> HeadState:
        state = self._states.get(seq)
        if state is None:  # not setdefault: it would build a HeadState on every call
            state = self._states[seq] = HeadState()
        return state

    def forget(self, seq: Sequence) -> None:
        """`seq` was preempted (its head KV went with its blocks) or ended."""
        self._states.pop(seq, None)

    def observe(self, spans: list[tuple[Sequence, int, int]], features: torch.Tensor) -> None:
        """The target's features of the positions each (seq, first position, count) verified
        this step, `features` their rows in that order, kept in those positions' slots."""
        _, slots = self.runner.slots(spans)
        self.features[slots] = features

    def available(self, seqs: list[Sequence], max_k: int) -> list[int]:
        return [max_k] * len(seqs)  # the head always drafts; what it gets right is only known after

    def draft_class(self, seq: Sequence) -> int:
        return 0  # ungraded

    def catch_up(self, seq: Sequence) -> int:
        """Verified positions whose features wait for the head (all of them after a pause)."""
        return seq.num_computed_tokens - self.state(seq).num_computed

    def propose(self, seqs: list[Sequence], num_draft_tokens: list[int]):
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list] = [[] for _ in seqs]
        live = [i for i, k in enumerate(num_draft_tokens) if k > 0]
        if live:
            logits, out = self._catch_up([seqs[i] for i in live])
            j = 0
            while True:
                for i, (token, q) in zip(live, self._choose([seqs[i] for i in live], logits)):
                    drafts[i].append(token)
                    probs[i].append(q)
                j += 1
                keep = [r for r, i in enumerate(live) if num_draft_tokens[i] > j]
                if not keep:
                    break
                live = [live[r] for r in keep]
                logits, out = self._extend([seqs[i] for i in live], [drafts[i][-1] for i in live], out[keep], j)
        return drafts, [torch.stack(p) if p and p[0] is not None else None for p in probs]

    def _catch_up(self, seqs: list[Sequence]):
        """Run the head over every verified position it has not seen; returns the logits and
        pre-norm outputs at each sequence's last position (which predict the first draft).
        Only the last position's output is read: the others are needed for their K/V alone (what
        later drafts attend to), so they get the input projections and a cache write, not the
        whole layer and the draft-vocab logits: about a fifth of the multiply-adds per position
        for the bundled model's head (fc + qkv against the layer, MLP and 8192-row lm_head)."""
        ids, feats, rest, last = [], [], [], []
        for seq in seqs:
            state = self.state(seq)
            start, end = state.num_computed, seq.num_computed_tokens
            ids.extend(seq.token_ids[start + 1:end + 1])  # the head pairs feature p with token p + 1
            feats.append((seq, start, end - start))
            rest.extend([True] * (end - 1 - start) + [False])
            last.append((seq, end - 1, 1))
            state.num_computed = end
        device = self.runner.device
        ids = torch.tensor(ids, device=device)
        positions, slots = self.runner.slots(feats)  # every unseen position: its features and its KV
        features = self.head.fuse(self.features[slots])
        rest = torch.tensor(rest, device=device)
        if len(ids) > len(seqs):  # positions before the last ones: their K/V only
            self.head.write_kv(ids[rest], features[rest], positions[rest], self.kv, slots[rest])
        positions, meta = self.runner.metadata(last)
        return self.head(ids[~rest], features[~rest], positions, self.kv, meta)

    def _extend(self, seqs: list[Sequence], tokens: list[int], features: torch.Tensor, j: int):
        """One chain step: feed draft j (at position num_computed + j - 1) with the previous output."""
        spans = [(s, s.num_computed_tokens + j - 1, 1) for s in seqs]
        positions, meta = self.runner.metadata(spans)
        return self.head(torch.tensor(tokens, device=positions.device), features, positions, self.kv, meta)

    def _choose(self, seqs: list[Sequence], logits: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
        """Each request's draft from its row of `logits`: greedy, the head's argmax (one argmax
        and one device read for the batch); sampling, see `_sample`."""
        top = self.head.to_target_ids(logits.argmax(-1)).tolist()
        return [(t, None) if s.params.greedy else self._sample(s, row) for s, row, t in zip(seqs, logits, top)]

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> tuple[int, torch.Tensor]:
        """A draw from the head's filtered distribution, returned over the target vocabulary
        for the rejection sampler."""
        p = seq.params
        dev = logits.device
        q = filter_logits(logits[None], torch.tensor([p.temperature], device=dev), torch.tensor([p.top_k], device=dev),
                          torch.tensor([p.top_p], device=dev)).softmax(-1)[0]
        d = draw(q, self.runner.generator(seq))
        full = torch.zeros(self.head.cfg.layer.vocab_size, device=dev)
        full[self.head.to_target_ids(torch.arange(q.shape[0], device=dev))] = q
        return int(self.head.to_target_ids(d)), full
