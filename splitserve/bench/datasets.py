"""Request sets for the serving benchmark: random, sharegpt, synthetic-sharegpt and random-mm.

Every generator is driven by one numpy Generator seeded from --seed, so the same arguments give
the same prompts in the same order against every server being compared.
"""
from __future__ import annotations

import base64
import io
import json
import os
from dataclasses import dataclass, field

import numpy as np

DATASETS = ("random", "sharegpt", "synthetic-sharegpt", "random-mm")


class BenchError(Exception):
    """A problem with the user's input or the server that should end the run with a message,
    not a traceback. exit_code 2 marks bad arguments/files (like argparse), 1 a failed run."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class SampleRequest:
    prompt: str | list[int]     # text, or token ids (completions endpoint with --token-ids)
    prompt_len: int             # tokens in the prompt as the client counts them (no chat template)
    output_len: int             # max_tokens to ask for
    images: list[str] = field(default_factory=list)  # data: URIs, sent as image_url parts (chat)
    model: str | None = None    # the model (a LoRA adapter's name) this request names; None: the run's


# ---------------------------------------------------------------------------- random prompts

class _PromptMaker:
    """Builds prompts of a requested token length from random vocabulary entries.

    Decoding random ids and re-encoding the text rarely gives back the same ids (BPE merges
    across the joins, partial UTF-8 bytes), so the text is re-encoded and trimmed/extended a few
    times until its length matches. Candidate ids are restricted to tokens that decode to
    printable ASCII on their own, which keeps prompts text-like and makes the round trip stable.
    """

    def __init__(self, tokenizer, rng: np.random.Generator):
        self.tok = tokenizer
        self.rng = rng
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        vocab = len(tokenizer)
        ids = [i for i in range(vocab) if i not in special]
        pieces = tokenizer.batch_decode([[i] for i in ids]) if hasattr(tokenizer, "batch_decode") \
            else [tokenizer.decode([i]) for i in ids]
        nice = [i for i, p in zip(ids, pieces) if p.strip() and p.isascii() and p.isprintable()]
        # A tokenizer for a non-Latin script may have few ASCII tokens; any non-special id will do.
        self.candidates = np.asarray(nice if len(nice) >= 100 else ids, dtype=np.int64)
        if len(self.candidates) == 0:
            raise BenchError("the tokenizer has no usable (non-special) tokens to build prompts from")

    def ids(self, n: int) -> list[int]:
        return self.rng.choice(self.candidates, size=n).tolist()

    def text(self, n: int) -> tuple[str, int]:
        ids = self.ids(n)
        text = self.tok.decode(ids)
        for _ in range(6):
            again = self.tok.encode(text, add_special_tokens=False)
            if len(again) == n:
                return text, n
            ids = again[:n] if len(again) > n else again + self.ids(n - len(again))
            text = self.tok.decode(ids)
        return text, len(self.tok.encode(text, add_special_tokens=False))


def sample_lengths(rng: np.random.Generator, n: int, mean: int, std: float, lo: int = 1) -> list[int]:
    """Normal(mean, std) rounded to integers and clipped below at lo (std 0 gives fixed lengths),
    as TensorRT-LLM's token-norm-dist does."""
    if mean < lo:
        raise BenchError(f"length mean {mean} must be at least {lo}")
    if std < 0:
        raise BenchError(f"length stdev {std} must not be negative")
    if std == 0:
        return [int(mean)] * n
    return np.maximum(np.rint(rng.normal(mean, std, n)), lo).astype(int).tolist()


def random_requests(tokenizer, n: int, input_len: int, input_std: float, output_len: int,
                    output_std: float, rng: np.random.Generator, token_ids: bool = False) -> list[SampleRequest]:
    maker = _PromptMaker(tokenizer, rng)
    ins = sample_lengths(rng, n, input_len, input_std)
    outs = sample_lengths(rng, n, output_len, output_std)
    out = []
    for li, lo in zip(ins, outs):
        if token_ids:
            out.append(SampleRequest(maker.ids(li), li, lo))
        else:
            text, actual = maker.text(li)
            out.append(SampleRequest(text, actual, lo))
    return out


# ---------------------------------------------------------------------------- ShareGPT file

