"""encode_text (splitserve/tokenize_parallel.py) must give exactly tokenizer.encode's ids.

The reference is the Hugging Face tokenizer's own encode of the whole text. The piece sizes are
shrunk (MIN_PIECE_CHARS, MIN_PARALLEL_CHARS, the CPU count) so that short random texts get many cuts:
every cut is a chance to disagree."""
import random
import re
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from splitserve import tokenize_parallel as tp
from splitserve.loading.resolve import load_tokenizer

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
REPO = Path(__file__).resolve().parents[2]
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]

# Bits random texts are made of: words, runs of spaces, newlines and tabs, digits, punctuation,
# contractions, non-ASCII letters and marks, emoji, and text that touches special tokens.
WORDS = ["the", "The", "quick", "brown", "fox", "jumps", "über", "naïve", "façade", "Ωmega", "привет", "мир",
         "日本語", "テキスト", "한국어", "e\u0301", "ﬁne", "x²", "IV", "Ⅻ", "don't", "we'll", "I'M", "it's", "_id",
         "snake_case", "camelCase", "a", "I", "ß", "ǅ"]
SEPARATORS = [" ", " ", " ", "  ", "   ", "\n", "\n\n", " \n", "\t", " \t ", "\r\n", "\u00a0", "\u3000", "\u2009",
              ", ", ". ", "! ", "? ", " - ", "...", " (", ") ", " \"", "\" ", " '", "' ", "  \n  "]
OTHER = ["123", "4567890", "3.14", "1,000", "😀", "👍🏽", "🇫🇷", "$", "%", "#!", "->", "==", "{}", "[0]", "\x1c",
         "\u200b", "\ufeff", "\u180e"]


def random_text(rng: random.Random, n_bits: int, specials: list[str]) -> str:
    out = []
    if rng.random() < 0.3:
        out.append(rng.choice([" ", "  ", "\n", "\t"]))  # leading whitespace
    for _ in range(n_bits):
        r = rng.random()
        if r < 0.55:
            out.append(rng.choice(WORDS))
        elif r < 0.9:
            out.append(rng.choice(SEPARATORS))
        elif r < 0.98 or not specials:
            out.append(rng.choice(OTHER))
        else:
            out.append(rng.choice(["", " ", "\n"]) + rng.choice(specials) + rng.choice(["", " ", "\n"]))
        if rng.random() < 0.5:
            out.append(" ")
    if rng.random() < 0.3:
        out.append(rng.choice([" ", "  ", "\n", " \n"]))  # trailing whitespace
    return "".join(out)


@pytest.fixture
def many_cuts(monkeypatch):
    """Cut texts of a few hundred characters into pieces of ~10."""
    monkeypatch.setattr(tp, "MIN_PARALLEL_CHARS", 20)
    monkeypatch.setattr(tp, "MIN_PIECE_CHARS", 8)
    monkeypatch.setattr(tp, "_cpus", lambda: 64)


