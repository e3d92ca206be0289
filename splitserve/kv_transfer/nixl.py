"""NixlConnector: KV blocks between engines over NIXL (UCX: CUDA IPC or NVLink inside a node, RDMA
across nodes, shared memory for host pools), READ by the decode side straight into its paged pool.

It is a TcpConnector for everything NIXL does not carry: the producer's side channel on
`kv_ip:kv_port` answers the handshake (`meta`, which here also carries the NIXL agent's metadata,
pool layout and addresses: `NixlKVTransport.metadata()`), holds finished requests' blocks and frees
them at lease end. The data never goes through that channel:
- Consumer: `load_async` queues one READ of the producer's blocks into the request's own blocks
  (every layer; notification = the producer's request id). The first load from a producer first
  fetches its metadata on a reader thread (a zmq round trip). The connector's NIXL thread posts the
  READs and checks their handles: DONE -> loaded; ERR, a refused post or no DONE within
  `kv_load_timeout` -> a failed load, so the recompute/fail policy applies. `poll` only collects.
- Producer: the reader's notification (NIXL delivers it once the READ has finished) is the
  acknowledgement that frees the held blocks; the lease covers readers that never come.
Every NIXL call after start-up is made on the one NIXL thread ("kv-nixl"), never on the engine
core's: posting a READ costs ~10 us per descriptor that NIXL cannot merge (scattered blocks: tens of
ms for one long prompt; `kv_connector_extra_config.num_threads` (0 by default; vLLM uses 4) splits a
long READ over that many UCX workers, and a block-major pool needs one descriptor per block:
nixl_transport.py), and NIXL releases the GIL meanwhile, so the core's steps go on.

Tensor parallelism: one rank on both sides (the pool must live in the core's process). A
tensor-parallel producer is refused at start-up (config_builder) and at the handshake; TcpConnector
reads a TP=N producer into a TP=1 reader.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import asdict, dataclass

from splitserve.kv_transfer.base import LoadDone
from splitserve.kv_transfer.pool import KVLayout, KVPool
from splitserve.kv_transfer.tcp import LoadError, TcpConnector, _enc

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    """A load: the producer's blocks into ours, from the engine behind `key` = (host, port, engine id)."""
    request_id: str
    key: tuple
    remote_request_id: str
    remote_blocks: list[int]
    local_blocks: list[int]
    start: float
    handle: object = None
    deadline: float = 0.0


