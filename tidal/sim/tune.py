"""`tidal tune`: turn a sweep of fixed draft lengths into batch-size-to-K schedules for tidal,
vLLM and SGLang, so users of those engines get the decision without running tidal.

The input is records of a sweep (simulated, or measured by `tidal bench`) whose targets are
`off` (K = 0) and `fixed:K`. At each concurrency the K with the most output tok/s wins; batch
sizes between two measured concurrencies take the nearer one's K (split at their geometric
mean), and equal neighbours merge into one range.

- tidal: `--spec-schedule "1-8:3,9-48:1,49-:0"`.
- vLLM (dynamic speculative decoding): `speculative_config.num_speculative_tokens_per_batch_size`,
  a list of inclusive `[range_start, range_end, K]` entries starting at batch size 1, with
  `num_speculative_tokens` the largest K (the buffers are sized for it).
- SGLang: static EAGLE settings for the smallest batch (`--speculative-num-steps K`,
  `--speculative-eagle-topk 1`, `--speculative-num-draft-tokens K+1`); recent SGLang also takes
  `--speculative-adaptive --speculative-adaptive-config FILE`, a JSON object keyed by the batch
  size each range starts at, with `candidate_steps` ([0] turns drafting off for that range).
  Older SGLang has no batch-size switch: there the static setting is all it can take.
"""

from __future__ import annotations

import math


def k_of(target: str) -> int | None:
    """Draft length a sweep target stands for: off -> 0, fixed:K -> K; None for anything else."""
    if target == "off":
        return 0
    name, _, arg = target.partition(":")
    return int(arg) if name == "fixed" and arg.isdigit() else None


def best_k(records) -> dict[int, int]:
    """Per concurrency, the K whose target had the most output tok/s (ties: the smaller K).
    `records`: objects or dicts with target, concurrency, output_tok_s."""
    best: dict[int, tuple[float, int]] = {}
    for r in records:
        k = k_of(_field(r, "target"))
        if k is None or _field(r, "errors", 0):
            continue
        c, tok_s = int(_field(r, "concurrency")), float(_field(r, "output_tok_s"))
        if c not in best or (tok_s, -k) > (best[c][0], -best[c][1]):
            best[c] = (tok_s, k)
    if not best:
        raise ValueError("no off / fixed:K results to tune from")
    return {c: k for c, (_, k) in sorted(best.items())}


def _field(r, name: str, default=None):
    return r.get(name, default) if isinstance(r, dict) else getattr(r, name, default)


def schedule_ranges(best: dict[int, int], max_batch_size: int) -> list[tuple[int, int, int]]:
    """Inclusive (start, end, K) ranges covering 1..max_batch_size."""
    levels = sorted(best)
    ranges: list[list[int]] = []
    for i, c in enumerate(levels):
        start = 1 if i == 0 else ranges[-1][1] + 1
        end = max_batch_size if i == len(levels) - 1 else int(math.sqrt(c * levels[i + 1]))
        end = max(end, start)
        if ranges and ranges[-1][2] == best[c]:
            ranges[-1][1] = end
        elif start <= max_batch_size:
            ranges.append([start, end, best[c]])
    ranges[-1][1] = max(ranges[-1][1], max_batch_size)
    return [tuple(r) for r in ranges]


def tidal_schedule(ranges: list[tuple[int, int, int]]) -> str:
    """tidal's --spec-schedule string; the last range is open-ended."""
    parts = [f"{s}-{e}:{k}" for s, e, k in ranges[:-1]]
    parts.append(f"{ranges[-1][0]}-:{ranges[-1][2]}")
    return ",".join(parts)


def vllm_config(ranges, method: str = "eagle3", draft_model: str | None = None) -> dict | None:
    """vLLM's speculative_config with the schedule; None when no batch size should speculate."""
    k_max = max(k for *_, k in ranges)
    if not k_max:
        return None
    config = {"method": method}
    if draft_model:
        config["model"] = draft_model
    config["num_speculative_tokens"] = k_max
    config["num_speculative_tokens_per_batch_size"] = [[s, e, k] for s, e, k in ranges]
    return config


def sglang_settings(ranges, algorithm: str = "EAGLE3", draft_model: str | None = None) -> dict:
    """SGLang launch arguments (a list of strings) and the adaptive config JSON for them."""
    k_first = ranges[0][2]
    adaptive = {str(s): {"candidate_steps": [k]} for s, _, k in ranges}
    if not max(k for *_, k in ranges):
        return {"args": [], "adaptive_config": None, "note": "speculation does not pay at any batch size: launch without it"}
    k_static = k_first or max(k for *_, k in ranges)
    args = ["--speculative-algorithm", algorithm]
    if draft_model:
        args += ["--speculative-draft-model-path", draft_model]
    args += ["--speculative-num-steps", str(k_static), "--speculative-eagle-topk", "1",
             "--speculative-num-draft-tokens", str(k_static + 1)]
    return {"args": args, "adaptive_args": ["--speculative-adaptive", "--speculative-adaptive-config", "ADAPTIVE.json"],
            "adaptive_config": adaptive if len(ranges) > 1 else None,
            "note": "adaptive_args with adaptive_config saved as ADAPTIVE.json switch K by batch size on SGLang "
                    "versions that have --speculative-adaptive (EAGLE/EAGLE3, topk 1); older ones take args only"}


def tune(records, max_batch_size: int = 256, method: str = "eagle3", draft_model: str | None = None) -> dict:
    """Everything `tidal tune` prints, as one JSON-able object."""
    best = best_k(records)
    ranges = schedule_ranges(best, max_batch_size)
    return {
        "best_k_by_concurrency": {str(c): k for c, k in best.items()},
        "tidal": {"spec_schedule": tidal_schedule(ranges)},
        "vllm": {"speculative_config": vllm_config(ranges, method, draft_model)},
        "sglang": sglang_settings(ranges, "EAGLE3" if method == "eagle3" else method.upper(), draft_model),
    }
