"""Train an EAGLE-3 head for a target by self-distillation, as EAGLE-3 does, sized for a CPU.

1. The target answers a prompt set (greedy, chat template; optionally also sampled answers, more
   contexts from the same prompts): the head learns the target's own continuations, not a
   dataset's. Every position's label is the target's distribution there, sampled answer or not.
2. One target prefill over prompt + answer gives, per position, the fused low/mid/high features
   the head drafts from and the target's final hidden state (its next-token distribution).
3. Training-time test (TTT): the head is unrolled for `num_steps` chained draft steps over every
   position at once. Step j at position t is fed token t + 1 and feature o_{j-1}(t - 1) (step 0:
   the target's feature at t), and attends to step-0 keys at positions <= t - j plus the step-i
   key at position t - j + i for i = 1..j: exactly what the inference cache holds when that query
   is the j-th draft of a chain started at t - j. Every step predicts the target's distribution at
   t + 1 over the draft vocabulary (soft cross-entropy), weighted 0.8^j.

The draft vocabulary is the most frequent tokens of the target's answers (d2t maps it back).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tidal.config import ModelConfig
from tidal.models.eagle3 import Eagle3Config, Eagle3Head
from tidal.sampling_params import SamplingParams
from tidal.sequence import Sequence


@dataclass
class Example:
    """One prompt + target answer: token ids [N], fused-layer features [N, 3H], final hidden [N, H]."""

    ids: torch.Tensor
    features: torch.Tensor
    hidden: torch.Tensor
    prompt_len: int


def target_answers(llm, prompts: list[str], max_tokens: int, temperature: float = 0.0,
                   seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """The target's answer to each prompt, greedy or sampled (prompt i seeded seed + i):
    (prompt ids, answer ids)."""
    tok = llm.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature,
                             seed=None if temperature == 0 else seed + i) for i in range(len(chats))]
    outs = llm.generate(chats, params)
    return [(o.prompt_token_ids, o.token_ids) for o in outs]


@torch.inference_mode()
def target_features(engine, pairs, aux_layers: tuple[int, ...], max_batch_tokens: int = 2048) -> list[Example]:
    """One target prefill per batch of examples, through the engine's own runner and cache."""
    runner, bm = engine.runner, engine.block_manager
    examples, batch = [], []

    def flush():
        seqs = [Sequence(f"train-{i}", p + a, SamplingParams()) for i, (p, a) in enumerate(batch)]
        for s in seqs:
            bm.allocate(s, s.num_tokens)
        positions, meta = runner.metadata([(s, 0, s.num_tokens) for s in seqs])
        ids = torch.tensor([t for s in seqs for t in s.token_ids], device=runner.device)
        hidden, aux = runner.model(ids, positions, runner.kv_caches, meta, aux_layers)
        feats = torch.cat(aux, dim=-1)
        start = 0
        for s, (p, _) in zip(seqs, batch):
            end = start + s.num_tokens
            examples.append(Example(ids[start:end].cpu(), feats[start:end].cpu(), hidden[start:end].cpu(), len(p)))
            start = end
            bm.free(s)
        batch.clear()

    for pair in pairs:
        if batch and sum(len(p) + len(a) for p, a in batch) + len(pair[0]) + len(pair[1]) > max_batch_tokens:
            flush()
        batch.append(pair)
    if batch:
        flush()
    return examples


