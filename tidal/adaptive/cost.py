"""Step-time models fitted online from the engine's own measured steps. Plain numbers only.

Target step (prefill chunks, decode tokens and draft tokens to verify, one forward):
    time = f(tokens) + c * sequences + d * context tokens + g * sequences verifying drafts,  c, d, g >= 0
where f is piecewise linear over knots in the token count. A straight line in tokens would miss
what matters on real hardware: a step is nearly flat while weights dominate (memory bound) and
grows once compute does, and a kernel switch makes a jump (tidal's CPU int4 path ends at
INT4_MAX_TOKENS = 8 tokens, so the engine adds knots at 8 and 9, and at 5 where its cost jumps,
and a pair where its compiled steps end, their MAX_TOKENS).

Draft phase (one proposal for the batch):
    time = e0 + e1 * head forwards + e2 * draft tokens + e3 * catch-up tokens,  all e >= 0

A sequence verifying drafts costs more than its extra tokens: it attends with several queries
(a causal mask), and its attention takes more of the step's rows or calls (model_runner:
query_width, SPLIT_PAD_ROWS); the g term prices that, and the start-up profile (batch
sizes 1-64 at K = 0, 2, 4) measures it from the start. A step verifying drafts is also priced with
`draft_bias` (see StepCostModel.draft_bias).

Both are least squares of the relative error over a window of recent steps plus the start-up
profile (kept as anchors where the live load has no samples), with a small smoothness penalty on f
so it interpolates between knots and extrapolates linearly past the last measured one. The
anchors are rescaled by the live steps' median ratio to what the anchors alone predict: the
profile keeps the shape, the live steps set the level (a profile taken on an idle machine would
otherwise make drafting look cheap on a busy one). Relative, because the choices that matter are
made on small decode steps, which a few long prefill steps would outweigh in absolute seconds.
The per-sequence and per-context terms may not be negative: fitted freely on a profile of at most
64 sequences they extrapolate to absurdly cheap large batches.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque

import numpy as np

DEFAULT_KNOTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

# The start-up profile that anchors both fits (LLMEngine.profile, mirrored by the simulator):
# requests of a 48-token prompt and 6 greedy tokens, at each batch size with each draft length.
PROFILE_PROMPT_LEN, PROFILE_MAX_TOKENS = 48, 6
PROFILE_BATCH_SIZES, PROFILE_DRAFT_LENGTHS = (1, 4, 16, 64), (0, 2, 4)


def profile_grid(capacity: int) -> list[tuple[int, int]]:
    """The profile's (batch size, draft length) points that fit in half a KV cache of `capacity` tokens."""
    return [(n, k) for n in PROFILE_BATCH_SIZES for k in PROFILE_DRAFT_LENGTHS
            if n * (PROFILE_PROMPT_LEN + PROFILE_MAX_TOKENS + k) <= capacity // 2]


class _LeastSquares:
    """Ridge least squares of the relative error (each row weighted by 1/y) over anchors + a
    sliding window of samples, refitted lazily: after each of the first `refit_every` samples (so
    the live level is set at once), then after every `refit_every`. A refit costs about as much
    as the policy's whole choice, and one sample barely moves a fit over dozens."""

    def __init__(self, num_features: int, window: int, penalty: np.ndarray, nonneg: tuple[int, ...] = (),
                 refit_every: int = 8):
        self.nonneg = nonneg  # coefficients that may not be negative (a cost never falls as it grows)
        self.anchors: list[tuple[np.ndarray, float]] = []
        # the window as a ring of rows and the anchors' own solve kept, so that a refit (every few
        # steps) builds no arrays: 256 samples + 75 anchors refit in 0.33 ms, 0.65 ms from a deque
        self._X, self._y = np.zeros((window, num_features)), np.zeros(window)
        self._added = 0
        self._anchor_fit = None  # (X, y, coefficients) of the anchors alone, until one is added
        self.penalty = penalty
        self.coef = [0.0] * num_features  # a plain list: cheap to index from Python
        self.floor = 0.0  # the smallest target seen, as of the last fit
        self.scale = 1.0  # live steps' time over the anchors' prediction, as of the last fit
        self.refit_every = refit_every
        self._pending = 0  # samples added since the last fit
        self._fitted = False

    def add(self, x: np.ndarray, y: float, anchor: bool = False) -> None:
        if anchor:
            self.anchors.append((x, y))
            self._anchor_fit = None
            self._pending = max(self._pending, self.refit_every)  # anchors change the shape: refit now
        else:
            i = self._added % len(self._y)
            self._X[i], self._y[i] = x, y
            self._added += 1
            self._pending += 1

    def fit(self) -> list[float]:
        due = self._pending >= (self.refit_every if self._fitted and self._added > self.refit_every else 1)
        if due and (self.anchors or self._added):
            n = self.num_samples
            Xs, ys = self._X[:n], self._y[:n]
            if self.anchors:
                if self._anchor_fit is None:
                    X, y = np.array([a[0] for a in self.anchors]), np.array([a[1] for a in self.anchors])
                    self._anchor_fit = X, y, np.array(self._solve(X, y))
                X, y, anchor_coef = self._anchor_fit
            if self.anchors and n:
                # the anchors give the shape, the live steps the level: rescale the anchors by the
                # live steps' median ratio to what the anchors alone predict (a profile taken on an
                # idle machine must not make extra tokens look cheap on a busy one)
                predicted = Xs @ anchor_coef
                ratio = ys / np.maximum(predicted, 1e-9)
                self.scale = float(np.clip(np.median(ratio), 0.2, 5.0)) if (predicted > 0).all() else 1.0
                X, y = np.vstack([X, Xs]), np.concatenate([y * self.scale, ys])
            elif n:
                X, y = Xs, ys
            self.coef = self._solve(X, y)
            self.floor = float(y.min())
            self._pending, self._fitted = 0, True
        return self.coef

    def _solve(self, X: np.ndarray, y: np.ndarray) -> list[float]:
        w = 1.0 / np.maximum(y, 1e-6)
        Xw, yw = X * w[:, None], y * w
        A = Xw.T @ Xw + self.penalty * float(np.median(w)) ** 2  # as strong as unweighted
        A, b = A + 1e-12 * np.eye(len(A)), Xw.T @ yw
        free = list(range(len(b)))
        while True:  # active set: a constrained coefficient that comes out negative is held at 0
            coef = np.zeros(len(b))
            coef[free] = np.linalg.solve(A[np.ix_(free, free)], b[free])
            bad = [i for i in self.nonneg if i in free and coef[i] < 0]
            if not bad:
                return coef.tolist()
            free.remove(min(bad, key=lambda i: coef[i]))

    @property
    def num_samples(self) -> int:
        return min(self._added, len(self._y))


class StepCostModel:
    """Seconds for one target forward over `tokens` tokens of `seqs` sequences holding `context`
    tokens of KV in all."""

    def __init__(self, knots=DEFAULT_KNOTS, window: int = 256, smoothness: float = 1e-2, bias_window: int = 32):
        self.knots = sorted(set(knots))
        self._knots = np.array(self.knots, dtype=float)
        n = len(self.knots)
        # second differences of f (per token, so knot spacing does not matter) should be small
        D = np.zeros((max(0, n - 2), n + 3))
        for i in range(n - 2):
            h0, h1 = self.knots[i + 1] - self.knots[i], self.knots[i + 2] - self.knots[i + 1]
            D[i, i], D[i, i + 1], D[i, i + 2] = 1 / h0, -(1 / h0 + 1 / h1), 1 / h1
        self._fit = _LeastSquares(n + 3, window, smoothness * D.T @ D + 1e-9 * np.eye(n + 3), nonneg=(n, n + 1, n + 2))
        # log(measured / predicted) of the last `bias_window` plain decode steps and steps verifying drafts
        self._residuals = {False: deque(maxlen=bias_window), True: deque(maxlen=bias_window)}
        self._draft_bias, self._draft_scale = 0.0, 1.0

    def _hat(self, tokens) -> tuple[int, float]:
        """The knot segment i holding `tokens` (the first or last past either end) and the weight
        of knot i + 1: `tokens` is (1 - w) of knot i and w of knot i + 1."""
        k = self.knots
        i = min(max(bisect.bisect_right(k, tokens) - 1, 0), len(k) - 2)
        return i, (tokens - k[i]) / (k[i + 1] - k[i])

    def features(self, tokens: int, seqs: int, context: int, drafting: int = 0) -> np.ndarray:
        """Hat-function weights of `tokens` on the knots (linear past either end), then seqs,
        context, and the sequences verifying drafts."""
        x = np.zeros(len(self.knots) + 3)
        i, w = self._hat(tokens)
        x[i], x[i + 1] = 1 - w, w
        x[-3], x[-2], x[-1] = seqs, context, drafting
        return x

    def observe(self, tokens: int, seqs: int, context: int, seconds: float, anchor: bool = False,
                drafts: int | None = None, drafting: int = 0) -> None:
        """One measured step, `drafting` of its sequences verifying drafts. `drafts`: for a
        decode step (every sequence fed one token plus its drafts), how many drafts it verified;
        None for a step that also prefills. Decode steps also update `draft_bias`."""
        if drafts is not None and not anchor and seconds > 0 and self.num_samples:
            predicted = self.predict(tokens, seqs, context, drafting, biased=False)
            self._residuals[drafts > 0].append(math.log(seconds / predicted))
            plain, verifying = self._residuals[False], self._residuals[True]
            if drafts and len(verifying) >= 4 and plain:
                self._draft_bias = min(0.5, max(-0.5, statistics.median(verifying) - statistics.median(plain)))
                self._draft_scale = math.exp(self._draft_bias)
        self._fit.add(self.features(tokens, seqs, context, drafting), seconds, anchor)

    @property
    def draft_bias(self) -> float:
        """How much dearer than the fit predicts a step verifying drafts has recently been,
        relative to a plain decode step (log ratio, within +-0.5): medians of the last 32 of
        each kind, from the fourth drafting step on. The fit has one token curve for every kind
        of token and drafts are rare in its window, while a drafting step's extra cost is mostly
        fixed (a second attention call, a kernel switch), so without it drafts look cheaper
        than they are. Medians, because this machine's slow spells land on one kind or the other."""
        return self._draft_bias

    def predict(self, tokens, seqs, context, drafting=0, biased: bool = True):
        """Seconds; `tokens`, `context` and `drafting` (sequences verifying drafts) may be numpy
        arrays. Plain numbers take a plain Python path: the policy prices its candidate steps one
        at a time (see SpecPolicy.plan). A step verifying drafts gets `draft_bias` if `biased`."""
        if isinstance(tokens, (int, float)):
            scale = self._draft_scale if drafting and biased else 1.0
            coef = self._fit.fit()
            i, w = self._hat(tokens)
            value = (1 - w) * coef[i] + w * coef[i + 1] + coef[-3] * seqs + coef[-2] * context + coef[-1] * drafting
            return scale * max(value, self._fit.floor)  # no step is faster than the fastest one measured
        coef, k = np.asarray(self._fit.fit()), self._knots
        i = np.clip(np.searchsorted(k, tokens, side="right") - 1, 0, len(k) - 2)
        w = (tokens - k[i]) / (k[i + 1] - k[i])
        value = (1 - w) * coef[i] + w * coef[i + 1] + coef[-3] * seqs + coef[-2] * context + coef[-1] * drafting
        scale = np.where(np.asarray(drafting) > 0, self._draft_scale, 1.0) if biased else 1.0
        return scale * np.maximum(value, self._fit.floor)  # no step is faster than the fastest one measured

    @property
    def num_samples(self) -> int:
        return self._fit.num_samples

    @property
    def num_anchors(self) -> int:
        return len(self._fit.anchors)


class DraftCostModel:
    """Seconds for one proposal: `forwards` drafter calls in a chain over `tokens` draft tokens in
    all, after catching the drafter up on `catch_up` skipped positions (EAGLE-3)."""

    def __init__(self, window: int = 256):
        # refitted as the step model is (every sample until 8, then every 8th), for the same
        # cost reason. At K = 0 its only samples are the policy's probes, so its level then
        # lags by up to 8 probes (128 steps).
        self._fit = _LeastSquares(4, window, 1e-9 * np.eye(4), nonneg=(0, 1, 2, 3))

    @staticmethod
    def features(forwards: int, tokens: int, catch_up: int) -> np.ndarray:
        return np.array([1.0 if forwards else 0.0, forwards, tokens, catch_up])

    def observe(self, forwards: int, tokens: int, catch_up: int, seconds: float, anchor: bool = False) -> None:
        self._fit.add(self.features(forwards, tokens, catch_up), seconds, anchor)

    def predict(self, forwards, tokens, catch_up):
        """Seconds, 0 without forwards; the arguments may be numpy arrays, as for StepCostModel."""
        e0, e1, e2, e3 = self._fit.fit()
        if isinstance(forwards, (int, float)):
            return max(0.0, e0 + e1 * forwards + e2 * tokens + e3 * catch_up) if forwards > 0 else 0.0
        return np.maximum(0.0, e0 + e1 * forwards + e2 * tokens + e3 * catch_up) * (np.asarray(forwards) > 0)
