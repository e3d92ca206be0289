"""The grammar process: owns the grammar matchers of the engine core's constrained requests and fills
their token bitmasks into memory it shares with the core, so the fill runs beside the core's host
work instead of on its thread (and under its GIL).

Started by `process_manager.GrammarProcessManager` as `python -m splitserve.structured_output.grammar_process
SOCKET_FD BITMASK_FD ROWS WORDS` (a plain interpreter: nothing of the user's `__main__` is imported
again). SOCKET_FD is its end of a Unix socket pair with the core; BITMASK_FD an anonymous shared file
of ROWS x WORDS int32 (one bitmask row per constrained row of a step). It ends with the core: at the
socket's end of file (the kernel closes the core's end when the core dies, SIGKILL included), or
when its parent pid changes (checked every second: a child the core forked may hold the core's end
open). Not with the parent-death signal of process_lifetime.py: that follows the *thread* that
started the process, and the first constrained request may come from any thread of the core.

Messages are length-prefixed msgpack arrays, the operation first. From the core:
- ("setup", pickled (tokenizer loader, vocab size, stop ids, compile threads)): first, once. The
  process loads the tokenizer and builds xgrammar's view of the vocabulary, then says ("hello",).
- ("add", handle, key, stop ids): a constrained request (handle: the core's number for it); its
  grammar compiles on a thread here (cached by key); then ("ready", [handle]) or
  ("failed", [[handle, reason]]) goes back whenever it is done.
- ("step", dropped handles, [[handle, token], ...], fill handles or None): forget the dropped
  requests, advance the matchers by the tokens, answer ("accepted", [[handle, rejected], ...]) for
  the matchers that ended (terminated, or refused the token: rejected 1); then, when fill handles
  are given, fill row i of the shared bitmask for fill handles[i] (all ones for a handle that is
  gone or whose grammar ended) and answer ("filled",).
- ("exit",).
"""
from __future__ import annotations

import logging
import os
import pickle
import select
import socket
import struct
import sys
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec

_HEADER = struct.Struct("<I")
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder()
# Compiled grammars kept for reuse, as in the in-process manager.
_CACHE_ENTRIES = 256

logger = logging.getLogger("splitserve.grammar_process")


def send_message(sock: socket.socket, message) -> None:
    payload = _ENCODER.encode(message)
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv_message(sock: socket.socket):
    """The next message, or None at end of file (the other side is gone)."""
    header = _recv_exact(sock, _HEADER.size)
    if header is None:
        return None
    payload = _recv_exact(sock, _HEADER.unpack(header)[0])
    return None if payload is None else _DECODER.decode(payload)


class _Entry:
    __slots__ = ("key", "future", "stops", "matcher")

    def __init__(self, key: tuple, future: Future, stops: list[int]):
        self.key, self.future, self.stops, self.matcher = key, future, stops, None


