"""SamplingParams: the user's per-request knobs, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    temperature 0 (below 1e-5) means greedy. top_k -1 (or 0) disables top-k; top_p 1 disables top-p.
    `seed` fixes the request's random draws; with speculative decoding the number of draws per
    step follows the draft length, so the same seed repeats its text only under the same draft
    lengths (not across adaptive runs or loads; the distribution is the same either way).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self):
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        _check(isinstance(stop, (list, tuple)), "stop", "must be a string or a list of strings")
        _check(isinstance(ids, (list, tuple)), "stop_token_ids", "must be a list of token ids")
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1,
               "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_number(self.temperature) and 0 <= self.temperature < math.inf,
               "temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1,
               "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and self.top_k >= -1,
               "top_k", f"must be -1 (disabled) or >= 1, got {self.top_k!r}")
        _check(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**63),
               "seed", f"must be an integer in [-2**63, 2**63), got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               "stop", "must be non-empty strings")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", "must be non-negative integers")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a boolean")

    @property
    def greedy(self) -> bool:
        # below this, temperature scaling overflows float32 logits; treat it as greedy (as vLLM does)
        return self.temperature < GREEDY_EPS


class InvalidParameter(ValueError):
    """A request parameter is out of range; `param` names it (OpenAI's error field)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param} {message}")
        self.param = param


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameter(param, message)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