class NixlConnector(TcpConnector):
    def __init__(self, config, pool) -> None:
        if not isinstance(pool, KVPool) or pool.layout.tp_size != 1:
            raise ValueError("NixlConnector runs with one rank per engine (-tp 1 on both roles); "
                             "a tensor-parallel prefill engine needs TcpConnector")
        from splitserve.kv_transfer.nixl_transport import NixlKVTransport
        # The agent (registered memory, UCX context) before the side channel can announce it.
        self.transport = NixlKVTransport(f"{config.engine_id or 'splitserve'}-{uuid.uuid4().hex[:8]}", pool.caches,
                                         num_threads=config.num_threads)
        self._nixl_meta = self.transport.metadata()
        super().__init__(config, pool)
        self._layer_block_bytes = self.transport.layout.block_bytes * self.transport.layout.num_layers
        self._loaded: list[tuple[str, int, float]] = []  # from the NIXL thread: (request id, bytes, seconds)
        self.handshakes = 0                              # metadata fetches (one per producer engine)
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()  # core -> NIXL thread: ("load", job), ("cancel", id), ...
        # The NIXL thread's own state (no other thread touches it):
        self._peers: dict[tuple, str] = {}               # key -> NIXL peer name
        self._waiting: dict[tuple, list[_Job]] = {}      # loads whose producer's metadata is on its way
        self._xfers: dict[str, _Job] = {}                # READs in flight
        self._zombies: list = []                         # handles of READs NIXL could not drop yet
        self._nixl_thread = threading.Thread(target=self._run, name="kv-nixl", daemon=True)
        self._nixl_thread.start()

    # -- producer ------------------------------------------------------------------------------
    def _answer(self, msg: dict) -> list:
        op = msg.get("op")
        if op == "meta":
            return [_enc.encode({"ok": True, "engine_id": self.engine_id, "layout": asdict(self.layout),
                                 "rank_ports": [], "nixl": self._nixl_meta})]
        if op == "read":
            return [_enc.encode({"ok": False, "error": "this engine is a NixlConnector: its blocks are read "
                                                       "over NIXL (the reader's kv_connector must be NixlConnector)"})]
        return super()._answer(msg)  # "done" too: harmless, the notification usually came first

    def _take_notifications(self) -> None:
        for note in self.transport.notifications():
            rid = note.decode(errors="replace")
            with self._lock:
                held = self._held.pop(rid, None)
                if held is None:
                    continue  # its lease ended first, or a reader's second read
                self._acked.append(rid)
                # What was held; a reader with prefix hits read fewer blocks (an upper bound).
                self.stats.sent_bytes += len(held[0]) * self._layer_block_bytes
                self.stats.sent_tokens += held[1]

    # -- consumer ------------------------------------------------------------------------------
    def load_async(self, request_id, params, block_ids, first_block, num_prompt_tokens):
        remote = list(params.get("remote_block_ids") or [])
        count = min(len(remote), len(block_ids))
        num_tokens = min(count * self.layout.block_size, num_prompt_tokens)
        self._loads[request_id] = (list(block_ids[first_block:count]), first_block, num_tokens)
        host, port, rrid = params.get("remote_host"), params.get("remote_port"), params.get("remote_request_id")
        now = time.monotonic()
        if not host or not port or rrid is None:
            self._fail(request_id, LoadError("kv_transfer_params need remote_host, remote_port and "
                                             "remote_request_id (as the prefill engine's response gives them)",
                                             recoverable=False), now)
            return
        key = (str(host), int(port), params.get("remote_engine_id"))
        self._cmds.put(("load", _Job(request_id, key, str(rrid), remote[first_block:count],
                                     list(block_ids[first_block:count]), now)))

    def cancel(self, request_id):
        super().cancel(request_id)  # what the NIXL thread still reports for it is dropped by poll
        self._cmds.put(("cancel", request_id))

    # -- the NIXL thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            # Short waits only while something is in flight (a READ: 0.2 ms, its completion is on
            # the request's TTFT) or held (a reader's notification: 2 ms); otherwise sleep on the queue.
            wait = 0.0002 if self._xfers or self._zombies else 0.002 if self._held else 0.05
            try:
                cmd = self._cmds.get(timeout=wait)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                try:
                    self._do(cmd)
                except Exception as e:  # never a silent hang: the load fails
                    logger.exception("NIXL thread: %s", cmd[0])
                    if cmd[0] == "load":
                        self._fail(cmd[1].request_id, LoadError(f"KV load could not start: {e}"), cmd[1].start)
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            try:
                if self._xfers or self._zombies:
                    self._check_transfers()
                if self.config.is_producer and self._held:
                    self._take_notifications()
            except Exception:  # a NIXL surprise must not end the thread (loads then time out)
                logger.exception("NIXL thread")
        for job in self._xfers.values():
            if job.handle is not None:
                self._drop(job.handle)

    def _do(self, cmd: tuple) -> None:
        if cmd[0] == "load":
            job = cmd[1]
            if job.key in self._peers:
                self._post(job)
            elif job.key in self._waiting:
                self._waiting[job.key].append(job)
            else:
                self._waiting[job.key] = [job]
                self._readers.submit(self._fetch_meta, job.key)
        elif cmd[0] == "peer":
            _, key, header = cmd
            error = self._add_peer(key, header)
            for job in self._waiting.pop(key, []):
                if error is None:
                    self._post(job)
                else:
                    self._fail(job.request_id, error, job.start)
        elif cmd[0] == "cancel":
            rid = cmd[1]
            job = self._xfers.pop(rid, None)
            if job is not None and job.handle is not None and not self._drop(job.handle):
                self._zombies.append(job.handle)
            for jobs in self._waiting.values():
                jobs[:] = [j for j in jobs if j.request_id != rid]

    def _fetch_meta(self, key: tuple) -> None:
        """Reader thread: the producer's handshake answer (zmq only; NIXL calls stay on the NIXL thread)."""
        host, port, _ = key
        sock = None
        try:
            sock = self._socket(host, port)
            header = self._ask(sock, {"op": "meta"}, "the handshake", host, port)[0]
            remote = KVLayout(**header["layout"])
            why = self.layout.mismatch(remote)
            if why is None and remote.tp_size != 1:
                why = f"tp_size: local 1, remote {remote.tp_size} (NixlConnector reads one-rank engines only)"
            if why is None and "nixl" not in header:
                why = "kv_connector: the producer is not a NixlConnector"
            if why is not None:
                raise LoadError(f"KV transfer handshake with engine {header.get('engine_id')} at {host}:{port} "
                                f"refused: its KV cache layout differs ({why})", recoverable=False)
            result = header
        except LoadError as e:
            result = e
        except Exception as e:  # a broken answer: a failed load, not a dead thread
            result = LoadError(f"KV handshake with {host}:{port} failed: {type(e).__name__}: {e}")
        finally:
            if sock is not None:
                sock.close()
        self.handshakes += 1
        self._cmds.put(("peer", key, result))

    def _add_peer(self, key: tuple, header) -> LoadError | None:
        if isinstance(header, LoadError):
            return header
        try:
            self._peers[key] = self.transport.add_peer(header["nixl"])
        except ValueError as e:  # the two pools' blocks differ (add_peer names the difference)
            return LoadError(f"KV transfer handshake with {key[0]}:{key[1]} refused: {e}", recoverable=False)
        except Exception as e:
            return LoadError(f"NIXL could not add the agent of {key[0]}:{key[1]}: {type(e).__name__}: {e}")
        return None

    def _post(self, job: _Job) -> None:
        if not job.local_blocks:  # everything was a local prefix hit
            self._xfers[job.request_id] = job
            return
        try:
            job.handle = self.transport.read(self._peers[job.key], job.remote_blocks, job.local_blocks,
                                             job.remote_request_id.encode())
        except Exception as e:  # the peer went away, say: NIXL refuses to start the READ
            self._forget_peer(job.key)
            self._fail(job.request_id, LoadError(f"KV load from {job.key[0]}:{job.key[1]} could not start: {e}"),
                       job.start)
            return
        job.deadline = time.monotonic() + self.config.kv_load_timeout
        self._xfers[job.request_id] = job

    def _fail(self, request_id: str, error: LoadError, start: float) -> None:
        with self._lock:  # TcpConnector.poll turns it into a failed LoadDone (and counts it)
            self._finished.append((request_id, error, time.monotonic() - start))

    def _forget_peer(self, key: tuple) -> None:
        peer = self._peers.pop(key, None)
        if peer is not None:
            try:
                self.transport.remove_peer(peer)
            except Exception as e:
                logger.warning("NIXL: removing peer %s: %s", peer, e)

    def _drop(self, handle) -> bool:
        """Releases a READ's handle (NIXL aborts it if it still runs); False when NIXL refuses now."""
        try:
            self.transport.release(handle)
            return True
        except Exception:
            return False

    def _check_transfers(self) -> None:
        now = time.monotonic()
        for rid, job in list(self._xfers.items()):
            if job.handle is None:
                state = "DONE"
            else:
                try:
                    state = self.transport.state(job.handle)
                except Exception as e:
                    state = f"ERR ({e})"
            if state == "PROC" and now < job.deadline:
                continue
            del self._xfers[rid]
            if job.handle is not None and not self._drop(job.handle):
                self._zombies.append(job.handle)
            if state == "DONE":
                with self._lock:
                    self._loaded.append((rid, len(job.local_blocks) * self._layer_block_bytes, now - job.start))
                continue
            where = f"{job.key[0]}:{job.key[1]}"
            if state == "PROC":
                why = f"the KV read from {where} did not finish within {self.config.kv_load_timeout:g} s (kv_load_timeout)"
            else:
                why = f"the KV read from {where} failed (NIXL state {state}; the prefill engine is gone?)"
                if not any(j.key == job.key for j in self._xfers.values()):
                    self._forget_peer(job.key)  # the next load handshakes again (a restarted producer)
            self._fail(rid, LoadError(why), job.start)
        self._zombies = [h for h in self._zombies if not self._drop(h)]

    # -- both (the core's thread) ----------------------------------------------------------------
    def poll(self):
        with self._lock:
            loaded, self._loaded = self._loaded, []
        ok = []
        for rid, nbytes, seconds in loaded:
            load = self._loads.pop(rid, None)
            if load is None:
                continue  # aborted while it loaded
            _, first, num_tokens = load
            self.stats.recv_bytes += nbytes
            self.stats.recv_tokens += num_tokens - first * self.layout.block_size
            self.stats.observe_time(seconds)
            ok.append(LoadDone(rid, True, num_tokens=num_tokens))
        done, released = super().poll()  # failures, acknowledgements, leases
        return ok + done, released

    @property
    def busy(self) -> bool:
        with self._lock:
            if self._loaded:
                return True
        return super().busy

    def shutdown(self):
        super().shutdown()  # stops the serving thread and, through the same event, the NIXL thread
        self._nixl_thread.join(timeout=5)
        if not self._nixl_thread.is_alive():  # (its READs' handles are released): NIXL goes now, here
            try:
                self.transport.close()
            except Exception as e:
                logger.warning("NIXL: closing the agent: %s", e)
