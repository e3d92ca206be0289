"""The grammar process (structured_output/process_manager.py, grammar_process.py) against the
in-process manager, on the default model's tokenizer: the same token histories give the same masks,
bit for bit; its death ends its requests; it never outlives the process that started it."""
import functools
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from splitserve.loading.resolve import load_tokenizer
from splitserve.core.request import Request, RequestStatus
from splitserve.sampling_params import SamplingParams, StructuredOutputsParams
from splitserve.structured_output.manager import StructuredOutputManager
from splitserve.structured_output.process_manager import GrammarProcessManager

LOADER = functools.partial(load_tokenizer, None)
CONSTRAINTS = [
    dict(json={"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                "tags": {"type": "array", "items": {"type": "string"}}},
               "required": ["name", "tags"]}),
    dict(json={"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 20}),
    dict(regex=r"[A-Z][a-z]{2,8}-[0-9]{3}( [a-z]+){0,4}"),
    dict(choice=["alpha beta", "gamma", 'delta "quoted"']),
    dict(grammar='root ::= "(" item ("," item)* ")"\nitem ::= [a-z]+ | root'),
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture
def managers(tokenizer):
    inline = StructuredOutputManager(len(tokenizer), (2,), lambda: tokenizer)
    process = GrammarProcessManager(len(tokenizer), (2,), LOADER, max_rows=32)
    yield inline, process
    process.shutdown()


def make_request(rid: str, so: dict) -> Request:
    return Request(rid, [1, 2], SamplingParams(structured_outputs=StructuredOutputsParams(**so)), (2,), 1000)


def wait_ready(manager, requests, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not all(manager.is_ready(r) for r in requests):
        assert not manager.take_failed()
        assert time.monotonic() < deadline, "grammar did not compile"
        manager.wait_for_compiles(0.05)


def allowed_ids(row, vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:vocab])


def test_masks_equal_the_in_process_fill_through_joins_leaves_aborts_and_preemption(managers, tokenizer):
    """Pairs of requests, one per manager, sample the same random allowed token each step (from the
    in-process row). Requests join and leave along the way, one is aborted after its row was sent
    (its row allows everything then), and one is preempted: it skips steps and resumes with the same
    grammar state. Every step's rows must be equal bit for bit, and the ends of the grammars agree."""
    inline, process = managers
    vocab = len(tokenizer)
    rng = random.Random(0)
    pairs, serial = {}, 0

    def join(so):
        nonlocal serial
        rid = f"r{serial}"
        serial += 1
        a, b = make_request(rid, so), make_request(rid, so)
        inline.register(a)
        process.register(b)
        wait_ready(inline, [a])
        wait_ready(process, [b])
        pairs[rid] = (a, b)

    for so in CONSTRAINTS * 2:
        join(so)
    preempted_until = {}
    ended_steps = 0
    for step in range(40):
        if step in (5, 17):
            join(CONSTRAINTS[step % len(CONSTRAINTS)])
        sampling = [rid for rid in pairs if preempted_until.get(rid, -1) < step]
        if step == 8:
            preempted_until[sampling[0]] = 12  # out of the batch for four steps, grammar state kept
        rng.shuffle(sampling)
        if not sampling:
            break
        process.queue_fill([pairs[rid][1] for rid in sampling])
        aborted = None
        if step in (10, 20):
            # Aborted between the steps: at 10 before its row went out (the row allows everything, as
            # in-process), at 20 after (the row is filled; either way its token is discarded).
            if step == 20:
                process.send_fill()
            aborted = sampling[-1]
            for r in pairs[aborted]:
                r.status = RequestStatus.FINISHED_ABORTED
            inline.release(pairs[aborted][0])
            process.release(pairs[aborted][1])
        process.send_fill()
        got = process.take_fill().clone()
        want = inline.fill_bitmask([pairs[rid][0] for rid in sampling])
        assert got.shape == want.shape
        for i, rid in enumerate(sampling):
            if rid == aborted:
                assert step == 20 or (got[i] == -1).all()
                continue
            assert (got[i] == want[i]).all(), f"step {step}: {rid} rows differ"
        if aborted is not None:
            del pairs[aborted]
            sampling.remove(aborted)
        tokens = {}
        for i, rid in enumerate(sampling):
            ids = allowed_ids(want[i], vocab)
            assert len(ids) and ids.max() < vocab
            tokens[rid] = int(ids[rng.randrange(len(ids))])
        ended_a = inline.accept_tokens([(pairs[rid][0], t) for rid, t in tokens.items()])
        ended_b = process.accept_tokens([(pairs[rid][1], t) for rid, t in tokens.items()])
        assert {pairs[rid][0].request_id for rid in tokens if id(pairs[rid][0]) in ended_a} == \
            {pairs[rid][1].request_id for rid in tokens if id(pairs[rid][1]) in ended_b}
        assert all(v is None for v in ended_b.values())
        for rid in [rid for rid in tokens if id(pairs[rid][0]) in ended_a]:
            inline.release(pairs[rid][0])
            process.release(pairs[rid][1])
            del pairs[rid]
            ended_steps += 1
    assert ended_steps >= 2  # choices and short regexes complete within 40 steps
    assert len(process.live) == len(inline.live) == len(pairs)


def test_rows_of_requests_that_ended_allow_everything_and_failures_come_back(managers, tokenizer):
    inline, process = managers
    done, live = make_request("done", dict(regex="[0-9]")), make_request("live", dict(regex="[0-9]"))
    bad = make_request("bad", dict(grammar="root ::= nope"))
    for r in (done, live):
        process.register(r)
    wait_ready(process, [done, live], timeout=120)  # (its take_failed must not see bad's failure)
    process.register(bad)
    seven = tokenizer.encode("7", add_special_tokens=False)[0]
    assert process.accept_tokens([(done, seven)]) == {}
    assert process.accept_tokens([(done, 2)]) == {id(done): None}  # the stop token completes it
    rows = process.fill_bitmask([done, live])
    assert (rows[0] == -1).all() and seven in allowed_ids(rows[1], len(tokenizer))
    deadline = time.monotonic() + 60
    while not (failed := process.take_failed()):
        assert time.monotonic() < deadline
        process.wait_for_compiles(0.05)
    [(req, reason)] = failed
    assert req is bad and 'Rule "nope" is not defined' in reason and id(bad) not in process.live


def test_a_lost_grammar_process_ends_its_requests_and_the_next_one_starts_again(managers, tokenizer):
    _, process = managers
    a, b = make_request("a", dict(regex="[a-z]{3,20}")), make_request("b", dict(choice=["yes", "no"]))
    for r in (a, b):
        process.register(r)
    wait_ready(process, [a, b])
    process.queue_fill([a, b])
    process.send_fill()
    process.take_fill()
    first = process.process
    first.kill()
    first.wait()
    # The rows of a pending fill allow everything; the tokens given afterwards end with the reason.
    process.queue_fill([a, b])
    process.send_fill()
    assert (process.take_fill() == -1).all()
    ended = process.accept_tokens([(a, 5)])  # its token came from an all-allowed row: a fails
    assert list(ended) == [id(a)] and "grammar process was lost" in ended[id(a)]
    failed = dict((r.request_id, why) for r, why in process.take_failed())  # and so does b
    assert set(failed) == {"a", "b"} and all("grammar process was lost" in why for why in failed.values())
    assert not process.live
    c = make_request("c", dict(regex="[0-9]{2}"))
    process.register(c)
    wait_ready(process, [c])
    assert process.process is not first and process.process.poll() is None
    assert len(allowed_ids(process.fill_bitmask([c])[0], len(tokenizer))) > 5


def test_the_in_process_fill_takes_over_when_the_process_cannot_start(tokenizer):
    """A tokenizer loader the process cannot receive (a lambda does not pickle): the in-process
    manager serves instead, from the first request on."""
    manager = GrammarProcessManager(len(tokenizer), (2,), lambda: tokenizer, max_rows=4)
    r = make_request("x", dict(regex="[0-9]{2}"))
    manager.register(r)
    assert not manager.fills_elsewhere and manager.process is None
    wait_ready(manager, [r])
    digits = allowed_ids(manager.fill_bitmask([r])[0], len(tokenizer))
    assert tokenizer.encode("7", add_special_tokens=False)[0] in digits and len(digits) < 50
    manager.shutdown()


def test_no_grammar_process_outlives_a_killed_core(tmp_path):
    """The process that started it is killed with SIGKILL (no clean-up runs): the grammar process
    goes too."""
    script = textwrap.dedent("""
        import functools, sys, time
        from splitserve.loading.resolve import load_tokenizer
        from splitserve.core.request import Request
        from splitserve.sampling_params import SamplingParams, StructuredOutputsParams
        from splitserve.structured_output.process_manager import GrammarProcessManager
        m = GrammarProcessManager(49152, (2,), functools.partial(load_tokenizer, None), max_rows=4)
        r = Request("a", [1], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")), (2,), 10)
        m.register(r)
        while not m.is_ready(r):
            m.wait_for_compiles(0.05)
        print(m.process.pid, flush=True)
        time.sleep(600)
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    core = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        child = int(core.stdout.readline())
        os.kill(child, 0)  # alive
        core.send_signal(signal.SIGKILL)
        core.wait()
        deadline = time.monotonic() + 30
        while _alive(child):
            assert time.monotonic() < deadline, "the grammar process outlived its core"
            time.sleep(0.1)
    finally:
        core.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purpose (its parent died; init reaps it).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_start_runs_the_process_ahead_and_the_first_request_uses_it(tokenizer):
    """start() spawns the process before any request, without waiting for its hello; a second start
    and the first constrained request use that same process."""
    manager = GrammarProcessManager(len(tokenizer), (2,), LOADER, max_rows=4)
    try:
        assert manager.process is None
        manager.start()
        first = manager.process
        assert first is not None and first.poll() is None and not manager._hello
        manager.start()
        assert manager.process is first
        r = make_request("x", dict(regex="[0-9]{2}"))
        manager.register(r)
        wait_ready(manager, [r])
        assert manager.process is first and manager.fills_elsewhere
        assert tokenizer.encode("7", add_special_tokens=False)[0] in allowed_ids(manager.fill_bitmask([r])[0],
                                                                                 len(tokenizer))
    finally:
        manager.shutdown()
    assert first.poll() is not None


def test_start_is_a_no_op_once_the_in_process_fill_took_over(tokenizer):
    manager = GrammarProcessManager(len(tokenizer), (2,), lambda: tokenizer, max_rows=4)  # cannot pickle
    manager.start()
    assert manager.process is None and not manager.fills_elsewhere
    manager.start()
    assert manager.process is None
    manager.shutdown()


def _lose_running_process(manager, rid: str):
    """A constrained request runs on a live process (started if needed), then the process is killed;
    the next message to it finds it lost."""
    r = make_request(rid, dict(regex="[a-z]{3,20}"))
    manager.register(r)
    wait_ready(manager, [r])
    proc = manager.process
    proc.kill()
    proc.wait()
    ended = manager.accept_tokens([(r, 5)])
    assert "grammar process was lost" in ended[id(r)]
    manager.release(r)
    return proc


def test_restarts_stop_after_three_lost_processes(tokenizer):
    """Three processes lost within the window: the fourth constrained request starts none and fails
    at once with the reason; before that, each loss was followed by a new process."""
    manager = GrammarProcessManager(len(tokenizer), (2,), LOADER, max_rows=4)
    try:
        seen = [_lose_running_process(manager, f"r{i}") for i in range(3)]
        assert len({p.pid for p in seen}) == 3  # each loss restarted it
        r = make_request("late", dict(regex="[0-9]+"))
        manager.register(r)
        assert manager.process is None
        [(req, reason)] = manager.take_failed()
        assert req is r and "lost 3 times" in reason and "not restarted" in reason
        assert not manager.live and manager.process is None
    finally:
        manager.shutdown()


def test_losses_outside_the_window_do_not_count(tokenizer, monkeypatch):
    """The bookkeeping alone (no process): losses are counted in a sliding window of time."""
    from splitserve.structured_output import process_manager as pm
    clock = [1000.0]
    monkeypatch.setattr(pm.time, "monotonic", lambda: clock[0])
    manager = GrammarProcessManager(len(tokenizer), (2,), LOADER, max_rows=4)
    manager._hello = True
    for step in (0.0, pm._LOSS_WINDOW_S * 0.6, pm._LOSS_WINDOW_S * 0.6):  # never 3 within the window
        clock[0] += step
        manager._lost("test")
        assert manager._given_up is None
    clock[0] += 1.0
    manager._lost("test")  # the last three are within the window
    assert manager._given_up is not None and "last: test" in manager._given_up
    manager.start()
    assert manager.process is None
