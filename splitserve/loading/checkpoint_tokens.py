"""Token ids a model needs at build time from the tokenizer files beside its config.

A model is built from its config alone (in the engine core, and as a weightless copy on the front),
but Fuyu and Kosmos-2 need a few ids that only the tokenizer knows (row ends, image begin/end). The
config's `_name_or_path` is the checkpoint folder; its tokenizer.json (added tokens, then the model's
vocabulary) and tokenizer_config.json (named special tokens) answer without loading a tokenizer.
"""
from __future__ import annotations

import json
import os


def _read(directory: str, name: str) -> dict:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def checkpoint_token_id(config, token: str, default: int) -> int:
    """The id of `token` in the checkpoint's tokenizer.json; `default` (the released model's id)
    where the folder has no tokenizer or the tokenizer lacks the token."""
    tok = _read(getattr(config, "_name_or_path", "") or "", "tokenizer.json")
    for added in tok.get("added_tokens") or []:
        if added.get("content") == token:
            return int(added["id"])
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and token in vocab:
        return int(vocab[token])
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        for i, entry in enumerate(vocab):
            if entry and entry[0] == token:
                return i
    return default


def checkpoint_special_id(config, role: str, default: int) -> int:
    """The id of a named special token (`unk_token`, `bos_token`...) of the checkpoint's tokenizer."""
    cfg = _read(getattr(config, "_name_or_path", "") or "", "tokenizer_config.json")
    token = cfg.get(role)
    if isinstance(token, dict):
        token = token.get("content")
    return default if not isinstance(token, str) else checkpoint_token_id(config, token, default)
