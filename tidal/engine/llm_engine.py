"""The engine: requests in, one step at a time, outputs out; and the offline LLM facade."""

from __future__ import annotations

import ctypes
import itertools
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from tidal.adaptive.cost import DEFAULT_KNOTS, PROFILE_MAX_TOKENS, PROFILE_PROMPT_LEN
from tidal.adaptive.policy import SpecPolicy, parse_schedule
from tidal.config import EngineConfig, SpecConfig
from tidal.engine import profile_cache
from tidal.engine.block_manager import BlockManager
from tidal.engine.compiled_step import GRAPHS
from tidal.engine.core import EngineCore
from tidal.engine.model_runner import ModelRunner
from tidal.engine.scheduler import Scheduler
from tidal.engine.step_log import StepLog
from tidal.layers.layout_choice import EAGER_EDGE, choose_layouts
from tidal import kernels
from tidal.layers.linear import EVERY_STEP, INT4_MAX_TOKENS, INT4_ROW_TILE
from tidal.models import loader
from tidal.models.eagle3 import load_eagle3
from tidal.sampling_params import InvalidParameter, SamplingParams
from tidal.sequence import Sequence
from tidal.speculative.drafter import Drafter
from tidal.speculative.eagle import Eagle3Drafter
from tidal.speculative.ngram import NgramDrafter

# The EAGLE-3 head trained for the bundled model by `tidal train-drafter` (its training log:
# docs/results/eagle3-head-train-log.txt).
DEFAULT_EAGLE3_HEAD = Path(__file__).resolve().parent.parent / "data" / "eagle3-smollm2-135m"

