"""Builds one step's tensors (tokens, positions, slot mapping, attention groups), runs the
model over the paged KV cache, and samples."""

from __future__ import annotations

import numpy as np
import torch

from tidal.config import CacheConfig, ModelConfig
from tidal.engine.scheduler import ScheduledSeq
from tidal.layers.attention import AttentionGroup, AttentionMetadata
from tidal.layers.sampler import sample
from tidal.models.llama import LlamaModel
from tidal.sequence import Sequence
from tidal.spec.verify import verify_greedy, verify_sampled

# Sequences feeding at most this many tokens share one padded attention call (decode, verify);
# longer prefill chunks get a call each so padding never multiplies a long chunk.
SHORT_QUERY_LEN = 16
# ...but padding multiplies short queries too: one request verifying 4 drafts pads 31 decoding
# ones to 5 queries each. So the one-token sequences get a call of their own once that padding
# would reach this many query rows; below it a second call's fixed cost wins. Attention alone, 30
# layers of the bundled model's shapes, two threads (throwaway timing, 2026-12-04): 32 sequences
# with one K=4 draft 48 ms in one call, 30 ms in two, 27 ms without the draft; 2 sequences with
# one K=2 draft 3.4-3.9 ms in one, 4.6-5.1 ms in two.
SPLIT_PAD_ROWS = 8


def kv_cache_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


