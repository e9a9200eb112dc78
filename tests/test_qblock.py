"""Block-quantized weights (GGUF's Q4_1 and Q8_0 layouts) and tidal's kernel for them: the
blocks hold the file's weights exactly, the kernel multiplies by exactly those weights (its only
rounding is the activations', to 8 bits a block), inside a compiled step as in an eager one."""

import json

import pytest
import torch
import torch.nn.functional as F

from tidal.config import CacheConfig
from tidal.engine import compiled_step, profile_cache
from tidal.engine.compiled_step import LoadedPackage, StepGraph, compile_package, flat_args, model_tensors
from tidal.engine.model_runner import ModelRunner
from tidal.layers.linear import EVERY_STEP, linear
from tidal import kernels
from tidal.layers.qblock import QBlockWeight
from tests.conftest import make_tiny_llama
from tidal.models import loader


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if not kernels.load(profile_cache.cache_dir() / "kernels"):
        pytest.skip("the block kernel does not build here (no compiler or ninja)")


def q8_weight(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """A weight as GGUF's Q8_0 stores one: int8 codes (each block reaching 127) times an fp16 scale."""
    codes = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    codes[..., 0] = 127
    scale = (torch.rand(n, k // 32, 1, generator=g) * 1e-3).half().float()
    return (codes * scale).view(n, k)


def exact_rows(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Activations the kernel's 8-bit rounding keeps exactly: integers, each block reaching 127."""
    x = torch.randint(-127, 128, (m, k // 32, 32), generator=g).float()
    x[..., 5] = -127
    return x.view(m, k)


def test_q4_blocks_hold_the_files_codes_exactly():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (48, 96), generator=g)
    scale, minimum = torch.rand(48, 3, generator=g) * 0.01, -torch.rand(48, 3, generator=g) * 0.05
    w = QBlockWeight.from_q4_codes(codes, scale, minimum, max_rows=8)
    want = codes.view(48, 3, 32).float() * scale.half().float()[..., None] + minimum.half().float()[..., None]
    assert w.blocks.shape == (48, 3 * 20) and w.blocks.dtype == torch.uint8
    assert torch.equal(w.dequantize(), want.view(48, 96))


def test_a_q8_weight_comes_back_from_its_blocks_exactly():
    w = q8_weight(40, 64, torch.Generator().manual_seed(1))
    assert torch.equal(QBlockWeight.quantize_q8(w, max_rows=8).dequantize(), w)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 8, 11, 20])
def test_the_kernel_multiplies_by_the_blocks_weight(bits, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(72, 160, generator=g) * 0.05
    q = QBlockWeight.quantize_q4(w, 64) if bits == 4 else QBlockWeight.quantize_q8(w, 64)
    x = exact_rows(rows, 160, g)
    torch.testing.assert_close(q(x), x @ q.dequantize().t(), rtol=1e-5, atol=1e-4)
    y = torch.randn(rows, 160, generator=g)  # any activations: off by their 8-bit rounding only
    ref = y @ q.dequantize().t()
    assert ((q(y) - ref).norm() / ref.norm()).item() < 0.02


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [48, 131])
def test_from_many_rows_the_kernel_multiplies_the_activations_unrounded(bits, rows):
    """Many rows: the weight widened to fp32 a tile of columns at a time, then an fp32 GEMM (a
    column count no tile divides, and more columns than a tile holds)."""
    g = torch.Generator().manual_seed(rows + bits)
    w = torch.randn(1003, 96, generator=g) * 0.05
    q = QBlockWeight.quantize_q4(w, 4096) if bits == 4 else QBlockWeight.quantize_q8(w, 4096)
    x = torch.randn(rows, 96, generator=g)
    torch.testing.assert_close(q(x), x @ q.dequantize().t(), rtol=1e-5, atol=1e-5)


def test_linear_takes_the_blocks_up_to_their_rows_then_the_dense_weight():
    g = torch.Generator().manual_seed(2)
    w = q8_weight(64, 96, g)
    q = QBlockWeight.quantize_q8(w, max_rows=4)
    x = exact_rows(4, 96, g)
    torch.testing.assert_close(linear(x, w, qblock=q), x @ w.t(), rtol=1e-5, atol=1e-4)
    big = torch.randn(5, 96, generator=g)
    assert torch.equal(linear(big, w, qblock=q), F.linear(big, w))


def test_projections_the_blocks_serve_at_every_step_keep_no_dense_copy(tmp_path):
    """Blocks serving every step size replace the dense projection by a shape-only stand-in; a
    prefill-wide step (the kernel's GEMM path) gives the dense weight's output; a step that still
    reached the dropped weight would fail, not read zeros."""
    make_tiny_llama(tmp_path)
    model = loader.build_model(loader.load(str(tmp_path)), torch.device("cpu"), torch.float32)
    codes, dense = {}, {}
    for i, layer in enumerate(model.layers):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            q = QBlockWeight.quantize_q4(getattr(layer, name), 1)
            dense[i, name] = q.dequantize()  # the weight the file's blocks hold
            codes[f"layers.{i}.{name}"] = _codes_of(q)
    model.attach_qblock(codes, {tuple(w.shape): EVERY_STEP for w in dense.values()}, head=False)
    x = torch.randn(70, max(w.shape[1] for w in dense.values()))
    for (i, name), w in dense.items():
        param = getattr(model.layers[i], name)
        assert param.shape == w.shape and param.untyped_storage().nbytes() == 4
        torch.testing.assert_close(model.layers[i]._linear(name, x[:, :w.shape[1]]), F.linear(x[:, :w.shape[1]], w),
                                   rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="dropped"):
        linear(x, model.layers[0].qkv_proj)


def _codes_of(q: QBlockWeight):
    """(codes, scale, minimum) of a Q4_1 block weight, as the loader hands them to attach_qblock."""
    n, nb = q.blocks.shape[0], q.blocks.shape[1] // 20
    half = lambda i: q.blocks[:, 2 * nb * i:2 * nb * (i + 1)].contiguous().view(torch.float16).float()  # noqa: E731
    nibbles = q.blocks[:, 4 * nb:].reshape(n, nb, 16)
    return torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(n, -1), half(0), half(1)


def test_bad_shapes_get_a_clear_error():
    q = QBlockWeight.quantize_q4(torch.randn(16, 64), 8)
    with pytest.raises(RuntimeError, match="do not match"):
        q(torch.randn(2, 96))
    with pytest.raises(RuntimeError, match="bits must be 4"):
        torch.ops.tidal.qblock_linear(torch.randn(2, 64), q.blocks, 5)
    with pytest.raises(RuntimeError, match="float32"):
        q(torch.randn(2, 64, dtype=torch.float64))


def test_a_tied_q8_embedding_is_looked_up_in_the_head_blocks(tmp_path):
    make_tiny_llama(tmp_path, tie=True)
    model = loader.build_model(loader.load(str(tmp_path)), torch.device("cpu"), torch.float32)
    head_shape = {tuple(model.unembedding.shape): 64}
    model.attach_qblock({}, head_shape, head=True)
    assert model.qblock_embed is None  # random fp32 weights: the blocks round them
    model.embed.data = QBlockWeight.quantize_q8(model.embed, 64).dequantize()  # as a Q8_0 file stores it
    model.attach_qblock({}, head_shape, head=True)
    ids = torch.tensor([5, 0, 257, 5])
    assert model.qblock_embed is model.qblock_head
    assert torch.equal(model.qblock_embed.rows(ids), model.embed[ids])


@pytest.mark.parametrize("unheld", [(), ("cos",)])
def test_a_compiled_step_calls_the_kernel_and_matches_eager(tmp_path, monkeypatch, unheld):
    """The one-token graph over block weights (embedding lookup, projections, head), compiled to
    its package (library and the spec by which it calls the kernel), loaded in place: the eager
    step's logits. Its constants are the model's own tensors; one the model does not hold
    (`unheld`, as a constant inductor derived would be) is kept beside the library instead."""
    make_tiny_llama(tmp_path / "tied", tie=True)
    model = loader.build_model(loader.load(str(tmp_path / "tied")), torch.device("cpu"), torch.float32)
    for layer in model.layers:
        layer.qblock = {n: QBlockWeight.quantize_q4(getattr(layer, n), 64)
                        for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    model.embed.data = QBlockWeight.quantize_q8(model.embed, 64).dequantize()
    model.attach_qblock({}, {tuple(model.unembedding.shape): 64}, head=True)
    assert model.qblock_embed is not None
    runner = ModelRunner(model, CacheConfig(block_size=4, num_blocks=4), torch.device("cpu"), torch.float32)
    ids, positions, meta, rows = runner.example_steps()["one"]
    kv = tuple(torch.randn_like(t) for pair in runner.kv_caches for t in pair)
    args = flat_args(ids, positions, meta, torch.tensor(rows), kv)
    with torch.no_grad():
        want = StepGraph(model, ()).eval()(*args)[0]
    path = tmp_path / "step-one.so"
    tensors = model_tensors(model)
    monkeypatch.setattr(compiled_step, "model_tensors", lambda m: {k: v for k, v in tensors.items() if k not in unheld})
    compile_package(StepGraph(model, ()).eval(), args, "one", path)
    assert path.with_suffix(".json").is_file()
    graph = LoadedPackage(path, tensors)
    torch.testing.assert_close(graph(*args)[0], want, rtol=1e-4, atol=1e-4)
    # no dense weight multiplied: the library holds no weights, its constants are the model's own
    # tensors (blocks, norms, rotary tables), but for those kept beside it
    storages = {tensors[k].untyped_storage().data_ptr() for k in tensors.keys() - set(unheld)}
    shared = [c for c, t in graph.constants.items() if t.untyped_storage().data_ptr() in storages]
    assert path.with_suffix(".constants.json").is_file() and path.with_suffix(".pt").exists() == bool(unheld)
    assert len(graph.constants) - len(shared) == len(unheld) and len(shared) > 10
    # a package whose constants file is incomplete, or whose derived constants are gone, does not load
    names = path.with_suffix(".constants.json")
    listed = json.loads(names.read_text())
    one = next(c for c, v in listed.items() if v["tensor"] is not None)
    names.write_text(json.dumps({c: v for c, v in listed.items() if c != one}))
    with pytest.raises(RuntimeError, match="does not name the library's constants"):
        LoadedPackage(path, tensors)
    if unheld:
        names.write_text(json.dumps(listed))
        path.with_suffix(".pt").unlink()
        with pytest.raises(FileNotFoundError, match="derived constants"):
            LoadedPackage(path, tensors)


def test_the_loader_reads_q8_0_as_gguf_dequantizes_it():
    import gguf
    import numpy as np

    from tidal.models.gguf_file import GGUFFile

    head = GGUFFile(loader.default_model_path()).tensors["token_embd.weight"]
    assert head.tensor_type == gguf.GGMLQuantizationType.Q8_0
    want = np.asarray(gguf.quants.dequantize(head.data, head.tensor_type), dtype=np.float32)
    assert np.array_equal(loader._widen_q8_0(*loader._q8_0(head)), want.reshape(-1, want.shape[-1]))


def test_the_head_blocks_taken_from_the_file_are_those_rounding_its_dense_head_gives():
    """The bundled Q8_0 head's blocks are read as the file stores them (no second rounding at
    every start); they are byte for byte what rounding the dequantized head to Q8_0 gives, and
    the tied embedding is looked up in them."""
    loaded = loader.load(None)
    assert loaded.head_q8 is not None
    dense = loaded.weights["embed"]
    assert torch.equal(QBlockWeight.from_q8_0(*loaded.head_q8, 1).blocks, QBlockWeight.quantize_q8(dense, 1).blocks)
    model = loader.build_model(loaded, torch.device("cpu"), torch.float32)
    model.attach_qblock({}, {tuple(dense.shape): 64}, head=True, head_q8=loaded.head_q8)
    assert model.qblock_embed is model.qblock_head and torch.equal(model.qblock_head.dequantize(), model.embed)


def test_the_loader_reads_q4_1_as_gguf_dequantizes_it():
    import gguf
    import numpy as np

    from tidal.models.gguf_file import GGUFFile

    tensors = GGUFFile(loader.default_model_path()).tensors
    loaded = loader.load(None)
    for ours, theirs in (("layers.0.o_proj", "blk.0.attn_output.weight"), ("layers.29.down_proj", "blk.29.ffn_down.weight")):
        t = tensors[theirs]
        assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1
        want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        assert np.array_equal(loader.dense(loaded, ours).numpy(), want.reshape(-1, want.shape[-1]))
