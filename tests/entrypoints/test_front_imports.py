"""The API-server process is the front: importing the server and the engine front loads no engine code.

The engine core, its executor and the model live in other processes (or, offline, are imported by
LLMEngine on its own); the server needs the wire structs (protocol/), the config and the front-side
processors only. A fresh interpreter tells what an import pulls in."""
from __future__ import annotations

import json
import subprocess
import sys

# Rooms of the engine side: none of their modules may be in the front's process after the imports.
ENGINE_ROOMS = ("core", "executor", "worker", "startup", "layers", "attention", "kernels", "lora")


def engine_side(module: str) -> bool:
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "splitserve":
        return False
    if parts[1] in ENGINE_ROOMS:
        return True
    # models/: model code is engine-side; each multimodal model's front-side processor is not.
    return parts[1] == "models" and len(parts) > 2 and parts[-1] != "processor" and parts[2] != "registry"


def loaded_after(*modules: str) -> list[str]:
    code = ("import json, sys\n" + "".join(f"import {m}\n" for m in modules)
            + "print(json.dumps(sorted(m for m in sys.modules if m.startswith('splitserve'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_server_and_the_front_import_no_engine_code():
    loaded = loaded_after("splitserve.entrypoints.openai.api_server", "splitserve.engine.front",
                          "splitserve.engine.async_engine")
    assert "splitserve.engine.front" in loaded and "splitserve.protocol.core_messages" in loaded
    assert [m for m in loaded if engine_side(m)] == []


def test_the_rule_catches_engine_modules():
    assert engine_side("splitserve.worker.model_runner") and engine_side("splitserve.core.engine_core")
    assert engine_side("splitserve.models.decoder") and not engine_side("splitserve.models.llava.processor")
    assert not engine_side("splitserve.protocol.core_messages") and not engine_side("splitserve.engine.front")
