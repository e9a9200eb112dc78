"""The start-up step-cost profile on disk, one file per key, so a later start with the same model
file, drafter, dtype, device, thread count, cache and scheduler limits and tidal version reuses it
instead of timing its steps again. The key is everything that changes a step's cost; anything
else (a new torch, a rebuilt head) changes a file's size or time, or the version."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

FORMAT = 1
log = logging.getLogger("tidal.engine")


def cache_dir() -> Path:
    """$TIDAL_CACHE_DIR, else $XDG_CACHE_HOME/tidal, else ~/.cache/tidal."""
    if os.environ.get("TIDAL_CACHE_DIR"):
        return Path(os.environ["TIDAL_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tidal"


def file_identity(path: str | Path | None) -> list:
    """Path, size and modification time of a file, or of every file in a directory."""
    if path is None:
        return []
    path = Path(path).resolve()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def cpu_identity() -> dict:
    """The CPU as far as a kernel's speed goes: its model name, architecture and the vector ISA
    torch dispatches to."""
    import platform

    import torch

    name = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model")):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": name, "arch": platform.machine(), "isa": torch.backends.cpu.get_cpu_capability()}


def load_record(key: str) -> dict | None:
    """A JSON object stored under `key`, or None if there is none or it is unreadable."""
    try:
        record = json.loads((cache_dir() / key).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def digest(parts: dict) -> str:
    """A short stable name for the set-up `parts` describes (JSON-serialisable values)."""
    blob = json.dumps({"format": FORMAT, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def profile_key(parts: dict) -> str:
    """A file name for the profile measured under `parts`."""
    return f"profile-{digest(parts)}.json"


def load(key: str) -> dict | None:
    """The stored profile {"steps": [[tokens, seqs, context, seconds, drafts, verifying], ...],
    "drafts": [[forwards, tokens, catch_up, seconds], ...]}, or None if there is none or it is unreadable."""
    record = load_record(key)
    if record is None or not _rows(record.get("steps"), 6) or not _rows(record.get("drafts"), 4, True):
        return None
    return record


def _rows(rows, width: int, may_be_empty: bool = False) -> bool:
    """A list of `width`-number rows (None allowed where the step log allows it)."""
    return (isinstance(rows, list) and (may_be_empty or bool(rows))
            and all(isinstance(r, list) and len(r) == width
                    and all(x is None or isinstance(x, (int, float)) for x in r) for r in rows))


def save(key: str, record: dict) -> None:
    """Write atomically (a concurrent start reads the old file or the new one, never half); a
    cache that cannot be written is skipped, the engine runs without it."""
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{key}.{os.getpid()}"
        tmp.write_text(json.dumps(record))
        tmp.replace(directory / key)
    except OSError as e:
        log.warning("start-up profile not cached: %s", e)
