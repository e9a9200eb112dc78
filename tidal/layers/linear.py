"""Linear layers: dense, or 4-bit weights packed for torch's CPU int4 kernel, or dense bf16
weights pre-packed for oneDNN on CPU.

GGUF Q4_0/Q4_1 weights are groups of 32 4-bit codes with a scale (and a minimum); torch's
`_weight_int4pack_mm_for_cpu` computes (q - 8) * scale + zero per group, which represents both
exactly. Reading 4-bit weights is what makes small batches fast on a CPU; at larger token counts
the dense bf16 matmul wins (decode steps of the bundled model on this project's 2-core
AVX512-BF16 machine, `benchmarks/int4_vs_dense.py`, dense weights packed as below: int4 faster up
to 8 tokens, dense from 10, with one compute thread and with two), so both are kept.

`F.linear` on a CPU bf16 weight re-lays the weight out for oneDNN on every call, which at a few
rows costs as much as the multiply itself; a weight packed once gives the same bits in about
half the time there (measured on this project's machine: the 49152-row output head at one row
4.3 -> 2.4 ms, a 3072-row MLP projection 0.13 -> 0.07 ms; within 10% of each other from 128 rows).

Where the activations are fp32 (CPUs without native bf16), a weight rounded to fp16 and packed for
fbgemm's fp16 GEMM (AVX2 code) reads half the bytes of fp32 and loses about 2e-4 of a weight's
size; whether it beats the dense matmul in an eager step, and up to how many rows, is measured on
the machine (tidal/layers/layout_choice.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tidal.layers.qblock import QBlockWeight

INT4_MAX_TOKENS = 8
# ...and within it the kernel's cost jumps between 4 and 5 rows (benchmarks/int4_vs_dense.py),
# so the step-cost model gets a knot there too
INT4_ROW_TILE = 4
INT8_MAX_TOKENS = 1
GROUP_SIZE = 32
# the most rows of a layout that serves every step size (layout_choice.py)
EVERY_STEP = 2**31 - 1


@dataclass
class Int4Weight:
    packed: torch.Tensor  # uint8 [N, K / 2], torch's CPU int4 layout
    scales_zeros: torch.Tensor  # [K / group, N, 2] in the activation dtype

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                   dtype: torch.dtype) -> "Int4Weight":
        """codes [N, K] in 0..15, scale and minimum [N, K / 32]: weight = code * scale + minimum."""
        return cls._build(codes, scale.to(dtype), (minimum + 8 * scale).to(dtype))  # the kernel subtracts 8

    @classmethod
    def _build(cls, codes: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor) -> "Int4Weight":
        """The kernel's weight (code - 8) * scale + zeros, scale and zeros in the activation dtype."""
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        return cls(packed, torch.stack([scale, zeros], dim=-1).transpose(0, 1).contiguous())

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """The kernel's shape rules: whole groups along K, N a multiple of 16."""
        return weight.dim() == 2 and weight.shape[1] % GROUP_SIZE == 0 and weight.shape[0] % 16 == 0

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype) -> "Int4Weight":
        """Round a dense [N, K] weight to 4 bits per group of 32 (each group's own min and step,
        as GGUF's Q4_1 does). The codes are picked against the step and offset as the kernel
        reads them, rounded to `dtype` (picked against the exact ones, a bf16 offset far from 0
        puts weights most of a step off; tests/test_int4.py), so at most half the bf16 step."""
        n, k = weight.shape
        groups = weight.detach().float().view(n, k // GROUP_SIZE, GROUP_SIZE)
        minimum, maximum = groups.amin(-1), groups.amax(-1)
        scale = ((maximum - minimum) / 15).clamp(min=1e-12).to(dtype)
        zeros = (minimum + 8 * scale.float()).to(dtype)
        codes = ((groups - zeros.float()[..., None]) / scale.float()[..., None] + 8).round().clamp(0, 15).view(n, k)
        return cls._build(codes, scale, zeros)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scales_zeros)


