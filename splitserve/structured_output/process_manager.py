"""Grammar state of constrained requests kept in a grammar process (structured_output/grammar_process.py).

The same contract as the in-process `StructuredOutputManager` (register, is_ready, take_failed,
sampling_requests, fill_bitmask, accept_tokens, release), plus a fill split in two so that it runs
while the core does other work: `queue_fill` (the rows of the step just launched), `send_fill`
(they go out, with the tokens of the step before when `accept_tokens` sends those), `take_fill` (the
rows, read from memory shared with the process, once it says they are filled).

- The process is started ahead by the engine core when its model runs on a GPU (`start`, at the end
  of its start-up: the process's own start-up, ~5 s of imports, tokenizer and vocabulary, then
  overlaps the first requests instead of delaying the first constrained one), else by the first
  constrained request; as a plain interpreter
  (`python -m`), with one end of a Unix socket pair and an anonymous shared file for the rows; it
  loads the tokenizer itself (the same loader as the front) and compiles grammars on its threads.
- Requests are known there by a number (`ProcessGrammar.handle`): an id may be reused once its
  request has finished. Requests that ended are dropped with the next message.
- If the process cannot start (it exits before saying hello), the in-process manager takes over
  (nothing has been compiled there yet). If it dies later, or stops answering for `_REPLY_TIMEOUT_S`,
  every constrained request ends with an error (`take_failed`, and `accept_tokens` for those whose
  tokens it was given), rows of a pending fill allow everything, and the next constrained request
  starts a new process; after `_MAX_LOSSES` such losses within `_LOSS_WINDOW_S` no new one is started:
  constrained requests then fail at once with the reason (a grammar that keeps crashing the process
  would otherwise restart it, ~5 s of CPU each time, for every request), other requests go on.
"""
from __future__ import annotations

import logging
import mmap
import os
import pickle
import select
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections import deque
from typing import Callable

import torch

from splitserve.structured_output.grammar_process import recv_message, send_message
from splitserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

_REPLY_TIMEOUT_S = 60.0    # a fill takes milliseconds; this long means the process is stuck
_STARTUP_TIMEOUT_S = 300.0  # tokenizer and xgrammar's vocabulary view of a 256k vocabulary included
_SOCKET_BUFFER = 4 << 20
_MAX_LOSSES = 3            # processes lost (after their hello) within the window: no more restarts
_LOSS_WINDOW_S = 600.0


class ProcessGrammar:
    """A constrained request's grammar, from the core's side."""
    __slots__ = ("handle", "ready", "failed")

    def __init__(self, handle: int, failed: str | None = None):
        self.handle = handle
        self.ready = False
        self.failed = failed  # why it cannot run (compile error, process lost)


class _Process:
    """The child, its socket and the shared rows."""

    def __init__(self, setup: bytes, rows: int, words: int):
        self.rows, self.words = rows, words
        size = rows * words * 4
        if hasattr(os, "memfd_create"):
            self.fd = os.memfd_create("splitserve-grammar-bitmask")
        else:
            fd, path = tempfile.mkstemp(prefix="splitserve-grammar-")
            os.unlink(path)
            self.fd = fd
        os.ftruncate(self.fd, size)
        self.shared = mmap.mmap(self.fd, size)
        self.bitmask = torch.frombuffer(self.shared, dtype=torch.int32).view(rows, words)
        self.sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for s in (self.sock, child):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
        # The child imports the splitserve this process runs (a checkout need not be the installed one).
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "splitserve.structured_output.grammar_process", str(child.fileno()),
                 str(self.fd), str(rows), str(words)], pass_fds=(child.fileno(), self.fd), env=env)
        finally:
            child.close()  # the child's end lives in the child only: its death is our end of file
        self.started = time.monotonic()
        send_message(self.sock, ("setup", setup))
        # Ends the child when the manager is dropped without shutdown (an engine garbage-collected).
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.sock)

    def close(self) -> None:
        self._finalizer()


