"""Exact parallel tokenization of one long text prompt.

A Hugging Face fast tokenizer encodes one text on one thread: ~1.4 s of CPU per MB, so a 32k-token
prompt costs ~200 ms before the engine sees it. `Tokenizer.encode_batch` encodes several texts on
the Rust thread pool with the GIL released. `encode_text` cuts a long text into a few pieces at
points where the tokenizer would split it anyway, encodes them as one batch without special tokens,
merges the encodings and runs the tokenizer's post-processor, which adds the special tokens (BOS...)
as `encode(text)` does. The ids are identical to `tokenizer.encode(text, add_special_tokens=...)`
or this is not used: tokenizers for which cutting is not provably safe, and short texts, take the
plain `encode`.

When cutting is safe (`_cut_safe` says which tokenizers qualify): the pipeline is
  added-token split -> normalizer -> pre-tokenizer (regex) -> BPE per pre-token -> post-processor.
BPE works on each pre-token alone, so two pieces encode like the whole when (1) the added-token
split finds the same tokens, (2) the normalizer changes nothing across the cut, and (3) the
pre-tokenizer has a boundary at the cut and splits each side as it splits the whole. See _is_cut for
(3), _near_added_token for (1), _SAFE_NORMALIZERS for (2).
"""
from __future__ import annotations

import json
import os
import re
import threading
import unicodedata
import weakref
from functools import lru_cache

from splitserve.cpu_limits import usable_cpus

# Measured on a 2-core box, SmolLM2's tokenizer (benchmarks/tokenize_parallel.py and a sweep of text
# sizes, median wall time): two pieces cost 0.27 ms vs 0.15 ms at 500 characters, break even near
# 1,000 (0.28 vs 0.29 ms), save from ~2,000 (0.52 vs 0.62 ms; ~300 tokens) and halve 1k-token prompts.
MIN_PARALLEL_CHARS = 2000
# Each piece is at least this long: the per-piece cost (a rayon task, an Encoding to merge) must stay
# small next to its encoding time.
MIN_PIECE_CHARS = 1000
# TOKENIZERS_PARALLELISM values (set; "" too) that turn the tokenizers thread pool off; tokenizers
# also sets "false" in a child forked after the pool was used.
_PARALLELISM_OFF = frozenset({"", "0", "false", "f", "off", "no", "n"})

# The cut: before a single space that follows a non-whitespace character and precedes a letter.
# Why that is always a pre-token boundary, for the GPT-2 regex and each of _SPLIT_REGEXES (read p as
# the index of the space, c = text[p-1]; the scan is leftmost-first and every character belongs to a
# match). E.g.
#   GPT-2:    's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
#   Llama-3:  (?i:'s|...|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*
#             |\s*[\r\n]+|\s+(?!\S)|\s+          (Qwen2: \p{N} instead of \p{N}{1,3})
# In every alternative of these regexes a space can only be the first character (the optional lead
# ` ?` or `[^\r\n\p{L}\p{N}]?`, one character) or part of an all-whitespace alternative. So:
# - No match holds c followed by the space: after its first character an alternative takes only
#   letters/marks, numbers, symbols, contraction letters or [\r\n/], and the whitespace
#   alternatives take no c. No match spans p: the whole text has a boundary there.
# - The left piece text[:p]: the matches before p are the same. An attempt at a start before p reads
#   at most up to text[p]; there it meets a space where the piece has its end, and no alternative
#   tells them apart (neither is consumed after a non-whitespace character; `(?!\S)` holds for both;
#   there is no other lookahead).
# - The right piece text[p:]: the whole-text scan starts a match at p; the regexes have no anchors,
#   lookbehind or \b, so a match at p sees the same characters from p onward.
# The letter after the space is not needed by that argument; it keeps the cut to the one shape
# (" word") that every one of these regexes reads as the start of a word match.
# Whitespace is judged conservatively (a Unicode-table difference between Python and the Rust regex
# engine must not make c whitespace there): c must not be a separator, control, format or unassigned
# character (White_Space characters are all Zs/Zl/Zp/Cc; U+180E, once White_Space, is now Cf).
_NOT_BEFORE_CUT = frozenset({"Zs", "Zl", "Zp", "Cc", "Cf", "Cn", "Co", "Cs"})


def _is_cut(text: str, p: int) -> bool:
    """Whether the pre-tokenizer is sure to split text before text[p] (the rule argued above)."""
    return (0 < p < len(text) - 1 and text[p] == " " and text[p + 1].isalpha()
            and unicodedata.category(text[p - 1]) not in _NOT_BEFORE_CUT)


# Where _is_cut may hold (it has the last word: Unicode categories, isalpha).
_CANDIDATES = re.compile(r"(?<=\S) (?=[^\W\d_])")

