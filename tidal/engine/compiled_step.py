"""Small decode/verify steps compiled once and replayed.

Four graphs serve every step of at most COMPILED_MAX_TOKENS tokens over the paged, ragged batch:
one token; 2..INT4_ROW_TILE tokens; up to INT4_MAX_TOKENS; and up to COMPILED_MAX_TOKENS, every
size but the first graph's dynamic (tokens, sequences, queries, keys, sampled rows, cache slots).
All take the step as one padded attention group. The token ranges are split where the best GEMM
changes: inductor tunes each graph's kernels at its example size; its 4-bit AMX kernel, the
fastest from 5 rows, costs as much at 2 rows as at 8, twice the vector kernel's cost there; past
INT4_MAX_TOKENS the dense weights win.
- CPU: each graph is exported and compiled by AOTInductor into a shared library on disk (its
  package), weights frozen into it (so inductor uses its own low-bit GEMM kernels); a later start
  loads the libraries in under a second instead of compiling for a minute.
- CUDA: torch.compile in mode max-autotune, which records CUDA graphs (AOTInductor does not).
"""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

import torch
from torch import nn

from tidal.layers.attention import AttentionGroup, AttentionMetadata
from tidal.layers.linear import INT4_MAX_TOKENS, INT4_ROW_TILE

# Steps of at most this many tokens (decode and verify up to this batch size, where eager pays a
# fixed cost of many small ops per step) run compiled; longer ones (prefill chunks, large batches)
# run eager, where that cost is small beside the step's work.
COMPILED_MAX_TOKENS = 64
# each graph's token counts
GRAPHS = {"one": (1, 1), "few": (2, INT4_ROW_TILE), "many": (INT4_ROW_TILE + 1, INT4_MAX_TOKENS),
          "wide": (INT4_MAX_TOKENS + 1, COMPILED_MAX_TOKENS)}

# freezing: weights become constants, which is what lets inductor pick its low-bit GEMM templates;
# weight_prepack lets it lay the dense ones (the widest graph's projections) out for its own GEMM
# templates too, where unpacked they are re-laid out on every call (see linear.PackedWeight)
PACKAGE_CONFIG = {"freezing": True, "max_autotune": True, "cpp.weight_prepack": True}


def graph_of(num_tokens: int) -> str:
    return next(g for g, (low, high) in GRAPHS.items() if low <= num_tokens <= high)


class StepGraph(nn.Module):
    """A compiled step as a module of flat tensor arguments (what export takes): the forward over
    one attention group and the output head at the sampled rows; returns the logits and the
    residual stream after each of `aux_layers`."""

    def __init__(self, model: nn.Module, aux_layers: tuple[int, ...]):
        super().__init__()
        self.model, self.aux_layers = model, aux_layers

    def forward(self, input_ids, positions, slot_mapping, token_index, kv_slots, mask, out_index,
                group_rows, rows, *kv):
        group = AttentionGroup(token_index, kv_slots, mask, out_index, group_rows)
        meta = AttentionMetadata(slot_mapping, [group])
        hidden, aux = self.model.run(input_ids, positions, list(zip(kv[0::2], kv[1::2])), meta, self.aux_layers)
        return (self.model.logits(hidden[rows]), *aux)


def flat_args(input_ids, positions, meta: AttentionMetadata, rows, kv: tuple) -> tuple:
    """StepGraph's arguments; `kv`: the caches flattened, (k0, v0, k1, v1, ...)."""
    (g,) = meta.groups
    return (input_ids, positions, meta.slot_mapping, g.token_index, g.kv_slots, g.mask, g.out_index, g.rows,
            rows, *kv)


def dynamic_shapes(graph: str, num_kv: int) -> tuple:
    """Which sizes of StepGraph's arguments vary between steps, and how they are tied (export
    takes the caches, StepGraph's `*kv`, as one tuple)."""
    from torch.export import Dim

    keys, slots = Dim("keys", min=2), Dim("slots", min=2)
    kv = tuple({0: slots} for _ in range(num_kv))
    if graph == "one":
        return (None, None, None, None, {1: keys}, {3: keys}, None, None, None, kv)
    low, high = GRAPHS[graph]
    tokens = Dim("tokens", min=low, max=high)
    seqs, queries, rows = (Dim(n, min=2, max=high) for n in ("seqs", "queries", "rows"))
    return ({0: tokens}, {0: tokens}, {0: tokens}, {0: seqs, 1: queries}, {0: seqs, 1: keys},
            {0: seqs, 2: queries, 3: keys}, {0: tokens}, {0: tokens}, {0: rows}, kv)


