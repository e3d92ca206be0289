"""Bad input raises a clear error naming the cause, queues nothing, and the engine keeps serving."""
import json
import subprocess
import sys

import pytest

from splitserve import LLM, SamplingParams
from splitserve.loading.resolve import load_tokenizer
from tests.hf_reference import make_tiny_llama_dir


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_llama_dir(tmp_path_factory.mktemp("tiny"), load_tokenizer(None), num_kv_heads=2, tie=True)
    return LLM(path, max_model_len=128, num_blocks=16, block_size=16)


@pytest.mark.parametrize("prompt,params,match", [
    ("", SamplingParams(), "prompt is empty"),
    ([], SamplingParams(), "prompt is empty"),
    ([1] * 128, SamplingParams(max_tokens=1), "128 tokens.*context is 128"),
    ([1] * 100, SamplingParams(max_tokens=50), r"prompt \(100 tokens\) \+ max_tokens \(50\).*128"),
    ([10**9], SamplingParams(), "token ids must be integers in"),
    ([-1], SamplingParams(), "token ids must be integers in"),
])
def test_bad_prompts_raise_and_engine_keeps_serving(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([[5, 6, 7], prompt], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # the good prompt was not queued either
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.kv_manager.pool.is_whole()


def test_max_model_len_beyond_the_model_fails_and_leaves_no_thread_behind(tmp_path):
    """Engine arguments that do not fit the model fail at once with the cause; the tokenizer thread has
    ended by then (the caller may go on to import transformers, which must not race it)."""
    import threading
    path = make_tiny_llama_dir(tmp_path, load_tokenizer(None), num_kv_heads=2, tie=True)
    with pytest.raises(ValueError, match="max_model_len 100000 exceeds the model's context of 512"):
        LLM(path, max_model_len=100000, num_blocks=16)
    assert not any(t.name.startswith("splitserve-tokenizer") for t in threading.enumerate())


def test_request_larger_than_the_kv_cache(tmp_path):
    path = make_tiny_llama_dir(tmp_path, load_tokenizer(None), num_kv_heads=2, tie=True)
    small = LLM(path, max_model_len=256, num_blocks=4, block_size=16)  # 64 tokens of cache
    with pytest.raises(ValueError, match="KV cache.*64 tokens"):
        small.generate([[1] * 60], SamplingParams(max_tokens=10), use_tqdm=False)


def test_missing_model_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM("/nonexistent/model/dir")


def test_uncached_hub_repo_says_how_to_download(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="`hf download someone/not-a-cached-model`") as e:
        LLM("someone/not-a-cached-model")
    assert "huggingface-cli" not in str(e.value)  # the old tool's name


def test_unsupported_architecture_lists_supported(tmp_path):
    path = make_tiny_llama_dir(tmp_path, load_tokenizer(None), num_kv_heads=2, tie=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model architecture.*LlamaForCausalLM"):
        LLM(path)


def test_cli_generate_and_chat_and_bad_model():
    run = [sys.executable, "-m", "splitserve"]
    out = subprocess.run(run + ["generate", "--prompt", "What is the capital of France?", "--chat",
                                "--max-tokens", "12"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    chat = subprocess.run(run + ["chat", "--max-tokens", "12"], input="What is the capital of France?\n/exit\n",
                          capture_output=True, text=True, timeout=300)
    assert chat.returncode == 0, chat.stderr
    assert "Paris" in chat.stdout
    bad = subprocess.run(run + ["generate", "--prompt", "x", "/nonexistent"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "does not exist" in bad.stderr and "Traceback" not in bad.stderr
