"""Nougat (VisionEncoderDecoderModel: Donut-Swin encoder + mBART decoder) through the engine vs
transformers' generate on the same random weights and the same NougatImageProcessor output: greedy
tokens equal and logprobs close for a batch of rendered text pages, the placeholder / chat / ignored
text contracts, the markdown post-processing, preemption with an abort leaving the pool whole, and
the refusal of encoder/decoder pairs the engine does not run."""
import pytest
import torch

from splitserve import LLM, SamplingParams
from tests.nougat_reference import NEW_TOKENS, hf_greedy, make_tiny_nougat, text_page

PAGES = [text_page(["Nougat: a test page", "some lines of text", "E = mc^2 and more"]),
         text_page(["# Results", "Table 1 shows", "the accuracy"], size=(240, 180), seed=1),
         text_page(["Abstract", "We propose a model", "for documents", "with math"], size=(130, 260), seed=2)]


@pytest.fixture(scope="module")
def nougat_dir(tmp_path_factory):
    return make_tiny_nougat(tmp_path_factory.mktemp("nougat"))


@pytest.fixture(scope="module")
def llm(nougat_dir):
    path, _, _ = nougat_dir
    return LLM(path, num_blocks=64, block_size=8, max_num_batched_tokens=128, attention_backend="torch_ref")


def test_pages_match_transformers(nougat_dir, llm):
    _, hf, processor = nougat_dir
    pages = PAGES + [PAGES[0]]  # a repeat: the same encoder input in one batch
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt": "", "multi_modal_data": {"image": p}} for p in pages], params, use_tqdm=False)
    spread = 0.0
    for page, out in zip(pages, outs):
        tokens, logprobs = hf_greedy(hf, processor, page)
        comp = out.outputs[0]
        assert comp.token_ids == tokens
        got = [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)]
        assert got == pytest.approx(logprobs, abs=2e-4)
        spread = max([spread, *(abs(a - b) for a, b in zip(logprobs, logprobs[1:]))])
    assert spread > 1e-2  # the logits are not flat: a wrong layer would move them
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) >= 3  # the pages give different outputs
    assert llm.engine.kv_manager.pool.is_whole()


def test_prompt_contracts_and_markdown(nougat_dir, llm):
    """Text is not an input of Nougat (ignored, as transformers' generate has none); in a token-id
    prompt `placeholder_id` marks the page; a chat message's image_url part is the page; the
    finished text's markdown is transformers' post-processing of it."""
    from transformers import NougatTokenizer

    from tests.e2e.test_server_pix2struct import data_url
    _, hf, processor = nougat_dir
    page = PAGES[1]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    mm = llm.engine.mm_processor
    by_text, by_ids = llm.generate([{"prompt": "Convert this page", "multi_modal_data": {"image": page}},
                                    {"prompt_token_ids": [mm.placeholder_id], "multi_modal_data": {"image": page}}],
                                   params, use_tqdm=False)
    chat = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(page)}}]}],
                    params, use_tqdm=False)[0]
    expected = hf_greedy(hf, processor, page)[0]
    for out in (by_text, by_ids, chat):
        assert out.outputs[0].token_ids == expected
        text = out.outputs[0].text
        assert out.outputs[0].markdown == NougatTokenizer().post_process_generation(text)
    with pytest.raises(ValueError, match="exactly one image"):
        llm.generate([{"prompt": "", "multi_modal_data": {"image": [page, page]}}], params, use_tqdm=False)
    assert llm.engine.kv_manager.pool.is_whole()


