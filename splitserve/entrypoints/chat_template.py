"""`--chat-template`: a Jinja chat template given as a file or inline, checked before the model loads."""
from __future__ import annotations

import os


def load_chat_template(value: str | None) -> str | None:
    """The template's text: the file's content when `value` names a file, else `value` itself when it
    looks like a template (it has Jinja delimiters). A template that does not parse is a ValueError
    with Jinja's reason, raised at start-up rather than on the first chat request."""
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {value}: cannot read it: {e}") from None
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"--chat-template {value!r}: no such file, and not an inline Jinja template "
                         "(it has no {{ or {%)")
    import jinja2
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: not a valid Jinja template: {e.message} (line {e.lineno})") from None
    return text
