"""Step-time models for the simulator: what a target forward and a drafter forward cost.

A step-time model answers two questions, in seconds:
    step_time(shape)            one target forward over a ragged batch (prefill chunks, decode
                                tokens, draft tokens to verify)
    draft_time(ks, catch_up)    one proposal of ks[i] drafts for request i, after the drafter
                                catches up on `catch_up` verified positions
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tidal.sim.presets import Hardware, ModelSpec, expected_distinct_experts


@dataclass(frozen=True)
class StepShape:
    """What one target forward processes."""

    tokens: int  # all tokens fed: prefill + decode + draft
    seqs: int
    context: int  # KV tokens of the scheduled sequences after this step (the engine's cost feature)
    draft_tokens: int = 0
    logits: int = 0  # positions whose logits are needed (decode, drafts, last prefill chunk)
    attention_pairs: int = 0  # (query, key) pairs attention computes
    verifying: int = 0  # sequences verifying drafts (the engine's cost feature for them)


@dataclass(frozen=True)
class Efficiency:
    """The roofline's free constants (what `tidal sim --calibrate` fits)."""

    bandwidth: float = 0.8  # fraction of peak memory bandwidth reached
    flops: float = 0.6  # fraction of peak dense FLOP/s reached
    step_overhead: float = 0.0  # seconds per target forward on top of the preset's launch overhead
    token_overhead: float = 0.0  # seconds per token fed (sampling, scheduling, ragged metadata)
    draft_overhead: float = 0.0  # seconds per drafter forward on top of the launch overhead
    link: float = 1.0  # all-reduce speed relative to the preset's latency and bandwidth (a guess, so free)


@dataclass(frozen=True)
class Terms:
    """The efficiency-free parts of one forward's time, per GPU."""

    flops: float
    bytes: float
    comm: float  # seconds of all-reduce at the preset's link speed
    tokens: int


DRAFTERS = ("eagle3", "eagle3-sglang", "eagle3-sglang-overlap", "none")


