"""`splitserve chat`: Ctrl-C (a real SIGINT) stops the answer being written and gives the prompt back; a
second Ctrl-C or Ctrl-D quits. And `--chat-template` loading. An engine double streams tokens forever."""
from __future__ import annotations

import io
import os
import signal
from types import SimpleNamespace

import pytest

from splitserve.entrypoints.chat_template import load_chat_template
from splitserve.entrypoints.terminal_chat import chat_loop


class EndlessEngine:
    """Streams "w0 w1 w2 ..." for every request until aborted; sends SIGINT to this process at the
    steps listed in `interrupt_at` (counted over the whole session)."""

    def __init__(self, interrupt_at=()):
        self.interrupt_at = set(interrupt_at)
        self.steps = 0
        self.live: dict[str, int] = {}
        self.aborted: list[str] = []
        self.prompts: list[list[dict]] = []
        self._ids = 0

    def add_request(self, request_id, prompt, params):
        rid = f"r{self._ids}"
        self._ids += 1
        self.live[rid] = 0
        return rid

    def abort_request(self, rid):
        self.aborted.append(rid)
        self.live.pop(rid, None)
        return []

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        self.steps += 1
        if self.steps in self.interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C would, in the middle of a step
        outs = []
        for rid, n in list(self.live.items()):
            self.live[rid] = n + 1
            outs.append(SimpleNamespace(request_id=rid, outputs=[SimpleNamespace(delta_text=f"w{n} ")]))
        return outs


class FakeLLM:
    def __init__(self, engine):
        self.engine = engine

    def apply_chat_template(self, messages):
        self.engine.prompts.append([dict(m) for m in messages])
        return [1, 2, 3]


def lines(*items):
    """read_line: returns the items in turn; an exception instance is raised instead."""
    it = iter(items)

    def read(prompt):
        item = next(it)
        if isinstance(item, BaseException):
            raise item
        return item
    return read


def test_ctrl_c_stops_the_answer_then_ctrl_d_quits():
    engine = EndlessEngine(interrupt_at=[3, 6])
    out = io.StringIO()
    assert chat_loop(FakeLLM(engine), None, "be brief", lines("hello", "again", EOFError()), out) == 0
    text = out.getvalue()
    assert text.count("[stopped]") == 2 and "w0 w1 w2 " in text
    assert engine.aborted == ["r0", "r1"]
    # the stopped answer stays in the conversation, up to where it was stopped
    history = engine.prompts[1]
    assert [m["role"] for m in history] == ["system", "user", "assistant", "user"]
    assert history[2]["content"].startswith("w0 w1 w2 ") and history[3]["content"] == "again"


def test_a_second_ctrl_c_while_stopping_quits():
    class Twice(EndlessEngine):  # both signals within one step: the abort has not run yet
        def step(self):
            if self.steps == 1:
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)
            return EndlessEngine.step(self)
    engine = Twice()
    # Python's own handler to begin with (a process started in the background by a non-interactive
    # shell inherits SIGINT ignored, and Python then installs none)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            chat_loop(FakeLLM(engine), None, None, lines("hello"), io.StringIO())
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is restored
    finally:
        signal.signal(signal.SIGINT, before)


def test_ctrl_c_at_the_prompt_quits():
    engine = EndlessEngine()
    assert chat_loop(FakeLLM(engine), None, None, lines(KeyboardInterrupt()), io.StringIO()) == 0
    assert engine.prompts == []


def test_chat_template_from_a_file_or_inline(tmp_path):
    tpl = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    f = tmp_path / "t.jinja"
    f.write_text(tpl)
    assert load_chat_template(str(f)) == tpl
    assert load_chat_template(tpl) == tpl
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        load_chat_template("{% for m in messages %}")
