"""Prompt-lookup drafter: continue the most recent earlier match of the sequence's own suffix."""

from __future__ import annotations

from tidal.sequence import Sequence


class TokenIndex:
    """Where each token of one growing sequence occurs, all but its last token: a lookup starts
    from the last token's earlier occurrences without scanning the sequence (the drafter looks
    up every decoding request every step)."""

    def __init__(self):
        self.size = 0  # tokens indexed
        self.at: dict[int, list[int]] = {}  # token -> its positions, in order

    def update(self, tokens: list[int]) -> None:
        at = self.at
        for p in range(self.size, len(tokens) - 1):
            at.setdefault(tokens[p], []).append(p)
        self.size = max(self.size, len(tokens) - 1)


def ngram_propose(tokens: list[int], k: int, min_n: int = 2, max_n: int = 4) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    length max_n..min_n; empty when no suffix recurs."""
    return ngram_match(tokens, k, min_n, max_n)[0]


def ngram_match(tokens: list[int], k: int, min_n: int = 2, max_n: int = 4, longest: int = 16,
                index: TokenIndex | None = None) -> tuple[list[int], int]:
    """ngram_propose's continuation, and how many tokens (up to `longest`) the matched
    occurrence shares with the sequence's end: the match extended backwards past max_n.
    `index`: the sequence's TokenIndex, brought up to date here (None: a new one)."""
    last = len(tokens) - 1
    if last < min_n:
        return [], 0
    if index is None:
        index = TokenIndex()
    index.update(tokens)
    best, end = 0, -1
    for e in reversed(index.at.get(tokens[last], ())):  # the latest first: it wins ties
        n = 1
        while n < max_n and e - n >= 0 and tokens[e - n] == tokens[last - n]:
            n += 1
        if n > best:
            best, end = n, e
            if n == max_n:
                break
    if best < min_n:
        return [], 0
    n = best
    while n < longest and end - n >= 0 and tokens[end - n] == tokens[last - n]:
        n += 1
    return list(tokens[end + 1:end + 1 + k]), n


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
        self._index: dict[Sequence, TokenIndex] = {}

    def available(self, seqs: list[Sequence], max_k: int) -> list[int]:
        """Lengths of the continuations found now, kept for `propose` (which then only slices):
        asking the policy to price drafts that do not exist overstates both their worth and
        their verify cost."""
        self._found = {}
        for s in seqs:
            index = self._index.get(s)
            if index is None:
                index = self._index[s] = TokenIndex()
            continuation, length = ngram_match(s.token_ids, max_k, self.min_n, self.max_n, index=index)
            self._found[s.request_id] = (s.num_tokens, continuation, match_grade(length))
        return [len(self._found[s.request_id][1]) for s in seqs]

    def draft_class(self, seq: Sequence) -> int:
        found = self._found.get(seq.request_id)
        return found[2] if found is not None and found[0] == seq.num_tokens else 0

    def catch_up(self, seq: Sequence) -> int:
        return 0  # nothing falls behind while a request does not draft (its index is read every step)

    def forget(self, seq: Sequence) -> None:
        self._index.pop(seq, None)

    def propose(self, seqs: list[Sequence], num_draft_tokens: list[int]):
        drafts = []
        for s, k in zip(seqs, num_draft_tokens):
            found = self._found.get(s.request_id)
            if k <= 0:
                drafts.append([])
            elif found is not None and found[0] == s.num_tokens and len(found[1]) >= k:
                drafts.append(found[1][:k])
            else:
                drafts.append(ngram_match(s.token_ids, k, self.min_n, self.max_n, index=self._index.get(s))[0])
        return drafts, None