def load_sharegpt_pairs(path: str) -> list[tuple[str, str]]:
    """(first user turn, first reply) pairs from a ShareGPT-format JSON file.

    Checked before anything slow happens (server check, tokenizer load) so a wrong path or a
    broken file is reported at once. Entries that are not conversations with at least two
    text turns are skipped, as vLLM's benchmark skips them; a file with none left is an error.
    """
    if not path:
        raise BenchError("--dataset sharegpt needs --dataset-path FILE.json (a ShareGPT-format JSON file)")
    if not os.path.isfile(path):
        raise BenchError(f"dataset file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise BenchError(f"dataset file {path} is not valid JSON: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BenchError(f"cannot read dataset file {path}: {e}") from None
    if not isinstance(data, list):
        raise BenchError(f"dataset file {path} is not in ShareGPT format: expected a JSON list of "
                         f'{{"conversations": [{{"from": ..., "value": ...}}, ...]}} objects, got {type(data).__name__}')
    pairs = []
    for entry in data:
        conv = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(conv, list) or len(conv) < 2:
            continue
        first, second = conv[0], conv[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        p, c = first.get("value"), second.get("value")
        if isinstance(p, str) and isinstance(c, str):
            pairs.append((p, c))
    if not pairs:
        raise BenchError(f"dataset file {path} has no usable ShareGPT conversations (entries need a "
                         f'"conversations" list whose first two turns have string "value" fields)')
    return pairs


def sharegpt_requests(pairs: list[tuple[str, str]], tokenizer, n: int, rng: np.random.Generator,
                      output_len: int | None = None, max_input_len: int = 1024,
                      max_total_len: int = 2048, min_len: int = 4) -> list[SampleRequest]:
    """Shuffle the pairs and keep those whose token lengths pass the usual filter: prompt and
    reference reply of at least min_len tokens, prompt at most max_input_len, both together at
    most max_total_len (1024/2048 are vLLM's defaults, so numbers are comparable with it).
    The reply's length becomes max_tokens unless output_len overrides it.

    Only as many pairs are tokenized as needed: the full ShareGPT file has ~90k conversations.
    No oversampling: if fewer than n pass, the run uses fewer and says so.
    """
    order = rng.permutation(len(pairs))
    out: list[SampleRequest] = []
    for idx in order:
        prompt, reply = pairs[int(idx)]
        p_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        r_len = len(tokenizer.encode(reply, add_special_tokens=False))
        if p_len < min_len or r_len < min_len or p_len > max_input_len or p_len + r_len > max_total_len:
            continue
        out.append(SampleRequest(prompt, p_len, output_len if output_len else r_len))
        if len(out) == n:
            break
    if not out:
        raise BenchError("no ShareGPT conversation passed the length filter "
                         f"({min_len} <= prompt <= {max_input_len}, reply >= {min_len}, total <= {max_total_len} tokens)")
    return out


# ---------------------------------------------------------------------------- synthetic ShareGPT

# Lognormal (mu, sigma) of prompt and reply token lengths; see synthetic_sharegpt_lengths.
SYNTH_INPUT = (5.13, 1.2)
SYNTH_OUTPUT = (4.93, 0.9)
SYNTH_TARGET_MEANS = (230, 203)


def synthetic_sharegpt_lengths(rng: np.random.Generator, n: int, max_input_len: int = 1024,
                               max_total_len: int = 2048, min_len: int = 4) -> list[tuple[int, int]]:
    """(prompt_len, output_len) pairs shaped like filtered ShareGPT, for when the file is not at hand.

    Where the numbers come from, honestly:
    - The means are the target. A run of vLLM's own benchmark on 1000 ShareGPT prompts
      (ShareGPT_Vicuna_unfiltered, Llama-3.1-8B-Instruct tokenizer, vLLM's 1024/2048 length
      filter), posted in vllm-project/vllm pull request #18566, reported 229,711 input and
      203,068 generated tokens: about 230 prompt tokens and 203 output tokens per request. The
      output figure counts what the model actually generated, which can stop before the
      reference reply's length, so real ShareGPT reply lengths average somewhat more.
    - The shape is our assumption, not a fit: lognormal lengths (ShareGPT has many short
      questions and a long tail of pasted documents and long answers), with sigma 1.2 for
      prompts and 0.9 for replies chosen by us for a heavy right tail, prompt and reply drawn
      independently. mu was then tuned numerically so that after the same filter as the
      sharegpt dataset (min_len..max_input_len prompt, reply >= min_len, total <= max_total_len,
      out-of-range pairs redrawn) the means come out at about 230 and 203 (medians then are
      about 153 and 138).
    For figures that match a real ShareGPT run, use --dataset sharegpt with the file itself.
    """
    (mi, si), (mo, so) = SYNTH_INPUT, SYNTH_OUTPUT
    out: list[tuple[int, int]] = []
    while len(out) < n:
        k = max(16, 2 * (n - len(out)))
        ins = np.rint(rng.lognormal(mi, si, k)).astype(int)
        outs = np.rint(rng.lognormal(mo, so, k)).astype(int)
        for a, b in zip(ins.tolist(), outs.tolist()):
            if min_len <= a <= max_input_len and b >= min_len and a + b <= max_total_len:
                out.append((a, b))
                if len(out) == n:
                    break
    return out


def synthetic_sharegpt_requests(tokenizer, n: int, rng: np.random.Generator, token_ids: bool = False,
                                output_len: int | None = None) -> list[SampleRequest]:
    maker = _PromptMaker(tokenizer, rng)
    reqs = []
    for p_len, r_len in synthetic_sharegpt_lengths(rng, n):
        if token_ids:
            reqs.append(SampleRequest(maker.ids(p_len), p_len, output_len or r_len))
        else:
            text, actual = maker.text(p_len)
            reqs.append(SampleRequest(text, actual, output_len or r_len))
    return reqs


# ---------------------------------------------------------------------------- random multimodal

def parse_size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise BenchError(f"image size {text!r} should look like WIDTHxHEIGHT, e.g. 512x512") from None
    if w < 1 or h < 1 or w * h > 64_000_000:
        raise BenchError(f"image size {text!r} is out of range")
    return w, h


def random_image_uri(rng: np.random.Generator, width: int, height: int) -> str:
    """A PNG of random coloured blocks as a data: URI.

    Blocks (an 8x8 random grid scaled up), not per-pixel noise: a vision encoder does the same
    work for any pixels of a given size, and blocks compress to a few KB, so a thousand images
    fit in memory and building/sending them adds little client time to the measurement.
    """
    from PIL import Image
    grid = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
    img = Image.fromarray(grid, "RGB").resize((width, height), Image.NEAREST)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def random_mm_requests(tokenizer, n: int, input_len: int, input_std: float, output_len: int,
                       output_std: float, rng: np.random.Generator, num_images: int = 1,
                       size: tuple[int, int] = (512, 512)) -> list[SampleRequest]:
    """Random text (prompt_len counts text tokens only; image tokens show up in server usage)
    plus num_images generated images per request."""
    if num_images < 1:
        raise BenchError("--random-mm-num-images must be at least 1")
    reqs = random_requests(tokenizer, n, input_len, input_std, output_len, output_std, rng)
    for r in reqs:
        r.images = [random_image_uri(rng, *size) for _ in range(num_images)]
    return reqs