@dataclass
class RooflineModel:
    """Step time from peak hardware numbers and the model's shape, tensor parallel over all GPUs.

    For a forward over T tokens on tp GPUs, per GPU:
        memory  = (W(T) + kv * context + kv * T) / (bandwidth * eff_bw)
            W(T) = weight bytes read / tp: attention and lm_head always; the dense MLP, or for a
                   MoE the experts touched, E * (1 - (1 - k/E)^T) per layer
            kv   = K+V bytes per token / min(tp, kv_heads)   (heads split, never below one)
        compute = (2 * T * active linear params + 2 * logits * vocab * hidden
                   + 4 * layers * heads * head_dim * attention pairs) / tp / (FLOP/s * eff_flops)
        comm    = (2 * layers + 1) * (latency + 2 (tp - 1) / tp * T * hidden * 2 bytes / link)
                  (ring all-reduces after the vocab-parallel embedding, attention and the MLP)
                  + latency + (tp - 1) / tp * logits * vocab * 2 bytes / link  (the ring
                  all-gather of the vocab-parallel lm_head's logits; a verify gathers every
                  draft position's); 0 when tp = 1
        time    = max(compute, memory) + comm / link + launch + step_overhead + token_overhead * T

    The EAGLE-3 draft head is one decoder layer of the target's width whose q/k/v read the
    concatenated (embedding, feature) of width 2 * hidden, an fc fusing three target features
    (3 * hidden -> hidden, run over the catch-up tokens only) and an lm_head over the draft vocab;
    each drafter forward is costed the same way (its own collectives included), with
    `draft_overhead` in place of the step's. How the head runs (`drafter`):
        eagle3                 tidal's: the first forward runs over the positions verified since
                               the last proposal and drafts from the last; K forwards in all
        eagle3-sglang          SGLang's: after the verify, an extend forward over the verified
                               positions; then K draft forwards over the batch: K + 1 in all.
                               SGLang's overlap scheduler (host work of step n + 1 while the GPU
                               runs step n) serves plain steps only: it is off while drafting,
                               so a step verifying drafts pays its host work and a plain one not
        eagle3-sglang-overlap  the same with SGLang's spec v2 schedule, which overlaps the host
                               work of verify and draft forwards too: only GPU time counts; the
                               GPU itself still runs head and target one after the other
    """

    hardware: Hardware
    model: ModelSpec
    tp: int | None = None  # None: all GPUs of the server
    dtype: str = "bf16"  # weights: bf16 | fp8; KV and activations are bf16
    efficiency: Efficiency = field(default_factory=Efficiency)
    drafter: str = "eagle3"  # one of DRAFTERS; none: a drafter with no GPU cost (n-gram)

    def __post_init__(self):
        if self.dtype not in ("bf16", "fp8"):
            raise ValueError(f"dtype {self.dtype!r} is not bf16 or fp8")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter {self.drafter!r} is not one of {', '.join(DRAFTERS)}")
        self.tp = self.tp or self.hardware.num_gpus
        if not 1 <= self.tp <= self.hardware.num_gpus:
            raise ValueError(f"tensor parallel size must be in 1..{self.hardware.num_gpus}")

    def with_efficiency(self, efficiency: Efficiency) -> "RooflineModel":
        """The same hardware and model with other constants."""
        return replace(self, efficiency=efficiency)

    # ------------------------------------------------------------ pieces

    @property
    def weight_bytes(self) -> int:
        """Bytes per weight."""
        return 1 if self.dtype == "fp8" else 2

    @property
    def peak_flops(self) -> float:
        """Dense tensor FLOP/s per GPU at the weight dtype."""
        return self.hardware.flops_fp8 if self.dtype == "fp8" else self.hardware.flops_bf16

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        """K and V bytes of one token on one GPU: heads are split, but never below one per GPU."""
        m = self.model
        return m.kv_bytes_per_token(2) / min(self.tp, m.num_kv_heads)

    def weight_bytes_read(self, tokens: int) -> float:
        """Weight bytes one GPU reads in a forward over `tokens` tokens."""
        return sum(self.weight_parts(tokens))

    def weight_parts(self, tokens: int) -> tuple[float, float]:
        """Weight bytes one GPU reads over `tokens` tokens: (those every forward reads, the
        routed experts the tokens touch: E * (1 - (1 - k/E)^T) per MoE layer)."""
        m = self.model
        experts = expected_distinct_experts(m.num_experts, m.experts_per_token, tokens) if m.is_moe else 0.0
        always = m.num_layers * m.attention_params + m.mlp_weights(0.0) + m.lm_head_params
        scale = self.weight_bytes / self.tp
        return always * scale, (m.mlp_weights(experts) - m.mlp_weights(0.0)) * scale

    def linear_flops(self, tokens: int) -> float:
        """Matmul FLOPs of the layers (not the lm_head) over `tokens` tokens, on one GPU."""
        m = self.model
        return 2.0 * tokens * (m.active_params - m.lm_head_params) / self.tp

    def allreduce_time(self, tokens: int, count: int) -> float:
        """`count` ring all-reduces of `tokens` hidden vectors in bf16."""
        if self.tp == 1 or tokens == 0:
            return 0.0
        hw = self.hardware
        size = tokens * self.model.hidden_size * 2
        return count * (hw.link_latency + 2 * (self.tp - 1) / self.tp * size / hw.link_bandwidth)

    def logits_gather_time(self, positions: int, vocab: int) -> float:
        """The ring all-gather of `positions` rows of bf16 logits over `vocab` entries, which a
        vocab-parallel lm_head splits over the GPUs: each GPU receives the other (tp - 1) / tp."""
        if self.tp == 1 or positions == 0:
            return 0.0
        hw = self.hardware
        return hw.link_latency + (self.tp - 1) / self.tp * positions * vocab * 2 / hw.link_bandwidth

    @property
    def overlaps_drafting(self) -> bool:
        """Whether the host work of verify and draft forwards runs under the GPU's (spec v2)."""
        return self.drafter == "eagle3-sglang-overlap"

    @property
    def draft_host_seconds(self) -> float:
        """Host work of one drafter forward that the GPU waits for (0 when overlapped)."""
        if self.overlaps_drafting:
            return 0.0
        return self.hardware.launch_overhead + self.efficiency.draft_overhead

    def pays_host(self, verifying: bool) -> bool:
        """Whether a target step waits for its host work (launch, scheduling): not under an
        overlap scheduler (see the class docstring)."""
        if self.overlaps_drafting:
            return False
        return self.drafter != "eagle3-sglang" or verifying

    def time(self, t: Terms, draft: bool = False, verifying: bool = False) -> float:
        """max(compute, memory) + comm + overheads, with this model's efficiency."""
        e = self.efficiency
        if draft:
            fixed = self.draft_host_seconds
        else:
            host = self.hardware.launch_overhead + e.step_overhead if self.pays_host(verifying) else 0.0
            fixed = host + e.token_overhead * t.tokens
        return max(t.flops / (self.peak_flops * e.flops), t.bytes / (self.hardware.memory_bandwidth * e.bandwidth)) \
            + t.comm / e.link + fixed

    # ------------------------------------------------------------ the two questions

    def step_time(self, shape: StepShape) -> float:
        """Seconds for one target forward (see the class docstring for the formula)."""
        return self.time(self.step_terms(shape), verifying=shape.draft_tokens > 0)

    def step_terms(self, shape: StepShape) -> Terms:
        """FLOPs, bytes and all-reduce seconds of one target forward, per GPU."""
        m = self.model
        logits = shape.logits or shape.seqs
        kv = self.kv_bytes_per_token_per_gpu
        memory = self.weight_bytes_read(shape.tokens) + kv * (shape.context + shape.tokens)
        flops = (self.linear_flops(shape.tokens) + 2.0 * logits * m.lm_head_params / self.tp
                 + 4.0 * m.num_layers * m.num_heads * m.head_dim * shape.attention_pairs / self.tp)
        comm = self.allreduce_time(shape.tokens, 2 * m.num_layers + 1) + self.logits_gather_time(logits, m.vocab_size)
        return Terms(flops, memory, comm, shape.tokens)

    def draft_forward_terms(self, tokens: int, fuse: bool, logits: int | None = None) -> Terms:
        """One EAGLE-3 head forward over `tokens` tokens, `logits` of them (default all) drafting
        through its lm_head; `fuse`: it also runs the fc over them."""
        m, h = self.model, self.model.hidden_size
        q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        layer = 2 * h * (q + 2 * kv) + q * h + 3 * h * m.draft_intermediate_size
        lm_head = h * m.draft_vocab_size
        params = layer + lm_head + (3 * h * h if fuse else 0)
        memory = params * self.weight_bytes / self.tp
        logits = tokens if logits is None else logits
        flops = 2.0 * (tokens * (params - lm_head) + logits * lm_head) / self.tp
        comm = self.allreduce_time(tokens, 3) + self.logits_gather_time(logits, m.draft_vocab_size)
        return Terms(flops, memory, comm, tokens)

    def draft_terms(self, ks: list[int], catch_up: int) -> list[Terms]:
        """A proposal of ks[i] drafts per request: the first forward runs over the `catch_up`
        verified positions (fusing their features); then forward j over the requests with
        k >= j, from j = 2 for tidal's head (its first forward drafted), from j = 1 for
        SGLang's (its first was the extend). No forwards for a drafter without GPU cost."""
        longest = max(ks, default=0)
        if not longest or self.drafter == "none":
            return []
        first = 1 if self.drafter.startswith("eagle3-sglang") else 2
        later = [self.draft_forward_terms(sum(k >= j for k in ks), False) for j in range(first, longest + 1)]
        return [self.draft_forward_terms(max(catch_up, 1), True, sum(k > 0 for k in ks))] + later

    def draft_time(self, ks: list[int], catch_up: int) -> float:
        """Seconds for one proposal (see draft_terms)."""
        return sum(self.time(t, draft=True) for t in self.draft_terms(ks, catch_up))

    def kv_capacity_tokens(self, memory_fraction: float = 0.9) -> int:
        """KV tokens that fit beside the weights in `memory_fraction` of each GPU's memory."""
        m = self.model
        free = self.hardware.memory_bytes * memory_fraction - m.total_params * self.weight_bytes / self.tp
        if free <= 0:
            raise ValueError(f"{m.name} in {self.dtype} does not fit on {self.tp} x {self.hardware.name} GPUs")
        return int(free / self.kv_bytes_per_token_per_gpu)

    def describe(self) -> str:
        """One line with the model, the hardware and the constants in use."""
        e = self.efficiency
        return (f"roofline {self.model.name} {self.dtype} on {self.hardware.name} tp={self.tp}: "
                f"bandwidth x{e.bandwidth:.3g}, FLOP/s x{e.flops:.3g}, "
                f"step overhead {1e3 * (self.hardware.launch_overhead + e.step_overhead):.3g} ms, "
                f"per token {1e6 * e.token_overhead:.3g} us, per draft forward "
                f"{1e3 * (self.hardware.launch_overhead + e.draft_overhead):.3g} ms, all-reduce x{e.link:.3g} "
                f"the preset's speed ({1e6 * self.hardware.link_latency / e.link:.3g} us + bytes / "
                f"{self.hardware.link_bandwidth * e.link / 1e9:.3g} GB/s)")