_GPT2_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
# The Split regexes of byte-level tokenizers (as transformers writes them, also for GGUF files), each
# checked against the argument above.
_SPLIT_REGEXES = frozenset({
    # Llama-3 (also Falcon3, DBRX, LFM2... in GGUF)
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    # Qwen2
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    # Qwen3.5
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
    # GPT-4o / Llama-4
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    # Mistral Tekken
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
})
# None, or NFC: NFC cannot join across a space. U+0020 has canonical combining class 0 and
# NFC_Quick_Check=Yes, and no canonical composition has it as its second character, so the
# normalization of the text before a space never reaches past it (a normalization boundary), and
# NFC maps no non-whitespace character to whitespace (only compatibility mappings do that: NFKC is
# refused). Texts that are not already NFC fall back (added tokens are then searched in the text
# that will actually be matched).
_SAFE_NORMALIZERS = (None, {"type": "NFC"})


def _safe_pre_tokenizer(pre: dict | None) -> bool:
    """A byte-level pre-tokenizer whose splits are only the GPT-2 regex or one of _SPLIT_REGEXES (optionally
    after single-digit splitting, which only cuts around digits and so keeps a boundary before a
    space), with no prefix space added."""
    if pre is None:
        return False
    parts = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    if not parts:
        return False
    if parts[0].get("type") == "Digits" and parts[0].get("individual_digits") is True:
        parts = parts[1:]  # StarCoder / SmolLM2's digits-apart
    if len(parts) == 1:
        return all(parts[0].get(k) == v for k, v in _GPT2_BYTE_LEVEL.items())
    if len(parts) != 2:
        return False
    split, byte_level = parts
    return (split.get("type") == "Split" and split.get("behavior") == "Isolated" and split.get("invert") is False
            and (split.get("pattern") or {}).get("Regex") in _SPLIT_REGEXES
            and byte_level.get("type") == "ByteLevel" and byte_level.get("add_prefix_space") is False
            and byte_level.get("use_regex") is False)


# More added tokens than this: no cutting (the regex that keeps cuts away from them would be slow to build).
_MAX_ADDED_TOKENS = 4096


class _Plan:
    """What one tokenizer allows: whether cutting is safe, and its added tokens to keep cuts away from."""

    def __init__(self, tokenizer):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.backend = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True) if backend is not None else -1
        self.safe = False
        self.nfc = False
        self.added = None
        self.added_max = 0
        self.frame = {}
        if backend is None:
            return
        try:
            state = json.loads(backend.to_str())
        except Exception:  # a tokenizer that cannot serialize itself is not one we can reason about
            return
        model = state.get("model") or {}
        if state.get("normalizer") not in _SAFE_NORMALIZERS or not _safe_pre_tokenizer(state.get("pre_tokenizer")):
            return
        if model.get("type") != "BPE" or model.get("dropout") not in (None, 0, 0.0):
            return  # BPE dropout is random: not even encode() agrees with itself
        self.nfc = state.get("normalizer") is not None
        self.frame = {flag: _special_frame(backend, state.get("post_processor"), flag) for flag in (False, True)}
        contents = [t["content"] for t in state.get("added_tokens") or [] if t.get("content")]
        if len(contents) > _MAX_ADDED_TOKENS:
            return
        if contents:
            # Lookahead: every start position, so overlapping occurrences are all seen.
            self.added = re.compile("(?=(" + "|".join(re.escape(c) for c in sorted(contents, key=len, reverse=True))
                                    + "))")
            self.added_max = max(len(c) for c in contents)
        self.safe = True


# Post-processors that only put fixed special tokens around the sequence's ids (ByteLevel changes only
# offsets). For them the ids are prefix + the pieces' ids + suffix, which skips building and copying a
# merged Encoding (offsets, masks...: ~0.15 us a token, serial, next to ~0.6 us a token of encoding
# spread over the CPUs). Others go through Encoding.merge and post_process.
_FIXED_FRAME_PROCESSORS = frozenset({"TemplateProcessing", "BertProcessing", "RobertaProcessing", "ByteLevel"})


def _special_frame(backend, processor: dict | None, add_special_tokens: bool) -> tuple[list[int], list[int]] | None:
    """(prefix, suffix) ids the post-processor puts around a single sequence, or None when it is not
    known to be a fixed frame. Found by post-processing a probe and locating the probe's ids in it."""
    if processor is not None:
        steps = processor.get("processors") if processor.get("type") == "Sequence" else [processor]
        if not steps or any(step.get("type") not in _FIXED_FRAME_PROCESSORS for step in steps):
            return None
    probe = backend.encode("Hello world", add_special_tokens=False)
    inner = list(probe.ids)
    full = list(backend.post_process(probe, None, add_special_tokens=add_special_tokens).ids)
    at = [i for i in range(len(full) - len(inner) + 1) if full[i:i + len(inner)] == inner]
    if not inner or len(at) != 1:
        return None
    return full[:at[0]], full[at[0] + len(inner):]


