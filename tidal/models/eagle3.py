"""The EAGLE-3 draft head (Li et al., 2025), loadable from public EAGLE-3 checkpoints.

One decoder layer whose attention reads [norm(embedding of token t+1), norm(feature at t)],
where the feature at t is `fc` of three target hidden states (low, mid, high layers) for the
first draft step and the head's own pre-norm output for the steps after it. It predicts over a
reduced draft vocabulary; `d2t[i]` maps draft id i to target id i + d2t[i].

Checkpoint layout (what vLLM and SGLang load): config.json with architectures
["LlamaForCausalLMEagle3"], draft_vocab_size, optional target_hidden_size and
eagle_config.eagle_aux_hidden_state_layer_ids; tensors fc.weight, midlayer.input_layernorm,
midlayer.hidden_norm, midlayer.self_attn.{q,k,v,o}_proj, midlayer.post_attention_layernorm,
midlayer.mlp.{gate,up,down}_proj, norm.weight, lm_head.weight, d2t, t2d (and sometimes
embed_tokens.weight; otherwise the target's embedding is shared).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tidal.config import ModelConfig
from tidal.layers.attention import AttentionMetadata, write_kv
from tidal.layers.linear import EVERY_STEP, Int4Weight, PackedWeight, drop_dense, int4_copies, linear, packed_copies
from tidal.layers.norm import rms_norm
from tidal.layers.qblock import QBlockWeight
from tidal.layers.rotary import rope_cache
from tidal.models.llama import PROJECTIONS, DecoderLayer

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the head's own layer shape (its vocab_size is the target's)
    draft_vocab_size: int
    target_hidden_size: int
    # target layers whose *input* residual stream is fed to fc (vLLM's and SGLang's convention)
    aux_layer_ids: tuple[int, int, int]

    @staticmethod
    def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
        return (2, num_target_layers // 2, num_target_layers - 3)

    def to_json(self) -> dict:
        c = self.layer
        return {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
                "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
                "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
                "max_position_embeddings": c.max_model_len, "vocab_size": c.vocab_size,
                "draft_vocab_size": self.draft_vocab_size, "target_hidden_size": self.target_hidden_size,
                "tie_word_embeddings": False,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)}}

    @classmethod
    def from_json(cls, d: dict, target: ModelConfig) -> "Eagle3Config":
        if ARCHITECTURE not in d.get("architectures", []):
            raise ValueError(f"not an EAGLE-3 head: architectures {d.get('architectures')!r}")
        if d.get("num_hidden_layers", 1) != 1:
            raise ValueError("only single-layer EAGLE-3 heads are supported")
        heads = d["num_attention_heads"]
        layer = ModelConfig(
            vocab_size=d.get("vocab_size", target.vocab_size), hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_layers=1, num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads", heads), head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rope_theta=float(d.get("rope_theta", target.rope_theta)), rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            max_model_len=max(d.get("max_position_embeddings", 0), target.max_model_len))
        if layer.vocab_size != target.vocab_size:
            raise ValueError(f"head vocab {layer.vocab_size} != target vocab {target.vocab_size}")
        ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        ids = tuple(ids) if ids else cls.default_aux_layers(target.num_layers)
        if len(ids) != 3 or list(ids) != sorted(set(ids)) or not all(1 <= i < target.num_layers for i in ids):
            raise ValueError(f"aux layer ids {ids!r} must be three increasing target layers in 1..{target.num_layers - 1}")
        return cls(layer, d.get("draft_vocab_size") or layer.vocab_size,
                   d.get("target_hidden_size") or target.hidden_size, ids)

    @property
    def target_output_layers(self) -> tuple[int, ...]:
        """The same features as outputs of our layers: the input of layer i is layer i-1's output."""
        return tuple(i - 1 for i in self.aux_layer_ids)


