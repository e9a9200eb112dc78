"""Small decode/verify steps compiled once and replayed.

Four graphs serve every step of at most COMPILED_MAX_TOKENS tokens over the paged, ragged batch:
one token; 2..INT4_ROW_TILE tokens; up to INT4_MAX_TOKENS; and up to COMPILED_MAX_TOKENS, every
size but the first graph's dynamic (tokens, sequences, queries, keys, sampled rows, cache slots).
All take the step as one padded attention group. The token ranges are split where the best GEMM
changes: inductor tunes each graph's kernels at its example size; its 4-bit AMX kernel, the
fastest from 5 rows, costs as much at 2 rows as at 8, twice the vector kernel's cost there; past
INT4_MAX_TOKENS the dense weights win.
- CPU: each graph is exported and compiled by AOTInductor into a shared library on disk (its
  package), weights frozen (so inductor uses its own low-bit GEMM kernels); a later start loads
  the libraries in under a second instead of compiling for a minute. A graph that multiplies by
  no dense weight (an fp32 model's steps over block weights) holds no weights in its library:
  its constants are the model's own tensors, handed to it at load (those inductor derived at
  compile time kept beside it), so those graphs and the eager model share one copy.
- CUDA: torch.compile in mode max-autotune, which records CUDA graphs (AOTInductor does not).
"""

from __future__ import annotations

import io
import json
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
FROZEN = {"freezing": True, "max_autotune": True, "cpp.weight_prepack": True,
          "aot_inductor.package_constants_in_so": False}
# the constants out of the library: in one file beside it (.blob), which the runner copies from
# at load and does not keep mapped (constants inside the library stay resident twice: mapped,
# and copied)...
BLOB_CONFIG = {**FROZEN, "aot_inductor.package_constants_on_disk_format": "binary_blob"}
# ...or one by one, so that each is matched to the model tensor that holds it (handed to the
# runner at load: not copied at all)
SHARED_CONFIG = {**FROZEN, "aot_inductor.package_constants_on_disk_format": "pickle_weights"}
MATMULS = {torch.ops.aten.linear.default, torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
           torch.ops.aten.matmul.default}


