"""The worker's persistent batch: built from step messages only (no scheduler objects), exact."""
import numpy as np
import torch

from splitserve.protocol.sched_output import CachedRequestData, NewRequestData, ResumedRequestData, SchedulerOutput
from splitserve.sampling_params import SamplingParams
from splitserve.worker.input_batch import InputBatch
from splitserve.worker.sampling_metadata import build_sampling_metadata

EOS = 2


def new(rid, prompt, blocks, computed=0, **params):
    params.setdefault("max_tokens", 50)
    return NewRequestData(rid, list(prompt), SamplingParams(**params), list(blocks), computed, (EOS,))


def msg(**fields):
    return SchedulerOutput(**fields)


def tokens(ib, rid):
    row = ib.row_of[rid]
    return ib.token_ids[row, :ib.num_known[row]].tolist()


def blocks(ib, rid):
    row = ib.row_of[rid]
    return ib.block_table[row, :ib.num_blocks[row]].tolist()


def launch(ib, nst, step_no):
    """What ModelRunner.prepare records for a step: rows, computed tokens, who samples."""
    rows = ib.rows_of(nst)
    seq_lens = ib.num_computed[rows] + np.fromiter(nst.values(), dtype=np.int64)
    sample_rows = rows[seq_lens == ib.num_tokens[rows]]
    states = [ib.row_states[r] for r in sample_rows.tolist()]
    ib.record_launch(rows, seq_lens, sample_rows, step_no)
    return states


def test_new_requests_take_rows_and_hold_prompt_and_blocks():
    ib = InputBatch(4, 32, 8)
    ib.update(msg(new_requests=[new("a", [5, 6, 7], [3]), new("b", range(20, 29), [4, 9, 1], computed=4)]))
    assert ib.row_of == {"a": 0, "b": 1} and ib.num_reqs == 2
    assert tokens(ib, "a") == [5, 6, 7] and blocks(ib, "a") == [3]
    assert tokens(ib, "b") == list(range(20, 29)) and blocks(ib, "b") == [4, 9, 1]
    assert ib.num_computed[1] == 4 and ib.num_tokens[1] == 9 and ib.num_prompt[1] == 9
    assert ib.states["b"].num_computed_tokens == 4 and ib.states["b"].is_active


def test_block_additions_append_to_the_table():
    ib = InputBatch(4, 64, 8)
    ib.update(msg(new_requests=[new("a", range(8), [3, 4])]))
    ib.update(msg(cached_requests=CachedRequestData(["a"], [[7]])))
    ib.update(msg(cached_requests=CachedRequestData(["a"], [[8, 2]])))
    assert blocks(ib, "a") == [3, 4, 7, 8, 2]


def test_finished_requests_free_their_rows_for_reuse_and_unknown_ids_are_ignored():
    ib = InputBatch(2, 32, 4)
    ib.update(msg(new_requests=[new("a", [1, 2], [0]), new("b", [3], [1])]))
    ib.update(msg(finished_req_ids=["a", "zzz"], new_requests=[new("c", [9, 9, 9], [2])]))
    assert "a" not in ib.states and ib.row_of == {"c": 0, "b": 1}
    assert tokens(ib, "c") == [9, 9, 9] and blocks(ib, "c") == [2]
    ib.update(msg(finished_req_ids=["b", "c"]))
    ib.update(msg(finished_req_ids=["b"]))            # sent again (a failed launch): no effect
    assert ib.num_reqs == 0 and not ib.states and sorted(ib._free_rows) == [0, 1]


def test_rows_follow_the_message_order_not_the_row_order():
    ib = InputBatch(4, 32, 4)
    ib.update(msg(new_requests=[new(r, [1], [i]) for i, r in enumerate("abcd")]))
    ib.update(msg(finished_req_ids=["b"], new_requests=[new("e", [1], [7])]))
    assert ib.rows_of({"d": 1, "e": 1, "a": 1}).tolist() == [3, 1, 0]


def test_sampled_tokens_become_known_and_pending_inputs_are_tracked():
    ib = InputBatch(2, 32, 4)
    ib.update(msg(new_requests=[new("a", [5, 6, 7], [0])]))
    a = ib.states["a"]
    [s] = launch(ib, {"a": 3}, step_no=0)            # prefill: samples, one token pending
    assert s is a and ib.num_tokens[0] == 4 and ib.num_known[0] == 3 and ib.pending_src[0] == 0
    launch(ib, {"a": 1}, step_no=1)                  # async: runs on the pending token (position 3)
    assert ib.num_computed[0] == 4 and ib.num_tokens[0] == 5 and ib.pending_step[0] == 1
    ib.record_sampled([a], [40])                     # step 0's token
    ib.record_sampled([a], [41])                     # step 1's token
    assert tokens(ib, "a") == [5, 6, 7, 40, 41] and a.output_token_ids == [40, 41]
    assert ib.num_tokens[0] == ib.num_known[0] == 5


