"""The scheduler's side of KV transfer (DESIGN.md, "KV transfer"): a waiting request whose prompt
blocks exist on another engine goes to `receiving` while the connector loads them; finished loads
rejoin the queue's head (or fail, or recompute, by policy); a finished producer request's blocks
are held for a remote reader. A mixin of core/scheduler.Scheduler, whose state it uses (`waiting`,
`receiving`, `kv`, `connector`, `kv_failed`, `kv_load_failure_policy`, `_release`)."""
from __future__ import annotations

from splitserve.core.request import Request, RequestStatus
from splitserve.kv_transfer.base import wants_remote_prefill


class KVTransferScheduling:
    def _start_remote_load(self, request: Request, hits: list, num_cached: int) -> bool:
        """Sends the head of the queue to `receiving` if its prompt's blocks exist remotely: it gets
        blocks for its whole prompt (the prefix hits first) and the connector starts loading the rest.
        False: it is admitted as usual (nothing remote, or no blocks for it now)."""
        params = request.kv_transfer_params
        if request.kv_load_tried or not wants_remote_prefill(params):
            return False
        num_remote = self.connector.lookup(request.request_id, params, request.num_prompt_tokens, len(hits))
        if num_remote <= 0:  # (its own prefix cache has them all): the producer need not hold them
            request.kv_load_tried = True
            self.connector.discard(request.request_id, params)
            return False
        # Blocks for every prompt token; the waiting request has computed none of them yet.
        if not self.kv.allocate_slots(request, request.num_prompt_tokens - num_cached, hits):
            return False
        request.kv_load_tried = True
        request.num_computed_tokens = request.num_cached_tokens = num_cached
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting.popleft()
        self.receiving[request.request_id] = request
        self.connector.load_async(request.request_id, params, list(request.block_ids), len(hits),
                                  request.num_prompt_tokens)
        return True

    def poll_connector(self) -> None:
        """Takes in finished loads (their requests rejoin the queue's head, or fail) and frees the
        blocks of held requests the connector lets go."""
        loads, released = self.connector.poll()
        for rid in released:
            self.kv.free_held(rid)
        for done in loads:
            request = self.receiving.pop(done.request_id, None)
            if request is None:
                continue  # aborted meanwhile
            request.status = RequestStatus.WAITING
            if done.ok:
                # All loaded prompt tokens count as computed but the last prompt token: its logits
                # give the first output token, so this engine computes at most that one.
                loaded = min(done.num_tokens, request.num_prompt_tokens - 1)
                request.num_computed_tokens = request.num_cached_tokens = max(request.num_computed_tokens, loaded)
                self.waiting.appendleft(request)
            elif self.kv_load_failure_policy == "fail" or not done.recoverable:
                request.status, request.stop_reason = RequestStatus.FINISHED_ERROR, done.error
                self._release(request)
                self.kv_failed.append(request)
            else:  # recompute: the request prefills here, from whatever its own prefix cache has
                self.kv.free(request)
                request.num_computed_tokens = request.num_cached_tokens = 0
                self.waiting.appendleft(request)

    def _hold_for_reader(self, request: Request) -> bool:
        """A finished producer request: whether the connector holds its blocks for a remote reader."""
        if request.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH) \
                or not request.block_ids or request.num_computed_tokens < request.num_prompt_tokens:
            return False
        params = self.connector.save(request.request_id, request.kv_transfer_params, list(request.block_ids),
                                     request.num_prompt_tokens)
        if params is None:
            return False
        if not self.kv.hold(request):
            self.connector.release(request.request_id)
            return False
        request.kv_params_out = params
        return True
