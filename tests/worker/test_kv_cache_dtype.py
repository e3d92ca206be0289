"""The KV pool's element type (--kv-cache-dtype): an FP8 cache takes one byte per element, so the same
memory holds twice the tokens of a bf16 cache, both where the pool is sized from the GPU's free
memory and from --cpu-kv-cache-gib; the allocated caches are FP8 and bound to the attention layers."""
import pytest
import torch
from transformers import LlamaConfig

from splitserve.attention.layer import Attention
from splitserve.config import CacheConfig, CompileConfig, EngineConfig, ModelConfig, SchedulerConfig
from splitserve.worker.model_runner import ModelRunner

# SmolLM2-135M's attention shape: 30 layers of 3 KV heads of 64.
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16


def runner(kv_cache_dtype: str, dtype=torch.bfloat16, model=None) -> ModelRunner:
    hf = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=LAYERS,
                     num_attention_heads=9, num_key_value_heads=KV_HEADS, max_position_embeddings=2048)
    config = EngineConfig(
        model=ModelConfig(hf, "LlamaForCausalLM", dtype, 2048, hf.vocab_size, (2,)),
        cache=CacheConfig(block_size=BLOCK, cpu_kv_cache_gib=0.5, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), compile=CompileConfig(),
        device="cpu", attention_backend="torch_ref")
    return ModelRunner(config, model if model is not None else torch.nn.Module())


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_fp8_block_takes_half_the_bytes_of_bf16(name):
    fp8, bf16 = runner(name), runner("auto")
    assert fp8.kv_cache_dtype == torch.float8_e4m3fn and bf16.kv_cache_dtype == torch.bfloat16
    assert fp8.bytes_per_block() == 2 * BLOCK * KV_HEADS * HEAD_DIM * LAYERS * 1
    assert bf16.bytes_per_block() == 2 * fp8.bytes_per_block()
    # auto is the model's dtype: fp32 on CPU by default, four bytes an element
    assert runner("auto", dtype=torch.float32).bytes_per_block() == 4 * fp8.bytes_per_block()


def test_pool_from_cpu_budget_holds_twice_the_tokens():
    budget = 0.5 * (1 << 30)
    fp8, bf16 = runner("fp8").determine_num_blocks(), runner("auto").determine_num_blocks()
    per_token_fp8 = 2 * KV_HEADS * HEAD_DIM * LAYERS
    assert fp8 == int(budget // (BLOCK * per_token_fp8))
    assert bf16 == int(budget // (2 * BLOCK * per_token_fp8))
    assert fp8 in (2 * bf16, 2 * bf16 + 1)  # twice, but for the floor of the division


def test_pool_from_gpu_memory_holds_twice_the_tokens(monkeypatch):
    """The CUDA branch (free memory x utilisation, minus activations), with the device's memory faked."""
    total, used = 80 << 30, 3 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - used, total))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    counts = {}
    for name in ("fp8", "auto"):
        r = runner(name)
        r.device = torch.device("cuda")
        counts[name] = r.determine_num_blocks()
    assert counts["auto"] > 1000
    assert counts["fp8"] in (2 * counts["auto"], 2 * counts["auto"] + 1)


class _TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(Attention(i, 9, KV_HEADS, HEAD_DIM, 0.125) for i in range(2))


def test_allocated_caches_are_fp8_and_bound_to_the_layers():
    model = _TwoLayers()
    r = runner("fp8", model=model)
    r.config.model.hf_config.num_hidden_layers = 2
    r.allocate_kv_cache(10)
    assert len(r.kv_caches) == 2
    for layer, cache in zip(model.layers, r.kv_caches):
        assert layer.kv_cache is cache
        assert cache.dtype == torch.float8_e4m3fn and cache.shape == (10, 2, BLOCK, KV_HEADS, HEAD_DIM)
        assert cache.untyped_storage().nbytes() == 10 * 2 * BLOCK * KV_HEADS * HEAD_DIM