def _stop(proc: subprocess.Popen, sock: socket.socket) -> None:
    try:
        send_message(sock, ("exit",))
    except OSError:
        pass
    sock.close()
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class GrammarProcessManager:
    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], tokenizer_loader: Callable[[], object],
                 max_rows: int, max_workers: int = 2):
        """tokenizer_loader must pickle (the process calls it): e.g. functools.partial of
        loading.resolve.load_serving_tokenizer."""
        self.vocab_size = vocab_size
        self.bitmask_words = -(-vocab_size // 32)
        self._eos = tuple(eos_token_ids)
        self._loader = tokenizer_loader
        self._max_rows = max_rows
        self._max_workers = max_workers
        self._tokenizer = None
        self.live: dict[int, object] = {}
        self._proc: _Process | None = None
        self._hello = False
        self._next_handle = 0
        self._by_handle: dict[int, object] = {}
        self._dropped: list[int] = []
        self._replies: deque = deque()
        self._stale = {"accepted": 0, "filled": 0}  # replies nobody waits for any more
        self._queued: list | None = None     # rows of the launched step, not sent yet
        self._sent: list | None = None       # rows being filled
        self._inline: StructuredOutputManager | None = None  # the fallback, when the process cannot start
        self._losses: deque[float] = deque()  # when processes were lost (after their hello)
        self._given_up: str | None = None     # why no process is started any more

    @property
    def process(self) -> subprocess.Popen | None:
        return None if self._proc is None else self._proc.proc

    @property
    def fills_elsewhere(self) -> bool:
        """The core sends its fills out and takes the rows later (False once the fallback runs)."""
        return self._inline is None

    def set_tokenizer(self, tokenizer) -> None:
        self._tokenizer = tokenizer  # for the fallback; the process loads its own with the loader
        if self._inline is not None:
            self._inline.set_tokenizer(tokenizer)

    # -- the process ------------------------------------------------------------------------------
    def start(self) -> None:
        """Starts the process now, without waiting for it (the engine core calls this at the end of its
        start-up; a no-op once a process runs, the fallback took over, or restarts stopped)."""
        if self._proc is None and self._inline is None and self._given_up is None:
            self._start()

    def _start(self) -> bool:
        try:
            setup = pickle.dumps((self._loader, self.vocab_size, self._eos, self._max_workers))
            self._proc = _Process(setup, self._max_rows, self.bitmask_words)
        except Exception as exc:  # cannot spawn, a loader that does not pickle, ...
            logger.warning("grammar process could not start (%s); filling grammar masks in this process", exc)
            self._fall_back()
            return False
        self._hello = False
        return True

    def _fall_back(self) -> None:
        """The in-process manager takes over every live request (none has compiled in the process)."""
        self._proc = None
        inline = StructuredOutputManager(self.vocab_size, self._eos, self._loader, self._max_workers)
        if self._tokenizer is not None:
            inline.set_tokenizer(self._tokenizer)
        self._inline = inline
        for request in list(self.live.values()):
            inline.register(request)
        self.live = inline.live

    def _lost(self, why: str) -> None:
        """The process died or hangs: before its hello, the fallback takes over; after it, every
        constrained request fails, and the next one starts a new process."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.proc.kill()
            proc.close()
        if not self._hello:
            logger.warning("grammar process did not start (%s); filling grammar masks in this process", why)
            self._fall_back()
            return
        logger.error("grammar process lost (%s): its %d constrained requests end with an error", why, len(self.live))
        reason = f"structured outputs: the grammar process was lost ({why})"
        now = time.monotonic()
        self._losses.append(now)
        while self._losses[0] < now - _LOSS_WINDOW_S:
            self._losses.popleft()
        if len(self._losses) >= _MAX_LOSSES:
            self._given_up = (f"structured outputs are unavailable: the grammar process was lost {len(self._losses)} "
                              f"times in {_LOSS_WINDOW_S:.0f} s (last: {why}); it is not restarted until the "
                              f"engine restarts")
            logger.error("%s", self._given_up)
        for request in self.live.values():
            request.grammar.failed = reason
            request.grammar.ready = False
        self._by_handle.clear()
        self._dropped.clear()
        self._replies.clear()
        self._stale = {"accepted": 0, "filled": 0}

    def _send(self, message) -> bool:
        if self._proc is None:
            return False
        try:
            send_message(self._proc.sock, message)
        except OSError as exc:
            self._lost(f"send failed: {exc}")
            return False
        return True

    def _read(self, timeout: float) -> bool:
        """Reads and applies one message if one comes within timeout; False when none did."""
        proc = self._proc
        if proc is None:
            return False
        if not select.select([proc.sock], [], [], timeout)[0]:
            if not self._hello and time.monotonic() - proc.started > _STARTUP_TIMEOUT_S:
                self._lost("no hello")
            elif proc.proc.poll() is not None:
                self._lost(f"exit code {proc.proc.returncode}")
            return False
        try:
            message = recv_message(proc.sock)
        except OSError as exc:
            message, why = None, str(exc)
        else:
            why = f"exit code {proc.proc.wait()}" if message is None else ""
        if message is None:
            self._lost(why)
            return False
        op = message[0]
        if op in ("accepted", "filled"):
            if self._stale[op]:
                self._stale[op] -= 1
            else:
                self._replies.append(message)
        elif op == "ready":
            for handle in message[1]:
                request = self._by_handle.get(handle)
                if request is not None:
                    request.grammar.ready = True
        elif op == "failed":
            for handle, reason in message[1]:
                request = self._by_handle.get(handle)
                if request is not None:
                    request.grammar.failed = f"structured output grammar failed to compile: {reason}"
        elif op == "hello":
            self._hello = True
        return True

    def _drain(self) -> None:
        while self._proc is not None and self._read(0.0):
            pass

    def _await(self, op: str):
        """The next reply of this kind; None if the process was lost meanwhile."""
        deadline = time.monotonic() + _REPLY_TIMEOUT_S
        while True:
            if self._replies:
                message = self._replies.popleft()
                assert message[0] == op, f"grammar process: expected {op!r}, got {message[0]!r}"
                return message
            if self._proc is None:
                return None
            if time.monotonic() > deadline:
                self._lost(f"no {op!r} reply in {_REPLY_TIMEOUT_S:.0f} s")
                return None
            self._read(1.0)

    # -- requests ---------------------------------------------------------------------------------
    def register(self, request) -> None:
        if self._inline is not None:
            return self._inline.register(request)
        params = request.sampling_params.structured_outputs
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        try:
            key = params.key()
        except ValueError as e:  # the front checks this; a request from elsewhere fails at admission
            request.grammar = ProcessGrammar(handle, f"structured output grammar failed to compile: {e}")
            self.live[id(request)] = request
            return
        if self._given_up is not None:
            request.grammar = ProcessGrammar(handle, self._given_up)  # take_failed ends it
            self.live[id(request)] = request
            return
        request.grammar = ProcessGrammar(handle)
        if self._proc is not None and self._proc.proc.poll() is not None:
            self._drain()  # a hello it sent before it died counts: a lost process, not one that never started
            if self._proc is not None:
                self._lost(f"exit code {self._proc.proc.returncode}")  # died while idle: start another
            if self._inline is not None:
                return self._inline.register(request)
            if self._given_up is not None:
                request.grammar.failed = self._given_up
                self.live[id(request)] = request
                return
        self.live[id(request)] = request
        if self._proc is None and not self._start():
            return  # the fallback registered it
        self._by_handle[handle] = request
        self._send(("add", handle, list(key), list(request.eos_token_ids)))

    def release(self, request) -> None:
        if self._inline is not None:
            return self._inline.release(request)
        self.live.pop(id(request), None)
        handle = request.grammar.handle
        if self._by_handle.pop(handle, None) is not None:
            self._dropped.append(handle)

    def is_ready(self, request) -> bool:
        if self._inline is not None:
            return self._inline.is_ready(request)
        grammar = request.grammar
        if not grammar.ready and grammar.failed is None:
            self._drain()
            if self._inline is not None:
                return self._inline.is_ready(request)
        return grammar.ready

    def take_failed(self) -> list[tuple[object, str]]:
        if self._inline is not None:
            return self._inline.take_failed()
        self._drain()
        if self._inline is not None:
            return self._inline.take_failed()
        failed = [(r, r.grammar.failed) for r in self.live.values() if r.grammar.failed is not None]
        for request, _ in failed:
            self.release(request)
        return failed

    def has_pending_compiles(self) -> bool:
        if self._inline is not None:
            return self._inline.has_pending_compiles()
        return any(not r.grammar.ready and r.grammar.failed is None for r in self.live.values())

    def wait_for_compiles(self, timeout: float) -> None:
        if self._inline is not None:
            return self._inline.wait_for_compiles(timeout)
        if self.has_pending_compiles() and self._read(timeout):
            self._drain()

    # -- steps ------------------------------------------------------------------------------------
    def sampling_requests(self, sched, sampling: Callable[[object, int], bool]) -> list:
        if self._inline is not None:
            return self._inline.sampling_requests(sched, sampling)
        if not self.live:
            return []
        num_tokens = sched.num_scheduled_tokens
        return [r for r in self.live.values()
                if (n := num_tokens.get(r.request_id)) and r.grammar.ready and sampling(r, n)]

    def accept_tokens(self, pairs: list[tuple[object, int]]) -> dict[int, str | None]:
        """Advances the matchers by a step's sampled tokens (the queued fill goes out in the same
        message). Returns {id(request): None} for requests whose grammar ended (complete, or it refused
        the token), {id(request): reason} for those whose grammar process was lost."""
        return self.accept_tokens_later(pairs)()

    def accept_tokens_later(self, pairs: list[tuple[object, int]]) -> Callable[[], dict[int, str | None]]:
        """accept_tokens in two halves: the tokens go out now, the returned function waits for the
        answer (the caller works meanwhile; nothing else may be sent before it is called)."""
        if self._inline is not None:
            return self._inline.accept_tokens_later(pairs)
        # Requests of a lost process: their token may come from an all-allowed row.
        ended = {id(r): r.grammar.failed for r, _ in pairs if r.grammar.failed is not None}
        pairs = [(r, t) for r, t in pairs if r.grammar.ready]
        if not pairs:
            return lambda: ended
        requests = self._queued
        fill = self._take_queued()
        sent = self._send(("step", self._take_dropped(), [[r.grammar.handle, t] for r, t in pairs], fill))
        if fill is not None:
            self._sent = requests  # a lost process answers with all-allowed rows (take_fill)

        def answer() -> dict[int, str | None]:
            reply = self._await("accepted") if sent else None
            if reply is None:
                reason = next((r.grammar.failed for r, _ in pairs if r.grammar.failed),
                              "structured outputs: the grammar process was lost")
                ended.update((id(r), reason) for r, _ in pairs)
                return ended
            for handle, rejected in reply[1]:
                request = self._by_handle.get(handle)
                if request is None:
                    continue
                if rejected:
                    logger.warning("request %s: sampled token is not allowed by its grammar; ending it",
                                   request.request_id)
                ended[id(request)] = None
            return ended
        return answer

    def accept_token(self, request, token: int) -> bool:
        """One token (the in-process manager's single-request form)."""
        return id(request) in self.accept_tokens([(request, token)])

    def queue_fill(self, requests: list) -> None:
        """The rows of the step just launched: they go out with the next message."""
        if self._inline is None and len(requests) > self._max_rows:
            raise ValueError(f"{len(requests)} constrained rows in a step, more than max_num_seqs {self._max_rows}")
        self._queued = list(requests)

    def _take_queued(self) -> list[int] | None:
        queued, self._queued = self._queued, None
        return None if queued is None else [r.grammar.handle for r in queued]

    def _take_dropped(self) -> list[int]:
        dropped, self._dropped = self._dropped, []
        return dropped

    def send_fill(self) -> None:
        """Sends the queued rows unless `accept_tokens` already has."""
        if self._inline is not None or self._queued is None:
            return
        requests = self._queued
        fill = self._take_queued()
        if self._send(("step", self._take_dropped(), [], fill)):
            self._stale["accepted"] += 1  # nobody waits for the empty accept
        self._sent = requests  # a lost process answers with all-allowed rows (take_fill)

    def take_fill(self) -> torch.Tensor:
        """The rows of the fill sent last ([rows, words] int32, valid until the next fill). Rows of a
        lost process allow everything (its requests end with an error)."""
        if self._inline is not None:
            requests, self._queued = self._queued or [], None
            return self._inline.fill_bitmask(requests)
        requests, self._sent = self._sent, None
        if requests is None:  # queued, but the process was lost before it was sent
            requests, self._queued = self._queued or [], None
            return torch.full((len(requests), self.bitmask_words), -1, dtype=torch.int32)
        proc = self._proc
        if self._await("filled") is None:
            return torch.full((len(requests), self.bitmask_words), -1, dtype=torch.int32)
        return proc.bitmask[:len(requests)]

    def discard_fill(self) -> None:
        """Forgets a fill nobody will take (its step failed)."""
        self._queued = None
        if self._sent is not None:
            self._sent = None
            self._stale["filled"] += 1

    def fill_bitmask(self, requests: list, drafts: dict[str, list[int]] | None = None) -> torch.Tensor:
        """The masks of `requests` now (row i for requests[i]), in memory of their own. Draft rows
        (speculative decoding) only inline: with speculation the matchers live in the core's process."""
        if self._inline is not None:
            return self._inline.fill_bitmask(requests, drafts)
        if drafts:
            raise RuntimeError("grammar masks for draft tokens need the in-process matchers (speculative decoding)")
        self.queue_fill(requests)
        self.send_fill()
        return self.take_fill().clone()

    def shutdown(self) -> None:
        if self._inline is not None:
            self._inline.shutdown()
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.close()