_plans: "weakref.WeakKeyDictionary[object, _Plan]" = weakref.WeakKeyDictionary()
_plans_lock = threading.Lock()


def _plan(tokenizer) -> _Plan:
    with _plans_lock:
        try:
            plan = _plans.get(tokenizer)
        except TypeError:  # not weak-referenceable: no cache
            return _Plan(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if plan is None or plan.backend is not backend or (
            backend is not None and backend.get_vocab_size(with_added_tokens=True) != plan.vocab_size):
        plan = _Plan(tokenizer)  # first use, or tokens were added since
        with _plans_lock:
            _plans[tokenizer] = plan
    return plan


@lru_cache(maxsize=1)
def _cpus() -> int:
    return usable_cpus()


def _near_added_token(plan: _Plan, text: str, p: int) -> bool:
    """Whether an added token's text occurs in text touching the cut before text[p] (the space).

    The added-token split runs first, leftmost-longest over the whole text. If every occurrence lies
    at least one character clear of the cut on both sides ([s, e) with e <= p-2 or s >= p+2), each
    lies wholly in one piece and the greedy scan picks the same matches piece by piece. Margins:
    lstrip/rstrip tokens swallow neighbouring whitespace, and the cut's neighbours text[p-1] and
    text[p+1] are not whitespace, so the only whitespace such a token could reach is the space at p
    and only from an occurrence ending at p or starting at p+1; single_word tokens look at the
    characters just outside them, which stay in the same piece."""
    if plan.added is None:
        return False
    lo, hi = max(0, p - plan.added_max - 1), min(len(text), p + plan.added_max + 2)
    for m in plan.added.finditer(text, lo, hi):
        s, e = m.start(), m.start() + len(m.group(1))
        if s <= p + 1 and e >= p - 1:
            return True
    return False


def cut_points(text: str, pieces: int, plan: _Plan | None = None) -> list[int]:
    """Up to pieces-1 cut positions: in each even share of the text, the first safe cut at or after
    its start (at least MIN_PIECE_CHARS from the previous cut and from the end). The candidates are
    found by a regex, in C, so a text with few cuts (digits between spaces) is not walked in Python."""
    cuts = []
    step = len(text) // pieces
    for k in range(1, pieces):
        lo = max(k * step, (cuts[-1] if cuts else 0) + MIN_PIECE_CHARS)
        hi = min((k + 1) * step, len(text) - MIN_PIECE_CHARS)
        for m in _CANDIDATES.finditer(text, lo, min(hi + 2, len(text))):
            p = m.start()
            if p > hi:
                break
            if _is_cut(text, p) and not (plan is not None and _near_added_token(plan, text, p)):
                cuts.append(p)
                break
    return cuts


def can_cut(tokenizer) -> bool:
    """Whether encode_text may cut this tokenizer's long texts (else it is plain encode)."""
    return _plan(tokenizer).safe


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """tokenizer.encode(text, add_special_tokens=...) as a list of ids, the long texts of tokenizers
    that allow it (see the module docstring) encoded in pieces on the tokenizers thread pool."""
    if len(text) >= MIN_PARALLEL_CHARS:
        pieces = min(_cpus(), len(text) // MIN_PIECE_CHARS)
        if pieces >= 2:
            ids = _encode_in_pieces(tokenizer, text, add_special_tokens, pieces)
            if ids is not None:
                return ids
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _encode_in_pieces(tokenizer, text: str, add_special_tokens: bool, pieces: int) -> list[int] | None:
    """The ids, or None when this tokenizer, its settings or this text do not allow cutting."""
    plan = _plan(tokenizer)
    backend = plan.backend
    if not plan.safe:
        return None
    # encode() also syncs these onto the backend; anything other than the plain settings falls back.
    if (getattr(tokenizer, "split_special_tokens", False) or getattr(backend, "encode_special_tokens", True)
            or backend.truncation is not None or backend.padding is not None):
        return None
    if os.environ.get("TOKENIZERS_PARALLELISM", "on").lower() in _PARALLELISM_OFF:
        return None  # encode_batch would run the pieces one after another: all cost, no gain
    if plan.nfc and not unicodedata.is_normalized("NFC", text):
        return None
    cuts = cut_points(text, pieces, plan)
    if not cuts:
        return None
    bounds = [0, *cuts, len(text)]
    parts = backend.encode_batch([text[a:b] for a, b in zip(bounds, bounds[1:])], add_special_tokens=False)
    frame = plan.frame.get(add_special_tokens)
    if frame is not None:
        ids = list(frame[0])
        for part in parts:
            ids.extend(part.ids)
        ids.extend(frame[1])
        return ids
    from tokenizers import Encoding
    merged = Encoding.merge(parts, growing_offsets=True)
    return list(backend.post_process(merged, None, add_special_tokens=add_special_tokens).ids)
