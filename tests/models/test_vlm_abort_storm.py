"""Abort storm on a vision-language model (issue 7): text-only, one- and two-image requests under a
tight KV pool (preemption), a small step budget (image placeholder runs split across prefill chunks)
and a small encoder cache (evictions, re-encoding), a seeded random subset aborted at random moments
(waiting, mid-prefill, mid-image, decoding), some waiting ones with their images encoded ahead. Survivors get exactly their unconstrained greedy tokens;
afterwards the block pool and the encoder cache are whole and no request is left anywhere."""
import random

import pytest

from splitserve import LLM, SamplingParams
from splitserve.multimodal.encoder_cache import EncoderCache
from splitserve.core.request import RequestStatus
from tests.multimodal_reference import make_tiny_llava_dir, mm_tokenizer, random_image

NUM_REQUESTS = 48
NEW_TOKENS = 8
BLOCK = 8
BUDGET = 24          # < one image's placeholder run plus text: image runs span prefill chunks
MAX_SEQS = 12
ENCODER_TOKENS = 48  # three images' worth: with six distinct images, entries are evicted and re-encoded
WORDS = "red green blue cat dog tree house river stone cloud light small quick bright".split()
PREFIXES = ["Describe this picture briefly.", "You look at images and answer.", "Question:"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llava_dir(tmp_path_factory.mktemp("llava") / "m", mm_tokenizer(), "clip", False, seed=5)


@pytest.fixture(scope="module")
def workload(model_dir):
    """Prompts (text-only, one image, two images from a pool of six, so images repeat) and their
    greedy tokens from an unconstrained engine that never aborts or preempts."""
    ref_llm = LLM(model_dir, num_blocks=512, block_size=BLOCK, enable_prefix_caching=False,
                  max_num_batched_tokens=4096, max_num_seqs=NUM_REQUESTS)
    mm = ref_llm.engine.mm_processor
    images = [mm.process_image(random_image(100 + i, (40 + 9 * i, 70 - 5 * i))) for i in range(6)]
    rng = random.Random(7)
    prompts = []
    for i in range(NUM_REQUESTS):
        words = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 12)))
        kind = i % 3
        if kind == 0:
            prompts.append(mm.tokenize(f"{rng.choice(PREFIXES)} {words()}"))
            continue
        imgs = rng.sample(images, 1) if kind == 1 else [rng.choice(images), rng.choice(images)]  # may repeat
        body = f"{rng.choice(PREFIXES)} <image> {words()}"
        if kind == 2:
            body += " <image> " + words()
        prompts.append(mm.build_prompt(body, imgs))
    assert sum(1 for p in prompts if len(getattr(p, "mm_items", ())) == 2) >= NUM_REQUESTS // 3
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, params, use_tqdm=False)]
    assert ref_llm.engine.scheduler.num_preemptions == 0
    return prompts, params, reference


PHASE_WEIGHTS = {"waiting": 1, "prefill": 3, "mid-image": 6, "decode": 2}


def phase(request) -> str:
    if request.status == RequestStatus.WAITING:
        return "waiting"  # never run, or preempted
    if request.num_computed_tokens >= request.num_prompt_tokens:
        return "decode"
    if any(it.offset < request.num_computed_tokens < it.end for it in request.mm_items):
        return "mid-image"  # part of an image's placeholder run computed: its features are pinned
    return "prefill"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_vlm_abort_storm_under_preemption(model_dir, workload, async_scheduling):
    prompts, params, reference = workload
    rng = random.Random(1234)
    llm = LLM(model_dir, num_blocks=20, block_size=BLOCK, max_num_batched_tokens=BUDGET, max_num_seqs=MAX_SEQS,
              async_scheduling=async_scheduling)
    engine = llm.engine
    mm = engine.runner.mm
    mm.cache = EncoderCache(capacity_tokens=ENCODER_TOKENS)
    ids = [engine.add_request(f"r{i}", p, params, stream=False) for i, p in enumerate(prompts)]
    requests = dict(engine.scheduler.requests)
    doomed = set(rng.sample(ids, NUM_REQUESTS * 2 // 5))
    finished, aborted, where = {}, set(), set()
    max_cache_pinned = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.finished
            finished[out.request_id] = out
        max_cache_pinned = max(max_cache_pinned, mm.cache.num_pinned())
        # Abort doomed requests wherever they are now (waiting, mid-prefill, inside an image run whose
        # features are pinned, decoding): a slow trickle over the whole run, each pick drawing a phase
        # among those some doomed request is in, weighted towards the short prefill phases.
        for _ in range(rng.choices([0, 1, 2], weights=[6, 3, 1])[0]):
            phases: dict[str, list[str]] = {}
            for rid in sorted(i for i in doomed if i in engine.states):
                phases.setdefault(phase(engine.scheduler.requests[rid]), []).append(rid)
            if not phases:
                break
            kinds = sorted(phases)
            kind = rng.choices(kinds, weights=[PHASE_WEIGHTS[k] for k in kinds])[0]
            rid = rng.choice(phases[kind])
            request = engine.scheduler.requests[rid]
            where.add(kind)
            out = engine.abort_request(rid)[0]
            assert out.finished and out.outputs[0].finish_reason == "abort"
            assert request.status == RequestStatus.FINISHED_ABORTED
            aborted.add(rid)
        assert len(engine.scheduler.running) <= MAX_SEQS

    # The scenario really happened: preemption, aborts in several phases, repeated images served
    # from the encoder cache, and evictions that forced re-encoding.
    assert engine.scheduler.num_preemptions > 0
    assert any(r.num_preemptions and r.mm_items for r in requests.values()), "no image request was preempted"
    assert aborted and aborted <= doomed
    assert {"waiting", "prefill", "mid-image", "decode"} <= where, where
    assert mm.cache.hits > 0 and max_cache_pinned > 0
    assert mm.num_images_encoded > 6
    assert mm.num_images_prefetched > 0  # images of waiting requests were encoded ahead of admission

    for i, rid in enumerate(ids):
        if rid in aborted:
            assert rid not in finished, f"{rid} was aborted but finished normally"
            continue
        assert finished[rid].outputs[0].finish_reason == "length", rid
        assert finished[rid].outputs[0].token_ids == reference[i], rid

    # Nothing leaks: every block back in the pool, no encoder entry pinned, the cache within its
    # bound, no request left in the scheduler, the engine or the step pipeline.
    assert engine.kv_manager.pool.is_whole()
    assert mm.cache.num_pinned() == 0 and mm.cache.is_whole()
    assert mm.cache.num_tokens <= ENCODER_TOKENS
    assert not mm.pending and not mm.announced  # nothing announced is left waiting or reserved
    assert not engine.runner.input_batch.announced_mm  # nor the announced images the worker kept
    assert not engine.scheduler.requests and not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.states and not engine.front.output_processor.children and engine.core._inflight is None
