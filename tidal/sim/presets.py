"""Hardware and model presets for the roofline step-time model. Plain numbers only.

Hardware numbers are the vendors' published peak figures (dense, i.e. without 2:4 sparsity),
per GPU; the roofline's efficiency factors (fitted by `tidal sim --calibrate`) say how much of
them a real engine gets. Model shapes are those of the public Hugging Face configs.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
TB = 1e12
TFLOPS = 1e12


@dataclass(frozen=True)
class Hardware:
    """One server: `num_gpus` identical GPUs joined by NVLink or PCIe."""

    name: str
    num_gpus: int
    memory_bytes: float  # per GPU
    memory_bandwidth: float  # bytes/s per GPU (HBM or GDDR)
    flops_bf16: float  # dense tensor-core FLOP/s per GPU
    flops_fp8: float
    link: str  # "nvlink" | "pcie"
    link_bandwidth: float  # bytes/s per GPU, one direction
    link_latency: float  # seconds per all-reduce, whatever its size
    launch_overhead: float  # seconds per forward that no kernel hides (launches, sync, sampling)


# H100 SXM5 datasheet: 989 TFLOPS bf16 and 1979 fp8 dense (half the "with sparsity" figures),
# 3.35 TB/s HBM3, 80 GB; NVLink 4 at 900 GB/s bidirectional = 450 GB/s each way.
# H200 SXM datasheet: the same compute and NVLink, 4.8 TB/s HBM3e, 141 GB.
# HGX B200 datasheet (per GPU): 2.25 PFLOPS bf16 and 4.5 PFLOPS fp8 dense, 8 TB/s HBM3e, 180 GB;
# NVLink 5 at 1.8 TB/s bidirectional = 900 GB/s each way.
# RTX PRO 6000 Blackwell Server Edition datasheet: 96 GB GDDR7 at 1792 GB/s; 4 PFLOPS FP4 with
# sparsity, so 2 dense FP4, 1 dense fp8 and 0.5 dense bf16 (each precision halves the rate).
# No NVLink: PCIe 5.0 x16 at 64 GB/s each way, and all-reduce goes through the PCIe switches.
# Latencies and launch overheads are typical measured magnitudes, not datasheet values:
# a small NCCL all-reduce takes ~10 us over NVLink and ~25 us over PCIe; a CUDA-graph decode
# step leaves ~1 ms of host work.
HARDWARE: dict[str, Hardware] = {h.name: h for h in (
    Hardware("h100x8", 8, 80 * GB, 3.35 * TB, 989 * TFLOPS, 1979 * TFLOPS, "nvlink", 450 * GB, 10e-6, 1e-3),
    Hardware("h200x8", 8, 141 * GB, 4.8 * TB, 989 * TFLOPS, 1979 * TFLOPS, "nvlink", 450 * GB, 10e-6, 1e-3),
    Hardware("b200x8", 8, 180 * GB, 8.0 * TB, 2250 * TFLOPS, 4500 * TFLOPS, "nvlink", 900 * GB, 10e-6, 1e-3),
    Hardware("rtx-pro-6000x8-pcie", 8, 96 * GB, 1.792 * TB, 500 * TFLOPS, 1000 * TFLOPS, "pcie", 64 * GB, 25e-6, 1e-3),
)}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder's shape: Llama-style attention, and a dense MLP or a mixture of experts.

    For a MoE, `intermediate_size` is one expert's; after the first `dense_layers` layers (whose
    MLP is dense, of `dense_intermediate_size`) every layer routes each token to
    `experts_per_token` of `num_experts` experts and runs its `shared_experts` on every token.
    """

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_experts: int = 0  # 0: dense
    experts_per_token: int = 0
    shared_experts: int = 0
    dense_layers: int = 0  # a MoE's first layers with a dense MLP instead of experts
    dense_intermediate_size: int = 0
    draft_vocab_size: int = 32000  # the EAGLE-3 head's reduced vocabulary

    @property
    def is_moe(self) -> bool:
        """A mixture of experts (num_experts > 0)."""
        return self.num_experts > 0

    @property
    def attention_params(self) -> int:
        """q, k, v and o projections of one layer."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h

    @property
    def mlp_params(self) -> int:
        """One dense MLP (gate, up, down), or one expert of a MoE."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def draft_intermediate_size(self) -> int:
        """The EAGLE-3 head's MLP width: the target's dense MLP's (an expert's if it has none)."""
        return self.dense_intermediate_size or self.intermediate_size

    def mlp_weights(self, routed: float) -> float:
        """Parameters of every layer's MLP that a forward reads when each MoE layer reads
        `routed` of its routed experts (a dense model: every MLP, whatever `routed`)."""
        if not self.is_moe:
            return self.num_layers * self.mlp_params
        dense = self.dense_layers * 3 * self.hidden_size * self.dense_intermediate_size
        moe = (self.num_layers - self.dense_layers) * ((routed + self.shared_experts) * self.mlp_params
                                                       + self.router_params)
        return dense + moe

    @property
    def router_params(self) -> int:
        """The MoE router of one layer (0 for a dense model)."""
        return self.hidden_size * self.num_experts

    @property
    def lm_head_params(self) -> int:
        """The output projection (untied from the input embedding, as in Llama-3.1)."""
        return self.hidden_size * self.vocab_size

    @property
    def total_params(self) -> int:
        """Every weight, with input embedding and lm_head counted separately (untied)."""
        return int(self.num_layers * self.attention_params + self.mlp_weights(self.num_experts) + 2 * self.lm_head_params)

    @property
    def active_params(self) -> int:
        """Weights one token multiplies by (no input embedding: that is a lookup)."""
        return int(self.num_layers * self.attention_params + self.mlp_weights(self.experts_per_token) + self.lm_head_params)

    def kv_bytes_per_token(self, kv_bytes: int) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * kv_bytes


# Llama-3.1-8B/70B, Qwen3-30B-A3B and GLM-4.6: the config.json of each model's Hugging Face
# repository. GLM-4.6 (Glm4MoeForCausalLM, as GLM-4.5): 92 layers of hidden 5120, 96 query and 8
# KV heads of 128; first_k_dense_replace 3 (intermediate_size 12288), then 160 routed experts of
# moe_intermediate_size 1536, 8 per token, and 1 shared expert; vocab 151552; untied embeddings.
# 353B parameters by this count (the card's 355B adds the multi-token-prediction layer), 33B active.
MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("llama-3.1-8b", 4096, 14336, 32, 32, 8, 128, 128256),
    ModelSpec("llama-3.1-70b", 8192, 28672, 80, 64, 8, 128, 128256),
    ModelSpec("qwen3-30b-a3b", 2048, 768, 48, 32, 4, 128, 151936, num_experts=128, experts_per_token=8),
    ModelSpec("glm-4.6", 5120, 1536, 92, 96, 8, 128, 151552, num_experts=160, experts_per_token=8,
              shared_experts=1, dense_layers=3, dense_intermediate_size=12288),
)}


def expected_distinct_experts(num_experts: int, experts_per_token: int, tokens: int) -> float:
    """Experts a layer touches for `tokens` tokens routed independently and uniformly:
    E * (1 - (1 - k/E)^tokens). One token reads k experts' weights; a big batch reads all E."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - experts_per_token / num_experts) ** tokens)