def compile_package(module: StepGraph, args: tuple, graph: str, path: Path) -> str:
    """Export `module` at the example `args` and compile it with AOTInductor into the shared
    library at `path` (the step's package: weights inside), written whole or not at all. Returns
    the name inductor gave the library (its cache keeps a copy under that name). AOTInductor
    writes a .pt2 archive around the library; the library alone is kept, so that a start loads it
    in place instead of unpacking the archive (300 MB a graph) to a temp folder each time, and
    beside it (same name, .json) the spec by which the library calls tidal's own operator (the
    block weights' kernel), which torch's runner reads from there."""
    from torch._inductor import aoti_compile_and_package

    archive = path.with_name(f".{path.stem}.{os.getpid()}.pt2")
    tmp = path.with_name(f".{path.stem}.{os.getpid()}{path.suffix}")
    tmp_spec, spec = tmp.with_suffix(".json"), path.with_suffix(".json")
    try:
        with torch.no_grad():
            program = torch.export.export(module, args, dynamic_shapes=dynamic_shapes(graph, len(args) - 9),
                                          strict=False)
            aoti_compile_and_package(program, package_path=str(archive), inductor_configs=PACKAGE_CONFIG)
        with zipfile.ZipFile(archive) as z:
            model = [n for n in z.namelist() if "/data/aotinductor/model/" in n]
            (library,) = [n for n in model if n.endswith(".so")]
            specs = [n for n in model if n == library.removesuffix(".so") + ".json"]
            # anything but the library, its sources, metadata and spec (separate weights, say)
            # would be lost with the archive
            if extra := [n for n in model if not n.endswith((".so", ".cpp", "_metadata.json")) and n not in specs]:
                raise RuntimeError(f"the compiled step needs files beside its library: {extra}")
            with z.open(library) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
            for name in specs:
                with z.open(name) as src, open(tmp_spec, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        if tmp_spec.is_file():
            tmp_spec.replace(spec)
        else:
            spec.unlink(missing_ok=True)
        tmp.replace(path)  # the library last: a start takes its presence for the package's
    finally:
        archive.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
        tmp_spec.unlink(missing_ok=True)
    return Path(library).name


class LoadedPackage:
    """A step's library loaded in place by torch's C++ runner, called with the step's flat
    tensors; returns the outputs as a list. Not through torch's Python loader
    (`aoti_load_package`), which imports inductor and dynamo (over a second of a start) only to
    compare the device the package was built for, which the compile key already pins."""

    def __init__(self, path: Path):
        self.runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1)  # one model instance

    def __call__(self, *args: torch.Tensor) -> list[torch.Tensor]:
        return self.runner.run(list(args))


class PackagedStep:
    """The graphs, loaded from their packages (those still compiling added as they land)."""

    MAX_TOKENS = COMPILED_MAX_TOKENS

    def __init__(self, paths: dict[str, Path], kv_caches: list[tuple]):
        self.graphs = {}
        for g, p in paths.items():
            self.add(g, p)
        self.kv = tuple(t for pair in kv_caches for t in pair)

    def add(self, graph: str, path: Path) -> None:
        self.graphs[graph] = LoadedPackage(path)

    def covers(self, num_tokens: int) -> bool:
        return num_tokens <= self.MAX_TOKENS and graph_of(num_tokens) in self.graphs

    def __call__(self, input_ids, positions, meta: AttentionMetadata, rows) -> tuple[torch.Tensor, list]:
        logits, *aux = self.graphs[graph_of(len(input_ids))](*flat_args(input_ids, positions, meta, rows, self.kv))
        return logits, aux


def _step_logits(model, input_ids, positions, kv_caches, meta, rows, aux_layers):
    hidden, aux = model.run(input_ids, positions, kv_caches, meta, aux_layers)
    return model.logits(hidden[rows]), aux


class InductorStep:
    """torch.compile of the step, mode max-autotune (CUDA graphs, one per shape met). `capture`
    at warm-up marks the sizes that vary between steps as dynamic, so that nothing recompiles
    while serving. It covers steps of up to MAX_TOKENS: wider ones (more shapes to record)
    have not been measured on a GPU."""

    MAX_TOKENS = INT4_MAX_TOKENS

    def __init__(self, model: nn.Module, kv_caches: list[tuple], aux_layers: tuple[int, ...], device: torch.device):
        from tidal.engine.profile_cache import cache_dir

        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
        mode = "max-autotune" if device.type == "cuda" else "max-autotune-no-cudagraphs"
        self.fn = torch.compile(_step_logits, mode=mode)
        self.model, self.kv_caches, self.aux_layers = model, kv_caches, aux_layers

    def covers(self, num_tokens: int) -> bool:
        return num_tokens <= self.MAX_TOKENS

    def __call__(self, input_ids, positions, meta: AttentionMetadata, rows, capture: bool = False):
        if capture:
            g = meta.groups[0]
            many = len(input_ids) > 1
            for t, dims in ((g.kv_slots, [1]), (g.mask, [3])) + (((input_ids, [0]), (positions, [0]), (rows, [0]),
                            (meta.slot_mapping, [0]), (g.token_index, [0, 1]), (g.kv_slots, [0]),
                            (g.mask, [0, 2]), (g.out_index, [0]), (g.rows, [0])) if many else ()):
                torch._dynamo.mark_dynamic(t, dims)
        # a config, not a torch.compile option: options cannot go with a mode
        from torch._inductor import config as inductor_config

        with inductor_config.patch(freezing=True):
            return self.fn(self.model, input_ids, positions, self.kv_caches, meta, rows, self.aux_layers)
