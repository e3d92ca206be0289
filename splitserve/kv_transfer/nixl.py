"""NixlConnector: the GPU path (a skeleton; its data path is not written yet, and start-up says so).

How NIXL fits the contract of base.py, for whoever writes it (issue 38):
- Start-up: one `nixl_agent` per engine (UCX backend); every layer's KV tensor registered once
  (`register_memory`), and the pool described as block descriptors: for layer l and block b the byte
  range `[addr_l + b * block_bytes, + block_bytes)` (pool.KVLayout gives the strides).
- Handshake: the consumer asks the producer's side channel (the TcpConnector's `meta` op, on
  `kv_ip:kv_port`) for its agent metadata and descriptor list besides its KVLayout; `add_remote_agent`
  once per remote engine; a layout mismatch is refused there, as in tcp.py.
- `load_async`: descriptors of the remote block ids (remote side) and of the local ones, one READ
  (`initialize_xfer("READ", local, remote, remote_agent, notif=remote_request_id)` + `transfer`);
  `poll` checks each handle (`check_xfer_state`: DONE / PROC / ERR) and reports LoadDone. No copy
  lands through the core: the NIC or NVLink writes the local blocks, which the request owns.
- Producer side: `save` holds the blocks (as tcp.py); the consumer's notification (`get_new_notifs`,
  carrying the request id) is the acknowledgement; the lease covers readers that never come.
- Different TP per role: the consumer reads, per remote rank, the head slice that its own heads map
  to (descriptor ranges inside each block), which needs the head-major split of the block layout.
"""
from __future__ import annotations

from splitserve.kv_transfer.tcp import TcpConnector

NOT_READY = ("NixlConnector's data path (NIXL READ into the paged pool) is not implemented yet; "
             "use TcpConnector (host memory over TCP) for now")


class NixlConnector(TcpConnector):
    def __init__(self, config, pool) -> None:
        raise ValueError(NOT_READY)
