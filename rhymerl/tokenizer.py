"""Tokenizers: HF ``AutoTokenizer`` for real checkpoints, a small character tokenizer for ours.

Every checkpoint rhymerl writes carries a ``tokenizer.json`` that ``AutoTokenizer`` loads,
so our tiny models are ordinary Hugging Face folders.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<s>", "</s>"


def build_char_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """One token per character of ``alphabet`` plus pad/bos/eos (ids 0, 1, 2)."""
    chars = sorted(set(alphabet))
    vocab = {PAD: 0, BOS: 1, EOS: 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([PAD, BOS, EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS)


# Tokenizer classes that are the ``tokenizer.json`` alone (what rhymerl's own checkpoints name).
_PLAIN_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in a model folder. A folder whose ``tokenizer_config.json`` names the
    plain fast tokenizer (every checkpoint rhymerl writes) is loaded as that class directly:
    ``AutoTokenizer`` would first read the model config, which imports transformers' model
    stack (1.5 s of every process's start); any other folder goes through ``AutoTokenizer``."""
    folder = Path(path)
    try:
        declared = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        declared = None
    if declared in _PLAIN_CLASSES and (folder / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(str(folder))


def tokenizer_fingerprint(tok: PreTrainedTokenizerBase) -> str:
    """A short hash of the vocabulary: history and checkpoints from another tokenizer are refused."""
    items = sorted(tok.get_vocab().items())
    return hashlib.sha256(repr(items).encode()).hexdigest()[:16]


def encode_prompt(tok: PreTrainedTokenizerBase, prompt: str | list[dict[str, Any]]) -> list[int]:
    """Token ids of a prompt: plain text as is, chat messages through the chat template."""
    if isinstance(prompt, str):
        return list(tok.encode(prompt, add_special_tokens=False))
    if getattr(tok, "chat_template", None) is None:
        raise ValueError("prompt is a list of chat messages but the tokenizer has no chat_template")
    ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def eos_ids(tok: PreTrainedTokenizerBase) -> list[int]:
    ids = tok.eos_token_id
    if ids is None:
        return []
    return list(ids) if isinstance(ids, (list, tuple)) else [int(ids)]
