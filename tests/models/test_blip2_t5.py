"""BLIP-2 with a Flan-T5-style language model vs transformers on the same random weights.

The engine's encoder input is [the image's projected query tokens; the prompt's token embeddings]
and the decoder starts from the decoder start token; transformers' generate does the same with the
processor's input ids. One batch mixes prompt lengths and images (ragged encoder lengths), a prompt
with its `<image>` marker in the middle, and a repeat; a later repeat (its encoder run again, no
encoder cache) gives the same tokens; an abort storm under preemption leaves the pool whole."""
import random

import pytest
import torch
import transformers

from splitserve import LLM, SamplingParams
from splitserve.models.blip2_t5.model import Blip2T5ForConditionalGeneration
from splitserve.multimodal.processor import offline_prompt
from tests.multimodal_reference import IMAGE, mm_tokenizer, random_image
from tests.zoo_reference import NUM_QUERY, blip2_processor, make_tiny_blip2_dir

NEW_TOKENS = 6


def t5_text_config(tok) -> dict:
    """Flan-T5's shape in small: gated-GELU, an untied head, no output scaling."""
    return dict(model_type="t5", vocab_size=len(tok), d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=2,
                num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20, dropout_rate=0.0,
                feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0, pad_token_id=0,
                eos_token_id=tok.eos_token_id)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = mm_tokenizer()
    path = make_tiny_blip2_dir(tmp_path_factory.mktemp("blip2t5") / "m", tok, seed=5, text_config=t5_text_config(tok))
    hf = transformers.Blip2ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return path, tok, hf, blip2_processor(path, tok)


@torch.inference_mode()
def reference(setup, text: str, img, new_tokens: int = NEW_TOKENS,
              add_special_tokens: bool = True) -> tuple[list[int], list[float], int]:
    """transformers' greedy tokens, their logprobs, and the encoder length."""
    _, tok, hf, processor = setup
    if IMAGE in text:  # the marker's place: its id repeated once per query token
        image_id = tok.convert_tokens_to_ids(IMAGE)
        ids = [t for i in tok.encode(text, add_special_tokens=add_special_tokens) for t in ([i] * NUM_QUERY if i == image_id else [i])]
        inputs = {"input_ids": torch.tensor([ids]),
                  "pixel_values": processor.image_processor(images=[img], return_tensors="pt")["pixel_values"]}
    else:
        inputs = dict(processor(images=[img], text=text, return_tensors="pt"))
    ids = inputs["input_ids"]
    inputs.setdefault("attention_mask", torch.ones_like(ids))
    out = hf.generate(**inputs, max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, 1:].tolist()  # after the decoder start token
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens)]
    return tokens, logprobs, ids.shape[1]


CASES = [("Question: what is shown here? Answer:", random_image(1, (80, 60))),
         ("Describe", random_image(2, (50, 90))),
         ("A longer prompt: tell me about the colours, the shapes and the mood of <image> in detail.",
          random_image(3, (64, 64))),
         ("Question: what is shown here? Answer:", random_image(1, (80, 60)))]  # a repeat in the batch


def test_registry_picks_the_t5_variant(setup):
    path, _, _, _ = setup
    llm = LLM(path, num_blocks=16, block_size=8, attention_backend="torch_ref")
    assert isinstance(llm.engine.runner.model, Blip2T5ForConditionalGeneration)


def test_greedy_parity_mixed_batch(setup):
    path, *_ = setup
    llm = LLM(path, num_blocks=64, block_size=8, max_num_batched_tokens=128, attention_backend="torch_ref")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    prompts = [{"prompt": t, "multi_modal_data": {"image": img}} for t, img in CASES]
    outs = llm.generate(prompts, params, use_tqdm=False)
    lengths, spread = set(), 0.0
    for (text, img), out in zip(CASES, outs):
        tokens, logprobs, enc_len = reference(setup, text, img)
        comp = out.outputs[0]
        assert comp.token_ids == tokens, text
        assert [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)] == pytest.approx(logprobs, abs=2e-4)
        spread = max([spread, *map(abs, logprobs)])
        lengths.add(enc_len)
    assert len(lengths) == 3 and spread > 1e-2  # ragged encoder lengths; logits not saturated
    again = llm.generate(prompts[:1], params, use_tqdm=False)[0]  # the encoder runs again: no encoder cache
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert llm.engine.kv_manager.pool.is_whole() and llm.engine.runner.mm is None


def test_abort_storm_under_preemption(setup):
    """A pool too small for all requests' cross blocks: preempted requests run their encoder again
    from the kept images; aborted ones leave nothing behind."""
    path, *_ = setup
    rng = random.Random(7)
    cases = [(" ".join(["word"] * rng.randint(1, 12)) + " Answer:", random_image(10 + i, (60 + 9 * i, 50)))
             for i in range(6)]
    llm = LLM(path, num_blocks=9, block_size=8, max_num_batched_tokens=64, max_num_seqs=4,
              attention_backend="torch_ref")
    engine = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)  # decoders grow past a block
    ids = [engine.add_request(f"r{i}", offline_prompt(engine, {"prompt": t, "multi_modal_data": {"image": img}}),
                              params, stream=False) for i, (t, img) in enumerate(cases)]
    finished, aborted, steps = {}, set(), 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
        steps += 1
        for rid in (ids[1], ids[4]):
            if steps == 2 + 2 * ids.index(rid) // 4 and rid in engine.states:
                engine.abort_request(rid)
                aborted.add(rid)
    assert engine.scheduler.num_preemptions > 0 and aborted
    for i, rid in enumerate(ids):
        if rid not in aborted:
            assert finished[rid].outputs[0].token_ids == reference(setup, *cases[i], new_tokens=20)[0], rid
    assert engine.kv_manager.pool.is_whole() and not engine.runner.encdec.inputs
    assert not engine.scheduler.requests and not engine.states


def test_text_only_prompt_runs_the_t5_encoder_on_tokens(setup):
    """No image: the encoder input is the prompt's tokens alone (transformers' T5 on the same ids)."""
    path, tok, hf, _ = setup
    llm = LLM(path, num_blocks=32, block_size=8, attention_backend="torch_ref")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    got = llm.generate(["Just some words"], params, use_tqdm=False)[0].outputs[0].token_ids
    ids = torch.tensor([tok.encode("Just some words")])
    out = hf.language_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                     min_new_tokens=NEW_TOKENS, do_sample=False)
    assert got == out[0, 1:].tolist()
