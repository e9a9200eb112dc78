"""tidal vs transformers.generate on the same model and prompts, and tidal's decode step time
next to a roofline estimate.

    python benchmarks/throughput.py [--dtypes float32,bfloat16] [--output-tokens 64] [--steps-only] [--enforce-eager]
                                    [--vs-eager]

Prints, per dtype: output tok/s at 1 request (requests one after another) and at N concurrent
requests (transformers with static batching: one left-padded batch), with the ratio, the two
engines taking turns request by request (batch by batch); then
tidal's median decode step time at batch 1, 8, 32, 128 beside max(bytes / bandwidth,
FLOPs / matmul rate) measured on this machine in the same run. `--vs-eager`: each step size also
with the compiled steps off in the same engine (the two taking turns, three times), which is
what a step larger than the compiled graphs cover costs.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from tidal import LLM, SamplingParams
from tidal.datasets import chat_prompts
from tidal.models.loader import default_model_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def chat_ids(tok, text):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def load_hf(dtype):
    import transformers

    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=dtype).eval()


def hf_generate(model, prompts, n_out):
    """Static batching: one left-padded batch, all rows generate n_out tokens."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n_out, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    el = time.perf_counter() - t
    assert out.shape[1] - width == n_out
    return len(prompts) * n_out / el


def tidal_generate(llm, prompts, n_out):
    params = SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    el = time.perf_counter() - t
    assert all(len(o.token_ids) == n_out for o in outs)
    return len(prompts) * n_out / el


def interleaved(gens: dict, prompt_sets: list[list[list[int]]], n_out: int) -> dict:
    """Total output tok/s of each engine over the prompt sets, the engines taking turns on
    every set (rotating who goes first), so that drift in this machine's speed hits all alike."""
    names = list(gens)
    seconds = dict.fromkeys(names, 0.0)
    tokens = dict.fromkeys(names, 0)
    for i, prompts in enumerate(prompt_sets):
        for name in names[i % len(names):] + names[: i % len(names)]:
            rate = gens[name](prompts, n_out)
            seconds[name] += len(prompts) * n_out / rate
            tokens[name] += len(prompts) * n_out
    return {name: tokens[name] / seconds[name] for name in names}


def decode_step_ms(llm, batch, ctx=64, steps=24):
    eng = llm.engine
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"step-{batch}-{i}", [(7 * i + j) % 30000 + 100 for j in range(ctx)], params)
    while any(s.num_computed_tokens < len(s.prompt_token_ids) for s in eng.scheduler.running + eng.scheduler.waiting):
        eng.step()
    times = []
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:]) * 1e3


def compiled_and_eager_step_ms(llm, batch, turns=3) -> tuple[float, float]:
    """Median decode step ms with the engine's compiled steps and with them off, taking turns."""
    runner = llm.engine.runner
    compiled, times = runner.compiled, {True: [], False: []}
    try:
        for _ in range(turns):
            for on in (True, False):
                runner.compiled = compiled if on else None
                times[on].append(decode_step_ms(llm, batch))
    finally:
        runner.compiled = compiled
    return statistics.median(times[True]), statistics.median(times[False])


