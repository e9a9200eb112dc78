"""Configuration dataclasses. Validated once at the edge, trusted inside."""

from __future__ import annotations

from dataclasses import dataclass, field


DTYPES = ("auto", "float32", "bfloat16", "float16")
# auto: reuse the stored start-up profile of this set-up, else measure and store it; if-cached:
# reuse a stored one, else none (the cost models learn from live steps); off: never profile
STARTUP_PROFILES = ("auto", "if-cached", "off")
# auto: each weight also in the narrower layouts that time faster on this machine (measured once,
# cached); dense: the dtype's dense weights only
WEIGHT_LAYOUTS = ("auto", "dense")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_model_len: int = 2048
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: `num_blocks` blocks of `block_size` token slots each."""

    block_size: int = 16
    num_blocks: int | None = None  # None: derived from kv_cache_bytes
    kv_cache_bytes: int = 2 << 30

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits per step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: which drafter, and how many draft tokens per request each step.

    mode "fixed": every decoding request gets `num_speculative_tokens`; "adaptive": the policy
    chooses 0..num_speculative_tokens per request per step from measured acceptance and step
    cost; "schedule": K by running batch size from `schedule`, e.g. "1-4:4,5-16:2,17-:0".
    """

    method: str = "none"  # none | ngram | eagle3
    num_speculative_tokens: int = 3
    draft_model: str | None = None  # EAGLE-3 head directory; None: the head shipped for the bundled model
    ngram_min: int = 2
    ngram_max: int = 4
    mode: str = "fixed"
    schedule: str | None = None

    def __post_init__(self):
        from tidal.adaptive.policy import MODES, parse_schedule

        if self.method not in ("none", "ngram", "eagle3"):
            raise ValueError(f"speculative method {self.method!r} is not one of none, ngram, eagle3")
        if not (0 if self.method == "none" else 1) <= self.num_speculative_tokens <= 15:
            raise ValueError("num_speculative_tokens must be in 1..15 (0 only with method none)")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if self.mode not in MODES:
            raise ValueError(f"speculation mode {self.mode!r} is not one of {', '.join(MODES)}")
        if (self.mode == "schedule") != (self.schedule is not None):
            raise ValueError("a speculation schedule goes with mode 'schedule', and only with it")
        if self.schedule is not None:
            parse_schedule(self.schedule)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs. `model=None` means the bundled default."""

    model: str | None = None
    dtype: str = "auto"  # auto: bfloat16 where native (CUDA, AVX512-BF16 CPUs), else float32
    device: str = "auto"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    step_log: str | None = None  # append every measured step and draft proposal to this CSV file
    startup_profile: str = "auto"  # one of STARTUP_PROFILES (adaptive speculation only)
    enforce_eager: bool = False  # else small decode/verify steps run compiled (engine/compiled_step.py)
    # a first start compiles every graph before it is ready (a library's or a benchmark's steady
    # state); False: none, they compile one at a time while it serves (the CLI's default)
    wait_compiled: bool = True
    weight_layouts: str = "auto"  # one of WEIGHT_LAYOUTS

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if self.weight_layouts not in WEIGHT_LAYOUTS:
            raise ValueError(f"weight_layouts {self.weight_layouts!r} is not one of {', '.join(WEIGHT_LAYOUTS)}")
        if self.startup_profile not in STARTUP_PROFILES:
            raise ValueError(f"startup_profile {self.startup_profile!r} is not one of {', '.join(STARTUP_PROFILES)}")
