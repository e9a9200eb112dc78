"""SpecPolicy: how many draft tokens each request gets this step (0 = none). Plain Python numbers only
(no numpy, torch or engine). The rules and their reasons: docs/adaptive-speculation.md.

Adaptive mode maximises the step's goodput, expected emitted tokens per second of decoding:

    goodput(k) = sum_i E_i(k_i) / (verify(tokens + sum k, seqs, context) - prefill + draft(max k, sum k, catch-up))

E_i(k) = 1 + sum_{j<=k} prod_{l<=j} a_il, a_il being request i's acceptance of draft position l.
The j-th draft is worth prod_{l<=j} a_il, which never grows with j, so taking drafts in order of
worth and keeping the best prefix is optimal. Prefill time is not charged to drafts (it is owed
anyway); an EAGLE-3 request's catch-up backlog is spread over the steps it has left; drafts never
take budget that pending prefill needs. Probes keep acceptance (and the plain step's cost)
measured while the policy does not draft; a risk bar (`min_gain`) and hysteresis (`margin`) keep
estimates' noise from deciding near break-even.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

MODES = ("fixed", "adaptive", "schedule")


@dataclass
class RequestView:
    """What the policy sees of one request about to draft."""

    max_k: int  # at most this many drafts (the configured K, and what the request may still emit)
    reached: list[float]  # recency-weighted count of verifications that reached draft position l
    accepted: list[float]  # ... and of those that accepted it
    catch_up: int = 0  # positions the drafter must catch up on before drafting (EAGLE after a pause)
    prev_k: int | None = None  # what it got last step
    remaining: int | None = None  # tokens it may still emit (None: unknown)
    draft_class: int = 0  # the drafter's grade of the drafts it would get (0: ungraded); `reached` and
    # `accepted` are its counts for drafts of this class


def parse_schedule(text: str) -> list[tuple[int, int | None, int]]:
    """'1-4:4,5-16:2,17-:0' -> [(1, 4, 4), (5, 16, 2), (17, None, 0)]: batch-size ranges and K."""
    out: list[tuple[int, int | None, int]] = []
    for part in text.replace(" ", "").split(","):
        try:
            rng, k = part.split(":")
            lo, hi = rng.split("-") if "-" in rng else (rng, rng)
            entry = (int(lo), int(hi) if hi else None, int(k))
        except ValueError:
            raise ValueError(f"bad speculation schedule entry {part!r}: want LO-HI:K, LO-:K or N:K") from None
        if entry[0] < 1 or entry[2] < 0 or (entry[1] is not None and entry[1] < entry[0]):
            raise ValueError(f"bad speculation schedule entry {part!r}")
        if out and (out[-1][1] is None or entry[0] <= out[-1][1]):
            raise ValueError("speculation schedule ranges must be increasing and not overlap")
        out.append(entry)
    return out


def scheduled_k(schedule: list[tuple[int, int | None, int]], batch_size: int) -> int:
    """K of the range holding `batch_size`; 0 outside every range."""
    for lo, hi, k in schedule:
        if lo <= batch_size and (hi is None or batch_size <= hi):
            return k
    return 0


def acceptance_curve(reached: list[float], accepted: list[float], prior: list[float], weight: float,
                     optimism: float = 0.0) -> list[float]:
    """Per-position conditional acceptance, the request's counts smoothed towards `prior`, the
    first position's prior raised by `optimism` (at most 1): a new request starts that much above
    the engine-wide rate, and the raise fades as its own counts outweigh the prior. Only the
    first position: it is measured whenever the request drafts at all; position l is reached
    only after l - 1 accepted drafts, and an optimistic estimate there would stay high for good."""
    out = []
    for l, p in enumerate(prior):
        n = (reached[l] if l < len(reached) else 0.0) + weight
        a = (accepted[l] if l < len(reached) else 0.0) + weight * min(1.0, p + (optimism if l == 0 else 0.0))
        out.append(a / n)
    return out


def draft_worths(alphas: list[float], k: int) -> list[float]:
    """Expected tokens the j-th draft adds, j = 1..k: prod_{l<=j} alpha_l (non-increasing)."""
    out, w = [], 1.0
    for a in alphas[:k]:
        w *= a
        out.append(w)
    return out


VerifyCost = Callable[[int, int, int, int], float]  # (tokens, seqs, context, sequences verifying drafts) -> seconds
DraftCost = Callable[[int, int, float], float]  # (forwards, draft tokens, catch-up positions) -> seconds


@dataclass(frozen=True)
class StepPrice:
    """The step that drafts would join, and what its cost models say it costs: it feeds
    `base_tokens` non-draft tokens over `seqs` sequences holding `context` KV tokens; `prefill`
    is what its prefill tokens add (not charged to drafts; see SpecPolicy.choose)."""

    base_tokens: int
    seqs: int
    context: int
    verify: VerifyCost
    draft: DraftCost
    prefill: float = 0.0

    def with_prefill(self, num_decoding: int) -> "StepPrice":
        """This price with `prefill` set: the step's time beyond its `num_decoding` plain tokens."""
        if self.base_tokens <= num_decoding:
            return replace(self, prefill=0.0)
        with_prefill = self.verify(self.base_tokens, self.seqs, self.context, 0)
        return replace(self, prefill=max(0.0, with_prefill - self.verify(num_decoding, self.seqs, self.context, 0)))

    def verify_seconds(self, total: int, verifying: int) -> float:
        """The target's step with `total` drafts to verify over `verifying` sequences, less its prefill."""
        return self.verify(self.base_tokens + total, self.seqs, self.context + total, verifying) - self.prefill

    def seconds(self, total: int, longest: int, catch_up: float, verifying: int) -> float:
        """The step with `total` drafts over `verifying` sequences (the longest chain `longest`),
        their proposal included."""
        if not total:  # K = 0: no drafter call
            return self.verify_seconds(0, 0)
        return self.verify_seconds(total, verifying) + self.draft(longest, total, catch_up)


