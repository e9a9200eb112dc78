"""Tokenizer wrapper: a `tokenizers` BPE plus the model's chat template (jinja2)."""

from __future__ import annotations

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers


class Tokenizer:
    """Encode, decode, and render chat messages with the model's own template."""

    def __init__(self, tokenizer: HFTokenizer, chat_template: str | None,
                 bos_token: str | None = None, eos_token: str | None = None, add_bos: bool = False):
        self._tok = tokenizer
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self._bos_id = tokenizer.token_to_id(bos_token) if add_bos and bos_token else None
        self._template = None
        if chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(chat_template)

    @classmethod
    def from_bpe(cls, tokens: list[str], merges: list[str], special_ids: list[int],
                 chat_template: str | None, bos_id: int | None, eos_id: int | None,
                 add_bos: bool = False) -> "Tokenizer":
        """A byte-level BPE tokenizer (GPT-2 style), as GGUF files of `tokenizer.ggml.model=gpt2` hold."""
        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special_ids])
        name = lambda i: tokens[i] if i is not None and 0 <= i < len(tokens) else None  # noqa: E731
        return cls(tok, chat_template, name(bos_id), name(eos_id), add_bos)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with BOS first when the model wants it (once: a chat template
        that already wrote it is not doubled)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self._bos_id is not None and ids[:1] != [self._bos_id]:
            ids.insert(0, self._bos_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_step(self, ids: list[int], prefix_offset: int, read_offset: int) -> tuple[str, int, int]:
        """Incremental detokenization: the text that ids[read_offset:] add, and the new offsets.

        Decodes a short window from `prefix_offset` both with and without the new tokens and
        returns the difference, so each step costs O(window), not O(output); text that ends in
        an incomplete UTF-8 character is held back until the next token completes it.
        """
        prefix = self.decode(ids[prefix_offset:read_offset])
        full = self.decode(ids[prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            return full[len(prefix):], read_offset, len(ids)
        return "", prefix_offset, read_offset

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("each message needs a string 'role' and a string 'content'")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"the chat template rejected these messages: {e}") from e


def _raise_template_error(message: str):
    raise jinja2.exceptions.TemplateError(message)
