"""The packed 4-bit path: Q4_1 codes, torch's CPU int4 kernel, and the bf16 default model; and
the oneDNN-packed dense bf16 weights."""

import pytest
import torch

from tidal.layers.linear import Int4Weight, Int8Weight, PackedWeight, linear
from tidal.models import loader


def test_int4_kernel_matches_dense_weights():
    g = torch.Generator().manual_seed(0)
    n, k = 96, 128
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.02
    minimum = -torch.rand(n, k // 32, generator=g) * 0.1
    dense = (codes.float().view(n, -1, 32) * scale[..., None] + minimum[..., None]).view(n, k)
    x = torch.randn(5, k, generator=g)
    w = Int4Weight.from_codes(codes, scale, minimum, torch.float32)
    torch.testing.assert_close(linear(x, dense, w), x @ dense.t(), atol=1e-4, rtol=1e-4)
    wb = Int4Weight.from_codes(codes, scale, minimum, torch.bfloat16)
    torch.testing.assert_close(wb(x.bfloat16()).float(), x @ dense.t(), atol=0.05, rtol=0.05)
    big = torch.randn(40, k, generator=g)  # above INT4_MAX_TOKENS: the dense weight is used
    torch.testing.assert_close(linear(big, dense, w), big @ dense.t())


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="needs a bf16 CPU")
def test_packed_dense_weight_gives_the_same_bits_as_f_linear():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(320, 192, generator=g) * 0.05).bfloat16()
    assert PackedWeight.supported(w) and not PackedWeight.supported(w.float())
    packed = PackedWeight(w)
    for rows in (1, 3, 40):
        x = torch.randn(rows, 192, generator=g).bfloat16()
        assert torch.equal(linear(x, w, packed=packed), torch.nn.functional.linear(x, w))


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="needs a bf16 CPU")
def test_the_default_engine_packs_its_dense_weights_and_the_heads():
    from tidal import LLM
    from tidal.config import CacheConfig, SpecConfig

    llm = LLM(spec=SpecConfig("eagle3", 2), enforce_eager=True, cache=CacheConfig(kv_cache_bytes=64 << 20))
    model, head = llm.engine.runner.model, llm.engine.drafter.head
    assert model.packed_head is not None and set(model.layers[0].packed) == set(model.layers[0].int4)
    assert set(head.packed) == {"fc", "lm_head"} and len(head.mid.packed) == 4
    assert set(head.int4) == {"fc", "lm_head"} and len(head.mid.int4) == 4  # the target is 4-bit: so is the head
    assert model.int8_head is not None  # the file's output head is Q8_0: read at 8 bits in one-token steps
    fp32 = LLM(dtype="float32", enforce_eager=True, cache=CacheConfig(kv_cache_bytes=64 << 20)).engine.runner.model
    assert not fp32.packed_head and fp32.int8_head is None


def test_int8_weight_stays_within_half_a_step_and_serves_one_row_only():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) * 0.05
    q = Int8Weight.quantize(w)
    back = q(torch.eye(96)).t()  # reads the rounded weight back, column by column
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((back - w).abs() <= step / 2 + 1e-6).all() and not torch.equal(back, w)
    x = torch.randn(2, 96, generator=g)
    assert torch.equal(linear(x[:1], w, int8=q), q(x[:1]))
    assert torch.equal(linear(x, w, int8=q), torch.nn.functional.linear(x, w))  # two rows: the dense weight


def test_rounding_a_dense_weight_to_int4_stays_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g) * 0.05
    assert Int4Weight.fits(w) and not Int4Weight.fits(w[:40]) and not Int4Weight.fits(w[:, :48])
    x = torch.eye(96)  # reads the rounded weight back, column by column
    back = Int4Weight.quantize(w, torch.float32)(x).t()
    groups = w.view(48, 3, 32)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(32, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-6).all() and not torch.equal(back, w)
    # bf16 step and offset: codes picked against those (against exact ones: 0.66 of a step off)
    far = w + 0.5
    q = Int4Weight.quantize(far, torch.bfloat16)
    back = Int4Weight(q.packed, q.scales_zeros.float())(x).t()  # the kernel's weight, read in fp32
    assert ((back - far).abs() <= step.bfloat16().float() / 2 + 1e-6).all()


def test_q4_codes_reproduce_gguf_dequantization():
    m = loader.load(None)
    assert len(m.int4_codes) == 4 * m.config.num_layers
    for name in ("layers.0.qkv_proj", "layers.17.gate_up_proj", "layers.29.down_proj"):
        codes, scale, minimum = m.int4_codes[name]
        n, k = codes.shape
        deq = (codes.float().view(n, -1, 32) * scale[..., None] + minimum[..., None]).view(n, k)
        assert torch.equal(deq, loader.dense(m, name))


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="needs a bf16 CPU")
def test_bf16_int4_default_agrees_with_transformers_fp32(hf_model):
    """Decode steps (few tokens) run the int4 kernel; the fp32 oracle scores what they chose."""
    from tidal import LLM, SamplingParams
    from tests.test_llama_vs_hf import PROMPTS, chat_ids

    llm = LLM(enforce_eager=True)  # the default: bf16 with packed 4-bit weights on this CPU
    assert llm.engine.dtype == torch.bfloat16 and llm.engine.runner.model.layers[0].int4
    prompts = [chat_ids(llm, t) for t in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    top1 = total = 0
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1:-1].float()
        chosen = torch.tensor(out.token_ids)
        gap = ref.max(-1).values - ref.gather(-1, chosen[:, None])[:, 0]
        assert gap.max().item() < 1.0  # never a token the oracle ranks far below its best
        top1 += (gap == 0).sum().item()
        total += len(chosen)
    assert top1 / total >= 0.9


def test_incremental_detokenization_matches_full_decode():
    tok = loader.load(None).tokenizer
    text = "Café naïve — 🌊 waves, 12345 and 日本語 text.\n\nDone!"
    ids = tok.encode(text)
    out, offsets = "", (0, 0)
    for n in range(1, len(ids) + 1):
        delta, *offsets = tok.decode_step(ids[:n], *offsets)
        assert "\ufffd" not in delta
        out += delta
    assert out == text == tok.decode(ids)
