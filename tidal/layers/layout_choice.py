"""Which weight layout serves which step sizes on this machine, by timing the kernels.

The fastest layout of a weight depends on the CPU (its ISA, caches and memory bandwidth), the
thread count, the weight's shape and the rows of the step, so it is measured rather than assumed:
for each distinct weight shape, the dense fp32 matmul against the fp16 layout (linear.Fp16Weight)
and the block layouts (qblock.QBlockWeight) as eager steps call them, at the ends of each range of
step sizes (`edges`). A machine where a layout cannot run (no fbgemm, e.g. ARM; no compiler for
the block kernel) keeps the dense weights.

The block kernel widens its weights to fp32 for a GEMM from a few dozen rows on, so past the last
edge its cost follows the dense matmul's: where it wins every range it serves every step size
(EVERY_STEP), and the model keeps no dense copy of that weight.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.nn.functional as F

from tidal.layers.linear import EVERY_STEP, Fp16Weight
from tidal.layers.qblock import QBlockWeight

log = logging.getLogger("tidal.engine")

# timed calls per kernel and row count, alternating, after one warm-up call each
REPEATS = 7
# a narrower layout is kept while it takes at most this much longer than dense fp32: it holds a
# quarter to a half of the bytes (a block layout serving every step frees the dense copy), and
# two timings of one kernel here differ by about as much
MARGIN = 1.1
# the widest step size timed, past the compiled steps' range: a prefill chunk, a busy batch's head
EAGER_EDGE = 256


def probe_rows(low: int, high: int) -> tuple[int, ...]:
    """The row counts timed for a range of step sizes: its ends."""
    return (low,) if low == high else (low, high)


def _median_seconds(fn, x: torch.Tensor, other, repeats: int) -> tuple[float, float]:
    """Median seconds of fn(x) and other(x), called in turn (a slow spell hits both alike)."""
    a, b = [], []
    fn(x), other(x)
    for _ in range(repeats):
        for f, out in ((fn, a), (other, b)):
            start = time.perf_counter()
            f(x)
            out.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b)


def max_rows(make, shape: tuple[int, int], edges: tuple[int, ...], repeats: int = REPEATS,
             beyond: bool = False) -> int:
    """The most rows up to which the layout `make(weight)` builds of an [N, K] weight is as fast
    as dense fp32 within MARGIN: the upper edge of the last step-size range, from the first, over
    which it takes no longer summed over its probe rows (with `beyond`, EVERY_STEP where that is
    every range); 0 where it loses the first range or cannot run here (`make` returns None or
    raises)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=g) * 0.05
    try:
        layout = make(weight)
        if layout is None:
            return 0
        layout(torch.zeros(1, shape[1]))
    except RuntimeError as e:  # a CPU the kernel does not support
        log.info("a weight layout is unavailable here: %s", e)
        return 0
    dense = lambda x: F.linear(x, weight)  # noqa: E731
    best, low = 0, 1
    for high in edges:
        times = [_median_seconds(layout, torch.randn(m, shape[1], generator=g), dense, repeats)
                 for m in probe_rows(low, high)]
        if sum(t for t, _ in times) > MARGIN * sum(t for _, t in times):
            return best
        best, low = high, high + 1
    return EVERY_STEP if beyond else best


def fp16_max_rows(shape: tuple[int, int], edges: tuple[int, ...], repeats: int = REPEATS) -> int:
    return max_rows(lambda w: Fp16Weight(w, edges[-1]) if Fp16Weight.supported(w) else None, shape, edges, repeats)


def qblock_max_rows(shape: tuple[int, int], bits: int, edges: tuple[int, ...], repeats: int = REPEATS) -> int:
    quantize = QBlockWeight.quantize_q4 if bits == 4 else QBlockWeight.quantize_q8
    return max_rows(lambda w: quantize(w, edges[-1]) if QBlockWeight.supported(w) else None, shape, edges, repeats,
                    beyond=True)


def choose_layouts(shapes: list[tuple[int, int]], block_bits: dict[tuple[int, int], int],
                   edges: tuple[int, ...]) -> dict[str, dict[tuple[int, int], int]]:
    """Under the current thread count, for each distinct shape: the most rows its fp16 copy
    serves ("fp16") and, for the shapes in `block_bits` (shape -> 4 or 8), its block copy
    ("qblock"). fp16 is timed only where the block layout stops."""
    start = time.perf_counter()
    with torch.inference_mode():
        qblock = {s: qblock_max_rows(s, bits, edges) for s, bits in block_bits.items()}
        fp16 = {s: fp16_max_rows(s, edges) for s in dict.fromkeys(shapes) if qblock.get(s, 0) < edges[-1]}
        fp16 = {s: r for s, r in fp16.items() if r > qblock.get(s, 0)}
    log.info("start-up: weight layouts measured in %.2f s: blocks up to %s rows, fp16 up to %s rows",
             time.perf_counter() - start,
             {f"{n}x{k}": "every" if r == EVERY_STEP else r for (n, k), r in qblock.items()},
             {f"{n}x{k}": r for (n, k), r in fp16.items()})
    return {"fp16": fp16, "qblock": qblock}


def forced(layout: str):
    """A stand-in for choose_layouts that gives `layout` ("fp16", "qblock" or "dense") every
    step size it can serve, whatever it costs: for checking a layout's numbers."""
    def choose(shapes, block_bits, edges):
        return {"fp16": {s: edges[-1] for s in shapes} if layout == "fp16" else {},
                "qblock": {s: EVERY_STEP for s in block_bits} if layout == "qblock" else {}}
    return choose
