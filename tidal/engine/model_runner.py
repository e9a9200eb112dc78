"""Builds one step's tensors (tokens, positions, slot mapping, attention groups), runs the
model over the paged KV cache, and samples."""

from __future__ import annotations

import os

import numpy as np
import torch
from torch._inductor import config as inductor_config

from tidal.config import CacheConfig, ModelConfig
from tidal.engine.profile_cache import cache_dir
from tidal.engine.scheduler import ScheduledSeq
from tidal.layers.attention import AttentionGroup, AttentionMetadata
from tidal.layers.linear import INT4_MAX_TOKENS
from tidal.layers.sampler import sample
from tidal.models.llama import LlamaModel
from tidal.sampling_params import SamplingParams
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


# Steps of at most this many tokens (decode and verify at small batch sizes, where a step is many
# small ops) run compiled; longer ones (prefill chunks, large batches) run eager.
COMPILED_MAX_TOKENS = INT4_MAX_TOKENS


def _step_logits(model: LlamaModel, input_ids, positions, kv_caches, meta, rows, aux_layers):
    """What a compiled step captures: the forward and the output head at the sampled rows."""
    hidden, aux = model.run(input_ids, positions, kv_caches, meta, aux_layers)
    return model.logits(hidden[rows]), aux


def compile_step(device: torch.device):
    """`_step_logits` through inductor, GEMMs autotuned (on CPU its own micro-kernels for the
    int4 weights) and, with weights frozen into the graph (see ModelRunner._run_compiled),
    CUDA graphs on a GPU. Compiled code and autotuning results are cached on disk."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    mode = "max-autotune" if device.type == "cuda" else "max-autotune-no-cudagraphs"
    return torch.compile(_step_logits, mode=mode)


def kv_cache_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


class ModelRunner:
    """Owns the model, its KV cache and the per-request sampling generators."""

    def __init__(self, model: LlamaModel, cache: CacheConfig, device: torch.device,
                 dtype: torch.dtype, seed: int = 0, compile: bool = False):
        self.model, self.cfg, self.device, self.dtype = model, model.cfg, device, dtype
        self.compiled = compile_step(device) if compile else None
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

    def _group(self, items: list[tuple[int, Sequence, int, int]], least: int = 1, least_keys: int = 1
               ) -> AttentionGroup:
        """items: (flat offset, seq, first position, tokens fed). Pads queries to Q, keys to K;
        sequences and queries to at least `least`, keys to at least `least_keys` (a padding
        sequence attends to slot 0 with one query, so no row is all masked)."""
        pad = max(0, least - len(items))
        q_lens = np.array([n for _, _, _, n in items] + [1] * pad)
        computed = np.array([start for _, _, start, _ in items] + [0] * pad)
        starts = np.array([off for off, _, _, _ in items] + [0] * pad)
        ctx = computed + q_lens
        Q, K = max(least, int(q_lens.max())), max(least_keys, int(ctx.max()))
        j = np.arange(Q)
        valid = (j[None] < q_lens[:, None]) & (np.arange(len(q_lens)) < len(items))[:, None]
        token_index = np.where(valid, starts[:, None] + j[None], 0)
        q_pos = np.where(valid, computed[:, None] + j[None], 0)
        p = np.arange(K)
        mask = (p[None, None] <= q_pos[:, :, None]) & (p[None, None] < ctx[:, None, None])
        kv_slots = np.zeros((len(q_lens), K), dtype=np.int64)
        for b, (_, seq, _, _) in enumerate(items):
            kv_slots[b, : ctx[b]] = self._slots(seq, 0, int(ctx[b]))
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)  # noqa: E731
        first = int(starts[0])
        in_order = (least == least_keys == 1 and bool(valid.all())
                    and np.array_equal(token_index.ravel(), np.arange(first, first + valid.size)))
        return AttentionGroup(token_index=t(token_index), kv_slots=t(kv_slots), mask=t(mask[:, None]),
                              out_index=t(token_index[valid]), rows=t(np.flatnonzero(valid)),
                              first=first if in_order else None)

    def slots(self, spans: list[tuple[Sequence, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and cache slots (on the device) of feeding each seq `n` tokens from position
        `start`, the sequences laid out one after another."""
        t = lambda parts: torch.from_numpy(np.concatenate(parts)).to(self.device)  # noqa: E731
        return (t([np.arange(start, start + n) for _, start, n in spans]),
                t([self._slots(seq, start, start + n) for seq, start, n in spans]))

    def metadata(self, spans: list[tuple[Sequence, int, int]], compiled: bool = False
                 ) -> tuple[torch.Tensor, AttentionMetadata]:
        """Positions and attention metadata for feeding each seq `n` tokens from position
        `start`, the sequences laid out one after another. The EAGLE drafter uses it too, over
        its own cache, which shares the target's block tables. `compiled`: one padded group
        whatever the step, every size at least 2 (but the sequences and queries of a one-token
        step), so that two compiled graphs (one token; more) serve every small step: dynamo
        specialises a size of 0 or 1 (see warm_up)."""
        positions, slots = self.slots(spans)
        if compiled:
            items = list(zip(np.cumsum([0] + [n for *_, n in spans[:-1]]).tolist(), *zip(*spans)))
            group = self._group(items, least=1 if len(positions) == 1 else 2, least_keys=2)
            return positions, AttentionMetadata(slot_mapping=slots, groups=[group])
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

    def prepare(self, scheduled: list[ScheduledSeq], compiled: bool = False):
        ids = []
        for s in scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            ids.extend(seq.token_ids[start:start + s.num_new_tokens - s.num_draft_tokens])
            ids.extend(seq.draft_token_ids[: s.num_draft_tokens])
        positions, meta = self.metadata([(s.seq, s.seq.num_computed_tokens, s.num_new_tokens) for s in scheduled],
                                        compiled)
        return torch.tensor(ids, device=self.device), positions, meta

    # ------------------------------------------------------------ run

    def execute(self, scheduled: list[ScheduledSeq]) -> tuple[list[list[int]], torch.Tensor | None]:
        """Run one step. Returns, for each scheduled seq that samples, in order, the tokens it
        gains (one sampled token, or its accepted drafts plus the verifier's next token); and
        the target features [T, 3 x hidden] of every fed token when `aux_layers` is set."""
        ends = np.cumsum([s.num_new_tokens for s in scheduled]) - 1
        rows, starts, sampling = [], [], []
        for end, s in zip(ends, scheduled):
            if s.samples:  # logits for the last fed token and for every draft token
                starts.append(len(rows))
                rows.extend(range(end - s.num_draft_tokens, end + 1))
                sampling.append(s)
        num_tokens = int(ends[-1]) + 1
        compiled = self.compiled is not None and 0 < len(rows) and num_tokens <= COMPILED_MAX_TOKENS
        input_ids, positions, meta = self.prepare(scheduled, compiled)
        if compiled:
            logits, aux = self._run_compiled(input_ids, positions, meta, rows)
        else:
            hidden, aux = self.model(input_ids, positions, self.kv_caches, meta, self.aux_layers)
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]) if rows else None
        features = torch.cat(aux, dim=-1) if aux else None
        if not sampling:
            return [], features
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

    def _run_compiled(self, input_ids, positions, meta, rows: list[int], capture: bool = False):
        """The compiled step; its sampled rows padded to at least 2 in a step of more than one
        token (like its other sizes, see metadata), the padding's logits dropped. `capture`:
        mark the sizes that vary from step to step as dynamic (warm_up)."""
        n = len(rows)
        if len(input_ids) > 1 and n < 2:
            rows = rows + rows[-1:]
        rows = torch.tensor(rows, device=self.device)
        if capture:
            g, many = meta.groups[0], len(input_ids) > 1
            for t, dims in ((g.kv_slots, [1]), (g.mask, [3])) + (((input_ids, [0]), (positions, [0]), (rows, [0]),
                            (meta.slot_mapping, [0]), (g.token_index, [0, 1]), (g.kv_slots, [0]),
                            (g.mask, [0, 2]), (g.out_index, [0]), (g.rows, [0])) if many else ()):
                torch._dynamo.mark_dynamic(t, dims)
        # freezing (weights as constants) is what lets inductor use its low-bit GEMM templates;
        # a config, not a torch.compile option, as options cannot go with a mode
        with torch.no_grad(), inductor_config.patch(freezing=True):
            logits, aux = self.compiled(self.model, input_ids, positions, self.kv_caches, meta, rows, self.aux_layers)
        return logits[:n], aux

    def warm_up(self) -> None:
        """Compile both graphs now (a one-token step; a step of 2..COMPILED_MAX_TOKENS tokens)
        over placeholder sequences in the first cache blocks, before any request holds them. The
        sizes of the second differ from each other at capture, and duck shaping is off, so no
        two are taken for one (dynamo would guard on their equality)."""
        if self.compiled is None:
            return
        from torch.fx.experimental import _config as fx_config

        seq = Sequence("warm-up", list(range(1, 8)), SamplingParams(max_tokens=1))
        other = Sequence("warm-up-2", [1, 2], SamplingParams(max_tokens=1))
        seq.block_table = other.block_table = list(range(-(-8 // self.block_size)))
        with fx_config.patch(use_duck_shape=False):
            for spans, rows in (([(seq, 6, 1)], [0]), ([(seq, 3, 3), (other, 0, 2)], [1, 2, 4])):
                ids = torch.ones(sum(n for *_, n in spans), dtype=torch.long, device=self.device)
                positions, meta = self.metadata(spans, compiled=True)
                self._run_compiled(ids, positions, meta, rows, capture=True)

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