def test_preempted_request_keeps_its_state_and_resumes_with_new_blocks():
    ib = InputBatch(3, 32, 4)
    ib.update(msg(new_requests=[new("a", [5, 6, 7], [0]), new("b", [8], [1])]))
    a = ib.states["a"]
    launch(ib, {"a": 3, "b": 1}, step_no=0)
    ib.update(msg(preempted_req_ids=["a"]))          # preempted while its token is in flight
    assert not a.is_active and "a" in ib.states and a.num_computed_tokens == 0 and a.num_pending == 1
    ib.update(msg(new_requests=[new("c", [9, 9], [2])]))
    assert ib.row_of["c"] == 0                       # a's row went to c
    ib.record_sampled([a, ib.states["b"]], [40, 50])  # a's token arrives while it is out of the batch
    assert a.output_token_ids == [40] and a.num_pending == 0 and tokens(ib, "c") == [9, 9]
    ib.update(msg(resumed_requests=[ResumedRequestData("a", [6, 3], 0)]))
    assert a.is_active and tokens(ib, "a") == [5, 6, 7, 40] and blocks(ib, "a") == [6, 3]
    row = ib.row_of["a"]
    assert row == 2
    assert ib.num_computed[row] == 0 and ib.num_tokens[row] == 4   # all 4 recomputed, then it samples
    assert [s.req_id for s in launch(ib, {"a": 4}, step_no=1)] == ["a"]


def test_a_late_token_of_a_finished_request_never_lands_in_a_reused_row():
    ib = InputBatch(1, 32, 4)
    ib.update(msg(new_requests=[new("a", [5, 6, 7], [0])]))
    [a] = launch(ib, {"a": 3}, step_no=0)
    ib.update(msg(finished_req_ids=["a"], new_requests=[new("a", [1, 2, 3, 4, 5], [1])]))  # id reused
    ib.record_sampled([a], [99])
    assert tokens(ib, "a") == [1, 2, 3, 4, 5] and ib.states["a"] is not a


def test_sampling_metadata_greedy_batch_carries_no_per_row_data():
    ib = InputBatch(4, 32, 4)
    ib.update(msg(new_requests=[new(r, [1, 2], [0], temperature=0) for r in "abc"]))
    states = launch(ib, {"a": 2, "b": 2, "c": 2}, 0)
    rows = np.array([ib.row_of[s.req_id] for s in states])
    meta = build_sampling_metadata(ib, rows, states, np.zeros(3, dtype=np.int64), torch.device("cpu"))
    assert meta.all_greedy and meta.greedy is None and meta.temperature is None
    assert meta.max_num_logprobs is None and not meta.penalties and meta.bias_rows is None and not meta.generators
    assert meta.allowed_rows is None and meta.grammar_rows is None and not meta.needs_host_tokens


def test_sampling_metadata_of_a_mixed_batch():
    ib = InputBatch(4, 32, 4)
    ib.update(msg(new_requests=[
        new("g", [1], [0], temperature=0, logprobs=2),
        new("s", [1], [1], temperature=0.7, top_k=5, top_p=0.9, seed=11),
        new("p", [4, 5], [2], temperature=0, repetition_penalty=1.3, min_tokens=2, stop_token_ids=[9]),
        new("m", [1], [3], temperature=0.5, min_p=0.1, min_tokens=1, ignore_eos=True)]))
    order = {"p": 2, "g": 1, "s": 1, "m": 1}
    states = launch(ib, order, 0)
    assert [s.req_id for s in states] == ["p", "g", "s", "m"]
    rows = ib.rows_of(order)
    dev = torch.device("cpu")
    meta = build_sampling_metadata(ib, rows, states, np.array([0, 0, 0, 1]), dev)
    assert not meta.all_greedy and meta.greedy.tolist() == [True, True, False, False]
    assert meta.temperature.tolist() == [0, 0, 0.7, 0.5] and meta.top_k.tolist() == [0, 0, 5, 0]
    assert meta.top_p.tolist() == [1.0, 1.0, 0.9, 1.0] and meta.min_p.tolist() == [0, 0, 0, 0.1]
    assert meta.max_num_logprobs == 2 and list(meta.generators) == [2]
    [pen] = meta.penalties
    assert (pen.row, pen.repetition_penalty, list(pen.prompt_token_ids)) == (0, 1.3, [4, 5])
    # p is under min_tokens (stop id and EOS banned); m has its one token (and ignores EOS anyway)
    assert meta.bias_rows.tolist() == [0, 0] and meta.bias_token_ids.tolist() == [EOS, 9]
    assert np.isneginf(meta.bias_values).all()
    gen = meta.generators[2]
    again = build_sampling_metadata(ib, rows, states, np.array([2, 1, 1, 2]), dev)
    assert again.generators[2] is gen and again.bias_rows is None  # made once, kept by the request


