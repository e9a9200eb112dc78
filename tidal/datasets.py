"""Prompt sets shipped with tidal for benchmarks and drafter training."""

from __future__ import annotations

import json
from importlib import resources


def chat_prompts() -> list[str]:
    """Short, varied single-turn user prompts (tidal/data/chat_prompts.json)."""
    return json.loads((resources.files("tidal.data") / "chat_prompts.json").read_text())


def rewrite_prompts() -> list[str]:
    """Repetition-heavy tasks (repeat, rewrite, reformat a given passage), where the answer
    reuses much of the prompt (tidal/data/rewrite_prompts.json)."""
    return json.loads((resources.files("tidal.data") / "rewrite_prompts.json").read_text())


def mixed_prompts() -> list[str]:
    """Chat and rewrite prompts taking turns, so that drafts' acceptance differs several-fold
    between the requests of one batch (the n-gram drafter copies rewrites, rarely chat)."""
    chat, rewrite = chat_prompts(), rewrite_prompts()
    n = max(len(chat), len(rewrite))
    return [p for i in range(n) for p in (chat[i % len(chat)], rewrite[i % len(rewrite)])]


def train_prompts() -> list[str]:
    """Prompts for drafter self-distillation (tidal/data/train_prompts.json); none of them is in
    the benchmark sets above, so those stay held out."""
    return json.loads((resources.files("tidal.data") / "train_prompts.json").read_text())


def sharegpt_prompts(path: str) -> list[str]:
    """The first human turn of every conversation in a ShareGPT-format JSON file (a list of
    {"conversations": [{"from": "human", "value": ...}, ...]}); conversations without one are
    skipped."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    prompts = []
    for item in data:
        turns = item.get("conversations", []) if isinstance(item, dict) else []
        first = next((t.get("value") for t in turns if isinstance(t, dict)
                      and t.get("from") in ("human", "user") and t.get("value")), None)
        if isinstance(first, str):
            prompts.append(first)
    if not prompts:
        raise ValueError(f"{path}: no conversation has a human turn")
    return prompts


def random_prompts(tokenizer, vocab_size: int, num: int, input_len: int, seed: int = 0) -> list[str]:
    """`num` texts of random tokens that `tokenizer` encodes to exactly `input_len` ids.

    Decoding random ids and encoding the text again can merge or split tokens, so the ids are
    re-drawn from the re-encoding until the round trip is exact.
    """
    import numpy as np

    if input_len < 1:
        raise ValueError("--input-len must be >= 1")
    rng = np.random.default_rng(seed)
    vocab = vocab_size
    prompts = []
    while len(prompts) < num:
        ids = rng.integers(0, vocab, input_len).tolist()
        for _ in range(20):
            text = tokenizer.decode(ids)
            got = tokenizer.encode(text)
            if len(got) == input_len:
                prompts.append(text)
                break
            ids = got[:input_len] + rng.integers(0, vocab, max(0, input_len - len(got))).tolist()
    return prompts
