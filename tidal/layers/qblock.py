"""Weights kept as ggml-style blocks of 32 (Q4_1: 4-bit codes with a scale and a minimum; Q8_0:
8-bit codes with a scale) and multiplied by tidal's own CPU kernel (tidal/kernels/qblock.cpp),
which rounds the activations to 8 bits per block, as llama.cpp does, and sums byte products.

Reading 0.6-1.1 bytes a weight instead of fp32's 4 is what a small step on a CPU needs; torch has
no kernel for it where the activations are fp32 (its int4/int8 ones are slower than the fp32
matmul there, and its dynamic-int8 one is a per-row layout that cannot hold GGUF's 4-bit blocks),
and ggml's kernels are not a library API, so the kernel is ours: AVX2 where the CPU
has it, portable C++ elsewhere. GGUF's Q4_1 weights and its Q8_0 output head are held
exactly; the loss is the activations' rounding (docs/results/notebook.md).

A machine that cannot build tidal's kernels (tidal/kernels) keeps dense weights.
"""

from __future__ import annotations

import torch

QK = 32  # weights per block
BLOCK_BYTES = {4: 20, 8: 34}  # Q4_1 and Q8_0 blocks


class QBlockWeight:
    """A [N, K] weight as N rows of blocks (uint8 [N, K / 32 * block bytes]; each row its blocks'
    fp16 scales, for Q4_1 their fp16 minimums, then their codes), serving steps of
    at most `max_rows` rows, eager and compiled alike (the op is a torch operator)."""

    def __init__(self, blocks: torch.Tensor, bits: int, max_rows: int):
        self.blocks, self.bits, self.max_rows = blocks.contiguous(), bits, max_rows

    @staticmethod
    def supported(weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
                and weight.shape[1] % QK == 0)

    @classmethod
    def from_q4_codes(cls, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                      max_rows: int) -> "QBlockWeight":
        """codes [N, K] in 0..15, scale and minimum [N, K / 32]: weight = code * scale + minimum
        (GGUF's Q4_1, and Q4_0 with minimum = -8 * scale), each fp16 as GGUF stores them."""
        n, k = codes.shape
        c = codes.to(torch.uint8).view(n, k // QK, QK)
        nibbles = (c[..., :16] | (c[..., 16:] << 4)).view(n, -1)
        halves = [t.to(torch.float16).contiguous().view(torch.uint8).view(n, -1) for t in (scale, minimum)]
        return cls(torch.cat([*halves, nibbles], dim=-1), 4, max_rows)

    @classmethod
    def quantize_q8(cls, weight: torch.Tensor, max_rows: int) -> "QBlockWeight":
        """Round each block of 32 to int8 with the scale max|w| / 127 in fp16 (GGUF's Q8_0, which
        a Q8_0 weight dequantized to fp32 comes back to exactly)."""
        n, k = weight.shape
        g = weight.detach().float().view(n, k // QK, QK)
        scale = (g.abs().amax(-1) / 127).to(torch.float16)
        inv = torch.where(scale > 0, 1 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
        codes = (g * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
        return cls.from_q8_0(scale, codes.view(n, k), max_rows)

    @classmethod
    def from_q8_0(cls, scale: torch.Tensor, codes: torch.Tensor, max_rows: int) -> "QBlockWeight":
        """scale fp16 [N, K / 32], codes int8 [N, K]: weight = code * scale (GGUF's Q8_0)."""
        n = codes.shape[0]
        return cls(torch.cat([scale.contiguous().view(torch.uint8).view(n, -1),
                              codes.contiguous().view(torch.uint8).view(n, -1)], -1), 8, max_rows)

    @classmethod
    def quantize_q4(cls, weight: torch.Tensor, max_rows: int) -> "QBlockWeight":
        """Round each block of 32 to 4 bits over its own range (GGUF's Q4_1); for timing shapes."""
        n, k = weight.shape
        g = weight.detach().float().view(n, k // QK, QK)
        low = g.amin(-1)
        scale = ((g.amax(-1) - low) / 15).clamp(min=1e-12)
        codes = ((g - low[..., None]) / scale[..., None]).round().clamp(0, 15).view(n, k)
        return cls.from_q4_codes(codes, scale, low, max_rows)

    def dequantize(self) -> torch.Tensor:
        """The weight as fp32 [N, K] (what the kernel multiplies by)."""
        return _dequantize(self.blocks, self.bits)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight as fp32 [len(ids), K]: an embedding lookup from the blocks."""
        return _dequantize(self.blocks[ids], self.bits)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.tidal.qblock_linear(x, self.blocks, self.bits)


def _dequantize(blocks: torch.Tensor, bits: int) -> torch.Tensor:
    """Each row: its blocks' fp16 scales, (4 bits) their fp16 minimums, then their codes."""
    n, nb = blocks.shape[0], blocks.shape[1] // BLOCK_BYTES[bits]
    half = lambda i: blocks[:, 2 * nb * i:2 * nb * (i + 1)].contiguous().view(torch.float16).float()[..., None]  # noqa: E731
    scale = half(0)
    if bits == 8:
        return (blocks[:, 2 * nb:].contiguous().view(torch.int8).view(n, nb, QK).float() * scale).view(n, -1)
    q = blocks[:, 4 * nb:].reshape(n, nb, 16)
    codes = torch.cat([q & 0x0F, q >> 4], dim=-1).float()
    return (codes * scale + half(1)).view(n, -1)
