"""Prompt-lookup drafter: continue the most recent earlier match of the sequence's own suffix."""

from __future__ import annotations

import numpy as np

from tidal.sequence import Sequence


def ngram_propose(tokens: list[int] | np.ndarray, k: int, min_n: int = 2, max_n: int = 4) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    length max_n..min_n; empty when no suffix recurs."""
    return ngram_match(tokens, k, min_n, max_n)[0]


def ngram_match(tokens: list[int] | np.ndarray, k: int, min_n: int = 2, max_n: int = 4,
                longest: int = 16) -> tuple[list[int], int]:
    """ngram_propose's continuation, and how many tokens (up to `longest`) the matched
    occurrence shares with the sequence's end: the match extended backwards past max_n.
    Found from the earlier occurrences of the last token, each extended backwards at once
    (it runs for every decoding request every step: a sliding window per n cost 6x more)."""
    arr = np.asarray(tokens)
    last = len(arr) - 1
    ends = np.flatnonzero(arr[:-1] == arr[-1]) if last >= min_n else arr[:0]  # candidate match ends
    if not ends.size:
        return [], 0
    length = np.ones(ends.size, dtype=np.int64)  # each candidate's match length, up to max_n
    alive = np.ones(ends.size, dtype=bool)
    for j in range(1, max_n):
        before = ends - j
        alive &= before >= 0
        alive[alive] &= arr[before[alive]] == arr[last - j]
        length += alive
    best = int(length.max())
    if best < min_n:
        return [], 0
    end = int(ends[np.flatnonzero(length == best)[-1]])  # the latest of the longest
    n = best
    while n < longest and end - n >= 0 and arr[end - n] == arr[last - n]:
        n += 1
    return arr[end + 1:end + 1 + k].tolist(), n


def match_grade(length: int) -> int:
    """A match's length graded 1 (2-3 tokens), 2 (4-7), 3 (8-15), 4 (16 and more); 0: none. The
    first draft of a 16-token match is accepted nearly always, of a 2-token one about half the
    time (docs/adaptive-speculation.md)."""
    return min(4, max(0, length.bit_length() - 1))


class NgramDrafter:
    """No weights: proposes from the request's own prompt and output."""

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n
        # request id -> (its length, continuation, match grade)
        self._found: dict[str, tuple[int, list[int], int]] = {}

    def available(self, seqs: list[Sequence], max_k: int) -> list[int]:
        """Lengths of the continuations found now, kept for `propose` (which then only slices):
        asking the policy to price drafts that do not exist overstates both their worth and
        their verify cost."""
        self._found = {}
        for s in seqs:
            continuation, length = ngram_match(s.token_ids, max_k, self.min_n, self.max_n)
            self._found[s.request_id] = (s.num_tokens, continuation, match_grade(length))
        return [len(self._found[s.request_id][1]) for s in seqs]

    def draft_class(self, seq: Sequence) -> int:
        found = self._found.get(seq.request_id)
        return found[2] if found is not None and found[0] == seq.num_tokens else 0

    def catch_up(self, seq: Sequence) -> int:
        return 0  # stateless: nothing falls behind while a request does not draft

    def forget(self, seq: Sequence) -> None:
        pass

    def propose(self, seqs: list[Sequence], num_draft_tokens: list[int]):
        drafts = []
        for s, k in zip(seqs, num_draft_tokens):
            found = self._found.get(s.request_id)
            if k <= 0:
                drafts.append([])
            elif found is not None and found[0] == s.num_tokens and len(found[1]) >= k:
                drafts.append(found[1][:k])
            else:
                drafts.append(ngram_propose(s.token_ids, k, self.min_n, self.max_n))
        return drafts, None