def draft_vocab(examples: list[Example], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` target ids seen most often in the answers, sorted (draft id -> target id)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ex in examples:
        counts += torch.bincount(ex.ids[ex.prompt_len:], minlength=vocab_size)
    return counts.topk(min(size, vocab_size)).indices.sort().values


def new_head(target, draft_ids: torch.Tensor, seed: int = 0) -> Eagle3Head:
    """A fresh head shaped like one target layer; lm_head and final norm start as the target's."""
    t: ModelConfig = target.cfg
    layer = ModelConfig(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                        num_layers=1, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim,
                        rope_theta=t.rope_theta, rms_norm_eps=t.rms_norm_eps, max_model_len=t.max_model_len)
    cfg = Eagle3Config(layer, len(draft_ids), t.hidden_size, Eagle3Config.default_aux_layers(t.num_layers))
    head = Eagle3Head(cfg, target.embed.detach().float())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (head.fc, head.mid.qkv_proj, head.mid.o_proj, head.mid.gate_up_proj, head.mid.down_proj):
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        head.lm_head.copy_(target.unembedding.detach().float()[draft_ids])
        head.norm.copy_(target.norm.detach().float())
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
    return head


def _attend(q, keys, values, j: int) -> torch.Tensor:
    """TTT attention of step j. q [B, N, h, D]; keys/values: steps 0..j, each [B, N, kvh, D].
    Step-0 keys are visible up to position t - j; step i >= 1 only at position t - j + i."""
    B, N, h, D = q.shape
    rep = h // keys[0].shape[2]
    qh = q.transpose(1, 2) * D ** -0.5  # [B, h, N, D]
    expand = lambda x: x.repeat_interleave(rep, dim=2).transpose(1, 2)  # noqa: E731  [B, h, N, D]
    t = torch.arange(N, device=q.device)
    scores = [(qh @ expand(keys[0]).transpose(-1, -2)).masked_fill(t[None, :] > t[:, None] - j, float("-inf"))]
    shifted_v = []
    for i in range(1, j + 1):
        s = j - i  # step-i key for query t sits at position t - s
        k_i, v_i = (F.pad(expand(x), (0, 0, s, 0))[:, :, :N] for x in (keys[i], values[i]))
        scores.append((qh * k_i).sum(-1, keepdim=True).masked_fill((t < s)[:, None], float("-inf")))
        shifted_v.append(v_i)
    probs = torch.cat(scores, dim=-1).softmax(-1).nan_to_num(0.0)  # rows t < j see nothing: unused
    out = probs[..., :N] @ expand(values[0])
    for i, v_i in enumerate(shifted_v):
        out = out + probs[..., N + i: N + i + 1] * v_i
    return out.transpose(1, 2).reshape(B, N, h * D)


def ttt_forward(head: Eagle3Head, ids: torch.Tensor, features: torch.Tensor, num_steps: int) -> list[torch.Tensor]:
    """Unroll the head over [B, N] sequences of token ids and target features [B, N, 3H]: the
    draft-vocab logits [B, N, V_d] of every step; step j at position t predicts token t + 2."""
    c = head.cfg.layer
    B, N = ids.shape
    t = torch.arange(N, device=ids.device)
    cos, sin = head.cos[t].repeat(B, 1), head.sin[t].repeat(B, 1)
    in_ids = F.pad(ids[:, 1:], (0, 1)).reshape(-1)  # token t + 1 at position t
    feature = head.fuse(features).reshape(B * N, -1)
    keys, values, logits = [], [], []
    for j in range(num_steps):
        q, k, v = head.mid.qkv(head.inputs(in_ids, feature), cos, sin)
        keys.append(k.view(B, N, c.num_kv_heads, c.head_dim))
        values.append(v.view(B, N, c.num_kv_heads, c.head_dim))
        attn = _attend(q.view(B, N, c.num_heads, c.head_dim), keys, values, j)
        out = head.mid.finish(feature, attn.reshape(B * N, -1)).view(B, N, -1)
        logits.append(head.logits(out))
        feature = F.pad(out[:, :-1], (0, 0, 1, 0)).reshape(B * N, -1)  # step j + 1 at t reads o_j(t - 1)
    return logits


def ttt_loss(head: Eagle3Head, unembed_d: torch.Tensor, batch: list[Example], num_steps: int):
    """Weighted soft cross-entropy over `num_steps` chained steps; also top-1 agreement per step."""
    N = max(len(ex.ids) for ex in batch)
    pad = lambda x: F.pad(x, (0, 0) * (x.dim() - 1) + (0, N - len(x)))  # noqa: E731
    ids = torch.stack([pad(ex.ids) for ex in batch])
    hidden = torch.stack([pad(ex.hidden) for ex in batch]).float()
    with torch.no_grad():  # the target's distribution at t + 1, over the draft vocab
        target = F.pad(F.linear(hidden[:, 1:], unembed_d).float(), (0, 0, 0, 1))
        probs_t, top_t = target.softmax(-1), target.argmax(-1)
    t = torch.arange(N)
    lengths = torch.tensor([len(ex.ids) for ex in batch])
    starts = torch.tensor([ex.prompt_len for ex in batch])
    # position t drafts token t + 2: it must be an answer token and exist
    base = (t[None] + 2 >= starts[:, None]) & (t[None] + 2 < lengths[:, None])
    losses, agree = [], []
    feats = torch.stack([pad(ex.features) for ex in batch]).float()
    for j, logits in enumerate(ttt_forward(head, ids, feats, num_steps)):
        mask = base & (t[None] >= j)
        ce = -(probs_t * logits.log_softmax(-1)).sum(-1)
        losses.append((ce * mask).sum() / mask.sum().clamp(min=1))
        agree.append(((logits.argmax(-1) == top_t) & mask).sum().item() / max(1, mask.sum().item()))
    total = sum(0.8 ** j * loss for j, loss in enumerate(losses))
    return total, [loss.item() for loss in losses], agree


def batches(examples: list[Example], max_tokens: int, gen: torch.Generator) -> list[list[Example]]:
    """Similar lengths together (little padding), in a shuffled order of batches."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].ids))
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * len(examples[i].ids) > max_tokens:
            out.append(cur)
            cur = []
        cur.append(examples[i])
    if cur:
        out.append(cur)
    return [out[i] for i in torch.randperm(len(out), generator=gen).tolist()]


def train(head: Eagle3Head, unembed_d: torch.Tensor, train_set: list[Example], val_set: list[Example], *,
          epochs: int, num_steps: int, lr: float, batch_tokens: int, seed: int, log) -> None:
    """AdamW with warm-up and cosine decay; logs loss and per-step top-1 agreement."""
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    total = epochs * len(batches(train_set, batch_tokens, gen))
    warmup = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
    step, t0 = 0, time.perf_counter()
    for epoch in range(epochs):
        for batch in batches(train_set, batch_tokens, gen):
            with torch.autocast(unembed_d.device.type, dtype=torch.bfloat16):  # ~1.5x on this CPU
                loss, per_step, agree = ttt_loss(head, unembed_d, batch, num_steps)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 10 == 0 or step == total:
                log(f"epoch {epoch + 1} step {step}/{total} loss {loss.item():.3f} top1 "
                    + " ".join(f"{a:.2f}" for a in agree) + f"  {time.perf_counter() - t0:.0f}s")
        with torch.no_grad(), torch.autocast(unembed_d.device.type, dtype=torch.bfloat16):
            vals = [ttt_loss(head, unembed_d, b, num_steps) for b in batches(val_set, batch_tokens, gen)]
        agree = [sum(v[2][j] for v in vals) / len(vals) for j in range(num_steps)]
        log(f"epoch {epoch + 1} held-out top-1 agreement per step: " + " ".join(f"{a:.3f}" for a in agree))


def save_examples(path: str, examples: list[Example], key: dict) -> None:
    """The generated data in one file (concatenated tensors), tagged with what produced it."""
    torch.save({"key": key, "lengths": [len(e.ids) for e in examples], "prompt_lens": [e.prompt_len for e in examples],
                "ids": torch.cat([e.ids for e in examples]), "features": torch.cat([e.features for e in examples]),
                "hidden": torch.cat([e.hidden for e in examples])}, path)


def load_examples(path: str, key: dict) -> list[Example]:
    """Examples saved by `save_examples`; a file made for another model, prompt set or length is refused."""
    d = torch.load(path, weights_only=True)
    if d["key"] != key:
        raise ValueError(f"--data {path} was generated for {d['key']}, not {key}: delete it or pass another path")
    split = lambda x: x.split(d["lengths"])  # noqa: E731
    return [Example(i, f, h, p) for i, f, h, p in zip(split(d["ids"]), split(d["features"]), split(d["hidden"]),
                                                        d["prompt_lens"])]


def train_drafter(output: str, *, model: str | None = None, prompts: list[str] | None = None,
                  max_tokens: int = 192, draft_vocab_size: int = 8192, epochs: int = 3, num_steps: int = 6,
                  lr: float = 1e-3, batch_tokens: int = 4096, val_fraction: float = 0.05, seed: int = 0,
                  dtype: str = "auto", data: str | None = None, sampled_answers: int = 0,
                  answer_temperature: float = 0.7, log=print) -> Eagle3Head:
    """Self-distil an EAGLE-3 head for `model` (default: the bundled one) and save it to `output`.
    `data`: a file for the generated answers and features; reused when it exists (same model,
    prompts, answer length and sampled answers), so that training runs can be repeated without
    the target. `sampled_answers`: that many answers per prompt sampled at `answer_temperature`,
    besides the greedy one. The held-out examples are whole prompts (all their answers)."""
    import hashlib
    import os

    from tidal.datasets import train_prompts
    from tidal.engine.llm_engine import LLM
    from tidal.models.eagle3 import save_eagle3

    if sampled_answers < 0 or (sampled_answers and SamplingParams(temperature=answer_temperature).greedy):
        raise ValueError("sampled_answers must be >= 0, and answer_temperature a sampling one (> 0) when it is not 0")
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    prompts = train_prompts() if prompts is None else prompts
    llm = LLM(model, dtype=dtype)
    target = llm.engine.runner.model
    log(f"target {llm.engine.model_name} ({llm.engine.dtype}); {len(prompts)} prompts, answers up to {max_tokens} tokens")
    key = {"model": llm.engine.model_name, "dtype": str(llm.engine.dtype), "max_tokens": max_tokens,
           "prompts": hashlib.sha256("\0".join(prompts).encode()).hexdigest()[:16]}
    if sampled_answers:
        key.update(sampled_answers=sampled_answers, answer_temperature=answer_temperature, seed=seed)
    if data and os.path.exists(data):
        examples = load_examples(data, key)
        log(f"answers and features: {sum(len(e.ids) for e in examples)} positions loaded from {data}")
    else:
        pairs = target_answers(llm, prompts, max_tokens)  # example i answers prompt i % len(prompts)
        for r in range(sampled_answers):
            pairs += target_answers(llm, prompts, max_tokens, answer_temperature, seed + (r + 1) * len(prompts))
        log(f"answers: {sum(len(a) for _, a in pairs)} tokens in {time.perf_counter() - t0:.0f}s")
        aux = Eagle3Config(target.cfg, 0, 0, Eagle3Config.default_aux_layers(target.cfg.num_layers)).target_output_layers
        examples = target_features(llm.engine, pairs, aux)
        log(f"features: {sum(len(e.ids) for e in examples)} positions in {time.perf_counter() - t0:.0f}s")
        if data:
            save_examples(data, examples, key)
            log(f"saved answers and features to {data}")
    draft_ids = draft_vocab(examples, draft_vocab_size, target.cfg.vocab_size)
    answer_tokens = torch.cat([e.ids[e.prompt_len:] for e in examples])
    log(f"draft vocab {len(draft_ids)}: covers {torch.isin(answer_tokens, draft_ids).float().mean():.2%} of answer tokens")
    head = new_head(target, draft_ids, seed)
    n_val = max(1, int(len(prompts) * val_fraction))
    held_out = set(torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed))[:n_val].tolist())
    val_set = [ex for i, ex in enumerate(examples) if i % len(prompts) in held_out]
    train_set = [ex for i, ex in enumerate(examples) if i % len(prompts) not in held_out]
    if not train_set:
        raise ValueError(f"{len(prompts)} prompt(s): nothing left to train on once {n_val} are held out")
    unembed_d = head.lm_head.detach().clone()  # the target's unembedding rows of the draft vocab
    train(head, unembed_d, train_set, val_set, epochs=epochs, num_steps=num_steps, lr=lr,
          batch_tokens=batch_tokens, seed=seed, log=log)
    save_eagle3(head, output)
    log(f"saved {output} after {time.perf_counter() - t0:.0f}s")
    return head
