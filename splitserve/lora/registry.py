"""The front's table of adapters: names clients select (`model=NAME`), checks before queueing, and
runtime load / unload (vLLM's `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`).

An adapter is checked here with its config and tensor shapes only (no weights read), so a bad one is
a ValueError naming the problem (a 400) before any request runs with it; the engine core loads the
weights when a request first needs them. Every adapter the table registers gets a fresh int id, never
reused: an adapter unloaded and loaded again under the same name is a different adapter to the prefix
cache and the slots.
"""
from __future__ import annotations

import json
import os
from splitserve.config import LoRAConfig
from splitserve.lora.adapter import LoRATargets, load_adapter
from splitserve.protocol.lora import LoRARequest


def parse_lora_modules(items: list[str] | None) -> tuple[tuple[str, str], ...]:
    """--lora-modules entries: NAME=PATH or vLLM's JSON object {"name": ..., "path": ...}."""
    out = []
    for item in items or ():
        item = item.strip()
        if item.startswith("{"):
            try:
                obj = json.loads(item)
                name, path = obj["name"], obj["path"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules {item!r}: expected a JSON object with name and path ({e})") from None
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {item!r}: expected NAME=PATH")
        out.append((str(name), str(path)))
    names = [n for n, _ in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"--lora-modules names a LoRA adapter twice: {dupes}")
    return tuple(out)


class LoRARegistry:
    def __init__(self, config: LoRAConfig | None, hf_config, base_model_name: str):
        self.config = config
        self.base_model_name = base_model_name
        self.targets = LoRATargets.from_hf_config(hf_config) if config is not None else None
        self.by_name: dict[str, LoRARequest] = {}
        self._next_id = 1 << 20  # clear of the small ids offline callers pick for their own LoRARequests
        self._checked: set[tuple[int, str]] = set()
        for name, path in (config.modules if config is not None else ()):
            self.add(name, path)

    @property
    def enabled(self) -> bool:
        return self.config is not None

    def check(self, lora: LoRARequest) -> None:
        """An adapter a request names: LoRA must be on and the adapter must fit the base model."""
        if self.config is None:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} requested, but LoRA is not enabled (--enable-lora)")
        key = (lora.lora_int_id, lora.lora_path)
        if key not in self._checked:
            load_adapter(lora.lora_int_id, lora.lora_name, lora.lora_path, self.targets, self.config.max_rank,
                         load=False)
            self._checked.add(key)

    def get(self, name: str) -> LoRARequest | None:
        return self.by_name.get(name)

    def add(self, name: str, path: str) -> LoRARequest:
        if not name or not path:
            raise ValueError("both lora_name and lora_path are needed")
        if name in self.by_name:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        if name == self.base_model_name:
            raise ValueError(f"{name!r} is the base model's name")
        lora = LoRARequest(name, self._next_id, os.path.abspath(path))
        self.check(lora)
        self._next_id += 1
        self.by_name[name] = lora
        return lora

    def add_at_runtime(self, name: str, path: str) -> LoRARequest:
        """POST /v1/load_lora_adapter: only with --allow-runtime-lora, and only under --lora-allowed-dir."""
        if self.config is None:
            raise ValueError("LoRA is not enabled (--enable-lora)")
        if not self.config.allow_runtime:
            raise PermissionError("loading LoRA adapters at run time is off (--allow-runtime-lora, or "
                                  "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)")
        allowed = self.config.allowed_dir
        if not allowed:
            raise PermissionError("no directory is allowed for runtime LoRA adapters (--lora-allowed-dir)")
        real, root = os.path.realpath(path or ""), os.path.realpath(allowed)
        if os.path.commonpath([real, root]) != root:
            raise PermissionError(f"lora_path {path!r} is not under the allowed directory {allowed!r}")
        return self.add(name, real)

    def remove(self, name: str) -> LoRARequest:
        """POST /v1/unload_lora_adapter; KeyError for an unknown name. Requests already running with
        it finish with it; new ones cannot name it."""
        if self.config is None or not self.config.allow_runtime:
            raise PermissionError("unloading LoRA adapters at run time is off (--allow-runtime-lora)")
        if name not in self.by_name:
            raise KeyError(name)
        return self.by_name.pop(name)
