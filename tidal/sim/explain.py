"""`tidal sim --explain C`: one steady decode step at concurrency C on the roofline, its time split
into terms, for plain decoding and for fixed draft lengths, so a reader sees why speculation wins
or loses there. Prefill is left out: every request decodes, at the mean context of its answer."""

from __future__ import annotations

from tidal.sim.roofline import RooflineModel, StepShape


def emitted_per_step(curve: tuple[float, ...], k: int) -> float:
    """Expected tokens a request emits per step with k drafts: 1 + sum_j prod_{l<=j} a_l
    (positions past the curve use its last value)."""
    total, reach = 1.0, 1.0
    for j in range(k):
        reach *= curve[min(j, len(curve) - 1)]
        total += reach
    return total


def decode_shape(concurrency: int, k: int, input_len: int, output_len: int) -> StepShape:
    """`concurrency` requests at context input_len + output_len / 2, each feeding 1 + k tokens."""
    c, q = concurrency, 1 + k
    ctx = input_len + output_len // 2
    pairs = c * (q * ctx + q * (q + 1) // 2)
    return StepShape(c * q, c, c * (ctx + q), c * k, c * q, pairs, c if k else 0)


def breakdown(model: RooflineModel, concurrency: int, k: int, curve: tuple[float, ...], input_len: int,
              output_len: int) -> dict[str, float]:
    """Seconds of each term of one decode step of `concurrency` requests, and its tok/s."""
    shape = decode_shape(concurrency, k, input_len, output_len)
    e, hw = model.efficiency, model.hardware
    bandwidth = hw.memory_bandwidth * e.bandwidth
    always, routed = model.weight_parts(shape.tokens)
    kv = model.kv_bytes_per_token_per_gpu * (shape.context + shape.tokens)
    terms = model.step_terms(shape)
    out = {"weights": always / bandwidth, "experts": routed / bandwidth, "attention (KV)": kv / bandwidth,
           "compute": terms.flops / (model.peak_flops * e.flops)}
    out["target roof = max(memory, compute)"] = max(out["weights"] + out["experts"] + out["attention (KV)"],
                                                     out["compute"])
    out["all-reduce"] = terms.comm / e.link
    host = hw.launch_overhead + e.step_overhead if model.pays_host(k > 0) else 0.0
    out["overhead"] = host + e.token_overhead * shape.tokens
    emitted = emitted_per_step(curve, k)
    forwards = model.draft_terms([k] * concurrency, round(concurrency * emitted)) if k else []
    times = [model.time(t, draft=True) for t in forwards]
    sglang = model.drafter.startswith("eagle3-sglang")
    out["extend"] = times[0] if sglang and times else 0.0
    out["drafting"] = sum(times) - out["extend"]
    out["step"] = out["target roof = max(memory, compute)"] + out["all-reduce"] + out["overhead"] + sum(times)
    out["tokens per request per step"] = emitted
    out["tok/s"] = concurrency * emitted / out["step"]
    return out


def explain(model: RooflineModel, concurrency: int, ks: list[int], curve: tuple[float, ...], input_len: int,
            output_len: int, spec_max_running: int | None = None) -> str:
    """A Markdown table: one column per draft length (0 = off), one row per term (ms). A
    speculative column runs at most `spec_max_running` requests (the rest wait)."""
    def running(k: int) -> int:
        return min(concurrency, spec_max_running) if k and spec_max_running else concurrency
    cols = [breakdown(model, running(k), k, curve, input_len, output_len) for k in ks]
    names = ["off" if k == 0 else f"fixed:{k}" for k in ks]
    lines = [f"step at concurrency {concurrency} (decode only, context {input_len + output_len // 2}; "
             f"{model.describe().split(':')[0]}, drafter {model.drafter}), ms:",
             "| term | " + " | ".join(names) + " |", "|---" * (len(ks) + 1) + "|"]
    lines.append("| requests running | " + " | ".join(str(running(k)) for k in ks) + " |")
    for term in cols[0]:
        if term in ("tokens per request per step", "tok/s"):
            cells = [f"{c[term]:.2f}" if term.startswith("tokens") else f"{c[term]:.1f}" for c in cols]
        else:
            cells = [f"{1e3 * c[term]:.3f}" for c in cols]
        lines.append(f"| {term} | " + " | ".join(cells) + " |")
    ratios = [f"{n} {c['tok/s'] / cols[0]['tok/s']:.2f}x" for n, c in zip(names[1:], cols[1:])] if ks[0] == 0 else []
    if ratios:
        lines.append("vs off: " + ", ".join(ratios))
    return "\n".join(lines)