def _train(pre_tokenizer, normalizer=None, post_processor=None) -> PreTrainedTokenizerFast:
    """A small byte-level BPE trained on local text, wrapped as transformers wraps tokenizer.json."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    corpus = [(REPO / "DESIGN.md").read_text(encoding="utf-8")]
    corpus += [p.read_text(encoding="utf-8") for p in sorted((REPO / "splitserve" / "engine").glob("*.py"))[:10]]
    corpus += [" ".join(WORDS + OTHER) * 20]
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.decoder = None
    if post_processor is not None:
        tok.post_processor = post_processor
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _llama3_pre(regex: str = LLAMA3_REGEX):
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _bos_template():
    bos = SPECIALS[0]
    return processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, 0)])


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def llama3_like():
    return _train(_llama3_pre(), post_processor=_bos_template())


@pytest.fixture(scope="module")
def qwen2_like():
    return _train(_llama3_pre(QWEN2_REGEX), normalizer=normalizers.NFC())


def _check_exact(tokenizer, n_texts: int, seed: int):
    plan = tp._plan(tokenizer)
    assert plan.safe
    specials = [t for t in tokenizer.get_added_vocab()]
    rng = random.Random(seed)
    cut_any = 0
    for i in range(n_texts):
        text = random_text(rng, rng.randint(20, 200), specials)
        for add in (True, False):
            want = list(tokenizer.encode(text, add_special_tokens=add))
            got = tp.encode_text(tokenizer, text, add_special_tokens=add)
            assert got == want, (i, add, text)
        cut_any += bool(tp.cut_points(text, 64, plan))
    assert cut_any > n_texts * 0.8  # the texts really were cut


def test_exact_smollm2(smollm2, many_cuts):
    _check_exact(smollm2, 600, seed=0)


def test_exact_llama3_style(llama3_like, many_cuts):
    assert llama3_like.encode("hi", add_special_tokens=True)[0] == 0  # the BOS the template adds
    _check_exact(llama3_like, 600, seed=1)


@pytest.mark.parametrize("regex", sorted(tp._SPLIT_REGEXES))
def test_exact_every_accepted_split_regex(regex, many_cuts):
    _check_exact(_train(_llama3_pre(regex), post_processor=_bos_template()), 100, seed=len(regex))


def test_exact_digits_then_gpt2(many_cuts):
    pre = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    _check_exact(_train(pre), 100, seed=11)


def test_exact_qwen2_style_nfc(qwen2_like, many_cuts):
    _check_exact(qwen2_like, 200, seed=2)
    decomposed = "cafe\u0301 " * 300  # not NFC: falls back, still exact
    assert tp._encode_in_pieces(qwen2_like, decomposed, True, 4) is None
    assert tp.encode_text(qwen2_like, decomposed) == list(qwen2_like.encode(decomposed))


def test_merge_and_post_process_path(llama3_like, many_cuts, monkeypatch):
    """With the fixed-frame shortcut off, Encoding.merge + post_process give the same ids."""
    plan = tp._plan(llama3_like)
    monkeypatch.setattr(plan, "frame", {})
    _check_exact(llama3_like, 50, seed=3)


def test_chat_template_text_keeps_special_tokens(smollm2, many_cuts):
    text = "".join(f"<|im_start|>user\nTell me about the {w} fox and the lazy dog, please.<|im_end|>\n"
                   "<|im_start|>assistant\nThe quick brown fox jumps over it.<|im_end|>\n" for w in WORDS)
    assert tp.cut_points(text, 64, tp._plan(smollm2))
    want = list(smollm2.encode(text, add_special_tokens=False))
    assert tp.encode_text(smollm2, text, add_special_tokens=False) == want


def test_no_cut_next_to_added_token(smollm2, many_cuts):
    plan = tp._plan(smollm2)
    text = "word<|im_end|> next word <|im_start|>x"
    for p in tp.cut_points(text, 64, plan):
        assert text[p - 1] != ">" and not text.startswith("<|", p + 1)


def _loose(text, p):
    return 0 < p < len(text) - 1 and text[p] == " "  # any space, even inside a run of them


def test_loosened_cut_rule_is_caught(smollm2, many_cuts, monkeypatch):
    """The exactness check has teeth: cutting before any space (inside runs of spaces) disagrees."""
    monkeypatch.setattr(tp, "_is_cut", _loose)
    monkeypatch.setattr(tp, "_CANDIDATES", re.compile(" "))
    rng = random.Random(4)
    wrong = 0
    for _ in range(100):
        text = random_text(rng, 100, [])
        wrong += tp.encode_text(smollm2, text) != list(smollm2.encode(text))
    assert wrong > 0


def test_real_text_from_the_repo(llama3_like, smollm2, monkeypatch):
    """Default sizes (pieces of >= MIN_PIECE_CHARS), a long real text: several cuts, same ids."""
    monkeypatch.setattr(tp, "_cpus", lambda: 8)
    text = (REPO / "DESIGN.md").read_text(encoding="utf-8")[:40_000]
    for tok in (smollm2, llama3_like):
        assert len(tp.cut_points(text, 8, tp._plan(tok))) >= 4
        assert tp.encode_text(tok, text) == list(tok.encode(text, add_special_tokens=True))


def test_refused_tokenizers_fall_back(many_cuts):
    text = "The quick brown fox jumps over the lazy dog. " * 20
    metaspace = Tokenizer(models.BPE())
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    metaspace.train_from_iterator([text * 5], trainers.BpeTrainer(vocab_size=300, show_progress=False))
    nfkc = _train(_llama3_pre(), normalizer=normalizers.NFKC())
    prefix = _train(pre_tokenizers.ByteLevel(add_prefix_space=True))
    other_regex = _train(_llama3_pre(r"\S+|\s+"))
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.train_from_iterator([text * 5], trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]"],
                                                                        show_progress=False))
    for tok in (metaspace, wordpiece):
        tok = PreTrainedTokenizerFast(tokenizer_object=tok)
        assert not tp._plan(tok).safe
        assert tp.encode_text(tok, text) == list(tok.encode(text))
    for tok in (nfkc, prefix, other_regex):
        assert not tp._plan(tok).safe
        assert tp.encode_text(tok, text) == list(tok.encode(text))


def test_truncation_or_split_special_tokens_fall_back(smollm2, many_cuts, monkeypatch):
    text = "The quick brown fox <|im_end|> jumps over the lazy dog. " * 20
    with monkeypatch.context() as m:
        m.setattr(smollm2, "split_special_tokens", True)
        assert tp._encode_in_pieces(smollm2, text, True, 4) is None
        assert tp.encode_text(smollm2, text) == list(smollm2.encode(text))
    # encode left split_special_tokens on the backend: the next plain encode puts it back, until then
    # encode_text falls back rather than encode with it.
    assert tp._encode_in_pieces(smollm2, text, True, 4) is None
    assert tp.encode_text(smollm2, text) == list(smollm2.encode(text))
    assert tp._encode_in_pieces(smollm2, text, True, 4) == list(smollm2.encode(text))


def test_texts_without_cuts(smollm2, monkeypatch):
    """No " word" spaces (numbers between spaces, no spaces at all): no cuts, plain encode."""
    monkeypatch.setattr(tp, "_cpus", lambda: 8)
    for text in (" ".join(str(i) for i in range(20_000)), "日本語のテキスト" * 2000, "a" + " " * 5000 + "b"):
        assert tp.cut_points(text, 8, tp._plan(smollm2)) == []
        assert tp.encode_text(smollm2, text) == list(smollm2.encode(text))


def test_parallelism_off_falls_back(smollm2, many_cuts, monkeypatch):
    text = "The quick brown fox jumps over the lazy dog. " * 20
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    assert tp._encode_in_pieces(smollm2, text, True, 4) is None
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    assert tp._encode_in_pieces(smollm2, text, True, 4) == list(smollm2.encode(text))


def test_short_text_takes_plain_encode(smollm2, monkeypatch):
    calls = []
    monkeypatch.setattr(tp, "_encode_in_pieces", lambda *a: calls.append(a))
    monkeypatch.setattr(tp, "_cpus", lambda: 8)
    tp.encode_text(smollm2, "word " * 100)  # 500 characters
    assert not calls
    tp.encode_text(smollm2, "word " * 1000)  # 5,000: two or more pieces
    assert calls and calls[0][3] >= 2


@pytest.fixture(scope="module")
def with_added_tokens():
    from tokenizers import AddedToken
    tok = _train(_llama3_pre(), post_processor=_bos_template())
    tok.add_tokens([AddedToken("New York", normalized=False), AddedToken("<mask>", lstrip=True, rstrip=True),
                    AddedToken("fox jumps", single_word=True)])
    return tok


def _added_token_texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    bits = ["New York", "New", "York", "<mask>", "fox jumps", "fox", "jumps", "the", "big", "Apple"]
    return ["".join(rng.choice(bits) + rng.choice([" ", " ", "  ", "\n", "", ". "]) for _ in range(60))
            for _ in range(n)]


def test_added_tokens_exact(with_added_tokens, many_cuts):
    for text in _added_token_texts(5, 100):
        assert tp.encode_text(with_added_tokens, text) == list(with_added_tokens.encode(text)), text


def test_added_token_guard_is_needed(with_added_tokens, many_cuts, monkeypatch):
    """Without the guard, cuts inside "New York" or next to lstrip/rstrip "<mask>" change the ids."""
    monkeypatch.setattr(tp, "_near_added_token", lambda *a: False)
    texts = _added_token_texts(6, 100)
    assert any(tp.encode_text(with_added_tokens, t) != list(with_added_tokens.encode(t)) for t in texts)


def _bare_serving(tokenizer):
    """The server's prompt handling alone: an OpenAIServing with only what tokenizing reads."""
    from splitserve.entrypoints.openai.serving import OpenAIServing
    serving = object.__new__(OpenAIServing)
    serving.tokenizer, serving.model_name, serving.mm_processor = tokenizer, "m", None
    return serving


