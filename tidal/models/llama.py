"""The target model: a Llama decoder over the paged KV cache.

One forward for every kind of token of a step (prefill chunks, decode tokens, draft tokens to
verify): a flat batch of T tokens with their positions and attention metadata.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.config import ModelConfig
from tidal.layers.attention import AttentionMetadata, paged_attention
from tidal.layers.linear import (EVERY_STEP, Fp16Weight, Int4Weight, Int8Weight, PackedWeight, drop_dense, linear,
                                 packed_copies)
from tidal.layers.qblock import QBlockWeight
from tidal.layers.norm import rms_norm
from tidal.layers.rotary import apply_rope, rope_cache


PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU block. `attn_input_size` lets EAGLE-3's layer attend over
    [normed embedding, normed feature] (2 x hidden) while keeping the hidden-size residual."""

    def __init__(self, cfg: ModelConfig, attn_input_size: int | None = None):
        super().__init__()
        self.cfg = cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.input_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.qkv_proj = nn.Parameter(torch.empty(q + 2 * kv, attn_input_size or cfg.hidden_size))
        self.o_proj = nn.Parameter(torch.empty(cfg.hidden_size, q))
        self.post_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.gate_up_proj = nn.Parameter(torch.empty(2 * cfg.intermediate_size, cfg.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(cfg.hidden_size, cfg.intermediate_size))
        self.int4: dict[str, Int4Weight] = {}  # optional packed 4-bit copies, by parameter name
        self.packed: dict[str, PackedWeight] = {}  # optional oneDNN-packed dense copies (CPU bf16)
        self.fp16: dict[str, Fp16Weight] = {}  # optional fp16 copies for small eager steps (CPU fp32)
        self.qblock: dict[str, QBlockWeight] = {}  # optional 4-bit block copies for small steps (CPU fp32)

    def forward(self, h, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        return self.block(h, rms_norm(h, self.input_norm, self.cfg.rms_norm_eps), cos, sin, k_cache, v_cache, meta)

    def block(self, h, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        """Attention over the normed input `x` added to the residual `h`, then the MLP."""
        q, k, v = self.qkv(x, cos, sin)
        return self.finish(h, paged_attention(q, k, v, k_cache, v_cache, meta, self.cfg.head_dim ** -0.5))

    def qkv(self, x, cos, sin):
        """Rotated queries [T, heads, D] and keys, values [T, kv_heads, D] of the normed input."""
        cfg = self.cfg
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv = self._linear("qkv_proj", x)
        # queries and keys rotated in one call: a decode step is many small ops, not a few big ones
        qk = apply_rope(qkv[:, :q_size + kv_size].view(-1, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim), cos, sin)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        return q, k, qkv[:, q_size + kv_size:].view(-1, cfg.num_kv_heads, cfg.head_dim)

    def finish(self, h, attn):
        """Residual add of the attention output [T, heads * D], then the MLP block."""
        h = h + self._linear("o_proj", attn)
        x = rms_norm(h, self.post_norm, self.cfg.rms_norm_eps)
        gate, up = self._linear("gate_up_proj", x).chunk(2, dim=-1)
        return h + self._linear("down_proj", F.silu(gate) * up)

    def _linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return linear(x, getattr(self, name), self.int4.get(name), self.packed.get(name), fp16=self.fp16.get(name),
                      qblock=self.qblock.get(name))

    def pack_dense(self) -> None:
        """Pack the projections for oneDNN once (inference only: the copies do not follow the
        parameters); a no-op where it does not apply (not CPU bf16)."""
        self.packed = packed_copies(self, PROJECTIONS)


class LlamaModel(nn.Module):
    """Llama-family decoder. Parameter names are ours; loader.py maps GGUF and HF names."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.packed_head: PackedWeight | None = None
        self.int8_head: Int8Weight | None = None
        self.fp16_head: Fp16Weight | None = None
        self.qblock_head: QBlockWeight | None = None
        self.qblock_embed: QBlockWeight | None = None  # the head's blocks, where they hold the embedding exactly
        cos, sin = rope_cache(cfg.head_dim, cfg.max_model_len, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def attach_int4(self, codes: dict[str, tuple], dtype: torch.dtype) -> None:
        """Add packed 4-bit copies of the layer weights named `layers.{i}.{param}` in `codes`."""
        for name, (q, scale, minimum) in codes.items():
            _, i, param = name.split(".")
            self.layers[int(i)].int4[param] = Int4Weight.from_codes(q, scale, minimum, dtype)

    def attach_int8_head(self) -> None:
        """An int8 copy of the output head for one-token steps (where the file stores it at 8 bits)."""
        self.int8_head = Int8Weight.quantize(self.unembedding)

    def weight_shapes(self) -> list[tuple[int, int]]:
        """The shapes of the weights a step multiplies by: the layers' projections and the head."""
        return [tuple(getattr(layer, n).shape) for layer in self.layers for n in PROJECTIONS] + [
            tuple(self.unembedding.shape)]

    def attach_fp16(self, max_rows: dict[tuple[int, int], int]) -> None:
        """fp16 copies of the projections and the head, each serving steps of up to its shape's
        `max_rows` (none where that is 0)."""
        def copy(w: torch.Tensor) -> Fp16Weight | None:
            rows = max_rows.get(tuple(w.shape), 0)
            return Fp16Weight(w, rows) if rows and Fp16Weight.supported(w) else None

        for layer in self.layers:
            layer.fp16 = {n: c for n in PROJECTIONS if (c := copy(getattr(layer, n))) is not None}
        self.fp16_head = copy(self.unembedding)

    def attach_qblock(self, codes: dict[str, tuple], max_rows: dict[tuple[int, int], int], head: bool,
                      head_q8: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Block copies of the layer weights the file stores at 4 bits (`codes`, as attach_int4
        takes them) and, with `head`, of the output head at 8 bits (`head_q8`: the file's own
        Q8_0 scales and codes, else rounded from the dense head), each serving steps of up to its
        shape's `max_rows` (none where that is 0). A projection whose blocks serve every step
        size keeps no dense copy (it would be most of the model's memory, never read)."""
        for name, (q, scale, minimum) in codes.items():
            _, i, param = name.split(".")
            layer = self.layers[int(i)]
            if rows := max_rows.get(tuple(q.shape), 0):
                layer.qblock[param] = QBlockWeight.from_q4_codes(q, scale, minimum, rows)
            if rows == EVERY_STEP:
                drop_dense(layer, param)
        rows = max_rows.get(tuple(self.unembedding.shape), 0)
        if head and rows and QBlockWeight.supported(self.unembedding):
            exact = head_q8 is not None  # the dense head was dequantized from these very blocks
            self.qblock_head = (QBlockWeight.from_q8_0(*head_q8, rows) if exact
                                else QBlockWeight.quantize_q8(self.unembedding, rows))
            # a tied Q8_0 embedding comes back exactly: look tokens up in the blocks, so that
            # steps the head's blocks serve need no fp32 copy of the embedding
            if self.cfg.tie_word_embeddings and (exact or torch.equal(self.qblock_head.dequantize(), self.embed)):
                self.qblock_embed = self.qblock_head

    def fp16_weights(self) -> list[Fp16Weight]:
        """The fp16 copies, layer by layer, then the head's."""
        return [layer.fp16[n] for layer in self.layers for n in PROJECTIONS if n in layer.fp16] + (
            [self.fp16_head] if self.fp16_head is not None else [])

    def pack_dense(self) -> None:
        """oneDNN-packed copies of the dense weights (CPU bf16): the output head, used every
        step, and the layers' projections, used where the 4-bit kernel is not."""
        for layer in self.layers:
            layer.pack_dense()
        self.packed_head = PackedWeight(self.unembedding) if PackedWeight.supported(self.unembedding) else None

    @property
    def unembedding(self) -> torch.Tensor:
        """The output head's weight [vocab, hidden]: the token embedding when they are tied."""
        return self.embed if self.cfg.tie_word_embeddings else self.lm_head

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple],
                meta: AttentionMetadata, aux_layers: tuple[int, ...] = ()):
        """Returns the final-normed hidden states [T, H] and the residual stream after each
        layer in `aux_layers` (the low/mid/high features EAGLE-3 drafts from)."""
        return self.run(input_ids, positions, kv_caches, meta, aux_layers)

    def run(self, input_ids, positions, kv_caches, meta: AttentionMetadata, aux_layers: tuple[int, ...] = ()):
        """`forward` without inference mode, which torch.compile cannot capture (it mutates the
        KV cache); compiled steps run it under no_grad."""
        h = self.qblock_embed.rows(input_ids) if self.qblock_embed is not None else F.embedding(input_ids, self.embed)
        cos, sin = self.cos[positions], self.sin[positions]
        aux = []
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            h = layer(h, cos, sin, k_cache, v_cache, meta)
            if i in aux_layers:
                aux.append(h)
        return rms_norm(h, self.norm, self.cfg.rms_norm_eps), aux

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.unembedding, packed=self.packed_head, int8=self.int8_head,
                      fp16=self.fp16_head, qblock=self.qblock_head).float()
