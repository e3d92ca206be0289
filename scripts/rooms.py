"""Draws the package's rooms from its imports: one line per room, top floor first, with the rooms it
imports. The order is the one tests/test_import_layers.py enforces; DESIGN.md carries this drawing
between its `rooms:begin` / `rooms:end` markers, and a test checks that it is the current one.

    python scripts/rooms.py            # print the drawing
    python scripts/rooms.py --write    # replace the drawing in DESIGN.md
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.test_import_layers import LAYERS, PACKAGE, import_arrows  # noqa: E402

BEGIN, END = "<!-- rooms:begin (scripts/rooms.py --write) -->", "<!-- rooms:end -->"


def drawing() -> str:
    targets: dict[str, set[str]] = {}
    order = [room for tier in LAYERS for room in tier]
    for src, dst, _ in import_arrows():
        if dst in order:  # not a name the package's __init__ defines (splitserve.__version__)
            targets.setdefault(src, set()).add(dst)
    names = {room: room + ("/" if (PACKAGE / room).is_dir() else ".py") for room in order}
    width = max(map(len, names.values())) + 2
    lines = ["```", "room" + " " * (width - 4) + "imports (rooms below it)"]
    for tier in LAYERS:
        for room in tier:
            name = names[room]
            below = sorted(targets.get(room, ()), key=order.index)
            lines.append(f"{name:<{width}}{', '.join(below) if below else '-'}")
    return "\n".join(lines + ["```"])


def with_drawing(design: str) -> str:
    head, _, rest = design.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{drawing()}\n{END}{tail}"


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        path = ROOT / "DESIGN.md"
        path.write_text(with_drawing(path.read_text()))
    else:
        print(drawing())
