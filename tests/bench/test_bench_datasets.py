"""Request sets: lengths, determinism, the ShareGPT filter, file errors, images."""
from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import sys

import numpy as np
import pytest

from splitserve.bench import datasets as ds
from splitserve.bench.datasets import BenchError

_spec = importlib.util.spec_from_file_location(
    "bench_stream_server", os.path.join(os.path.dirname(__file__), "..", "fixtures", "stream_server.py"))
ss = sys.modules.setdefault("bench_stream_server", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(ss)


def rng(seed=0):
    return np.random.default_rng(seed)


def test_random_fixed_lengths_and_no_special_tokens():
    tok = ss.WordTokenizer(50)
    reqs = ds.random_requests(tok, 20, 30, 0, 7, 0, rng())
    assert all(r.prompt_len == 30 and r.output_len == 7 for r in reqs)
    assert all(len(tok.encode(r.prompt)) == 30 for r in reqs)
    assert all(49 not in tok.encode(r.prompt) for r in reqs)  # 49 is the tokenizer's special id
    assert len({r.prompt for r in reqs}) == 20                # distinct prompts: no accidental prefix-cache hits


def test_random_normal_lengths_and_seed():
    tok = ss.WordTokenizer()
    a = ds.random_requests(tok, 400, 100, 20, 50, 10, rng(1))
    lens = np.array([r.prompt_len for r in a])
    outs = np.array([r.output_len for r in a])
    assert abs(lens.mean() - 100) < 4 and 15 < lens.std() < 25
    assert abs(outs.mean() - 50) < 2 and 7 < outs.std() < 13
    b = ds.random_requests(tok, 400, 100, 20, 50, 10, rng(1))
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert min(ds.sample_lengths(rng(), 1000, 3, 50)) >= 1    # clipped, never zero or negative
    with pytest.raises(BenchError):
        ds.sample_lengths(rng(), 3, 10, -1)


def test_random_token_ids():
    reqs = ds.random_requests(ss.WordTokenizer(), 5, 12, 0, 3, 0, rng(), token_ids=True)
    assert all(isinstance(r.prompt, list) and len(r.prompt) == 12 for r in reqs)


class _BPE:
    """A real byte-level BPE (trained here in a blink) behind the methods the benchmark uses:
    decoding random ids and re-encoding does not give the same ids back, as with real models."""

    def __init__(self):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        words = ["serve", "token", "model", "batch", "cache", "paged", "attention", "layer", "stream",
                 "the", "a", "of", "and", "request", "latency", "throughput", "prefix", "decode"]
        g = np.random.default_rng(0)
        corpus = [" ".join(g.choice(words, 12)) + "." for _ in range(300)]
        self.tk = Tokenizer(models.BPE())
        self.tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.tk.decoder = decoders.ByteLevel()
        self.tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        self.all_special_ids = [self.tk.token_to_id("<eos>")]

    def __len__(self):
        return self.tk.get_vocab_size()

    def encode(self, text, add_special_tokens=False):
        return self.tk.encode(text).ids

    def decode(self, ids):
        return self.tk.decode(ids)

    def batch_decode(self, batch):
        return self.tk.decode_batch(batch)


def test_random_prompts_hit_length_with_real_bpe():
    tok = _BPE()
    reqs = ds.random_requests(tok, 30, 64, 0, 8, 0, rng(3))
    for r in reqs:
        actual = len(tok.encode(r.prompt))
        assert r.prompt_len == actual          # the recorded length is the true re-encoded length
        assert abs(actual - 64) <= 2


def _write(tmp_path, obj, name="d.json"):
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(p)


def _conv(prompt_words, reply_words):
    return {"conversations": [{"from": "human", "value": " ".join(["w1"] * prompt_words)},
                              {"from": "gpt", "value": " ".join(["w2"] * reply_words)}]}


def test_sharegpt_filter(tmp_path):
    data = [_conv(10, 20), _conv(3, 20), _conv(10, 3), _conv(1025, 10), _conv(1000, 1049), _conv(1000, 1048),
            {"conversations": [{"from": "human", "value": "w1 w1 w1 w1"}]},  # one turn: skipped
            {"junk": True}, "not a dict"]
    pairs = ds.load_sharegpt_pairs(_write(tmp_path, data))
    assert len(pairs) == 6
    reqs = ds.sharegpt_requests(pairs, ss.WordTokenizer(), 100, rng())
    assert sorted((r.prompt_len, r.output_len) for r in reqs) == [(10, 20), (1000, 1048)]
    fixed = ds.sharegpt_requests(pairs, ss.WordTokenizer(), 100, rng(), output_len=5)
    assert all(r.output_len == 5 for r in fixed)
    assert len(ds.sharegpt_requests(pairs, ss.WordTokenizer(), 1, rng())) == 1


@pytest.mark.parametrize("content,message", [
    ("[{", "is not valid JSON"),
    ({"conversations": []}, "not in ShareGPT format"),
    ([{"conversations": [{"from": "human"}, {"from": "gpt"}]}], "no usable ShareGPT conversations"),
])
def test_sharegpt_bad_files(tmp_path, content, message):
    with pytest.raises(BenchError, match=message):
        ds.load_sharegpt_pairs(_write(tmp_path, content))


def test_sharegpt_missing_file_and_nothing_passing(tmp_path):
    with pytest.raises(BenchError, match="not found"):
        ds.load_sharegpt_pairs(str(tmp_path / "missing.json"))
    with pytest.raises(BenchError, match="--dataset-path"):
        ds.load_sharegpt_pairs(None)
    pairs = ds.load_sharegpt_pairs(_write(tmp_path, [_conv(2, 2)]))
    with pytest.raises(BenchError, match="length filter"):
        ds.sharegpt_requests(pairs, ss.WordTokenizer(), 5, rng())


def test_synthetic_sharegpt_matches_documented_statistics():
    pairs = ds.synthetic_sharegpt_lengths(rng(0), 20000)
    ins = np.array([p for p, _ in pairs])
    outs = np.array([o for _, o in pairs])
    target_in, target_out = ds.SYNTH_TARGET_MEANS
    assert abs(ins.mean() - target_in) / target_in < 0.03
    assert abs(outs.mean() - target_out) / target_out < 0.03
    assert ins.min() >= 4 and outs.min() >= 4 and ins.max() <= 1024 and (ins + outs).max() <= 2048
    assert np.median(ins) < ins.mean()  # the long right tail the docstring promises
    reqs = ds.synthetic_sharegpt_requests(ss.WordTokenizer(), 10, rng(), token_ids=True)
    assert all(len(r.prompt) == r.prompt_len for r in reqs)


def test_random_mm_images():
    from PIL import Image
    reqs = ds.random_mm_requests(ss.WordTokenizer(), 3, 10, 0, 4, 0, rng(), num_images=2, size=(64, 48))
    uris = [u for r in reqs for u in r.images]
    assert len(uris) == 6 and len(set(uris)) == 6
    head, b64 = uris[0].split(",", 1)
    assert head == "data:image/png;base64"
    assert Image.open(io.BytesIO(base64.b64decode(b64))).size == (64, 48)
    assert ds.parse_size("640x480") == (640, 480)
    with pytest.raises(BenchError):
        ds.parse_size("big")
