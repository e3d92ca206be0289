"""The package's rooms (top-level folders and modules of splitserve/) import only downwards.

The order below is the one DESIGN.md draws ("Rooms"); keep the two the same. A room may import any room
in a LOWER tier and nothing in its own tier or above. Every import counts, function-local ones too
(a deferred import is still a dependency); only `if TYPE_CHECKING:` blocks are exempt.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "splitserve"

# Top first. Each inner tuple is one tier: its rooms do not import one another.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__main__",),
    ("__init__",),                       # splitserve/__init__.py: LLM, SamplingParams
    ("entrypoints",),                    # CLI, OpenAI server
    ("bench",),
    ("export",),                         # `splitserve export`: ONNX graphs of the batchful part
    ("metrics",),                        # the server's Prometheus metrics
    ("engine",),                         # LLM, LLMEngine, AsyncLLMEngine, front, core loop, EngineArgs
    ("executor",),                       # in-process runner or rank processes, multi-node launcher
    ("core",),                           # EngineCore (handed its executor), scheduler, KV manager
    ("startup",),                        # kernel precompile, bytecode warm-up
    ("worker",),                         # model runner, persistent batch, CUDA graphs
    ("structured_output",),
    ("models",),
    ("loading",),                        # HF dirs, GGUF, .nemo, safetensors
    ("multimodal",),                     # media decoding, processors
    ("lora",),
    ("kv_transfer",),                    # KV connectors: moving blocks between engines (NIXL, TCP, host memory)
    ("attention",),
    ("layers",),
    ("kernels",),
    ("tokenize_parallel",),
    ("protocol",),                       # every wire struct
    ("config",),                         # EngineConfig and its sections
    ("sampling_params", "logprobs", "fault_injection", "arg_utils", "process_lifetime", "ttft_trace"),
    ("cpu_limits", "parallel"),          # parallel/: process groups and collectives
)
TIER = {room: i for i, tier in enumerate(LAYERS) for room in tier}


def room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "splitserve" and len(parts) > 1 else None


def module_of(path: Path, package: Path = PACKAGE) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, package_dir: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in the file, TYPE_CHECKING blocks left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    module = module_of(path, package_dir)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            # `from splitserve import engine` names a room through the imported name
            if target == "splitserve":
                found += [(node.lineno, f"splitserve.{alias.name}") for alias in node.names]
    return found


def import_arrows(package: Path = PACKAGE) -> list[tuple[str, str, str]]:
    """(from room, to room, 'file:line') for every import between two rooms."""
    arrows = []
    for path in sorted(package.rglob("*.py")):
        src = room_of(module_of(path, package)) or "__init__"
        for line, target in imported_modules(path, package):
            dst = room_of(target)
            if dst is not None and dst != src:
                arrows.append((src, dst, f"{path.relative_to(package.parent)}:{line}"))
    return arrows


def test_every_room_has_a_place_in_the_order():
    rooms = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}
    assert rooms - set(TIER) == set(), "add the new room to LAYERS (and DESIGN.md's drawing)"


def test_imports_only_point_down():
    wrong = [f"{where}: {src} -> {dst}" for src, dst, where in import_arrows()
             if dst in TIER and TIER[dst] <= TIER[src]]
    assert wrong == [], "imports against the layer order:\n" + "\n".join(wrong)


def test_the_check_sees_an_upward_import(tmp_path):
    """The walker itself: a room that imports one above it is caught, through a deferred import too."""
    pkg = tmp_path / "splitserve"
    (pkg / "parallel").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "parallel" / "__init__.py").write_text("")
    (pkg / "parallel" / "groups.py").write_text("def f():\n    from splitserve.engine import llm\n")
    (pkg / "parallel" / "ok.py").write_text("if TYPE_CHECKING:\n    from splitserve.engine import llm\n")
    assert import_arrows(pkg) == [("parallel", "engine", "splitserve/parallel/groups.py:2")]


def test_design_md_draws_the_rooms_as_they_are():
    """DESIGN.md's drawing of the rooms is the one scripts/rooms.py makes from today's imports."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("rooms", PACKAGE.parent / "scripts" / "rooms.py")
    rooms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rooms)
    design = (PACKAGE.parent / "DESIGN.md").read_text(encoding="utf-8")
    assert rooms.BEGIN in design, "DESIGN.md lost its rooms drawing markers"
    assert rooms.with_drawing(design) == design, "run: python scripts/rooms.py --write"
