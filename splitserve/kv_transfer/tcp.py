"""TcpConnector: KV blocks between engines over ZeroMQ (TCP) and host memory, for CPU machines and tests.

Producer (kv_producer / kv_both): a request that asked for `do_remote_decode` keeps its blocks after
it finishes (the core holds them); a serving thread answers readers on `kv_ip:kv_port` (ROUTER):
`meta` (the handshake: engine id and KV layout), `read` (the held blocks' bytes) and `done` (the
reader's acknowledgement: the blocks may go). Blocks nobody acknowledges go back after
`kv_lease_duration` seconds. Consumer (kv_consumer / kv_both): `load_async` hands the read to a
thread, which handshakes once per remote engine (refusing another dtype, block size or layout), reads
with `kv_load_timeout` as its bound, and acknowledges; `poll` writes what arrived into the pool on
the core's thread. A remote that does not answer in time is a failed load, never a hang.

Tensor-parallel producer (prefill on N ranks, decode on one): the core keeps the side channel (meta,
done, leases) and each rank serves its own heads' blocks on `kv_port + 1 + rank` (`BlockServer`,
started by the rank process); the reader gets the rank ports at the handshake, reads every rank and
puts each of the model's KV heads where a one-rank pool holds it (`pool.gather_heads`).
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import asdict
from concurrent.futures import ThreadPoolExecutor

import msgspec
import numpy as np
import torch
import zmq

from splitserve.kv_transfer.base import KVConnector, LoadDone, wants_remote_decode
from splitserve.kv_transfer.pool import KVLayout, gather_heads

logger = logging.getLogger(__name__)

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


class LoadError(Exception):
    """A load that cannot succeed; `recoverable` False when recomputing would hide a misconfiguration."""

    def __init__(self, message: str, recoverable: bool = True):
        super().__init__(message)
        self.recoverable = recoverable


def _tensor_from(header: dict, raw) -> torch.Tensor:
    dtype = getattr(torch, header["dtype"])
    buf = np.frombuffer(raw, dtype=np.uint8).copy()
    return torch.from_numpy(buf).view(dtype).reshape(header["shape"])


class TcpConnector(KVConnector):
    def __init__(self, config, pool) -> None:
        super().__init__(config, pool)
        self.layout = pool.layout
        self.engine_id = config.engine_id or f"splitserve-{uuid.uuid4().hex[:12]}"
        self._ctx = zmq.Context.instance()
        self._lock = threading.Lock()
        # Producer: request id -> (block ids, prompt tokens, lease deadline); acknowledged ids.
        self._held: dict[str, tuple[list[int], int, float]] = {}
        self._acked: list[str] = []
        self._reading: set[str] = set()  # held requests a serving thread is copying out: no lease end now
        # Consumer: request id -> (local block ids, first block, prompt tokens) of loads in flight,
        # and what their threads have finished: (request id, tensor or LoadError, seconds).
        self._loads: dict[str, tuple[list[int], int, int]] = {}
        self._finished: list[tuple[str, object, float]] = []
        # (host, port) -> (engine id, layout, its ranks' block ports: empty for one rank)
        self._layouts: dict[tuple[str, int], tuple[str, KVLayout, list[int]]] = {}
        self._stop = threading.Event()
        self.port = None
        self.rank_ports: list[int] = []
        if config.is_producer:
            self._server = self._ctx.socket(zmq.ROUTER)
            self._server.setsockopt(zmq.LINGER, 0)
            if config.kv_port:
                self._server.bind(f"tcp://{config.kv_ip}:{config.kv_port}")
                self.port = config.kv_port
            else:
                self.port = self._server.bind_to_random_port(f"tcp://{config.kv_ip}")
            # A tensor-parallel producer's ranks serve their own blocks (BlockServer) next to this port.
            self.rank_ports = [self.port + 1 + r for r in range(self.layout.tp_size)] if self.layout.tp_size > 1 else []
            self._thread = threading.Thread(target=self._serve, name="kv-tcp-serve", daemon=True)
            self._thread.start()
            logger.info("KV producer %s serving held blocks on %s:%d", self.engine_id, config.kv_ip, self.port)
        self._readers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-tcp-read") \
            if config.is_consumer else None

    # -- producer ------------------------------------------------------------------------------
    def save(self, request_id, params, block_ids, num_prompt_tokens):
        if not self.config.is_producer or not wants_remote_decode(params):
            return None
        n = -(-num_prompt_tokens // self.layout.block_size)
        with self._lock:
            self._held[request_id] = (list(block_ids[:n]), num_prompt_tokens,
                                      time.monotonic() + self.config.kv_lease_duration)
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_host": self.config.kv_ip, "remote_port": self.port, "remote_block_ids": list(block_ids[:n]),
                "remote_request_id": request_id, "tp_size": self.layout.tp_size}

    def release(self, request_id):
        with self._lock:
            self._held.pop(request_id, None)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._server, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                ident, payload = self._server.recv_multipart()
                frames = self._answer(_dec.decode(payload))
            except Exception as e:  # a malformed message must not stop serving
                logger.warning("KV producer: bad message: %s", e)
                continue
            self._server.send_multipart([ident, *frames], copy=False)
        self._server.close()

    def _answer(self, msg: dict) -> list:
        op = msg.get("op")
        if op == "meta":
            return [_enc.encode({"ok": True, "engine_id": self.engine_id, "layout": asdict(self.layout),
                                 "rank_ports": self.rank_ports})]
        rid = msg.get("request_id")
        if op == "read":
            if self.rank_ports:
                return [_enc.encode({"ok": False, "error": "read this engine's blocks from its ranks' ports"})]
            with self._lock:
                held = self._held.get(rid)
                if held is not None:
                    self._reading.add(rid)
            if held is None:
                return [_enc.encode({"ok": False, "error": f"request {rid!r} holds no blocks here (released, its "
                                                           f"lease of {self.config.kv_lease_duration:g} s expired, "
                                                           f"or never prefilled)"})]
            try:
                wanted = list(msg.get("block_ids", []))
                if not set(wanted) <= set(held[0]):
                    return [_enc.encode({"ok": False, "error": f"blocks {wanted} are not all held for {rid!r}"})]
                data = self.pool.read(wanted).contiguous()
            finally:
                with self._lock:
                    self._reading.discard(rid)
            raw = data.view(torch.uint8).numpy()
            with self._lock:
                self.stats.sent_bytes += raw.nbytes
                self.stats.sent_tokens += min(held[1], len(wanted) * self.layout.block_size)
            return [_enc.encode({"ok": True, "shape": list(data.shape),
                                 "dtype": str(data.dtype).removeprefix("torch.")}), raw]
        if op == "done":
            with self._lock:
                if self._held.pop(rid, None) is not None:
                    self._acked.append(rid)
                    if self.rank_ports:  # the ranks sent the bytes; the reader says how many
                        self.stats.sent_bytes += int(msg.get("bytes", 0))
                        self.stats.sent_tokens += int(msg.get("tokens", 0))
            return [_enc.encode({"ok": True})]
        return [_enc.encode({"ok": False, "error": f"unknown op {op!r}"})]

    # -- consumer ------------------------------------------------------------------------------
    def lookup(self, request_id, params, num_prompt_tokens, num_local_blocks):
        if not self.config.is_consumer or not params or not params.get("do_remote_prefill"):
            return 0
        needed = -(-num_prompt_tokens // self.layout.block_size)
        remote = params.get("remote_block_ids") or []
        return max(0, min(len(remote), needed) - num_local_blocks)

    def load_async(self, request_id, params, block_ids, first_block, num_prompt_tokens):
        remote = list(params.get("remote_block_ids") or [])
        count = min(len(remote), len(block_ids))
        bs = self.layout.block_size
        self._loads[request_id] = (list(block_ids[first_block:count]), first_block, min(count * bs, num_prompt_tokens))
        self._readers.submit(self._read, request_id, dict(params), remote[first_block:count],
                             min(count * bs, num_prompt_tokens) - first_block * bs)

    def cancel(self, request_id):
        self._loads.pop(request_id, None)  # what its thread brings back is dropped by poll

    def discard(self, request_id, params):
        host, port, rid = params.get("remote_host"), params.get("remote_port"), params.get("remote_request_id")
        if self._readers is not None and host and port and rid is not None:
            self._readers.submit(self._release_remote, str(host), int(port), rid)

    def _release_remote(self, host: str, port: int, rid) -> None:
        """Reader thread: tells the producer that a request's held blocks will not be read."""
        sock = self._socket(host, port)
        try:
            self._ask(sock, {"op": "done", "request_id": rid, "bytes": 0, "tokens": 0}, "a release", host, port)
        except LoadError as e:  # the producer frees them at lease end instead
            logger.warning("KV consumer: %s", e)
        finally:
            sock.close()

    def _socket(self, host: str, port: int):
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{host}:{port}")
        return sock

    def _ask(self, sock, msg: dict, what: str, host: str, port: int) -> list:
        sock.send(_enc.encode(msg))
        if not sock.poll(int(self.config.kv_load_timeout * 1000)):
            raise LoadError(f"the prefill engine at {host}:{port} did not answer {what} within "
                            f"{self.config.kv_load_timeout:g} s (kv_load_timeout)")
        frames = sock.recv_multipart(copy=False)
        header = _dec.decode(frames[0].buffer)
        if not header.get("ok"):
            raise LoadError(f"the prefill engine at {host}:{port} refused {what}: {header.get('error')}")
        return [header, *frames[1:]]

    def _handshake(self, sock, host: str, port: int, engine_id: str | None) -> tuple[KVLayout, list[int]]:
        known = self._layouts.get((host, port))
        if known is not None and (engine_id is None or known[0] == engine_id):
            return known[1], known[2]
        header = self._ask(sock, {"op": "meta"}, "the handshake", host, port)[0]
        remote = KVLayout(**header["layout"])
        why = self.layout.mismatch(remote)
        if why is not None:
            raise LoadError(f"KV transfer handshake with engine {header['engine_id']} at {host}:{port} refused: "
                            f"its KV cache layout differs ({why})", recoverable=False)
        self._layouts[(host, port)] = (header["engine_id"], remote, list(header.get("rank_ports") or []))
        return remote, list(header.get("rank_ports") or [])

    def _read_ranks(self, host: str, rank_ports: list[int], rid: str, blocks: list[int], remote: KVLayout):
        """A tensor-parallel producer: every rank's heads of the blocks, put together."""
        parts = []
        for port in rank_ports:
            sock = self._socket(host, port)
            try:
                header, raw = self._ask(sock, {"op": "read", "block_ids": blocks},
                                        f"the read of request {rid!r}", host, port)
                parts.append(_tensor_from(header, raw.buffer))
            finally:
                sock.close()
        return gather_heads(parts, remote.model_kv_heads)

    def _read(self, request_id: str, params: dict, remote_blocks: list[int], num_tokens: int) -> None:
        start = time.monotonic()
        sock = None
        try:
            host, port = params.get("remote_host"), params.get("remote_port")
            rid = params.get("remote_request_id")
            if not host or not port or rid is None:
                raise LoadError("kv_transfer_params need remote_host, remote_port and remote_request_id "
                                "(as the prefill engine's response gives them)", recoverable=False)
            sock = self._socket(host, int(port))
            remote, rank_ports = self._handshake(sock, host, int(port), params.get("remote_engine_id"))
            result = torch.empty(0)
            if remote_blocks and rank_ports:
                result = self._read_ranks(host, rank_ports, rid, remote_blocks, remote)
            elif remote_blocks:
                header, raw = self._ask(sock, {"op": "read", "request_id": rid, "block_ids": remote_blocks},
                                        f"the read of request {rid!r}", host, port)
                result = _tensor_from(header, raw.buffer)
        except LoadError as e:
            result = e
        except Exception as e:  # a bug or a broken frame: a failed load, not a dead thread
            result = LoadError(f"KV load failed: {type(e).__name__}: {e}")
        with self._lock:  # the request may go on now; the acknowledgement follows off its path
            self._finished.append((request_id, result, time.monotonic() - start))
        try:
            if not isinstance(result, LoadError):
                # Waits for the answer: closing a socket (LINGER 0) drops what it has not sent yet.
                self._ask(sock, {"op": "done", "request_id": rid, "bytes": result.numel() * result.element_size(),
                                 "tokens": min(len(remote_blocks) * self.layout.block_size, num_tokens)},
                          "the acknowledgement", host, port)
        except LoadError as e:  # the producer frees the blocks at lease end instead
            logger.warning("KV consumer: %s", e)
        finally:
            if sock is not None:
                sock.close()

    # -- both ----------------------------------------------------------------------------------
    def poll(self):
        with self._lock:
            finished, self._finished = self._finished, []
            acked, self._acked = self._acked, []
            now = time.monotonic()
            # (a lease ending while its blocks are copied out waits for the copy: they must not be reused yet)
            expired = [rid for rid, (_, _, deadline) in self._held.items() if deadline < now and rid not in self._reading]
            for rid in expired:
                del self._held[rid]
        if expired:
            logger.warning("KV producer: %d held request(s) were never read; freed at lease end (%g s)",
                           len(expired), self.config.kv_lease_duration)
        done = []
        for rid, result, seconds in finished:
            load = self._loads.pop(rid, None)
            if load is None:
                continue  # aborted while it loaded
            block_ids, first, num_tokens = load
            if isinstance(result, LoadError):
                self.stats.failed += 1
                logger.warning("KV load of request %s failed: %s", rid, result)
                done.append(LoadDone(rid, False, error=str(result), recoverable=result.recoverable))
                continue
            if block_ids:
                self.pool.write(block_ids, result)
            self.stats.recv_bytes += result.numel() * result.element_size()
            self.stats.recv_tokens += num_tokens - first * self.layout.block_size
            self.stats.observe_time(seconds)
            done.append(LoadDone(rid, True, num_tokens=num_tokens))
        return done, acked + expired

    @property
    def busy(self) -> bool:
        """Loads in flight, blocks held, or acknowledgements the core has not taken in yet."""
        with self._lock:
            return bool(self._loads or self._held or self._acked or self._finished)

    def shutdown(self):
        self._stop.set()
        if self._readers is not None:
            self._readers.shutdown(wait=False, cancel_futures=True)


class BlockServer:
    """A tensor-parallel producer's rank: serves `read` of its own heads' blocks on `ip:port`. The
    engine core's TcpConnector keeps the held-block bookkeeping; a rank only reads its pool."""

    def __init__(self, pool, ip: str, port: int) -> None:
        self.pool = pool
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://{ip}:{port}")
        self._stop = threading.Event()
        threading.Thread(target=self._serve, name="kv-tcp-blocks", daemon=True).start()
        logger.info("KV producer rank serving its blocks on %s:%d", ip, port)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            try:
                ident, payload = self._sock.recv_multipart()
                data = self.pool.read(list(_dec.decode(payload)["block_ids"])).contiguous()
                frames = [_enc.encode({"ok": True, "shape": list(data.shape),
                                       "dtype": str(data.dtype).removeprefix("torch.")}), data.view(torch.uint8).numpy()]
            except Exception as e:  # a bad message must not stop serving
                logger.warning("KV producer rank: bad read: %s", e)
                continue
            self._sock.send_multipart([ident, *frames], copy=False)
        self._sock.close()

    def shutdown(self) -> None:
        self._stop.set()
