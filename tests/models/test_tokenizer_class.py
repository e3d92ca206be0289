"""The direct tokenizer class against AutoTokenizer on the same files: where the loader skips
AutoTokenizer (generic tokenizer.json classes), both must give the same tokenizer; everywhere else
the loader must leave the choice to AutoTokenizer."""
from __future__ import annotations

import json

import pytest

from splitserve.loading.resolve import ModelSource, load_tokenizer, named_tokenizer_class

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n", "naïve café — 東京 🚀", "<|im_start|>user<|im_end|>", ""]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def saved_tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    load_tokenizer(None).save_pretrained(directory)
    return directory


def _variant(tmp_path, saved, tokenizer_class: str | None, model_type: str | None, **extra) -> str:
    for f in saved.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if tokenizer_class is None:
        cfg.pop("tokenizer_class", None)
    else:
        cfg["tokenizer_class"] = tokenizer_class
    cfg.update(extra)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    if model_type is not None:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 64,
                                                          "num_attention_heads": 4, "num_hidden_layers": 1}))
    return str(tmp_path)


def _behaviour(tok) -> dict:
    return {
        "class": type(tok),
        "encode": [tok.encode(t, add_special_tokens=True) for t in TEXTS],
        "encode_plain": [tok.encode(t, add_special_tokens=False) for t in TEXTS],
        "decode": tok.decode(tok.encode(TEXTS[2] + TEXTS[3], add_special_tokens=False), skip_special_tokens=True),
        "specials": (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id, len(tok)),
        "chat": tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
    }


@pytest.mark.parametrize("tokenizer_class,model_type", [("TokenizersBackend", None), ("PreTrainedTokenizerFast", None),
                                                         ("PreTrainedTokenizerFast", "llama")])
def test_direct_class_gives_what_autotokenizer_gives(saved_tokenizer, tmp_path, tokenizer_class, model_type):
    from transformers import AutoTokenizer
    directory = _variant(tmp_path, saved_tokenizer, tokenizer_class, model_type)
    cls = named_tokenizer_class(directory)
    assert cls is not None
    assert _behaviour(cls.from_pretrained(directory)) == _behaviour(AutoTokenizer.from_pretrained(directory))
    assert _behaviour(load_tokenizer(ModelSource("tok", directory))) == _behaviour(AutoTokenizer.from_pretrained(directory))


@pytest.mark.parametrize("case", ["specialised class", "no class", "remote code", "qwen2", "mistral", "llava", "no tokenizer.json",
                                  "broken config.json"])
def test_everything_else_goes_through_autotokenizer(saved_tokenizer, tmp_path, case):
    args = {"specialised class": ("LlamaTokenizer", None), "no class": (None, None), "mistral": ("TokenizersBackend", "mistral"),
            "qwen2": ("TokenizersBackend", "qwen2"),  # AutoTokenizer gives Qwen2Tokenizer there
            "llava": ("PreTrainedTokenizerFast", "llava")}.get(case, ("TokenizersBackend", None))
    extra = {"auto_map": {"AutoTokenizer": [None, "tok.MyTokenizer"]}} if case == "remote code" else {}
    directory = _variant(tmp_path, saved_tokenizer, *args, **extra)
    if case == "no tokenizer.json":
        (tmp_path / "tokenizer.json").unlink()
    if case == "broken config.json":
        (tmp_path / "config.json").write_text("{oops")
    assert named_tokenizer_class(directory) is None
