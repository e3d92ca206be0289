"""Pix2Struct (Deplot-style: the prompt rendered as a header above a drawn bar chart) through the
engine vs transformers' Pix2StructForConditionalGeneration on the same random weights and the same
image processor output: greedy tokens equal, logprobs close, for a batch of charts of different
aspect ratios (different patch grids, so different encoder lengths) and headers, and the pool whole."""
import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.models.pix2struct.processor import DEPLOT_PROMPT
from tests.pix2struct_reference import NEW_TOKENS, bar_chart, hf_greedy, hf_inputs, make_tiny_deplot


@pytest.fixture(scope="module")
def deplot_dir(tmp_path_factory):
    return make_tiny_deplot(tmp_path_factory.mktemp("deplot"))

def test_deplot_charts_match_transformers(deplot_dir):
    path, hf, processor = deplot_dir
    cases = [(bar_chart([0.3, 0.9, 0.5], (120, 80)), DEPLOT_PROMPT),
             (bar_chart([0.7, 0.2, 0.4, 0.8, 0.6], (64, 128), seed=1), DEPLOT_PROMPT),
             (bar_chart([0.5, 0.5], (200, 60), seed=2), "What is the value of bar B?"),
             (bar_chart([0.3, 0.9, 0.5], (120, 80)), DEPLOT_PROMPT)]  # a repeat: same encoder input
    llm = LLM(path, num_blocks=128, block_size=8, max_num_batched_tokens=256, attention_backend="torch_ref")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt": h, "multi_modal_data": {"image": img}} for img, h in cases], params,
                        use_tqdm=False)
    lengths = set()
    spread = 0.0
    for (img, header), out in zip(cases, outs):
        tokens, logprobs = hf_greedy(hf, processor, img, header)
        comp = out.outputs[0]
        assert comp.token_ids == tokens
        got = [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)]
        assert got == pytest.approx(logprobs, abs=2e-4)
        spread = max([spread, *map(abs, logprobs)])
        lengths.add(int(hf_inputs(processor, img, header)["attention_mask"].sum()))
    assert len(lengths) >= 3  # different patch grids: ragged encoder lengths in one batch
    assert spread > 1e-2
    assert llm.engine.kv_manager.pool.is_whole()
    table = llm.engine.runner.model.self_attn[0].pos_bias  # as the Triton kernels read it
    assert table.dtype == torch.float32 and table.is_contiguous()


def test_token_id_prompt_marks_the_image_with_the_placeholder(deplot_dir):
    """The benchmarks' contract: in a token-id prompt `mm_processor.placeholder_id` marks the image
    and the other ids are the header; an encoder input longer than a step is a clear error."""
    path, _, _ = deplot_dir
    llm = LLM(path, num_blocks=64, block_size=8, max_num_batched_tokens=128, attention_backend="torch_ref")
    mm = llm.engine.mm_processor
    chart = bar_chart([0.4, 0.6], (90, 60))
    header_ids = llm.get_tokenizer().encode(DEPLOT_PROMPT, add_special_tokens=False)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    by_text, by_ids = llm.generate([{"prompt": DEPLOT_PROMPT, "multi_modal_data": {"image": chart}},
                                    {"prompt_token_ids": [mm.placeholder_id] + header_ids,
                                     "multi_modal_data": {"image": chart}}], params, use_tqdm=False)
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    assert llm.engine.kv_manager.pool.is_whole()
    small = LLM(path, num_blocks=64, block_size=8, max_num_batched_tokens=32, attention_backend="torch_ref")
    with pytest.raises(ValueError, match="encoder input has"):
        small.generate([{"prompt": DEPLOT_PROMPT, "multi_modal_data": {"image": chart}}], params, use_tqdm=False)


def test_deplot_preemption_and_aborts(deplot_dir):
    """A pool that holds about two requests' encoder blocks: preempted requests run their encoder
    again from the patches the worker kept; aborted ones leave nothing behind."""
    path, hf, processor = deplot_dir
    charts = [bar_chart([0.1 * (i + 1), 0.5, 0.9 - 0.1 * i], (60 + 17 * i, 90 - 9 * i), seed=i) for i in range(6)]
    llm = LLM(path, num_blocks=25, block_size=8, max_num_batched_tokens=256, max_num_seqs=4,
              attention_backend="torch_ref")
    engine = llm.engine
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    from splitserve.multimodal.processor import offline_prompt
    ids = [engine.add_request(f"c{i}", offline_prompt(engine, {"prompt": DEPLOT_PROMPT, "multi_modal_data": {"image": c}}),
                              params, stream=False) for i, c in enumerate(charts)]
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
        steps += 1
        if steps == 3:
            engine.abort_request(ids[5])
    assert engine.scheduler.num_preemptions > 0
    for i in range(5):
        assert finished[ids[i]].outputs[0].token_ids == hf_greedy(hf, processor, charts[i], DEPLOT_PROMPT)[0], i
    assert ids[5] not in finished
    assert engine.kv_manager.pool.is_whole() and not engine.runner.encdec.inputs