class Eagle3Head(nn.Module):
    """The draft head. `embed` is the target's token embedding unless the checkpoint has one."""

    def __init__(self, cfg: Eagle3Config, embed: torch.Tensor):
        super().__init__()
        c = cfg.layer
        self.cfg = cfg
        self.fc = nn.Parameter(torch.empty(c.hidden_size, 3 * cfg.target_hidden_size))
        self.mid = DecoderLayer(c, attn_input_size=2 * c.hidden_size)
        self.hidden_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.norm = nn.Parameter(torch.ones(c.hidden_size))
        self.lm_head = nn.Parameter(torch.empty(cfg.draft_vocab_size, c.hidden_size))
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.embed = embed.detach()  # a plain tensor: shared with the target, not a parameter here
        self.packed: dict[str, PackedWeight] = {}  # oneDNN-packed fc and lm_head (CPU bf16 inference)
        self.int4: dict[str, Int4Weight] = {}  # 4-bit fc and lm_head for small steps (see pack)
        self.qblock: dict[str, QBlockWeight] = {}  # 8-bit block fc and lm_head (CPU fp32, see pack)
        cos, sin = rope_cache(c.head_dim, c.max_model_len, c.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def pack(self, int4: bool = False, blocks: bool = False) -> None:
        """Inference copies of the weights (they do not follow the parameters): oneDNN-packed
        dense ones on CPU bf16 (see PackedWeight), and with `int4` also 4-bit ones for steps of
        up to INT4_MAX_TOKENS rows, as the target's; with `blocks` (CPU fp32, where the target's
        weights are blocks under tidal's kernel) every weight rounded to 8-bit blocks at every
        step size, the dense ones dropped. A draft step at one request reads all of the
        head's weights for one row, so it costs what reading them does; rounding only changes
        what the head proposes (verification keeps the output exact)."""
        self.mid.pack_dense()
        names = ("fc", "lm_head")
        self.packed = packed_copies(self, names)
        int4 = int4 and self.fc.device.type == "cpu"  # torch's int4 kernel used here is CPU-only
        self.int4 = int4_copies(self, names) if int4 else {}
        self.mid.int4 = int4_copies(self.mid, PROJECTIONS) if int4 else {}
        if blocks:
            self.qblock = _block_copies(self, names)
            self.mid.qblock = _block_copies(self.mid, PROJECTIONS)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[T, 3 x target hidden] target features -> [T, hidden] head input."""
        return linear(aux, self.fc, self.int4.get("fc"), self.packed.get("fc"), qblock=self.qblock.get("fc"))

    @torch.inference_mode()
    def forward(self, input_ids, features, positions, kv_cache: tuple, meta: AttentionMetadata):
        """features [T, hidden] (fused target features, or the head's previous output).
        Returns draft-vocab logits (float32) and the pre-norm output for the next step."""
        out = self.mid.block(features, self.inputs(input_ids, features), self.cos[positions],
                             self.sin[positions], *kv_cache, meta)
        return self.logits(out), out

    @torch.inference_mode()
    def write_kv(self, input_ids, features, positions, kv_cache: tuple, slot_mapping: torch.Tensor) -> None:
        """Only the K/V of positions whose outputs nothing reads (a catch-up's all-but-last): a
        one-layer head's K/V at a position depend on that position's input alone."""
        _, k, v = self.mid.qkv(self.inputs(input_ids, features), self.cos[positions], self.sin[positions])
        write_kv(k, v, *kv_cache, slot_mapping)

    def inputs(self, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The attention input [T, 2 x hidden]: [norm(embedding of token), norm(feature)]."""
        eps = self.cfg.layer.rms_norm_eps
        emb = F.embedding(input_ids, self.embed).to(features.dtype)
        return torch.cat([rms_norm(emb, self.mid.input_norm, eps), rms_norm(features, self.hidden_norm, eps)], dim=-1)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits (float32) of the head's pre-norm output."""
        x = rms_norm(out, self.norm, self.cfg.layer.rms_norm_eps)
        return linear(x, self.lm_head, self.int4.get("lm_head"), self.packed.get("lm_head"),
                      qblock=self.qblock.get("lm_head")).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def _block_copies(owner: nn.Module, names) -> dict[str, QBlockWeight]:
    """8-bit block copies of `owner`'s weights `names` (those the kernel takes), serving every
    step size; each dense weight copied is replaced by a shape-only stand-in."""
    copies = {}
    for name in names:
        if QBlockWeight.supported(weight := getattr(owner, name)):
            copies[name] = QBlockWeight.quantize_q8(weight, EVERY_STEP)
            drop_dense(owner, name)
    return copies


# ---------------------------------------------------------------- checkpoints

_NAMES = {  # public checkpoint name -> ours (q/k/v and gate/up are fused on load)
    "fc.weight": "fc", "midlayer.input_layernorm.weight": "mid.input_norm",
    "midlayer.hidden_norm.weight": "hidden_norm", "midlayer.self_attn.o_proj.weight": "mid.o_proj",
    "midlayer.post_attention_layernorm.weight": "mid.post_norm",
    "midlayer.mlp.down_proj.weight": "mid.down_proj", "norm.weight": "norm", "lm_head.weight": "lm_head",
}


def load_eagle3(path: str | Path, target: ModelConfig, target_embed: torch.Tensor) -> Eagle3Head:
    """Load an EAGLE-3 head directory (config.json + *.safetensors) for `target`."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json for the EAGLE-3 head")
    cfg = Eagle3Config.from_json(json.loads((path / "config.json").read_text()), target)
    raw = {}
    for f in sorted(path.glob("*.safetensors")):
        raw.update({k.removeprefix("model."): v for k, v in load_file(str(f)).items()})
    if not raw:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    a, m = "midlayer.self_attn.", "midlayer.mlp."
    state = {ours: raw[name].float() for name, ours in _NAMES.items()}
    state["mid.qkv_proj"] = torch.cat([raw[a + "q_proj.weight"], raw[a + "k_proj.weight"], raw[a + "v_proj.weight"]]).float()
    state["mid.gate_up_proj"] = torch.cat([raw[m + "gate_proj.weight"], raw[m + "up_proj.weight"]]).float()
    state["d2t"] = raw["d2t"].long() if "d2t" in raw else torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    embed = raw["embed_tokens.weight"].to(target_embed) if "embed_tokens.weight" in raw else target_embed
    head = Eagle3Head(cfg, embed)
    head.load_state_dict(state, strict=True)
    return head


def save_eagle3(head: Eagle3Head, path: str | Path, dtype: torch.dtype = torch.float16) -> None:
    """Write `head` in the public layout (what vLLM and SGLang load), weights in `dtype`."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    s = {k: v.detach() for k, v in head.state_dict().items()}
    c = head.cfg.layer
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out = {name: s[ours].to(dtype) for name, ours in _NAMES.items()}
    wq, wk, wv = s["mid.qkv_proj"].split([q, kv, kv])
    gate, up = s["mid.gate_up_proj"].chunk(2)
    a, m = "midlayer.self_attn.", "midlayer.mlp."
    out.update({a + "q_proj.weight": wq.to(dtype), a + "k_proj.weight": wk.to(dtype), a + "v_proj.weight": wv.to(dtype),
                m + "gate_proj.weight": gate.to(dtype), m + "up_proj.weight": up.to(dtype)})
    out["d2t"] = s["d2t"].clone()
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[torch.arange(head.cfg.draft_vocab_size) + s["d2t"]] = True
    out["t2d"] = t2d
    save_file({k: v.contiguous() for k, v in out.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(head.cfg.to_json(), indent=2))