def test_preemption_and_aborts(nougat_dir):
    """A pool that holds about two requests: preempted requests run their encoder again from the
    pixels the worker kept; the aborted one leaves nothing behind."""
    path, hf, processor = nougat_dir
    pages = [text_page([f"Page {i}", "x" * (3 + i), "more text"], size=(150 + 11 * i, 200 - 7 * i), seed=i)
             for i in range(6)]
    llm = LLM(path, num_blocks=9, block_size=8, max_num_batched_tokens=128, max_num_seqs=4,
              attention_backend="torch_ref")
    engine = llm.engine
    params = SamplingParams(max_tokens=2 * NEW_TOKENS, temperature=0, ignore_eos=True)
    from splitserve.multimodal.processor import offline_prompt
    ids = [engine.add_request(f"p{i}", offline_prompt(engine, {"prompt": "", "multi_modal_data": {"image": p}}),
                              params, stream=False) for i, p in enumerate(pages)]
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
        steps += 1
        if steps == 3:
            engine.abort_request(ids[5])
    assert engine.scheduler.num_preemptions > 0
    for i in range(5):
        assert finished[ids[i]].outputs[0].token_ids == hf_greedy(hf, processor, pages[i], 2 * NEW_TOKENS)[0], i
    assert ids[5] not in finished
    assert engine.kv_manager.pool.is_whole() and not engine.runner.encdec.inputs


def test_unsupported_encoder_decoder_pairs_are_refused():
    from transformers import GPT2Config, MBartConfig, VisionEncoderDecoderConfig, ViTConfig

    from splitserve.models.nougat.model import NougatForConditionalGeneration
    from splitserve.models.registry import get_model_class
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(ViTConfig(), GPT2Config())
    _, cls = get_model_class(["VisionEncoderDecoderModel"], config)
    assert cls is NougatForConditionalGeneration
    with pytest.raises(ValueError, match="encoder 'vit' and decoder 'gpt2' is not supported"):
        with torch.device("meta"):
            cls(config)
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(ViTConfig(), MBartConfig(add_cross_attention=True))
    with pytest.raises(ValueError, match="encoder 'vit'"):
        with torch.device("meta"):
            cls(config)


@pytest.mark.parametrize("model_type", ["donut-swin", "swin"])
def test_swin_encoder_matches_transformers_on_odd_grids(model_type, tmp_path):
    """The encoder alone on a map that needs padding (15 x 11 patches: windows of 3 padded, odd
    merges padded) and a last stage no larger than a window; SwinModel's final LayerNorm too."""
    import transformers

    from splitserve.models.nougat.swin import SwinEncoder
    kw = dict(image_size=[60, 44], patch_size=4, embed_dim=16, depths=[2, 2, 2], num_heads=[2, 4, 4], window_size=3)
    config = (transformers.DonutSwinConfig if model_type == "donut-swin" else transformers.SwinConfig)(**kw)
    torch.manual_seed(1)
    ref = transformers.AutoModel.from_config(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.add_(torch.randn_like(p) * (0.5 if "relative_position" in name else 0.1))
    ref.save_pretrained(tmp_path)  # the checkpoint's names (transformers 5 renames Swin's in memory)
    from splitserve.loading.safetensors_io import iter_safetensors
    ours = SwinEncoder(config).eval()
    params = dict(ours.named_parameters())
    filled = {ours.load_weight(n, torch.as_tensor(t)) for n, t in iter_safetensors(str(tmp_path))} - {None}
    assert filled == set(params)
    pixels = torch.randn(2, 3, 60, 44)
    with torch.no_grad():
        want = ref(pixel_values=pixels).last_hidden_state
        got = ours(pixels)
    assert got.shape == want.shape == (2, 12, 64)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_decode_graph_path_matches_transformers(nougat_dir):
    """The decode-graph path (worker/cuda_graphs.py) with the cross-attention op inside, run without
    graphs on CPU: static self- and cross-attention buffers, steps padded up to the graph sizes."""
    from splitserve.worker.cuda_graphs import DecodeGraphs
    path, hf, processor = nougat_dir
    llm = LLM(path, num_blocks=64, block_size=8, max_num_batched_tokens=128, max_num_seqs=3,
              attention_backend="torch_ref")
    runner = llm.engine.runner
    m = runner.config.model
    runner.graphs = DecodeGraphs(runner.model, runner.backend, [2, 4], runner.max_blocks_per_seq, m.max_model_len,
                                 runner.kv_layout()[1], runner.device, use_graphs=False,
                                 cross_blocks=runner.encdec.cross_table.shape[1], block_size=runner.block_size)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt": "", "multi_modal_data": {"image": p}} for p in PAGES], params, use_tqdm=False)
    for page, out in zip(PAGES, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, processor, page)[0]
    assert runner.steps_by_path["decode_graph"] > 0
    assert llm.engine.kv_manager.pool.is_whole()
