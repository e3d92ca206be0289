"""`splitserve chat`: a conversation in the terminal, streamed token by token.

Ctrl-C while an answer is being written stops that answer (the part written so far stays in the
conversation) and gives the prompt back; a second Ctrl-C before the answer has stopped, Ctrl-C at
the prompt, Ctrl-D, an empty line or /exit quit.

The first Ctrl-C only raises a flag that the loop reads between engine steps: a KeyboardInterrupt
raised in the middle of a step would leave the scheduler and the worker disagreeing about it.
"""
from __future__ import annotations

import signal
import sys
from typing import Callable, TextIO

BANNER = ("splitserve chat — Ctrl-C stops an answer; Ctrl-D, Ctrl-C at the prompt, an empty line or /exit "
          "quits; /clear resets the conversation")


class _StopOnInterrupt:
    """While active, the first SIGINT sets `requested`; the next one raises KeyboardInterrupt."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "_StopOnInterrupt":
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


def stream_answer(llm, messages: list[dict], params, out: TextIO) -> tuple[str, bool]:
    """Writes one answer as it comes; -> (its text, whether Ctrl-C stopped it)."""
    engine = llm.engine
    rid = engine.add_request(None, llm.apply_chat_template(messages), params)
    reply = ""
    with _StopOnInterrupt() as interrupt:
        stopped = False
        while engine.has_unfinished_requests():
            if interrupt.requested and not stopped:
                engine.abort_request(rid)  # frees its blocks; the loop runs on until the engine is idle
                stopped = True
            for output in engine.step():
                if output.request_id == rid and not stopped:
                    piece = output.outputs[0].delta_text
                    reply += piece
                    out.write(piece)
                    out.flush()
        stopped = stopped or interrupt.requested
    out.write("\n[stopped]\n" if stopped else "\n")
    return reply, stopped


def chat_loop(llm, params, system: str | None = None, read_line: Callable[[str], str] = input,
              out: TextIO | None = None) -> int:
    out = out or sys.stdout
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    print(BANNER, file=sys.stderr)
    while True:
        try:
            line = read_line("> ")
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return 0
        if line.strip() in ("", "/exit", "/quit"):
            return 0
        if line.strip() == "/clear":
            history = history[:1] if system else []
            continue
        history.append({"role": "user", "content": line})
        reply, _ = stream_answer(llm, history, params, out)
        history.append({"role": "assistant", "content": reply})
