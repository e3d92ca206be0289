"""Server-sent events stay one line per event for every line splitter, whatever the text holds."""
import json

import httpx

from splitserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from splitserve.entrypoints.openai.serving import _sse


def test_event_with_unicode_line_separators_is_one_line_for_splitlines_clients():
    # Model output can contain NEL, LINE SEPARATOR, PARAGRAPH SEPARATOR and C0 separators; JSON keeps
    # the first three raw, and str.splitlines-based clients (httpx aiter_lines) would split there.
    text = "a\x85b\u2028c\u2029d\x1ce\x0bf\x0cg\rh\ni"
    event = _sse(ErrorResponse(error=ErrorInfo(message=text, type="t")).model_dump_json())
    decoder = httpx._decoders.LineDecoder()
    lines = [line for line in decoder.decode(event) + decoder.flush() if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: "):])["error"]["message"] == text
    assert event.endswith("\n\n") and event.splitlines()[1:] == [""]
