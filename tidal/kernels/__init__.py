"""tidal's own CPU operators (C++ beside this file), built into one torch extension:
`torch.ops.tidal.qblock_linear` (layers/qblock.py) and `torch.ops.tidal.paged_attention`
(layers/attention.py).

They are compiled once per machine, torch release and source (seconds, with torch's extension
builder and ninja) into the cache; a machine that cannot build them (no compiler) keeps torch's
own kernels for both jobs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger("tidal.engine")

SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
NAME = "tidal_kernels"
_loaded: bool | None = None


def _flags() -> list[str]:
    """AVX2 code where torch itself dispatches to AVX2 or wider (so ATEN_CPU_CAPABILITY=avx2
    holds these kernels to AVX2 too); the portable path elsewhere."""
    isa = torch.backends.cpu.get_cpu_capability()
    vector = ["-mavx2", "-mfma", "-mf16c"] if isa.startswith(("AVX2", "AVX512")) else []
    return ["-O3", "-fopenmp", *vector]


def available() -> bool:
    """Whether the operators are loaded in this process."""
    return bool(_loaded)


def load(directory: Path) -> bool:
    """Build (once, into `directory`) and load the operators; False where they cannot be built here."""
    global _loaded
    if _loaded is not None:
        return _loaded
    flags = _flags()
    h = hashlib.sha256(repr((flags, torch.__version__)).encode())
    for source in SOURCES:
        h.update(source.read_bytes())
    build_dir = directory / f"tidal-{h.hexdigest()[:16]}"
    try:
        _build(build_dir, flags)
    except Exception as e:  # no compiler or ninja: torch's kernels serve
        log.warning("tidal's CPU kernels unavailable (they did not build), torch's serve: %s", e)
        _loaded = False
        return False

    @torch.library.register_fake("tidal::qblock_linear")
    def _(x, blocks, bits):
        return x.new_empty(x.shape[0], blocks.shape[0])

    @torch.library.register_fake("tidal::paged_attention")
    def _(q, k_cache, v_cache, kv_slots, mask, scale):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    _loaded = True
    return True


def _build(build_dir: Path, flags: list[str]) -> None:
    """Load the library built in `build_dir` (its name holds the sources' digest), building it
    first if it is not there; a built one loads without torch's extension builder (its import
    and its ninja check are time a warm start need not spend)."""
    library = build_dir / f"{NAME}.so"
    if library.is_file() and not (build_dir / "lock").exists():  # the builder's lock: no build under way
        torch.ops.load_library(str(library))
        return
    from torch.utils.cpp_extension import load as build

    if shutil.which("ninja") is None:  # the PyPI ninja's binary sits beside the interpreter's scripts
        try:
            import ninja
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    build_dir.mkdir(parents=True, exist_ok=True)
    build(name=NAME, sources=[str(s) for s in SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
          build_directory=str(build_dir), is_python_module=False, verbose=False)
