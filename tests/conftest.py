"""Shared fixtures: the bundled model (ours and transformers'), and tiny random HF models."""

from __future__ import annotations

import json

import pytest
import torch

from tidal.models.loader import default_model_path


@pytest.fixture(scope="session", autouse=True)
def private_cache_dir(tmp_path_factory):
    """Tests never read a start-up profile the user stored, nor leave one of theirs behind."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("tidal-cache")
        mp.setenv("TIDAL_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="session", autouse=True)
def dense_weights_unless_forced():
    """Engines built in this process keep their dense weights: tests that compare two engines'
    greedy tokens (eager and compiled, speculation on and off, alone and batched) need one set of
    numerics, and which layouts win is timed per machine. tests/test_layouts.py,
    tests/test_qblock.py and the layouts' oracle tests force a layout themselves (by replacing
    choose_layouts). A choice cached by a subprocess (`tidal generate` in test_cli.py times the
    layouts for real) is not read either."""
    from tidal.engine import llm_engine

    def dense(shapes, block_bits, edges):
        return {"fp16": {}, "qblock": {}}

    measured = llm_engine.weight_layouts

    def dense_unless_forced(*args, **kwargs):
        return {} if llm_engine.choose_layouts is dense else measured(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llm_engine, "choose_layouts", dense)
        mp.setattr(llm_engine, "weight_layouts", dense_unless_forced)
        yield


@pytest.fixture(scope="session")
def llm():
    from tidal import LLM

    # the oracle comparisons are made in fp32 on the dense weights (the fp16 layout is lossy:
    # tests/test_llama_vs_hf.py bounds it apart)
    return LLM(dtype="float32", enforce_eager=True, weight_layouts="dense")


@pytest.fixture(scope="session")
def hf_model():
    """transformers' own loading of the same GGUF file: the correctness oracle."""
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def make_tiny_llama(path, *, tie=False, seed=0, layers=2, vocab=258):
    """A random Llama in HF layout (config.json, model.safetensors, tokenizer.json)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import pre_tokenizers

    from tidal.tokenizer import Tokenizer

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=tie, bos_token_id=256, eos_token_id=257)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(str(path))
    tokens = ["<s>", "</s>"]
    byte_tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer.from_bpe(byte_tokens + tokens, [], [256, 257], None, 256, 257)
    tok._tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(path)
    return path
