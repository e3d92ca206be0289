"""The engine core's grammar state, on the default model's tokenizer, with plain request objects."""
import time

import numpy as np
import pytest
import torch

from splitserve.protocol.sched_output import SchedulerOutput
from splitserve.loading.resolve import load_tokenizer
from splitserve.core.request import Request
from splitserve.sampling_params import SamplingParams, StructuredOutputsParams
from splitserve.structured_output.manager import StructuredOutputManager


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def request(rid: str, **so) -> Request:
    return Request(rid, [1, 2], SamplingParams(structured_outputs=StructuredOutputsParams(**so)), (2,), 100)


def wait_ready(manager, req, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not manager.is_ready(req):
        assert time.monotonic() < deadline, "grammar did not compile"
        manager.wait_for_compiles(0.05)


def allowed(bitmask_row: torch.Tensor, vocab: int) -> set[int]:
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


def test_masks_follow_the_grammar_and_never_allow_padding_ids(tokenizer):
    """The model's vocabulary is wider than the tokenizer's (37 padding ids): they are never allowed,
    even by a grammar that allows almost anything."""
    vocab = len(tokenizer) + 37
    manager = StructuredOutputManager(vocab, (2,), lambda: tokenizer)
    assert manager.bitmask_words == -(-vocab // 32)
    digits = request("d", regex="[0-9]{2}")
    anything = request("a", regex="(.|\n)+")
    for r in (digits, anything):
        manager.register(r)
        wait_ready(manager, r)
    sched = SchedulerOutput(num_scheduled_tokens={"d": 2, "a": 2, "other": 1})
    step = manager.step_bitmask(sched, lambda req, n: True)
    assert step.req_ids == ["d", "a"] and step.bitmask.shape == (2, manager.bitmask_words)
    digit_ids = {i for i in range(len(tokenizer)) if tokenizer.decode([i]) and tokenizer.decode([i]).isdigit()
                 and len(tokenizer.decode([i])) <= 2}
    first = allowed(step.bitmask[0], vocab)
    assert first and first <= digit_ids
    wide = allowed(step.bitmask[1], vocab)
    assert len(wide) > len(tokenizer) // 2 and max(wide) < len(tokenizer)
    # Two digits, then only the stop token; accepting it ends the grammar.
    one = tokenizer.encode("7", add_special_tokens=False)[0]
    assert not manager.accept_token(digits, one) and not manager.accept_token(digits, one)
    step = manager.step_bitmask(SchedulerOutput(num_scheduled_tokens={"d": 1}), lambda req, n: True)
    assert allowed(step.bitmask[0], vocab) == {2}
    assert manager.accept_token(digits, 2)


def test_equal_constraints_share_one_compile_and_failures_are_reported(tokenizer):
    manager = StructuredOutputManager(len(tokenizer), (2,), lambda: tokenizer)
    a, b = request("a", json={"type": "integer"}), request("b", json='{"type":"integer"}')
    manager.register(a)
    manager.register(b)
    assert a.grammar.future is b.grammar.future
    bad = Request("x", [1], SamplingParams(structured_outputs=StructuredOutputsParams(grammar="root ::= nope")), (2,), 10)
    manager.register(bad)
    wait_ready(manager, a)
    deadline = time.monotonic() + 30
    while not bad.grammar.future.done():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not manager.is_ready(bad)
    [(req, reason)] = manager.take_failed()
    assert req is bad and 'Rule "nope" is not defined' in reason
    assert manager.step_bitmask(SchedulerOutput(num_scheduled_tokens={"zzz": 1}), lambda r, n: True) is None
    manager.release(a)
    manager.release(b)
    assert not manager.live


def test_rows_of_requests_that_ended_since_scheduling_allow_everything(tokenizer):
    """With masks filled after the launch, a request scheduled in the step may have ended meanwhile
    (its grammar completed, or it was aborted): its row allows every id (the token is discarded);
    the others get their grammar's mask, in the batch fill and one by one alike."""
    from splitserve.core.request import RequestStatus
    vocab = len(tokenizer)
    manager = StructuredOutputManager(vocab, (2,), lambda: tokenizer)
    done, aborted, live = request("done", regex="[0-9]"), request("ab", regex="[0-9]"), request("live", regex="[0-9]")
    for r in (done, aborted, live):
        manager.register(r)
        wait_ready(manager, r)
    seven = tokenizer.encode("7", add_special_tokens=False)[0]
    assert not manager.accept_token(done, seven) and manager.accept_token(done, 2)  # grammar complete
    aborted.status = RequestStatus.FINISHED_ABORTED
    digits = allowed(manager.fill_bitmask([live])[0], vocab)
    assert seven in digits and len(digits) < 20
    for order in ([done, aborted, live], [live, done], [aborted]):
        bitmask = manager.fill_bitmask(order)
        for row, r in zip(bitmask, order):
            assert allowed(row, vocab) == (digits if r is live else set(range(vocab)))


def test_drafts_checked_and_masked_row_by_row_then_rolled_back(tokenizer):
    """Speculative decoding: the grammar takes a prefix of the drafts (up to the first it refuses);
    a verifying request's d + 1 rows hold the masks after 0..d drafts; the matcher is back where it
    was after both (rollback), and a plain request in the same fill keeps one row."""
    vocab = len(tokenizer)
    manager = StructuredOutputManager(vocab, (2,), lambda: tokenizer)
    digits, other = request("d", regex="[0-9]{3}"), request("o", regex="[0-9]{3}")
    for r in (digits, other):
        manager.register(r)
        wait_ready(manager, r)
    digit = [tokenizer.encode(c, add_special_tokens=False)[0] for c in "123"]
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    assert manager.valid_drafts(digits, digit + [2]) == 4  # three digits, then the stop token
    assert manager.valid_drafts(digits, [digit[0], letter, digit[1]]) == 1
    assert manager.valid_drafts(digits, [letter]) == 0
    bitmask = manager.fill_bitmask([other, digits], {"d": [digit[0], digit[1], letter]})
    assert bitmask.shape == (1 + 4, manager.bitmask_words)
    one_digit = allowed(bitmask[0], vocab)  # "o": its one row
    assert 2 not in one_digit and digit[0] in one_digit
    assert allowed(bitmask[1], vocab) == allowed(bitmask[2], vocab) == one_digit  # after 0 and 1 digit
    after_two = allowed(bitmask[3], vocab)
    assert digit[2] in after_two and letter not in after_two  # the row that rejects the letter
    # rolled back: the same masks again, and the grammar still wants three digits
    again = manager.fill_bitmask([digits], {"d": [digit[0], digit[1], letter]})
    assert torch.equal(again, bitmask[1:])
    for t in digit:
        assert not manager.accept_token(digits, t)
    assert manager.accept_token(digits, 2)
