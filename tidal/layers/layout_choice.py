"""Which weight layout serves which step sizes on this machine, by timing the kernels.

The fastest layout of a weight depends on the CPU (its ISA, caches and memory bandwidth), the
thread count, the weight's shape and the rows of the step, so it is measured rather than assumed:
for each distinct weight shape, the dense fp32 matmul against the fp16 layout (linear.Fp16Weight)
as eager steps call them, at the ends of each range of step sizes (`edges`). A machine where a
layout cannot run (no fbgemm, e.g. ARM) keeps the dense weights.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.nn.functional as F

from tidal.layers.linear import Fp16Weight

log = logging.getLogger("tidal.engine")

# timed calls per kernel and row count, alternating, after one warm-up call each
REPEATS = 7


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


def fp16_max_rows(shape: tuple[int, int], edges: tuple[int, ...], repeats: int = REPEATS) -> int:
    """The most rows up to which the fp16 layout of an [N, K] weight is at least as fast as dense
    fp32: the upper edge of the last step-size range, from the first, over which fp16 takes no
    longer summed over its probe rows; 0 where it loses the first range or cannot run here."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=g) * 0.05
    if not Fp16Weight.supported(weight):
        return 0
    try:
        fp16 = Fp16Weight(weight, max_rows=edges[-1])
        fp16(torch.zeros(1, shape[1]))
    except RuntimeError as e:  # a CPU fbgemm does not support
        log.info("fp16 weights unavailable here: %s", e)
        return 0
    dense = lambda x: F.linear(x, weight)  # noqa: E731
    best, low = 0, 1
    for high in edges:
        times = [_median_seconds(fp16, torch.randn(m, shape[1], generator=g), dense, repeats)
                 for m in probe_rows(low, high)]
        if sum(t for t, _ in times) > sum(t for _, t in times):
            break
        best, low = high, high + 1
    return best


def choose_fp16_rows(shapes: list[tuple[int, int]], edges: tuple[int, ...]) -> dict[tuple[int, int], int]:
    """fp16_max_rows of each distinct shape, under the current thread count."""
    start = time.perf_counter()
    with torch.inference_mode():
        rows = {s: fp16_max_rows(s, edges) for s in dict.fromkeys(shapes)}
    log.info("start-up: weight layouts measured in %.2f s: fp16 up to %s rows",
             time.perf_counter() - start, {f"{n}x{k}": r for (n, k), r in rows.items()})
    return rows
