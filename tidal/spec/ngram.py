"""Prompt-lookup drafter: continue the most recent earlier match of the sequence's own suffix."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tidal.sequence import Sequence


def ngram_propose(tokens: list[int] | np.ndarray, k: int, min_n: int = 2, max_n: int = 4) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    length max_n..min_n; empty when no suffix recurs."""
    arr = np.asarray(tokens)
    for n in range(min(max_n, len(arr) - 1), min_n - 1, -1):
        windows = sliding_window_view(arr[:-1], n)  # every n-gram that ends before the last token
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []


class NgramDrafter:
    """No weights: proposes from the request's own prompt and output."""

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n

    def catch_up(self, seq: Sequence) -> int:
        return 0  # stateless: nothing falls behind while a request does not draft

    def propose(self, seqs: list[Sequence], num_draft_tokens: list[int]):
        drafts = [ngram_propose(s.token_ids, k, self.min_n, self.max_n) if k > 0 else []
                  for s, k in zip(seqs, num_draft_tokens)]
        return drafts, None
