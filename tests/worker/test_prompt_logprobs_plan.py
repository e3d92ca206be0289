"""Which hidden rows of a step give prompt logprobs (worker/prompt_logprobs.py), on the persistent
batch, exactly: chunks of a prompt, the last prompt position left to the sampler, rows that sampled
already, and the counter that keeps steps without such requests free of any of it."""
import numpy as np

from splitserve.protocol.sched_output import NewRequestData, SchedulerOutput
from splitserve.sampling_params import SamplingParams
from splitserve.worker.input_batch import InputBatch
from splitserve.worker.prompt_logprobs import plan_prompt_logprobs


def layout(ib, nst):
    rows = ib.rows_of(nst)
    counts = np.array(list(nst.values()), dtype=np.int64)
    starts = ib.num_computed[rows]
    qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return rows, starts, counts, qsl


def test_plan_follows_chunks_and_leaves_the_last_prompt_position_to_the_sampler():
    ib = InputBatch(4, 64, 8)
    plain = NewRequestData("plain", list(range(100, 106)), SamplingParams(), [0])
    asks = NewRequestData("asks", list(range(200, 210)), SamplingParams(prompt_logprobs=2), [1])
    ib.update(SchedulerOutput(new_requests=[plain, asks]))
    assert ib.num_prompt_logprob_rows == 1

    # Step 1: plain's whole prompt (6), asks' first chunk of 4 tokens (positions 0..3 -> tokens 1..4).
    nst = {"plain": 6, "asks": 4}
    rows, starts, counts, qsl = layout(ib, nst)
    plan = plan_prompt_logprobs(ib, rows, starts, counts, qsl)
    assert plan.hidden_rows.tolist() == [6, 7, 8, 9]
    assert plan.target_ids.tolist() == [201, 202, 203, 204]
    assert plan.segments == [("asks", 2, 0, 0, 4)] and plan.max_k == 2
    ib.record_launch(rows, starts + counts, rows[:1], 0)

    # Step 2: asks' last 6 tokens (positions 4..9): position 9 predicts the first output token.
    nst = {"asks": 6}
    rows, starts, counts, qsl = layout(ib, nst)
    plan = plan_prompt_logprobs(ib, rows, starts, counts, qsl)
    assert plan.hidden_rows.tolist() == [0, 1, 2, 3, 4]
    assert plan.target_ids.tolist() == [205, 206, 207, 208, 209]
    assert plan.segments == [("asks", 2, 4, 0, 5)]
    ib.record_launch(rows, starts + counts, rows, 1)

    # Sampled: no more prompt rows, even if it were recomputed from the start (resumed).
    ib.num_computed[rows] = 0
    assert plan_prompt_logprobs(ib, rows, ib.num_computed[rows], np.array([10]), np.array([0, 10])) is None

    ib.update(SchedulerOutput(finished_req_ids=["asks"]))
    assert ib.num_prompt_logprob_rows == 0 and (ib.num_prompt_logprobs == -1).all()
