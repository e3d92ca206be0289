"""--speculative-config / LLM(speculative_config=...): vLLM's keys, clear errors at start-up."""
from __future__ import annotations

import pytest

from splitserve.config import SpeculativeConfig
from splitserve.engine.args import EngineArgs


def test_parse_json_and_dict():
    a = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}')
    b = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5})
    assert a == b and a.prompt_lookup_min == 1 and a.lookahead_slots == 0
    assert SpeculativeConfig.parse({"method": "draft_model", "model": "x", "num_speculative_tokens": 2}).lookahead_slots == 2
    for method in ("eagle", "eagle3"):  # an EAGLE head writes its drafts' K/V in lookahead slots too
        assert SpeculativeConfig.parse({"method": method, "model": "x", "num_speculative_tokens": 3}).lookahead_slots == 3


@pytest.mark.parametrize("value, message", [
    ('{"method": "medusa", "num_speculative_tokens": 2}', "method must be one of"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "unknown key"),
    ('{"method": "ngram"}', "needs method and num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs a model"),
    ('{"method": "eagle3", "num_speculative_tokens": 2}', "needs a model"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}', "disable_by_batch_size"),
    ('not json', "not valid JSON"),
])
def test_bad_configs_fail_at_start_up(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_engine_config_carries_it_and_checks_the_draft():
    cfg = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 3}, device="cpu",
                     max_model_len=256).create_engine_config()
    assert cfg.speculative.method == "ngram" and cfg.speculative.num_speculative_tokens == 3
    assert EngineArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}', device="cpu",
                      max_model_len=256, tensor_parallel_size=2).create_engine_config().speculative.method == "ngram"
    with pytest.raises(ValueError, match="pipeline_parallel_size 1"):
        EngineArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}', device="cpu",
                   max_model_len=256, pipeline_parallel_size=2).create_engine_config()
    with pytest.raises(ValueError, match="method ngram only"):
        EngineArgs(speculative_config={"method": "draft_model", "model": "default", "num_speculative_tokens": 3},
                   device="cpu", max_model_len=256, tensor_parallel_size=2).create_engine_config()