class SpecPolicy:
    """Chooses draft lengths per request each step: fixed K, a batch-size schedule, or adaptive."""

    def __init__(self, mode: str, max_k: int, schedule: str | None = None, margin: float = 0.03, min_gain: float = 0.05,
                 prior_weight: float = 2.0, decay: float = 0.98, initial_acceptance: float = 0.5,
                 probe_every: int = 16, probe_share: float = 0.01, plain_every: int = 64, optimism: float = 0.2,
                 class_weight: float = 4.0):
        if mode not in MODES:
            raise ValueError(f"speculation mode {mode!r} is not one of {', '.join(MODES)}")
        self.mode, self.max_k, self.margin, self.prior_weight, self.decay = mode, max_k, margin, prior_weight, decay
        self.min_gain, self.optimism = min_gain, optimism
        self.schedule = parse_schedule(schedule) if schedule else []
        if mode == "schedule" and not self.schedule:
            raise ValueError("schedule mode needs a schedule")
        # engine-wide recency-weighted counts per draft position: the prior of every request
        self._reached = [1.0] * max_k
        self._accepted = [initial_acceptance] * max_k
        # the same per graded draft class, smoothed towards the engine-wide counts with `class_weight`
        self._classes: dict[int, tuple[list[float], list[float]]] = {}
        self.class_weight = class_weight
        self.probe_every, self.probe_share, self.plain_every = probe_every, probe_share, plain_every
        # per draft position l: adaptive steps whose longest chain stopped at l - 1 since a chain last
        # reached l (l = 1: steps in a row without drafts), and their predicted verification time
        self._short = [0] * max_k
        self._short_seconds = [0.0] * max_k
        self._busy = 0  # adaptive steps in a row with drafts

    @property
    def prior(self) -> list[float]:
        return [a / r for a, r in zip(self._accepted, self._reached)]

    def class_prior(self, draft_class: int) -> list[float]:
        """The prior of drafts the drafter graded `draft_class`: that class's engine-wide counts,
        smoothed towards all drafts' with weight `class_weight` (class 0, ungraded: all drafts').
        A grade (an n-gram match's length) tells a request's next drafts apart before the
        request's own counts of that grade exist."""
        counts = self._classes.get(draft_class) if draft_class else None
        if counts is None:
            return self.prior
        w = self.class_weight
        return [(a + w * p) / (r + w) for r, a, p in zip(*counts, self.prior)]

    def record(self, num_drafted: int, num_accepted: int, draft_class: int = 0) -> None:
        """One verification anywhere in the engine: positions 1..num_accepted + 1 were reached.
        Counted per verification, the prior leans towards the requests that draft most, which
        are those that accept most (counting each request once erred the other way: a request
        whose first drafts are rejected stops drafting and keeps a rate near 0)."""
        graded = None
        if draft_class:
            graded = self._classes.setdefault(draft_class, ([0.0] * self.max_k, [0.0] * self.max_k))
        for l in range(min(num_drafted, num_accepted + 1, self.max_k)):
            self._reached[l] = self.decay * self._reached[l] + 1
            self._accepted[l] = self.decay * self._accepted[l] + (l < num_accepted)
            if graded:
                graded[0][l] = self.decay * graded[0][l] + 1
                graded[1][l] = self.decay * graded[1][l] + (l < num_accepted)

    def most(self, num_requests: int) -> int:
        """The most drafts any of `num_requests` decoding requests can get this step, known
        before looking at them (0: the drafter need not be asked anything)."""
        return scheduled_k(self.schedule, num_requests) if self.mode == "schedule" else self.max_k

    def choose(self, requests: list[RequestView], price: StepPrice, draft_budget: int | None = None) -> list[int]:
        """Draft lengths for `requests` (the decoding ones) in the step `price` describes, with
        room for at most `draft_budget` drafts in all (adaptive mode only; None: no limit)."""
        if self.mode == "fixed":
            return [min(self.max_k, r.max_k) for r in requests]
        if self.mode == "schedule":
            k = self.most(len(requests))
            return [min(k, r.max_k) for r in requests]
        priors = {c: self.class_prior(c) for c in {r.draft_class for r in requests}}
        optimism = self.optimism / max(1, len(requests))
        worths = [draft_worths(acceptance_curve(r.reached, r.accepted, priors[r.draft_class], self.prior_weight,
                                                optimism), min(self.max_k, r.max_k)) for r in requests]
        charges = [self.catch_up_charge(r, w) for r, w in zip(requests, worths)]
        budget = sum(len(w) for w in worths) if draft_budget is None else max(0, draft_budget)
        price = price.with_prefill(len(requests))
        ks = self.plan(requests, worths, charges, price, budget)
        if any(r.prev_k is not None for r in requests):
            stay = [min(r.max_k, self.max_k, ks[i] if r.prev_k is None else r.prev_k) for i, r in enumerate(requests)]
            if (stay != ks and sum(stay) <= budget and self.goodput(requests, worths, charges, price, ks)
                    <= (1 + self.margin) * self.goodput(requests, worths, charges, price, stay)):
                ks = stay
        return self._probe(ks, requests, worths, budget, price)

    @staticmethod
    def catch_up_charge(r: RequestView, worths: list[float]) -> float:
        """Catch-up positions charged to this step if `r` drafts (see the module docstring)."""
        if r.prev_k or r.remaining is None or not r.catch_up:
            return float(r.catch_up)
        steps_left = r.remaining / (1.0 + sum(worths))
        return r.catch_up / max(1.0, steps_left)

    def _probe(self, ks: list[int], requests: list[RequestView], worths: list[list[float]], budget: int,
               price: StepPrice) -> list[int]:
        """One more draft for one request at the first position no request drafts this step, once
        `probe_every` steps have stopped short of it since a chain last reached it and the draft
        costs at most `probe_share` of their time; and a step without drafts after `plain_every`
        with them (see the module docstring)."""
        depth, total = max(ks, default=0), sum(ks)
        for l in range(depth):  # positions drafted this step: measured, their counts start again
            self._short[l], self._short_seconds[l] = 0, 0.0
        if depth:
            self._busy += 1
            if self._busy > self.plain_every:
                self._busy = 0
                return [0] * len(ks)
        else:
            self._busy = 0
        if depth >= self.max_k:
            return ks
        verifying = sum(1 for k in ks if k)
        now = price.verify_seconds(total, verifying)
        self._short[depth] += 1
        self._short_seconds[depth] += now
        able = [i for i, r in enumerate(requests) if ks[i] == depth and min(r.max_k, self.max_k) > depth]
        if self._short[depth] >= self.probe_every and able and total < budget:
            if depth == 0:  # the cheapest backlog to catch up on
                i = min(able, key=lambda i: requests[i].catch_up)
            else:  # the likeliest to reach the position (its drafts so far all accepted); backlog paid
                i = max(able, key=lambda i: worths[i][depth - 1])
            catch_up = requests[i].catch_up if depth == 0 else 0
            drafting = price.draft(depth, total, catch_up) if depth else 0.0  # K = 0: no drafter call
            extra = (price.verify_seconds(total + 1, verifying + (depth == 0)) - now
                     + price.draft(depth + 1, total + 1, catch_up) - drafting)
            if extra <= self.probe_share * self._short_seconds[depth]:
                ks = list(ks)
                ks[i] += 1
                self._short[depth], self._short_seconds[depth] = 0, 0.0
        return ks

    def _rate(self, emitted: float, total: int, longest: int, catch_up: float, verifying: int,
              price: StepPrice) -> float:
        """Emitted tokens per second of decoding with `total` drafts over `verifying` sequences
        (the longest chain `longest`), discounted by 1 + min_gain when there are any: the
        policy's objective."""
        seconds = price.seconds(total, longest, catch_up, verifying)
        return emitted / max(seconds, 1e-9) / (1 + self.min_gain if total else 1.0)

    def goodput(self, requests, worths, charges, price: StepPrice, ks) -> float:
        """The objective for draft lengths `ks`: expected emitted tokens per second of decoding."""
        emitted = len(requests) + sum(sum(w[:k]) for w, k in zip(worths, ks))
        catch_up = sum(c for c, k in zip(charges, ks) if k)
        return float(self._rate(emitted, sum(ks), max(ks, default=0), catch_up, sum(1 for k in ks if k), price))

    def plan(self, requests, worths, charges, price: StepPrice, budget: int) -> list[int]:
        """The goodput-best allocation among prefixes (of at most `budget` drafts) of all drafts
        sorted by worth, each prefix priced in turn in plain Python. Not numpy: run between two
        model forwards, which evict the caches, numpy's per-call overhead costs more than these
        few dozen multiplications."""
        ks = [0] * len(requests)
        # sorted() is stable: a request's equal-worth drafts stay in chain order
        flat = sorted(((w, i, j) for i, ws in enumerate(worths) for j, w in enumerate(ws, 1)),
                      key=lambda d: -d[0])[:max(0, budget)]
        emitted, longest, catch_up, verifying = float(len(requests)), 0, 0.0, 0
        best, best_n = self._rate(emitted, 0, 0, catch_up, 0, price), 0
        for n, (w, i, j) in enumerate(flat, 1):
            emitted += w
            longest = max(longest, j)
            if j == 1:  # the request's first draft: one more sequence verifying, its backlog paid
                catch_up += charges[i]
                verifying += 1
            rate = self._rate(emitted, n, longest, catch_up, verifying, price)
            if rate > best:  # the first best: the fewest drafts
                best, best_n = rate, n
        for _, i, _ in flat[:best_n]:
            ks[i] += 1
        return ks
