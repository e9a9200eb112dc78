"""SamplingParams: the user's per-request knobs, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    temperature 0 means greedy. top_k -1 (or 0) disables top-k; top_p 1 disables top-p.
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
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_number(self.temperature) and self.temperature >= 0,
               "temperature", f"must be >= 0, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1,
               "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= -1,
               "top_k", f"must be -1 (disabled) or >= 1, got {self.top_k!r}")
        _check(self.seed is None or isinstance(self.seed, int),
               "seed", f"must be an integer, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               "stop", "must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