def test_sampling_metadata_logit_changes_are_flat_arrays():
    """logit_bias, one-token bad words, min_tokens bans and allowed ids of several rows become one sparse
    list each; a bad word of several tokens bans its last token only right after its first ones."""
    ib = InputBatch(4, 32, 4, vocab_size=100)
    bad = SamplingParams(max_tokens=50, temperature=0, bad_words=["x"])
    ib.update(msg(new_requests=[
        new("b", [1], [0], temperature=0, logit_bias={5: -100, 6: 2.5, 150: 1}),
        new("a", [1], [1], temperature=0, allowed_token_ids=[3, 4, 200]),
        NewRequestData("w", [1], bad, [2], 0, (EOS,), bad_words_token_ids=[[7], [20, 21, 22]]),  # the front's
        new("m", [1], [3], temperature=0, min_tokens=3, logit_bias={8: 1})]))
    order = {"b": 1, "a": 1, "w": 1, "m": 1}
    states = launch(ib, order, 0)
    rows = ib.rows_of(order)
    meta = build_sampling_metadata(ib, rows, states, np.array([0, 0, 0, 0]), torch.device("cpu"))
    triples = sorted(zip(meta.bias_rows.tolist(), meta.bias_token_ids.tolist(), meta.bias_values.tolist()))
    inf = float("-inf")
    assert triples == [(0, 5, -100.0), (0, 6, 2.5), (2, 7, inf), (3, EOS, inf), (3, 8, 1.0)]  # 150: past the vocab
    assert meta.allowed_rows.tolist() == [1, 1] and meta.allowed_token_ids.tolist() == [3, 4]
    assert meta.reads_history and meta.needs_host_tokens
    # After w generated 20, 21 its next token may not be 22; once m has 3 tokens EOS is allowed again.
    ib.states["w"].output_token_ids[:] = [9, 20, 21]
    meta = build_sampling_metadata(ib, rows, states, np.array([1, 1, 3, 3]), torch.device("cpu"))
    triples = sorted(zip(meta.bias_rows.tolist(), meta.bias_token_ids.tolist(), meta.bias_values.tolist()))
    assert triples == [(0, 5, -100.0), (0, 6, 2.5), (2, 7, inf), (2, 22, inf), (3, 8, 1.0)]


def test_bad_words_ride_beside_the_params_from_the_front_to_the_worker():
    """The front's tokenization of bad_words travels in EngineCoreRequest, the core's Request and
    NewRequestData, never inside the user's SamplingParams."""
    from splitserve.config import SchedulerConfig
    from splitserve.core.kv_cache_manager import KVCacheManager
    from splitserve.core.request import Request
    from splitserve.core.scheduler import Scheduler
    from splitserve.protocol.core_messages import AddRequests, Codec, FrontToCore
    from tests.engine.test_async_engine import FakeFront

    front = FakeFront(8)
    front.world_size, front.loras = 1, None
    params = SamplingParams(n=2, max_tokens=5, bad_words=["ab"])
    _, sent = front.new_request("r", [1, 2, 3], params)
    words = [[97, 98], [32, 97, 98]]  # "ab" and " ab" by the fake tokenizer
    assert [r.bad_words_token_ids for r in sent] == [words, words]
    assert all(not hasattr(r.sampling_params, "_bad_words_token_ids") for r in sent)
    sched = Scheduler(SchedulerConfig(8, 100), KVCacheManager(20, 4, False))
    for r in Codec(FrontToCore).decode(Codec(FrontToCore).encode(AddRequests(sent))).requests:
        sched.add_request(Request(r.request_id, r.prompt_token_ids, r.sampling_params, r.eos_token_ids,
                                  r.max_total_tokens, bad_words_token_ids=r.bad_words_token_ids))
    out = sched.schedule()
    assert [n.bad_words_token_ids for n in out.new_requests] == [words, words]
    ib = InputBatch(4, 32, 4, vocab_size=100)
    ib.update(out)
    assert [ib.states[r.request_id].bad_word_seqs for r in sent] == [((97, 98), (32, 97, 98))] * 2


def test_sampling_metadata_places_grammar_masks_on_their_sampling_rows():
    from splitserve.protocol.sched_output import GrammarBitmask
    ib = InputBatch(4, 32, 4)
    ib.update(msg(new_requests=[new(r, [1, 2, 3], [0], temperature=0) for r in "xyz"]))
    order = {"x": 2, "y": 3, "z": 3}  # x is mid-prefill: it does not sample
    states = launch(ib, order, 0)
    assert [s.req_id for s in states] == ["y", "z"]
    sample_rows = np.array([ib.row_of["y"], ib.row_of["z"]])
    masks = torch.tensor([[5], [6]], dtype=torch.int32)
    meta = build_sampling_metadata(ib, sample_rows, states, np.zeros(2, dtype=np.int64), torch.device("cpu"),
                                   GrammarBitmask(["z", "y"], masks))
    assert meta.grammar_rows.tolist() == [1, 0] and meta.grammar_bitmask is masks and meta.needs_host_tokens
