"""Builds one step's tensors (tokens, positions, slot mapping, attention groups), runs the
model over the paged KV cache, and samples."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import mmap
import os
import subprocess
import time
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from tidal.config import CacheConfig, ModelConfig
from tidal.engine import profile_cache
from tidal.engine.compiled_step import (COMPILED_MAX_TOKENS, GRAPHS, InductorStep, PackagedStep, StepGraph,
                                        compile_package, flat_args, graph_of)
from tidal.engine.scheduler import ScheduledSeq
from tidal.layers.attention import AttentionGroup, AttentionMetadata
from tidal import kernels
from tidal.layers.sampler import sample
from tidal.models import loader
from tidal.models.llama import LlamaModel
from tidal.sampling_params import SamplingParams
from tidal.sequence import Sequence
from tidal.speculative.verify import verify_greedy, verify_sampled
from tidal.version import __version__

# Sequences feeding at most this many tokens share one padded attention call (decode, verify);
# longer prefill chunks get a call each so padding never multiplies a long chunk.
SHORT_QUERY_LEN = 16
# ...but padding multiplies short queries too: one request verifying 4 drafts pads 31 decoding
# ones to 5 queries each. So the one-token sequences get a call of their own once that padding
# would reach this many query rows; below it a second call's fixed cost wins (timings: the
# commit that set it).
SPLIT_PAD_ROWS = 8
# A compiled step is one attention group whose rows each hold up to `width` queries of one
# sequence: a sequence feeding n tokens takes ceil(n / width) rows, each gathering the longest
# context's keys. One row's gather costs about as much as this many padded query rows, so
# query_width() picks the width that minimises rows x (this + width) (timings: the commit that
# set it).
ROW_GATHER_QUERIES = 8

log = logging.getLogger("tidal.engine")

# Where compiled steps are AOTInductor packages; elsewhere (CUDA) torch.compile with CUDA graphs.
PACKAGED_DEVICES = ("cpu",)
# A set-up's packages (each a copy of the weights) unused this long are deleted when another
# set-up compiles, so the cache does not grow with every model, thread count and release.
PACKAGE_MAX_IDLE_S = 7 * 24 * 3600


def kv_cache_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def _zeros(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on the CPU a private anonymous mapping of its own, whose pages the OS
    zeroes on first touch, so a large KV cache costs nothing at start-up and holds only the
    memory the requests use (calloc would hand back heap the loader freed, and zero it all by
    hand). Page-aligned, beyond the 64 bytes torch's allocator aligns to."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * dtype.itemsize
    if size == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.from_numpy(np.frombuffer(pages, dtype=np.uint8)).view(dtype).view(shape)


class ModelRunner:
    """Owns the model, its KV cache and the per-request sampling generators."""

    def __init__(self, model: LlamaModel, cache: CacheConfig, device: torch.device,
                 dtype: torch.dtype, seed: int = 0, compile: bool = False, layouts: dict | None = None):
        self.model, self.cfg, self.device, self.dtype = model, model.cfg, device, dtype
        # the block layout's rows by weight shape: the compiled steps call its kernel
        self.block_rows = sorted([n, k, r] for (n, k), r in (layouts or {}).get("qblock", {}).items())
        self.compile = compile  # small steps compiled at warm_up
        self.compiled: PackagedStep | InductorStep | None = None
        self.compiled_key: str | None = None  # what the compiled steps were built from (their packages' key)
        self.compiling: dict[str, Path] = {}  # graphs compiling in the background, to their packages
        self._workers: list = []  # their process
        self._lock_path: Path | None = None  # or, when another process compiles them, its lock
        self._compile_start = 0.0
        self.block_size = cache.block_size
        self.num_blocks = cache.num_blocks or max(
            1, cache.kv_cache_bytes // kv_cache_block_bytes(self.cfg, cache.block_size, dtype))
        slots = self.num_blocks * self.block_size
        shape = (slots, self.cfg.num_kv_heads, self.cfg.head_dim)
        self.kv_caches = [(self.cache_zeros(shape), self.cache_zeros(shape)) for _ in range(self.cfg.num_layers)]
        self._rng = np.random.default_rng(seed)
        self.aux_layers: tuple[int, ...] = ()  # target layers whose outputs a drafter needs

    def cache_zeros(self, shape: tuple) -> torch.Tensor:
        """A zeroed cache tensor in the KV dtype (the target's, and a drafter's own cache)."""
        return _zeros(shape, self.dtype, self.device)

    # ------------------------------------------------------------ step inputs

    def _slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        pos = np.arange(start, end)
        table = np.asarray(seq.block_table, dtype=np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _group(self, items: list[tuple[int, Sequence, int, int]], least: int = 1, least_keys: int = 1
               ) -> AttentionGroup:
        """items: (flat offset, seq, first position, tokens fed). Pads queries to Q, keys to K;
        sequences and queries to at least `least`, keys to at least `least_keys` (a padding
        sequence attends to slot 0 with one query, so no row is all masked)."""
        pad = max(0, least - len(items))
        q_lens = np.array([n for _, _, _, n in items] + [1] * pad)
        computed = np.array([start for _, _, start, _ in items] + [0] * pad)
        starts = np.array([off for off, _, _, _ in items] + [0] * pad)
        ctx = computed + q_lens
        Q, K = max(least, int(q_lens.max())), max(least_keys, int(ctx.max()))
        j = np.arange(Q)
        valid = (j[None] < q_lens[:, None]) & (np.arange(len(q_lens)) < len(items))[:, None]
        token_index = np.where(valid, starts[:, None] + j[None], 0)
        q_pos = np.where(valid, computed[:, None] + j[None], 0)
        p = np.arange(K)
        mask = (p[None, None] <= q_pos[:, :, None]) & (p[None, None] < ctx[:, None, None])
        kv_slots = np.zeros((len(q_lens), K), dtype=np.int64)
        for b, (_, seq, _, _) in enumerate(items):
            kv_slots[b, : ctx[b]] = self._slots(seq, 0, int(ctx[b]))
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)  # noqa: E731
        first = int(starts[0])
        in_order = (least == least_keys == 1 and bool(valid.all())
                    and np.array_equal(token_index.ravel(), np.arange(first, first + valid.size)))
        return AttentionGroup(token_index=t(token_index), kv_slots=t(kv_slots), mask=t(mask[:, None]),
                              out_index=t(token_index[valid]), rows=t(np.flatnonzero(valid)),
                              first=first if in_order else None)

    def slots(self, spans: list[tuple[Sequence, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and cache slots (on the device) of feeding each seq `n` tokens from position
        `start`, the sequences laid out one after another."""
        t = lambda parts: torch.from_numpy(np.concatenate(parts)).to(self.device)  # noqa: E731
        return (t([np.arange(start, start + n) for _, start, n in spans]),
                t([self._slots(seq, start, start + n) for seq, start, n in spans]))

    def metadata(self, spans: list[tuple[Sequence, int, int]], compiled: bool = False
                 ) -> tuple[torch.Tensor, AttentionMetadata]:
        """Positions and attention metadata for feeding each seq `n` tokens from position
        `start`, the sequences laid out one after another. The EAGLE drafter uses it too, over
        its own cache, which shares the target's block tables. `compiled`: one group of rows of
        query_width() queries whatever the step, every size at least 2 (but the rows and queries
        of a one-token step), so that a few compiled graphs (one token; more,
        compiled_step.GRAPHS) serve every small step: export specialises a size of 0 or 1."""
        positions, slots = self.slots(spans)
        if compiled:
            width = query_width([n for *_, n in spans])
            offsets = np.cumsum([0] + [n for *_, n in spans[:-1]]).tolist()
            items = [(off + i, seq, start + i, min(width, n - i))
                     for off, (seq, start, n) in zip(offsets, spans) for i in range(0, n, width)]
            group = self._group(items, least=1 if len(positions) == 1 else 2, least_keys=2)
            return positions, AttentionMetadata(slot_mapping=slots, groups=[group])
        short, groups = [], []
        offset = 0
        for seq, start, n in spans:
            if n <= SHORT_QUERY_LEN:
                short.append((offset, seq, start, n))
            else:
                groups.append(self._group([(offset, seq, start, n)]))
            offset += n
        single = [item for item in short if item[3] == 1]
        if single and len(single) * (max(item[3] for item in short) - 1) >= SPLIT_PAD_ROWS:
            multi = [item for item in short if item[3] > 1]
            groups[:0] = [self._group(single), self._group(multi)]
        elif short:
            groups.insert(0, self._group(short))
        return positions, AttentionMetadata(slot_mapping=slots, groups=groups)

    def prepare(self, scheduled: list[ScheduledSeq], compiled: bool = False):
        ids = []
        for s in scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            ids.extend(seq.token_ids[start:start + s.num_new_tokens - s.num_draft_tokens])
            ids.extend(seq.draft_token_ids[: s.num_draft_tokens])
        positions, meta = self.metadata([(s.seq, s.seq.num_computed_tokens, s.num_new_tokens) for s in scheduled],
                                        compiled)
        return torch.tensor(ids, device=self.device), positions, meta

    # ------------------------------------------------------------ run

    def execute(self, scheduled: list[ScheduledSeq]) -> tuple[list[list[int]], torch.Tensor | None]:
        """Run one step. Returns, for each scheduled seq that samples, in order, the tokens it
        gains (one sampled token, or its accepted drafts plus the verifier's next token); and
        the target features [T, 3 x hidden] of every fed token when `aux_layers` is set."""
        ends = np.cumsum([s.num_new_tokens for s in scheduled]) - 1
        rows, starts, sampling = [], [], []
        for end, s in zip(ends, scheduled):
            if s.samples:  # logits for the last fed token and for every draft token
                starts.append(len(rows))
                rows.extend(range(end - s.num_draft_tokens, end + 1))
                sampling.append(s)
        num_tokens = int(ends[-1]) + 1
        compiled = self.compiled is not None and 0 < len(rows) and self.compiled.covers(num_tokens)
        input_ids, positions, meta = self.prepare(scheduled, compiled)
        if compiled:
            logits, aux = self._run_compiled(input_ids, positions, meta, rows)
        else:
            hidden, aux = self.model(input_ids, positions, self.kv_caches, meta, self.aux_layers)
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]) if rows else None
        features = torch.cat(aux, dim=-1) if aux else None
        if not sampling:
            return [], features
        results: list[list[int]] = [[] for _ in sampling]
        plain = [i for i, s in enumerate(sampling) if not s.num_draft_tokens]
        if plain:
            tokens = self.sample(logits[[starts[i] for i in plain]], [sampling[i].seq for i in plain])
            for i, t in zip(plain, tokens):
                results[i] = [t]
        for i, s in enumerate(sampling):
            if s.num_draft_tokens:
                results[i] = self.verify(logits[starts[i]:starts[i] + s.num_draft_tokens + 1], s)
        return results, features

    def _run_compiled(self, input_ids, positions, meta, rows: list[int], capture: bool = False):
        """The compiled step; its sampled rows padded to at least 2 in a step of more than one
        token (like its other sizes, see metadata), the padding's logits dropped."""
        n = len(rows)
        if len(input_ids) > 1 and n < 2:
            rows = rows + rows[-1:]
        rows = torch.tensor(rows, device=self.device)
        with torch.no_grad():
            logits, aux = self.compiled(input_ids, positions, meta, rows, **({"capture": True} if capture else {}))
        return logits[:n], aux

    def example_steps(self) -> dict[str, tuple]:
        """One step of each compiled graph, (input_ids, positions, metadata, sampled rows), over
        placeholder sequences in the first cache blocks (before any request holds them). Each
        graph's kernels are tuned at its example's sizes."""
        seq = Sequence("warm-up", list(range(1, 8)), SamplingParams(max_tokens=1))
        other = Sequence("warm-up-2", [1, 2], SamplingParams(max_tokens=1))
        # the widest graph's: eight requests verifying one draft each
        wide = [Sequence(f"warm-up-{i + 3}", list(range(1, 8)), SamplingParams(max_tokens=1)) for i in range(8)]
        for s in (seq, other, *wide):
            s.block_table = list(range(-(-8 // self.block_size)))
        steps = {}
        for spans, rows in (([(seq, 6, 1)], [0]), ([(seq, 3, 3), (other, 0, 1)], [1, 2, 3]),
                            ([(seq, 3, 3), (other, 0, 2)], [1, 2, 4]), ([(s, 5, 2) for s in wide], list(range(16)))):
            ids = torch.ones(sum(n for *_, n in spans), dtype=torch.long, device=self.device)
            steps[graph_of(len(ids))] = (ids, *self.metadata(spans, compiled=True), rows)
        return steps

    def warm_up(self, model: str | None = None, background: bool = False) -> None:
        """Make the compiled steps ready (`model`: the file the weights came from, None for the
        bundled one). `background`: wait for none; they compile while the engine serves, one at a
        time in a process of lower priority, each landing as it is written (its steps eager until
        then, see land_compiled). A failure to compile is logged and leaves the steps eager."""
        if not self.compile:
            return
        try:
            if self.device.type in PACKAGED_DEVICES:
                paths = self._packages(model, background)
                self.compiled = PackagedStep({g: p for g, p in paths.items() if p.is_file()}, self.kv_caches, self.model)
            else:
                self._capture()
        except Exception as e:  # an optimisation that cannot be had must not stop the engine
            self.compiled, self.compiling = None, {}
            log.warning("compiled steps unavailable, running eager: %s", e)

    def _capture(self) -> None:
        """torch.compile the graphs now; duck shaping off, so sizes equal at capture stay distinct."""
        from torch.fx.experimental import _config as fx_config

        self.compiled = InductorStep(self.model, self.kv_caches, self.aux_layers, self.device)
        with fx_config.patch(use_duck_shape=False):
            for ids, positions, meta, rows in self.example_steps().values():
                if self.compiled.covers(len(ids)):
                    self._run_compiled(ids, positions, meta, rows, capture=True)

    def _packages(self, model: str | None, background: bool) -> dict[str, Path]:
        """The graphs' packages, compiled now (in parallel processes) where the cache lacks them;
        with `background`, left compiling (self.compiling) in one process, the one-token graph first."""
        job = {"model": model, "dtype": str(self.dtype).removeprefix("torch."), "device": str(self.device),
               "threads": torch.get_num_threads(), "aux_layers": list(self.aux_layers), "block_size": self.block_size,
               "qblock": self.block_rows}
        key = profile_cache.digest({**job, "model": profile_cache.file_identity(model or loader.default_model_path()),
                                    "source": _source_digest(), "tidal": __version__, "torch": torch.__version__,
                                    "cpu": torch.backends.cpu.get_cpu_capability(), "max_tokens": COMPILED_MAX_TOKENS})
        self.compiled_key = key
        directory = profile_cache.cache_dir() / "compiled"
        paths = {g: directory / f"step-{key}-{g}.so" for g in GRAPHS}
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / f"step-{key}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another process compiles these steps
                if background:  # serve eager, landing its packages as it writes them
                    self.compiling = {g: p for g, p in paths.items() if not p.is_file()}
                    self._lock_path, self._compile_start = Path(lock.name), time.perf_counter()
                    log.info("another process is compiling %s; until each lands, its steps run eager",
                             ", ".join(self.compiling) or "nothing")
                    return paths
                log.info("waiting for another process compiling these steps")
                fcntl.flock(lock, fcntl.LOCK_EX)
            os.utime(lock.fileno())  # the lock's mtime is the set-up's last use
            missing = [g for g, p in paths.items() if not p.is_file()]
            if not missing:
                return paths
            prune_packages(directory, time.time() - PACKAGE_MAX_IDLE_S)
            jobs = [{**job, "graph": g, "path": str(paths[g])} for g in missing]
            if not background:
                log.info("compiling the decode step ahead of time, once per model, dtype and thread count: %s",
                         ", ".join(missing))
                _run_workers([[j] for j in jobs])
            else:
                log.info("compiling %s in the background, one at a time (minutes each); until each lands, "
                         "its steps run eager", ", ".join(missing))
                # the worker holds the lock (an inherited descriptor) until it exits
                self.compiling = {g: paths[g] for g in missing}
                self._workers = _start_workers([jobs], lock.fileno(), nice=True)
                self._compile_start = time.perf_counter()
        return paths

    def land_compiled(self, wait: bool = False) -> bool:
        """Load each package compiled in the background once it is written (`wait`: block until
        the worker has exited). True when nothing is left compiling."""
        if not self.compiling:
            return True
        if self._lock_path is not None:  # another process compiles: running while it holds the lock
            running = not _lock_free(self._lock_path, wait)
        else:
            running = any(proc.poll() is None for proc, _ in self._workers)
            if wait and running:
                for proc, _ in self._workers:
                    proc.wait()
                running = False
        for g, path in list(self.compiling.items()):
            if not path.is_file():  # written whole by a rename, or not at all
                continue
            del self.compiling[g]
            try:
                if self.compiled is not None:
                    self.compiled.add(g, path)
                    log.info("compiled step %s landed after %.0f s", g, time.perf_counter() - self._compile_start)
            except Exception as e:  # a package that cannot load leaves its steps eager
                log.warning("compiled step %s unavailable, its steps stay eager: %s", g, e)
        if running:
            return not self.compiling
        failures = _wait_workers(self._workers)
        if failures:
            log.warning("compiling the step in the background failed, those steps stay eager: %s", failures[0])
        elif self.compiling:
            log.warning("the process compiling %s ended without them; those steps stay eager",
                        ", ".join(self.compiling))
        self.compiling, self._workers, self._lock_path = {}, [], None
        return True

    def verify(self, logits: torch.Tensor, s: ScheduledSeq) -> list[int]:
        seq, p = s.seq, s.seq.params
        draft = seq.draft_token_ids[: s.num_draft_tokens]
        if p.greedy:
            return verify_greedy(logits, draft)
        probs = None if seq.draft_probs is None else seq.draft_probs[: len(draft)]
        return verify_sampled(logits, draft, probs, p.temperature, p.top_k, p.top_p, self.generator(seq))

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        params = [s.params for s in seqs]
        f32 = dict(dtype=torch.float32, device=self.device)
        temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], **f32)
        top_k = torch.tensor([p.top_k for p in params], device=self.device)
        top_p = torch.tensor([p.top_p for p in params], **f32)
        return sample(logits, temperature, top_k, top_p, [self.generator(s) for s in seqs]).tolist()

    def generator(self, seq: Sequence) -> torch.Generator | None:
        """The request's own generator (None when greedy), seeded once on first use."""
        if seq.params.greedy:
            return None
        if seq.generator is None:
            seed = seq.params.seed if seq.params.seed is not None else int(self._rng.integers(2**63))
            seq.generator = torch.Generator(device=self.device).manual_seed(seed)
        return seq.generator


def query_width(q_lens: list[int]) -> int:
    """The queries per row of a compiled step's attention group (ModelRunner.metadata): the width
    that minimises rows x (ROW_GATHER_QUERIES + width), at least 2 (export specialises 1)."""
    return min(range(max(2, *q_lens), 1, -1),
               key=lambda w: sum(-(-n // w) for n in q_lens) * (ROW_GATHER_QUERIES + w))


# ------------------------------------------------------------ compiled packages


def _source_digest() -> str:
    """The source a compiled step is traced from (layers, models, the step), so that a package
    never outlives the code it was compiled from."""
    root = Path(__file__).parents[1]  # the package
    files = sorted([*root.glob("layers/*.py"), *root.glob("models/*.py"), *root.glob("kernels/*.cpp"),
                    root / "engine" / "compiled_step.py"])
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _lock_free(path: Path, wait: bool = False) -> bool:
    """Whether no process holds the lock at `path` (`wait`: until none does)."""
    with open(path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            return False
        fcntl.flock(lock, fcntl.LOCK_UN)
        return True


def prune_packages(directory: Path, unused_since: float) -> list[str]:
    """Delete the packages of every set-up whose lock was last touched before `unused_since`
    (seconds since the epoch); returns the deleted set-ups' keys."""
    pruned = []
    for partial in directory.glob(".step-*"):  # a worker killed while writing leaves its temp files
        if partial.stat().st_mtime < unused_since:
            partial.unlink(missing_ok=True)
    for lock in directory.glob("step-*.lock"):
        if lock.stat().st_mtime < unused_since:
            key = lock.stem.removeprefix("step-")
            for package in directory.glob(f"step-{key}-*"):  # libraries (and archives of older versions)
                package.unlink(missing_ok=True)
            lock.unlink(missing_ok=True)
            pruned.append(key)
    if pruned:
        log.info("deleted the compiled steps of %d set-up(s) unused for %d days", len(pruned),
                 PACKAGE_MAX_IDLE_S // 86400)
    return pruned


_WORKER = ("import json, os, sys; from tidal.engine.model_runner import build_package\n"
           "if sys.argv[2] == 'nice': os.nice(10)\n"
           "for job in json.loads(sys.argv[1]): build_package(job)")


def _start_workers(batches: list[list[dict]], lock_fd: int | None = None, nice: bool = False) -> list:
    """Start a process for each batch of jobs, running build_package on them in order (`nice`:
    at a lower priority than this one); each holds `lock_fd` until it exits."""
    workers = []
    for jobs in batches:
        err = tempfile.TemporaryFile(mode="w+")
        workers.append((subprocess.Popen([sys.executable, "-c", _WORKER, json.dumps(jobs), "nice" if nice else "-"],
                                         stdout=subprocess.DEVNULL, stderr=err,
                                         pass_fds=() if lock_fd is None else (lock_fd,)), err))
    return workers


def _wait_workers(workers: list) -> list[str]:
    """Wait for the workers; the error line of each that failed."""
    failures = []
    for proc, err in workers:
        if proc.wait():
            err.seek(0)
            lines = [line for line in err.read().splitlines() if line.strip()]
            errors = [line for line in lines if "Error" in line.split(":")[0]] or lines
            failures.append(errors[-1] if errors else f"exit status {proc.returncode}")
        err.close()
    return failures


def _run_workers(batches: list[list[dict]]) -> None:
    """Run each batch of build_package jobs in its own process, all at once; raise with the first
    failure's error line."""
    failures = _wait_workers(_start_workers(batches))
    if failures:
        raise RuntimeError(f"compiling the step failed: {failures[0]}")


def build_package(job: dict) -> None:
    """Compile one step graph to its package (run in a worker process, see _start_workers): the
    model loaded and packed as the engine does, the example step of that graph."""
    torch.set_num_threads(job["threads"])
    device, dtype = torch.device(job["device"]), getattr(torch, job["dtype"])
    loaded = loader.load(job["model"])
    model = loader.build_model(loaded, device, dtype)
    # the serving process's kernels (attention too: the package must compute what eager steps do)
    if device.type == "cpu" and not kernels.load(profile_cache.cache_dir() / "kernels") and job["qblock"]:
        raise RuntimeError("the block weights' kernel did not build")
    loader.pack_model(model, loaded, device, dtype, {"qblock": {(n, k): r for n, k, r in job["qblock"]}})
    runner = ModelRunner(model, CacheConfig(block_size=job["block_size"], num_blocks=4), device, dtype)
    ids, positions, meta, rows = runner.example_steps()[job["graph"]]
    args = flat_args(ids, positions, meta, torch.tensor(rows, device=device),
                     tuple(t for pair in runner.kv_caches for t in pair))
    library = compile_package(StepGraph(model, tuple(job["aux_layers"])).eval(), args, job["graph"], Path(job["path"]))
    drop_inductor_copy(library)


def drop_inductor_copy(library: str) -> None:
    """Delete inductor's own copy of the library it named `library` (its source and metadata
    too). Inductor keeps each library it builds, weights and all (150-300 MB a graph), in its
    cache under the temp folder, where nothing deletes it; a set-up compiles once and loads its
    package, so the copy is never read. The cached kernels and tuning results (small, and what
    makes a later compile faster) stay."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    for copy in Path(cache_dir()).glob(f"*/{library.split('.')[0]}.*"):
        copy.unlink(missing_ok=True)