def test_server_completion_prompts(smollm2, many_cuts):
    serving = _bare_serving(smollm2)
    rng = random.Random(7)
    prompts = [random_text(rng, 150, ["<|im_start|>", "<|im_end|>"]) for _ in range(20)] + [[1, 2, 3]]
    want = [list(smollm2.encode(p, add_special_tokens=True)) for p in prompts[:-1]] + [[1, 2, 3]]
    assert serving._tokenize_prompts(prompts) == want


def test_server_chat_template(smollm2, many_cuts):
    from splitserve.entrypoints.openai.protocol import ChatMessage
    serving = _bare_serving(smollm2)
    rng = random.Random(8)
    for _ in range(10):
        msgs = [{"role": r, "content": random_text(rng, 80, ["<|im_end|>"])}
                for r in ("system", "user", "assistant", "user")]
        want = smollm2.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        got = serving.apply_chat_template([ChatMessage(**m) for m in msgs], add_generation_prompt=True)
        assert got == want
    # A chat_template_kwargs that names a tokenizing argument keeps the template's own tokenization.
    got = serving.apply_chat_template([ChatMessage(**msgs[0])], extra={"return_dict": False})
    assert got == list(smollm2.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=True,
                                                   return_dict=False))


def test_engine_front_hook(smollm2, many_cuts):
    from splitserve.engine.front import EngineFront
    front = object.__new__(EngineFront)
    front.tokenizer, front.mm_processor = smollm2, None
    text = random_text(random.Random(9), 300, [])
    assert front.tokenize_prompt(text) == list(smollm2.encode(text, add_special_tokens=True))


def test_server_chat_template_adds_no_second_bos(llama3_like, many_cuts, monkeypatch):
    """The template writes BOS itself; tokenizing the rendered chat must not add the post-processor's."""
    from splitserve.entrypoints.openai.protocol import ChatMessage
    monkeypatch.setattr(llama3_like, "chat_template", "<|begin_of_text|>{% for m in messages %}<|start_header_id|>"
                        "{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}", raising=False)
    text = random_text(random.Random(10), 200, [])
    got = _bare_serving(llama3_like).apply_chat_template([ChatMessage(role="user", content=text)])
    want = llama3_like.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert got == want and got.count(0) == 1