def package_config(program: torch.export.ExportedProgram, dtype: torch.dtype) -> dict:
    """The graph's inductor options. It keeps its own copy of the weights (BLOB_CONFIG) where it
    multiplies by a dense weight, which inductor prepacks into oneDNN's opaque layout (such
    copies cannot be shared, and unpacked the graph runs slower: docs/results/notebook.md), and
    for bf16 models (whose low-bit kernels were tuned that way); otherwise it shares the model's."""
    sig = program.graph_signature
    weights = {*sig.inputs_to_parameters, *sig.inputs_to_buffers, *sig.inputs_to_lifted_tensor_constants}

    def reads_weight(node, depth: int = 3) -> bool:  # through views and transposes of it
        if not isinstance(node, torch.fx.Node) or depth == 0:
            return False
        return node.name in weights or (node.op == "call_function" and reads_weight(node.args[0], depth - 1))

    dense = any(n.op == "call_function" and n.target in MATMULS and any(reads_weight(a) for a in n.args[:3])
                for n in program.graph.nodes)
    return BLOB_CONFIG if dense or dtype == torch.bfloat16 else SHARED_CONFIG


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the model holds, by a name stable across processes: parameters, buffers, and
    the tensors of its weights' other layouts (plain attributes: tidal.layers.linear, qblock)."""
    found: dict[str, torch.Tensor] = {}

    def visit(name: str, value, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            found.setdefault(name, value)
        elif isinstance(value, dict) and depth < 3:
            for k, v in value.items():
                visit(f"{name}.{k}", v, depth + 1)
        elif hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type)) and depth < 3:
            for k, v in vars(value).items():
                visit(f"{name}.{k}", v, depth + 1)

    for prefix, module in model.named_modules():
        items = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False),
                 *((k, v) for k, v in vars(module).items() if not k.startswith("_"))]
        for k, v in items:
            visit(f"{prefix}.{k}" if prefix else k, v, 0)
    return found


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
    library at `path` (the step's package), written whole or not at all. Returns the name
    inductor gave the library (its cache keeps a copy under that name). AOTInductor writes a .pt2
    archive around the library; the library alone is kept, so that a start loads it in place
    instead of unpacking the archive to a temp folder each time, and beside it (same name) the
    .json spec by which the library calls tidal's own operators (torch's runner reads it from
    there) and its constants (package_config): the .blob holding them all, or the .constants.json
    naming the model tensor each is and the .pt holding those inductor derived."""
    from torch._inductor import aoti_compile_and_package

    archive = path.with_name(f".{path.stem}.{os.getpid()}.pt2")
    tmp = path.with_name(f".{path.stem}.{os.getpid()}{path.suffix}")
    beside = (".json", ".blob", ".constants.json", ".pt")
    temps = {s: tmp.with_suffix(s) for s in beside}
    try:
        with torch.no_grad():
            program = torch.export.export(module, args, dynamic_shapes=dynamic_shapes(graph, len(args) - 9),
                                          strict=False)
            config = package_config(program, next(module.parameters()).dtype)
            aoti_compile_and_package(program, package_path=str(archive), inductor_configs=config)
        with zipfile.ZipFile(archive) as z:
            model = [n for n in z.namelist() if "/data/aotinductor/model/" in n]
            (library,) = [n for n in model if n.endswith(".so")]
            specs = [n for n in model if n == library.removesuffix(".so") + ".json"]
            configs = [n for n in model if n.endswith("/weights_config.json")]
            blobs = [n for n in model if n == library.removesuffix(".so") + "_weights.blob"]
            # anything but the library, its sources, metadata, spec and constants would be lost
            # with the archive
            if extra := [n for n in model if not n.endswith((".so", ".cpp", "_metadata.json"))
                         and n not in specs + configs + blobs]:
                raise RuntimeError(f"the compiled step needs files beside its library: {extra}")
            with z.open(library) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
            for name, suffix in [*((n, ".json") for n in specs), *((n, ".blob") for n in blobs)]:
                with z.open(name) as src, open(temps[suffix], "wb") as dst:
                    shutil.copyfileobj(src, dst)
            if configs:
                _share_constants(z, configs[0], tmp, model_tensors(module.model), temps[".constants.json"],
                                 temps[".pt"])
        for suffix, t in temps.items():
            if t.is_file():
                t.replace(path.with_suffix(suffix))
            else:
                path.with_suffix(suffix).unlink(missing_ok=True)
        tmp.replace(path)  # the library last: a start takes its presence for the package's
    finally:
        archive.unlink(missing_ok=True)
        for t in (tmp, *temps.values()):
            t.unlink(missing_ok=True)
    return Path(library).name


def _share_constants(z: zipfile.ZipFile, config: str, library: Path, tensors: dict[str, torch.Tensor],
                     names_path: Path, derived_path: Path) -> None:
    """For each constant of the compiled `library` (its values in the archive `z`), the model
    tensor whose storage holds it (written to `names_path` with the view: shape, stride, storage
    offset), or, for those inductor derived, its value (saved to `derived_path`). The archive
    names constants by their original names, the library by its own."""
    root = config.split("/data/")[0]
    fqns = torch._C._aoti.AOTIModelContainerRunnerCpu(str(library), 1).get_constant_names_to_original_fqns()
    own = {fqn: name for name, fqn in fqns.items()}
    loaded: dict[str, torch.Tensor] = {}
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        by_dtype.setdefault(t.dtype, []).append((name, t))
    names, derived = {}, {}
    for fqn, (file, shape, stride, offset) in json.loads(z.read(config)).items():
        if file not in loaded:
            loaded[file] = torch.load(io.BytesIO(z.read(f"{root}/data/weights/{file}")), weights_only=True)
        value = loaded[file].as_strided(shape, stride, offset)
        size = loaded[file].untyped_storage().nbytes()
        # a constant the model holds was saved with its whole storage; its own name, then the
        # same view, first
        candidates = sorted((c for c in by_dtype.get(value.dtype, ()) if c[1].untyped_storage().nbytes() == size),
                            key=lambda c: (c[0] != fqn.removeprefix("model."),
                                           (tuple(c[1].shape), c[1].stride(), c[1].storage_offset())
                                           != (tuple(shape), tuple(stride), offset)))
        owner = next((name for name, t in candidates if torch.equal(t.as_strided(shape, stride, offset), value)), None)
        constant = own[fqn]
        names[constant] = {"tensor": owner, "shape": list(shape), "stride": list(stride), "offset": offset}
        if owner is None:
            derived[constant] = loaded[file]
    if set(names) != set(fqns):
        raise RuntimeError(f"the archive's constants are not the compiled step's: {sorted(set(fqns) ^ set(names))}")
    names_path.write_text(json.dumps(names))
    if derived:
        torch.save(derived, derived_path)


class LoadedPackage:
    """A step's library loaded in place by torch's C++ runner, called with the step's flat
    tensors; returns the outputs as a list. Not through torch's Python loader
    (`aoti_load_package`), which imports inductor and dynamo (over a second of a start) only to
    compare the device the package was built for, which the compile key already pins. Its
    constants come from the .blob beside it, or are `tensors` (model_tensors of the model it was
    built from) as its .constants.json names them."""

    def __init__(self, path: Path, tensors: dict[str, torch.Tensor]):
        self.runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1)  # one model instance
        names, blob = path.with_suffix(".constants.json"), path.with_suffix(".blob")
        if blob.is_file():
            self.runner.update_constant_buffer_from_blob(str(blob))
        elif not names.is_file():
            if self.runner.get_constant_names_to_original_fqns():  # it would run on unset constants
                raise FileNotFoundError(f"{path.name}: its constants ({blob.name} or {names.name}) are missing")
        else:
            derived, listed = path.with_suffix(".pt"), json.loads(names.read_text())
            if any(v["tensor"] is None for v in listed.values()) and not derived.is_file():
                raise FileNotFoundError(f"{path.name}: its derived constants ({derived.name}) are missing")
            # the runner checks neither that every constant is given (a missing one would run on
            # unset memory) nor their kinds: the file must name exactly the library's constants
            if set(listed) != set(self.runner.get_constant_names_to_original_fqns()):
                raise RuntimeError(f"{path.name}: {names.name} does not name the library's constants")
            stored = torch.load(derived, mmap=True, weights_only=True) if derived.is_file() else {}
            # not copied; torch's runner holds its own reference to each for the rest of the process
            self.constants = {c: (tensors[v["tensor"]] if v["tensor"] else stored[c]).as_strided(
                v["shape"], v["stride"], v["offset"]) for c, v in listed.items()}
            self.runner.update_constant_buffer(self.constants, False, True, True)

    def __call__(self, *args: torch.Tensor) -> list[torch.Tensor]:
        return self.runner.run(list(args))


class PackagedStep:
    """The graphs, loaded from their packages (those still compiling added as they land)."""

    MAX_TOKENS = COMPILED_MAX_TOKENS

    def __init__(self, paths: dict[str, Path], kv_caches: list[tuple], model: nn.Module):
        self.graphs = {}
        self.tensors = model_tensors(model)
        for g, p in paths.items():
            self.add(g, p)
        self.kv = tuple(t for pair in kv_caches for t in pair)

    def add(self, graph: str, path: Path) -> None:
        self.graphs[graph] = LoadedPackage(path, self.tensors)

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
