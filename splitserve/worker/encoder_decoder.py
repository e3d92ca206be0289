"""The runner's encoder-decoder part: runs the encoders a step message asks for and lays out the
step's cross-attention metadata.

The scheduler lists the requests whose encoder runs this step (`SchedulerOutput.encoder_runs`, with
their cross blocks: admitted, or resumed after a preemption). Their encoders run as one batch
(`model.encode`), and every decoder layer projects the encoder output to its cross K/V once and
stores it in those blocks (`model.store_cross_kv`) before the decoder's forward. Each row of the
persistent batch keeps its encoder length and cross block table here (numpy, indexed by the
persistent batch's row, written when the row is placed), so the step's `CrossAttentionMetadata` is
a gather over the step's rows, like the self-attention block tables. Nothing here reads request.py:
the encoder inputs come with `NewRequestData` and are kept until the request finishes (a preempted
request's encoder runs again from them).
"""
from __future__ import annotations

import numpy as np
import torch

from splitserve.kernels.attention.cross_ref import CrossAttentionMetadata, encoder_slots
from splitserve.protocol.sched_output import SchedulerOutput


class EncoderDecoderStep:
    def __init__(self, model: torch.nn.Module, backend, max_num_seqs: int, max_encoder_len: int, block_size: int,
                 device: torch.device):
        self.model, self.backend, self.block_size, self.device = model, backend, block_size, device
        max_blocks = -(-max_encoder_len // block_size)
        self.enc_len = np.zeros(max_num_seqs, dtype=np.int32)
        self.cross_table = np.zeros((max_num_seqs, max_blocks), dtype=np.int32)
        # request id -> (encoder token ids, encoder positions, images): what its encoder runs on
        self.inputs: dict[str, tuple[list[int], int, tuple]] = {}

    def update(self, sched: SchedulerOutput) -> None:
        """Takes in a message's new requests and drops the finished ones (with the persistent batch)."""
        for rid in sched.finished_req_ids:
            self.inputs.pop(rid, None)
        for new in sched.new_requests:
            if not new.num_encoder_tokens:
                raise ValueError(f"request {new.req_id!r} has no encoder input; this model is an encoder-decoder")
            self.inputs[new.req_id] = (new.encoder_prompt_ids, new.num_encoder_tokens, new.mm_items)

    @torch.inference_mode()
    def prepare(self, sched: SchedulerOutput, meta, input_batch) -> None:
        """Runs the step's encoders (storing their cross K/V) and sets `meta.cross` for the decoder.
        Call after the persistent batch has applied the message (rows are placed)."""
        self.update(sched)
        bs = self.block_size
        runs = sched.encoder_runs
        if runs:
            slots, inputs = [], []
            for rid, block_ids in runs.items():
                ids, n, mm_items = self.inputs[rid]
                row = input_batch.row_of[rid]
                self.enc_len[row] = n
                self.cross_table[row, :len(block_ids)] = block_ids
                slots += encoder_slots(block_ids, n, bs)
                inputs.append((ids, n, mm_items))
            hidden = self.model.encode(inputs)  # [sum of n, hidden]
            self.model.store_cross_kv(hidden, torch.tensor(slots, dtype=torch.long, device=self.device), self.backend)
        rows = input_batch.rows_of(sched.num_scheduled_tokens)
        enc_lens = self.enc_len[rows]
        max_enc = int(enc_lens.max())
        width = -(-max_enc // bs)
        enc_lens_t = torch.from_numpy(enc_lens.copy())
        meta.cross = CrossAttentionMetadata(
            query_start_loc=meta.query_start_loc, enc_lens=enc_lens_t.to(self.device, non_blocking=True),
            block_tables=torch.from_numpy(self.cross_table[rows, :width]).to(self.device, non_blocking=True),
            max_query_len=meta.max_query_len, max_enc_len=max_enc, enc_lens_cpu=enc_lens_t,
            query_start_loc_cpu=meta.query_start_loc_cpu)
