"""Connectors by vLLM's names (config.KV_CONNECTORS); `build_connector` makes the configured one."""
from __future__ import annotations

import importlib
import importlib.util

_CONNECTORS = {
    "TcpConnector": "splitserve.kv_transfer.tcp",
    "OffloadingConnector": "splitserve.kv_transfer.offload",
    "NixlConnector": "splitserve.kv_transfer.nixl",
}


def check_available(name: str) -> None:
    """Raises ValueError at start-up when the connector's own dependency is missing."""
    if name == "NixlConnector":
        if not any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu13", "nixl_cu12")):
            raise ValueError("NixlConnector needs the nixl package (pip install 'splitserve[nixl]', or nixl-cu13 / "
                             "nixl-cu12; UCX underneath); on machines without it use TcpConnector")


def build_connector(config, pool):
    """config: config.KVTransferConfig; pool: pool.KVPool over this engine's KV tensors."""
    module = _CONNECTORS.get(config.kv_connector)
    if module is None:
        raise ValueError(f"unknown kv_connector {config.kv_connector!r}; one of {', '.join(_CONNECTORS)}")
    check_available(config.kv_connector)
    return getattr(importlib.import_module(module), config.kv_connector)(config, pool)
