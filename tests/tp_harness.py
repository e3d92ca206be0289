"""Runs a function on every rank of a small CPU world (gloo), each rank a spawned process, and
drives a ModelRunner through a fixed step schedule for the tensor/pipeline-parallel tests."""
from __future__ import annotations

import os
import socket
import tempfile

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, tp: int, pp: int, port: int, tasks, results) -> None:
    """A rank of a RankPool: joins the world once, then runs each (fn, out_dir, args) it is sent
    until it gets None, answering ("ok"|"error", rank, traceback) on `results`."""
    import gc
    import traceback
    from splitserve.parallel.parallel_state import destroy_model_parallel, init_model_parallel
    torch.set_num_threads(1)  # a 2-core machine runs up to four ranks
    init_model_parallel(tp_size=tp, pp_size=pp, rank=rank, backend="gloo",
                        init_method=f"tcp://127.0.0.1:{port}", timeout_s=300)
    try:
        while (task := tasks.get()) is not None:
            fn, out_dir, args = task
            try:
                torch.save(fn(rank, *args), os.path.join(out_dir, f"rank{rank}.pt"))
                results.put(("ok", rank, ""))
            except BaseException:
                results.put(("error", rank, traceback.format_exc()))
            gc.collect()
    finally:
        destroy_model_parallel()


class RankPool:
    """tp * pp spawned rank processes that stay up for several run_ranks calls: starting a rank
    (importing torch and splitserve, joining the gloo world) costs seconds on a CPU, more than most
    calls' own work. A call that fails on any rank closes the pool (the other ranks may wait in a
    collective); the next call starts a new one."""

    def __init__(self, tp: int, pp: int):
        ctx = mp.get_context("spawn")
        self.world = tp * pp
        self.tasks = [ctx.SimpleQueue() for _ in range(self.world)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [ctx.Process(target=_rank_main, args=(r, tp, pp, port, self.tasks[r], self.results), daemon=True)
                      for r in range(self.world)]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, args: tuple) -> list:
        import queue
        with tempfile.TemporaryDirectory() as out_dir:
            for q in self.tasks:
                q.put((fn, out_dir, args))
            pending = set(range(self.world))
            while pending:
                try:
                    status, rank, tb = self.results.get(timeout=1.0)
                except queue.Empty:
                    dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                    if dead:
                        self.close(kill=True)
                        raise RuntimeError(f"rank(s) {dead} exited with "
                                           f"{[self.procs[r].exitcode for r in dead]} during {fn.__name__}")
                    continue
                if status == "error":
                    self.close(kill=True)
                    raise RuntimeError(f"rank {rank} raised in {fn.__name__}:\n{tb}")
                pending.discard(rank)
            return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(self.world)]

    def close(self, kill: bool = False) -> None:
        for q, p in zip(self.tasks, self.procs):
            if p.is_alive() and not kill:
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if kill else 30)
            if p.is_alive():
                p.kill()
                p.join()
        self.results.close()


_POOLS: dict[tuple[int, int], RankPool] = {}


def run_ranks(fn, tp: int, pp: int = 1, *args) -> list:
    """fn(rank, *args) on each of tp * pp ranks (a module-level function); their return values in
    rank order. A rank that raises fails the call with its traceback. The ranks are a RankPool's,
    kept until close_rank_pools() (tests/executor/conftest.py calls it after each module)."""
    pool = _POOLS.get((tp, pp))
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close()
        pool = _POOLS[tp, pp] = RankPool(tp, pp)
    try:
        return pool.run(fn, args)
    finally:
        if not pool.alive():
            _POOLS.pop((tp, pp), None)


def close_rank_pools() -> None:
    """Ends every pool's ranks (killed: they hold nothing to save, and a clean exit takes seconds)."""
    while _POOLS:
        _POOLS.popitem()[1].close(kill=True)


# -- a model through the real runner ----------------------------------------------------------------
PROMPTS = {"a": 9, "b": 5}  # request -> prompt length
# Chunked prefill, then one-token steps over the cached context (decode-shaped attention), then
# (where every rank knows the sampled tokens) real decode steps; requests sample where their last
# prompt token is computed.
SCHEDULE = [{"a": 6, "b": 3}, {"a": 1, "b": 2}, {"a": 1}, {"a": 1}]
DECODE_STEPS = [{"a": 1, "b": 1}, {"a": 1, "b": 1}]


def build_runner(source, quantization: str | None = None):
    """The model of `source` (quantized as its checkpoint says, or online by `quantization`) in a
    fp32 CPU ModelRunner with the torch reference attention and a KV pool of four blocks; with
    pipeline stages, the worker processes' StageRunner (the last stage's first rank samples and
    broadcasts the tokens)."""
    from splitserve.config import CacheConfig, CompileConfig, EngineConfig, ModelConfig, SchedulerConfig
    from splitserve.layers.quantization.config import resolve_quant_config
    from splitserve.models.loader import load_hf_config, load_model
    from splitserve.worker.model_runner import ModelRunner
    hf_config = load_hf_config(source)
    quant = resolve_quant_config(quantization, hf_config, None if source.gguf_file else source.directory)
    arch, model = load_model(source, hf_config, torch.float32, "cpu", quant_config=quant)
    config = EngineConfig(
        model=ModelConfig(hf_config, arch, torch.float32, 64, hf_config.vocab_size, (), quant),
        cache=CacheConfig(block_size=16, num_blocks=4), scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        compile=CompileConfig(enforce_eager=True), device="cpu", attention_backend="torch_ref")
    from splitserve.parallel.parallel_state import pp_group, tp_group
    if pp_group().world_size > 1:  # the worker process's runner: stage transfers, one sampling rank
        from splitserve.executor.rank_worker import StageRunner
        runner = StageRunner(config, model, sampler_rank=(pp_group().world_size - 1) * tp_group().world_size)
    else:
        runner = ModelRunner(config, model)
    runner.allocate_kv_cache(4)
    return runner


def run_schedule(runner, prompt_seed: int, decode: bool) -> list[dict]:
    """Each step's sampled tokens and logprobs (top 5 and the sampled token's), by request."""
    from splitserve.protocol.sched_output import NewRequestData, SchedulerOutput
    from splitserve.sampling_params import SamplingParams
    gen = torch.Generator().manual_seed(prompt_seed)
    vocab = runner.config.model.vocab_size
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    new = [NewRequestData(rid, torch.randint(0, vocab, (n,), generator=gen).tolist(), params, [i])
           for i, (rid, n) in enumerate(PROMPTS.items())]
    results = []
    with torch.inference_mode():
        for i, counts in enumerate(SCHEDULE + (DECODE_STEPS if decode else [])):
            sched = SchedulerOutput(step_id=i, num_scheduled_tokens=counts, total_num_scheduled_tokens=sum(counts.values()),
                                    new_requests=new if i == 0 else [])
            res = runner.collect(runner.launch(sched))
            results.append({"tokens": res.tokens, "logprobs": res.logprobs})
    return results


def assert_same_steps(got: list[dict], want: list[dict], tol: float = 1e-4) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert g["tokens"] == w["tokens"], f"step {step}"
        for rid, lp in w["logprobs"].items():
            assert set(g["logprobs"][rid]) == set(lp), f"step {step} request {rid}: other top tokens"
            for tok, v in lp.items():
                assert abs(g["logprobs"][rid][tok] - v) <= tol, f"step {step} request {rid} token {tok}"