def machine_rates(dtype):
    """Memory bandwidth (copy of a 512 MiB tensor, read + write) and dense matmul FLOP/s."""
    a = torch.ones(128 << 20, dtype=torch.float32)
    b = torch.empty_like(a)
    bw = max(2 * a.numel() * 4 / _timed(lambda: b.copy_(a)) for _ in range(5))
    x = torch.randn(2048, 2048, dtype=dtype)
    flops = max(2 * 2048 ** 3 / _timed(lambda: x @ x) for _ in range(5))
    return bw, flops


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def single_core_read_bandwidth() -> float:
    """Bytes/s one thread reads (the sum of a 512 MiB tensor), best of five."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.ones(128 << 20, dtype=torch.float32)
        return max(a.numel() * 4 / _timed(lambda: a.sum()) for _ in range(5))
    finally:
        torch.set_num_threads(threads)


def step_bytes(engine, batch, ctx) -> int:
    """Bytes one decode step of `batch` tokens reads: every weight in the copy the step uses at
    that batch (4-bit codes with their scales, the 8-bit head, or dense), and the KV cache."""
    from tidal.layers.linear import INT4_MAX_TOKENS, INT8_MAX_TOKENS
    from tidal.models.llama import PROJECTIONS

    def nbytes(*tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    model, cfg = engine.runner.model, engine.model_config
    total = nbytes(model.norm)
    for layer in model.layers:
        total += nbytes(layer.input_norm, layer.post_norm)
        for name in PROJECTIONS:
            q = layer.int4.get(name)
            total += nbytes(q.packed, q.scales_zeros) if q and batch <= INT4_MAX_TOKENS else nbytes(getattr(layer, name))
    head = model.int8_head
    compiled = engine.runner.compiled is not None and engine.runner.compiled.covers(batch)
    int8 = head and (batch <= INT8_MAX_TOKENS or compiled)  # compiled steps read the int8 head at every size
    total += nbytes(head.codes, head.scales) if int8 else nbytes(model.unembedding)
    return total + batch * ctx * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * engine.dtype.itemsize


def roofline_ms(engine, batch, ctx, bw, flops):
    """max(bytes read / bandwidth, FLOPs / matmul rate) for one decode step of `batch` tokens."""
    cfg = engine.model_config
    per_layer = (cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                 + cfg.num_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size)
    t_mem = step_bytes(engine, batch, ctx) / bw
    t_compute = 2 * (cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size) * batch / flops
    return max(t_mem, t_compute) * 1e3, "memory" if t_mem >= t_compute else "compute"


TIDAL = {"float32": "tidal fp32", "bfloat16": "tidal bf16 (default)"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--single-requests", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2, help="batches at the high concurrency")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--step-batches", default="1,8,32,128")
    ap.add_argument("--steps-only", action="store_true", help="only the decode steps and roofline, no transformers")
    ap.add_argument("--enforce-eager", action="store_true", help="tidal without compiled small steps")
    ap.add_argument("--vs-eager", action="store_true", help="each step size also with the compiled steps off")
    args = ap.parse_args()
    texts = chat_prompts()
    n = args.output_tokens
    print(f"# tidal vs transformers {_hf_version()}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.machine()}; {n} output tokens per request")
    rates: dict[tuple[str, int], float] = {}
    steps, roof_lines = [], []
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        llm = LLM(dtype=name, enforce_eager=args.enforce_eager)
        prompts = [chat_ids(llm.tokenizer, t) for t in texts]
        single = prompts[: args.single_requests]
        many = (prompts * (1 + args.concurrency // len(prompts)))[: args.concurrency]
        if not args.steps_only:
            hf = load_hf(dtype)
            gens = {TIDAL[name]: lambda p, k: tidal_generate(llm, p, k),
                    f"transformers {name}": lambda p, k: hf_generate(hf, p, k)}
            for gen in gens.values():
                gen(single[:1], 4)  # warm-up
            for conc, sets in ((1, [[p] for p in single]), (args.concurrency, [many] * args.repeats)):
                for label, rate in interleaved(gens, sets, n).items():
                    rates[label, conc] = rate
                    print(f"  {label}: {rate:.1f} tok/s at {conc}", flush=True)
            del hf
        bw, flops = machine_rates(dtype)
        print(f"  measured {name}: copy bandwidth {bw / 1e9:.1f} GB/s, matmul {flops / 1e9:.0f} GFLOP/s")
        for b in map(int, args.step_batches.split(",")):
            ms, eager = compiled_and_eager_step_ms(llm, b) if args.vs_eager else (decode_step_ms(llm, b), None)
            steps.append((TIDAL[name], b, ms, eager, *roofline_ms(llm.engine, b, 64 + 12, bw, flops)))
            if b == 1:
                read, one_core = step_bytes(llm.engine, 1, 64 + 12), single_core_read_bandwidth()
                roof_lines.append(f"{TIDAL[name]}, one request: {read / 1e6:.1f} MB read a token; in a "
                                  f"{ms:.1f} ms step that is {read / ms / 1e6:.1f} GB/s; one core reads "
                                  f"{one_core / 1e9:.1f} GB/s ({read / ms / 1e6 / (one_core / 1e9):.0%} of it)")
        del llm
    print("\n" + "\n".join(roof_lines))
    if rates:
        print_rates(rates, args.concurrency)
    eager_cols = args.vs_eager
    print("\n| engine | batch | decode step ms (median) | " + ("eager ms | eager / compiled | " if eager_cols else "")
          + "roofline ms | bound | roofline / measured |")
    print("|---" * (6 + 2 * eager_cols) + "|")
    for label, b, ms, eager, roof, bound in steps:
        print(f"| {label} | {b} | {ms:.1f} | " + (f"{eager:.1f} | {eager / ms:.2f}x | " if eager_cols else "")
              + f"{roof:.1f} | {bound} | {roof / ms:.0%} |")


def print_rates(rates: dict[tuple[str, int], float], concurrency: int) -> None:
    labels = list(dict.fromkeys(label for label, _ in rates))
    hf_labels = [x for x in labels if x.startswith("transformers")]
    ours = [x for x in labels if x.startswith("tidal")]
    print("\n| concurrency | " + " | ".join(f"{x} tok/s" for x in labels)
          + " | " + " | ".join(f"{x} / best transformers" for x in ours) + " |")
    print("|---" * (1 + len(labels) + len(ours)) + "|")
    for conc in (1, concurrency):
        best = max(rates[x, conc] for x in hf_labels)
        print(f"| {conc} | " + " | ".join(f"{rates[x, conc]:.1f}" for x in labels) + " | "
              + " | ".join(f"{rates[x, conc] / best:.2f}x" for x in ours) + " |")


def _hf_version():
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    main()