log = logging.getLogger("tidal.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RequestOutput:
    """What a request has produced so far; `finished` once, with a `finish_reason`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_draft_tokens: int = 0  # drafts this step verified for the request
    num_accepted_tokens: int = 0  # ... and how many of them it accepted


@dataclass(frozen=True)
class EngineLoad:
    """The engine's queue and KV cache, as published after each step (for gauges)."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where the hardware computes it natively (CUDA, CPUs with AVX512-BF16/AMX)."""
    if device.type == "cuda" or (device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return torch.bfloat16
    return torch.float32


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available")
    return dev


def weight_layouts(shapes: list[tuple[int, int]], block_bits: dict[tuple[int, int], int], device: torch.device,
                   dtype: torch.dtype, layouts: str) -> dict[str, dict[tuple[int, int], int]]:
    """Layout ("fp16", "qblock") -> weight shape -> the most rows of a step that copy serves:
    measured once per CPU, thread count and torch release (layout_choice.py), then read from the
    cache. `block_bits`: the shapes the file stores quantized, and at how many bits. Empty where
    no narrower layout applies (`layouts` "dense", or not CPU fp32)."""
    if layouts == "dense" or device.type != "cpu" or dtype != torch.float32:
        return {}
    if block_bits and not kernels.load(profile_cache.cache_dir() / "kernels"):
        block_bits = {}
    edges = tuple(high for _, high in GRAPHS.values()) + (EAGER_EDGE,)
    key = "layouts-" + profile_cache.digest({**profile_cache.cpu_identity(), "torch": torch.__version__,
                                            "threads": torch.get_num_threads(), "edges": edges,
                                            "shapes": sorted(set(shapes)),
                                            "blocks": sorted([*s, b] for s, b in block_bits.items())}) + ".json"
    record = profile_cache.load_record(key)
    try:
        return {name: {(int(n), int(k)): int(rows) for n, k, rows in record[name]} for name in ("fp16", "qblock")}
    except (TypeError, KeyError, ValueError):
        pass
    chosen = choose_layouts(shapes, block_bits, edges)
    profile_cache.save(key, {name: [[n, k, r] for (n, k), r in rows.items()] for name, rows in chosen.items()})
    return chosen


def _return_freed_heap() -> None:
    """Hand the heap that loading freed (the file's dequantized transients, hundreds of MB that
    glibc keeps for reuse) back to the OS; nothing where the C library is not glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


@contextmanager
def _phase(name: str):
    """Log one start-up phase with its seconds."""
    start = time.perf_counter()
    yield
    log.info("start-up: %s %.2f s", name, time.perf_counter() - start)


def make_drafter(spec: SpecConfig, runner: ModelRunner, target: str | None) -> Drafter | None:
    if spec.method == "ngram":
        return NgramDrafter(spec.ngram_min, spec.ngram_max)
    if spec.method == "eagle3":
        if spec.draft_model is None and target is not None:
            raise ValueError("eagle3 needs --draft-model for a model other than the bundled one")
        model = runner.model
        head = load_eagle3(spec.draft_model or DEFAULT_EAGLE3_HEAD, model.cfg, model.embed)
        head.to(device=runner.device, dtype=runner.dtype)
        # 4-bit where the target's kernel is, blocks where the target's weights are
        head.pack(int4=any(layer.int4 for layer in model.layers), blocks=any(layer.qblock for layer in model.layers))
        drafter = Eagle3Drafter(head, runner)
        runner.aux_layers = drafter.aux_layers
        return drafter
    return None


class LLMEngine(EngineCore):
    """Continuous-batching engine over the paged KV cache: loads the model, admits and aborts
    requests, detokenises; its steps are EngineCore's, executed by the ModelRunner."""

    def __init__(self, config: EngineConfig = EngineConfig()):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = default_dtype(self.device) if config.dtype == "auto" else _DTYPES[config.dtype]
        start = time.perf_counter()
        with _phase("load"):
            loaded = loader.load(config.model)
            self.model_name = loaded.name
            self.model_config = loaded.config
            self.tokenizer = loaded.tokenizer
            model = loader.build_model(loaded, self.device, self.dtype)
        with _phase("pack"):
            if self.device.type == "cpu":  # tidal's kernels: block weights, short-query attention
                kernels.load(profile_cache.cache_dir() / "kernels")
            layouts = weight_layouts(model.weight_shapes(), loader.block_bits(loaded, model), self.device,
                                     self.dtype, config.weight_layouts)
            loader.pack_model(model, loaded, self.device, self.dtype, layouts)
            self.runner = ModelRunner(model, config.cache, self.device, self.dtype, config.seed,
                                      compile=not config.enforce_eager, layouts=layouts)
            self.block_manager = BlockManager(self.runner.num_blocks, self.runner.block_size)
            self.scheduler = Scheduler(config.scheduler, self.block_manager)
            self.drafter = make_drafter(config.spec, self.runner, config.model)
            del loaded
            _return_freed_heap()
        if not config.enforce_eager:
            with _phase("compile"):
                self.runner.warm_up(config.model, background=not config.wait_compiled)
        self._requests: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        int4 = any(layer.int4 for layer in model.layers)
        # the step's cost jumps where a kernel or the compiled graph changes
        int4_knots = (INT4_ROW_TILE, INT4_ROW_TILE + 1, INT4_MAX_TOKENS, INT4_MAX_TOKENS + 1)
        narrow_rows = {w.max_rows for w in model.fp16_weights()} | set(layouts.get("qblock", {}).values())
        narrow_knots = tuple(k for r in sorted(narrow_rows - {0, EVERY_STEP}) for k in (r, r + 1))
        compiled = self.runner.compiled
        compiled_knots = (compiled.MAX_TOKENS, compiled.MAX_TOKENS + 1) if compiled is not None else ()
        super().__init__(self.scheduler, self.runner, self.drafter,
                         self._make_policy() if self.drafter is not None else None, time.perf_counter,
                         DEFAULT_KNOTS + (int4_knots if int4 else ()) + narrow_knots + compiled_knots)
        self.step_log = StepLog(config.step_log, tuple(self.step_cost.knots)) if config.step_log else None
        self._profile_rows: dict[str, list] | None = None  # while profiling: what it measured
        if self.policy is not None and self.policy.mode == "adaptive" and config.startup_profile != "off":
            self._startup_profile()
        log.info("start-up: ready %.2f s", time.perf_counter() - start)

    # ------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None) -> Sequence:
        """Queue a request; raises InvalidParameter for input that could never be served."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(prompt, (str, list, tuple)):
            raise InvalidParameter("prompt", "must be a string or a list of token ids")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_fits(ids, params)
        seq = Sequence(request_id, ids, params, arrival=next(self._arrivals))
        self.runner.generator(seq)  # seeded now, so a bad seed fails here and not mid-step
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def _check_fits(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise InvalidParameter("prompt", "must not be empty")
        vocab = self.model_config.vocab_size
        if any(type(t) is not int or not 0 <= t < vocab for t in ids):
            raise InvalidParameter("prompt", f"token ids must be integers in [0, {vocab})")
        limit = self.model_config.max_model_len
        if len(ids) + params.max_tokens > limit:
            raise InvalidParameter(
                "max_tokens", f"too large: this model's maximum context length is {limit} tokens, "
                f"and you requested {len(ids)} prompt + {params.max_tokens} completion tokens")
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if len(ids) + params.max_tokens > capacity:
            raise InvalidParameter(
                "max_tokens", f"too large: the KV cache holds {capacity} tokens, and the request "
                f"needs {len(ids) + params.max_tokens}")

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; its last output (finish_reason "abort"), or None
        if it is unknown or already finished."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        if self.drafter is not None:
            self.drafter.forget(seq)
        return self._output(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def load(self) -> EngineLoad:
        bm = self.block_manager
        return EngineLoad(len(self.scheduler.running), len(self.scheduler.waiting),
                          1.0 - bm.num_free_blocks / bm.num_blocks)

    @property
    def max_context_len(self) -> int:
        """The longest prompt + completion a request may have: the model's, or the KV cache's."""
        return min(self.model_config.max_model_len, self.block_manager.num_blocks * self.block_manager.block_size)

    # ------------------------------------------------------------ step

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, and report every request that got a token."""
        if self.runner.compiling:  # outside the timed step: loading packages is not a step's cost
            self.runner.land_compiled()
        return [self._output(seq, drafted, accepted) for seq, drafted, accepted in super().step() or ()]

    def emit(self, seq: Sequence, tokens: list[int]) -> None:
        for t in tokens:
            self._append(seq, t)
            if seq.is_finished:
                break

    def _make_policy(self) -> SpecPolicy:
        spec = self.config.spec
        max_k = max(k for *_, k in parse_schedule(spec.schedule)) if spec.schedule else spec.num_speculative_tokens
        return SpecPolicy(spec.mode, max_k, spec.schedule)

    def record_step(self, tokens: int, seqs: int, context: int, seconds: float, drafts: int | None,
                    verifying: int, predicted: float | None = None) -> None:
        """A measured target step into the step-cost fit (an anchor while profiling) and the step log."""
        if self.profiling:
            self._profile_rows["steps"].append([tokens, seqs, context, seconds, drafts, verifying])
        super().record_step(tokens, seqs, context, seconds, drafts, verifying, predicted)
        if self.step_log is not None:
            self.step_log.step(tokens, seqs, context, seconds, self.profiling, drafts, predicted,
                               None if self.policy is None and not self.profiling else verifying)

    def record_draft(self, forwards: int, tokens: int, catch_up: int, seconds: float) -> None:
        """A measured proposal into the draft-cost fit (an anchor while profiling) and the step log."""
        if self.profiling:
            self._profile_rows["drafts"].append([forwards, tokens, catch_up, seconds])
        super().record_draft(forwards, tokens, catch_up, seconds)
        if self.step_log is not None:
            self.step_log.draft(forwards, tokens, catch_up, seconds, self.profiling)

    def _startup_profile(self) -> None:
        """Anchor the cost models with the stored profile of this set-up, else (startup_profile
        "auto") measure it and store it; "if-cached" runs on live steps alone when none is stored."""
        key = profile_cache.profile_key(self._profile_identity())
        stored = profile_cache.load(key)
        if stored is None and self.runner.compiling:
            log.info("start-up: profile none stored, not measured while steps compile; the cost models learn "
                     "from live steps")
            return
        if stored is None and self.config.startup_profile == "if-cached":
            log.info("start-up: profile none stored; the cost models learn from live steps")
            return
        with _phase("profile" + (" (stored)" if stored else "")):
            self._profile_rows = {"steps": [], "drafts": []}
            try:
                if stored is not None:
                    self.profiling = True
                    for row in stored["steps"]:
                        self.record_step(*row)
                    for row in stored.get("drafts", []):
                        self.record_draft(*row)
                else:
                    self.profile()
                    profile_cache.save(key, self._profile_rows)
            finally:
                self._profile_rows, self.profiling = None, False

    def _profile_identity(self) -> dict:
        """What the stored profile must have been measured under (see profile_cache)."""
        from tidal.version import __version__

        c, spec = self.config, self.config.spec
        head = (spec.draft_model or DEFAULT_EAGLE3_HEAD) if spec.method == "eagle3" else None
        return {"model": profile_cache.file_identity(c.model or loader.default_model_path()),
                "drafter": [spec.method, spec.ngram_min, spec.ngram_max, profile_cache.file_identity(head)],
                "dtype": str(self.dtype), "device": str(self.device), "threads": torch.get_num_threads(),
                "compiled": None if self.runner.compiled is None else self.runner.compiled_key or "inductor",
                "cache": [self.runner.num_blocks, self.runner.block_size], "scheduler": repr(c.scheduler),
                "knots": self.step_cost.knots, "tidal": __version__, "torch": torch.__version__}

    def profile(self) -> None:
        """Seed the cost models with real steps over dummy requests (EngineCore.profile; a few
        seconds at start-up)."""
        greedy = SamplingParams(max_tokens=PROFILE_MAX_TOKENS, temperature=0, ignore_eos=True)
        prompt = [(7 * i) % 97 + 3 for i in range(8)] * (PROFILE_PROMPT_LEN // 8)  # repeats, so n-gram drafts too
        rows, self._profile_rows = self._profile_rows, self._profile_rows or {"steps": [], "drafts": []}
        try:
            super().profile(lambda rid: self.add_request(rid, prompt, greedy))
        finally:
            self._profile_rows = rows

    def _append(self, seq: Sequence, token: int) -> None:
        seq.output_token_ids.append(token)
        p = seq.params
        prev_len = len(seq.output_text)
        delta, *offsets = self.tokenizer.decode_step(seq.output_token_ids, *seq.detok_offsets)
        seq.output_text += delta
        seq.detok_offsets = tuple(offsets)
        reason = None
        if (not p.ignore_eos and token in self.model_config.eos_token_ids) or token in p.stop_token_ids:
            reason = "stop"
        if reason is None and len(seq.output_token_ids) >= p.max_tokens:
            reason = "length"
        if reason is not None and seq.detok_offsets[1] < len(seq.output_token_ids):
            seq.output_text = self.tokenizer.decode(seq.output_token_ids)  # flush held-back bytes
        for stop in p.stop:
            at = seq.output_text.find(stop, max(0, prev_len - len(stop) + 1))
            if at >= 0:
                seq.output_text, reason = seq.output_text[:at], "stop"
                break
        if reason is not None:
            self.scheduler.finish(seq, reason)
            del self._requests[seq.request_id]

    @staticmethod
    def _output(seq: Sequence, drafted: int = 0, accepted: int = 0) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.prompt_token_ids, list(seq.output_token_ids),
                             seq.output_text, seq.is_finished, seq.finish_reason, drafted, accepted)


class LLM:
    """Offline batch generation: `LLM().generate(prompts, params)`."""

    def __init__(self, model: str | None = None, **engine_kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """`prompts`: a string, a list of strings, or a list of token-id lists. Outputs keep order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        final: dict[str, RequestOutput] = {}
        try:
            for rid, prompt, p in zip(ids, prompts, params_list):
                self.engine.add_request(rid, prompt, p)
            while len(final) < len(ids):
                for o in self.engine.step():
                    if o.finished:
                        final[o.request_id] = o
        finally:  # on any error, leave no request of ours holding KV blocks
            for rid in ids:
                if rid not in final:
                    self.engine.abort(rid)
        return [final[rid] for rid in ids]

    def chat(self, messages: list[dict] | list[list[dict]], params=None) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.tokenizer.apply_chat_template(c) for c in convs], params)