@dataclass
class Int8Weight:
    """A weight rounded to int8 with one scale per output row, for torch's weight-only int8
    kernel: half the bytes of bf16. Eager, that kernel beats the packed bf16 matmul only for a
    single row, so it serves one-token steps; compiled, inductor's own int8 GEMM beats its bf16
    one at every row count a compiled step has (the output head: 2.2 vs 3.8 ms at 2 rows), so
    it serves every compiled step."""

    codes: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # [N] in the activation dtype

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Int8Weight":
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        codes = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        return cls(codes, scale.to(weight.dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)


class Fp16Weight:
    """An fp32 weight rounded to fp16 and packed for fbgemm's fp16 GEMM (fp32 activations in and
    out), serving eager steps of at most `max_rows` rows. Compiled steps keep the dense weight:
    inductor's own GEMM over it (packed at compile time, on every thread) beat this
    single-threaded kernel called from the graph (docs/results/notebook.md)."""

    def __init__(self, weight: torch.Tensor, max_rows: int):
        w = weight.detach().float().contiguous()
        self.packed = torch.ops.aten.fbgemm_pack_gemm_matrix_fp16(w)
        self.bias = torch.zeros(w.shape[0])  # the kernel takes one
        self.max_rows = max_rows

    @staticmethod
    def supported(weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
                and "fbgemm" in torch.backends.quantized.supported_engines)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.fbgemm_linear_fp16_weight(x.contiguous(), self.packed, self.bias)


class PackedWeight:
    """A CPU bf16 weight laid out once for oneDNN's matmul (what `F.linear` redoes every call)."""

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    @staticmethod
    def supported(weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
                and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def packed_copies(owner, names) -> dict[str, PackedWeight]:
    """oneDNN-packed copies of `owner`'s weights `names`, those PackedWeight supports."""
    return {n: PackedWeight(w) for n in names if PackedWeight.supported(w := getattr(owner, n))}


def int4_copies(owner, names) -> dict[str, Int4Weight]:
    """4-bit copies rounded from `owner`'s dense weights `names`, those the kernel fits."""
    return {n: Int4Weight.quantize(w, w.dtype) for n in names if Int4Weight.fits(w := getattr(owner, n))}


def placeholder(shape, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
    """A stand-in for a dense weight that another layout serves at every step size: its shape and
    dtype, no data (one element, zero strides), so that the model does not hold the dense copy."""
    return torch.zeros((), dtype=dtype, device=device).expand(*shape)


def is_placeholder(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.stride(0) == 0


def drop_dense(owner: torch.nn.Module, name: str) -> None:
    """Replace `owner`'s dense weight `name` by a placeholder of its shape, dtype and device."""
    weight = getattr(owner, name)
    stand_in = placeholder(weight.shape, weight.dtype, weight.device)
    setattr(owner, name, torch.nn.Parameter(stand_in, requires_grad=False))


def linear(x: torch.Tensor, weight: torch.Tensor, int4: Int4Weight | None = None,
           packed: PackedWeight | None = None, int8: Int8Weight | None = None,
           fp16: Fp16Weight | None = None, qblock: QBlockWeight | None = None) -> torch.Tensor:
    """x @ weight.T through the fastest copy of the weight there is for x's row count."""
    if qblock is not None and x.shape[0] <= qblock.max_rows:
        return qblock(x)
    if fp16 is not None and x.shape[0] <= fp16.max_rows and not torch.compiler.is_compiling():
        return fp16(x)
    if int4 is not None and x.shape[0] <= INT4_MAX_TOKENS:
        return int4(x)
    if int8 is not None and (x.shape[0] <= INT8_MAX_TOKENS or torch.compiler.is_compiling()):
        return int8(x)
    if packed is not None and not torch.compiler.is_compiling():  # inductor packs frozen weights itself
        return packed(x)
    if is_placeholder(weight):
        raise RuntimeError(f"a step of {x.shape[0]} rows needs the dense weight {tuple(weight.shape)}, "
                           "which was dropped for a layout that serves every step size")
    return F.linear(x, weight)
