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


def train_prompts() -> list[str]:
    """Prompts for drafter self-distillation (tidal/data/train_prompts.json); none of them is in
    the benchmark sets above, so those stay held out."""
    return json.loads((resources.files("tidal.data") / "train_prompts.json").read_text())