class ModelRunner:
    """Owns the model, its KV cache and the per-request sampling generators."""

    def __init__(self, model: LlamaModel, cache: CacheConfig, device: torch.device,
                 dtype: torch.dtype, seed: int = 0):
        self.model, self.cfg, self.device, self.dtype = model, model.cfg, device, dtype
        self.block_size = cache.block_size
        self.num_blocks = cache.num_blocks or max(
            1, cache.kv_cache_bytes // kv_cache_block_bytes(self.cfg, cache.block_size, dtype))
        slots = self.num_blocks * self.block_size
        shape = (slots, self.cfg.num_kv_heads, self.cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device)) for _ in range(self.cfg.num_layers)]
        self._rng = np.random.default_rng(seed)
        self.aux_layers: tuple[int, ...] = ()  # target layers whose outputs a drafter needs

    # ------------------------------------------------------------ step inputs

    def _slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        pos = np.arange(start, end)
        table = np.asarray(seq.block_table, dtype=np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _group(self, items: list[tuple[int, Sequence, int, int]]) -> AttentionGroup:
        """items: (flat offset, seq, first position, tokens fed). Pads queries to Q, keys to K."""
        q_lens = np.array([n for _, _, _, n in items])
        computed = np.array([start for _, _, start, _ in items])
        starts = np.array([off for off, _, _, _ in items])
        ctx = computed + q_lens
        Q, K = int(q_lens.max()), int(ctx.max())
        j = np.arange(Q)
        valid = j[None] < q_lens[:, None]
        token_index = np.where(valid, starts[:, None] + j[None], 0)
        q_pos = np.where(valid, computed[:, None] + j[None], 0)
        p = np.arange(K)
        mask = (p[None, None] <= q_pos[:, :, None]) & (p[None, None] < ctx[:, None, None])
        kv_slots = np.zeros((len(items), K), dtype=np.int64)
        for b, (_, seq, _, _) in enumerate(items):
            kv_slots[b, : ctx[b]] = self._slots(seq, 0, int(ctx[b]))
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)  # noqa: E731
        return AttentionGroup(token_index=t(token_index), kv_slots=t(kv_slots), mask=t(mask[:, None]),
                              out_index=t(token_index[valid]), valid=t(valid.reshape(-1)))

    def slots(self, spans: list[tuple[Sequence, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and cache slots (on the device) of feeding each seq `n` tokens from position
        `start`, the sequences laid out one after another."""
        t = lambda parts: torch.from_numpy(np.concatenate(parts)).to(self.device)  # noqa: E731
        return (t([np.arange(start, start + n) for _, start, n in spans]),
                t([self._slots(seq, start, start + n) for seq, start, n in spans]))

    def metadata(self, spans: list[tuple[Sequence, int, int]]) -> tuple[torch.Tensor, AttentionMetadata]:
        """Positions and attention metadata for feeding each seq `n` tokens from position
        `start`, the sequences laid out one after another. The EAGLE drafter uses it too, over
        its own cache, which shares the target's block tables."""
        positions, slots = self.slots(spans)
        short, groups = [], []
        offset = 0
        for seq, start, n in spans:
            if n <= SHORT_QUERY_LEN:
                short.append((offset, seq, start, n))
            else:
                groups.append(self._group([(offset, seq, start, n)]))
            offset += n
        single = [item for item in short if item[3] == 1]
        if single and len(single) * (max(item[3] for item in short) - 1) >= SPLIT_PAD_ROWS:
            multi = [item for item in short if item[3] > 1]
            groups[:0] = [self._group(single), self._group(multi)]
        elif short:
            groups.insert(0, self._group(short))
        return positions, AttentionMetadata(slot_mapping=slots, groups=groups)

    def prepare(self, scheduled: list[ScheduledSeq]):
        ids = []
        for s in scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            ids.extend(seq.token_ids[start:start + s.num_new_tokens - s.num_draft_tokens])
            ids.extend(seq.draft_token_ids[: s.num_draft_tokens])
        positions, meta = self.metadata([(s.seq, s.seq.num_computed_tokens, s.num_new_tokens) for s in scheduled])
        return torch.tensor(ids, device=self.device), positions, meta

    # ------------------------------------------------------------ run

    def execute(self, scheduled: list[ScheduledSeq]) -> tuple[list[list[int]], torch.Tensor | None]:
        """Run one step. Returns, for each scheduled seq that samples, in order, the tokens it
        gains (one sampled token, or its accepted drafts plus the verifier's next token); and
        the target features [T, 3 x hidden] of every fed token when `aux_layers` is set."""
        input_ids, positions, meta = self.prepare(scheduled)
        hidden, aux = self.model(input_ids, positions, self.kv_caches, meta, self.aux_layers)
        features = torch.cat(aux, dim=-1) if aux else None
        ends = np.cumsum([s.num_new_tokens for s in scheduled]) - 1
        rows, starts, sampling = [], [], []
        for end, s in zip(ends, scheduled):
            if s.samples:  # logits for the last fed token and for every draft token
                starts.append(len(rows))
                rows.extend(range(end - s.num_draft_tokens, end + 1))
                sampling.append(s)
        if not sampling:
            return [], features
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        results: list[list[int]] = [[] for _ in sampling]
        plain = [i for i, s in enumerate(sampling) if not s.num_draft_tokens]
        if plain:
            tokens = self.sample(logits[[starts[i] for i in plain]], [sampling[i].seq for i in plain])
            for i, t in zip(plain, tokens):
                results[i] = [t]
        for i, s in enumerate(sampling):
            if s.num_draft_tokens:
                results[i] = self.verify(logits[starts[i]:starts[i] + s.num_draft_tokens + 1], s)
        return results, features

    def verify(self, logits: torch.Tensor, s: ScheduledSeq) -> list[int]:
        seq, p = s.seq, s.seq.params
        draft = seq.draft_token_ids[: s.num_draft_tokens]
        if p.greedy:
            return verify_greedy(logits, draft)
        probs = None if seq.draft_probs is None else seq.draft_probs[: len(draft)]
        return verify_sampled(logits, draft, probs, p.temperature, p.top_k, p.top_p, self.generator(seq))

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        params = [s.params for s in seqs]
        f32 = dict(dtype=torch.float32, device=self.device)
        temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], **f32)
        top_k = torch.tensor([p.top_k for p in params], device=self.device)
        top_p = torch.tensor([p.top_p for p in params], **f32)
        return sample(logits, temperature, top_k, top_p, [self.generator(s) for s in seqs]).tolist()

    def generator(self, seq: Sequence) -> torch.Generator | None:
        """The request's own generator (None when greedy), seeded once on first use."""
        if seq.params.greedy:
            return None
        if seq.generator is None:
            seed = seq.params.seed if seq.params.seed is not None else int(self._rng.integers(2**63))
            seq.generator = torch.Generator(device=self.device).manual_seed(seed)
        return seq.generator