class GrammarServer:
    def __init__(self, sock: socket.socket, bitmask, wakeup_fd: int):
        self.sock = sock
        self.bitmask = bitmask  # torch int32 [rows, words] over the shared file
        self._wakeup_fd = wakeup_fd
        self.compiler = None
        self.pool: ThreadPoolExecutor | None = None
        self.cache: OrderedDict[tuple, Future] = OrderedDict()
        self.entries: dict[int, _Entry] = {}
        self.pending: dict[int, _Entry] = {}  # compiling
        self._batch = None

    def setup(self, payload: bytes) -> None:
        import xgrammar as xgr
        loader, vocab_size, eos, compile_threads = pickle.loads(payload)
        info = xgr.TokenizerInfo.from_huggingface(loader(), vocab_size=vocab_size, stop_token_ids=list(eos) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=compile_threads)
        self.pool = ThreadPoolExecutor(compile_threads, thread_name_prefix="splitserve-grammar")

    def _compiled(self, key: tuple) -> Future:
        future = self.cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self.cache.move_to_end(key)
            return future
        from splitserve.structured_output.grammar import build_grammar
        future = self.pool.submit(lambda: self.compiler.compile_grammar(build_grammar(key)))
        future.add_done_callback(lambda _: os.write(self._wakeup_fd, b"x"))
        self.cache[key] = future
        while len(self.cache) > _CACHE_ENTRIES:
            self.cache.popitem(last=False)
        return future

    def add(self, handle: int, key: list, stops: list[int]) -> None:
        entry = _Entry(_as_key(key), None, stops)
        entry.future = self._compiled(entry.key)
        self.entries[handle] = entry
        self.pending[handle] = entry
        self.report_compiles()

    def report_compiles(self) -> None:
        """Matchers for the finished compiles; the core learns which are ready or failed."""
        import xgrammar as xgr
        from splitserve.structured_output.grammar import error_reason
        ready, failed = [], []
        for handle, entry in list(self.pending.items()):
            if not entry.future.done():
                continue
            del self.pending[handle]
            if self.entries.get(handle) is not entry:
                continue  # dropped meanwhile
            exc = entry.future.exception()
            if exc is not None:
                failed.append([handle, error_reason(exc)])
                del self.entries[handle]
                continue
            entry.matcher = xgr.GrammarMatcher(entry.future.result(), override_stop_tokens=entry.stops or None)
            ready.append(handle)
        if ready:
            send_message(self.sock, ("ready", ready))
        if failed:
            send_message(self.sock, ("failed", failed))

    def step(self, dropped: list[int], tokens: list, fill: list[int] | None) -> None:
        for handle in dropped:
            self.entries.pop(handle, None)
            self.pending.pop(handle, None)
        ended = []
        for handle, token in tokens:
            entry = self.entries.get(handle)
            if entry is None or entry.matcher is None:
                continue
            if not entry.matcher.accept_token(token):
                ended.append([handle, 1])
            elif entry.matcher.is_terminated():
                ended.append([handle, 0])
        send_message(self.sock, ("accepted", ended))
        if fill is not None:
            self.fill(fill)
            send_message(self.sock, ("filled",))

    def fill(self, handles: list[int]) -> None:
        """The same calls as the in-process fill (manager.StructuredOutputManager.fill_bitmask), so
        the rows are the same bits."""
        bitmask = self.bitmask
        rows, matchers = [], []
        for i, handle in enumerate(handles):
            entry = self.entries.get(handle)
            matcher = entry.matcher if entry is not None else None
            if matcher is None or matcher.is_terminated():
                bitmask[i].fill_(-1)
            else:
                rows.append(i)
                matchers.append(matcher)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        elif matchers:
            if self._batch is None:
                import xgrammar as xgr
                from splitserve.structured_output.manager import fill_threads
                self._batch = xgr.BatchGrammarMatcher(fill_threads())
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)


def _as_key(key: list) -> tuple:
    return tuple(key)


def serve(sock: socket.socket, bitmask) -> None:
    parent = os.getppid()
    wakeup_r, wakeup_w = os.pipe()
    server = GrammarServer(sock, bitmask, wakeup_w)
    while True:
        readable, _, _ = select.select([sock, wakeup_r], [], [], 1.0)
        if os.getppid() != parent:
            return  # the core is gone (the parent-death signal covers Linux; this, the rest)
        if wakeup_r in readable:
            os.read(wakeup_r, 4096)
            server.report_compiles()
        if sock not in readable:
            continue
        message = recv_message(sock)
        if message is None:
            return  # the core closed its end, or died
        op = message[0]
        if op == "step":
            server.step(message[1], message[2], message[3])
        elif op == "add":
            server.add(message[1], message[2], message[3])
        elif op == "setup":
            server.setup(message[1])
            send_message(sock, ("hello",))
        elif op == "exit":
            return


def main(argv: list[str]) -> None:
    sock_fd, bitmask_fd, rows, words = (int(a) for a in argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s grammar process: %(message)s")
    import mmap

    import torch
    torch.set_num_threads(1)
    sock = socket.socket(fileno=sock_fd)
    shared = mmap.mmap(bitmask_fd, rows * words * 4)
    bitmask = torch.frombuffer(shared, dtype=torch.int32).view(rows, words)
    try:
        serve(sock, bitmask)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the core is gone
    except Exception:
        logger.exception("grammar process failed")
        os._exit(1)
    os._exit(0)  # the compile threads are not waited for


if __name__ == "__main__":
    main(sys.argv[1:])
