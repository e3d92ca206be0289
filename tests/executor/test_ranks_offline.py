"""Several ranks (one worker process each) behind the offline `LLM`, over gloo on CPU: the tokens equal
Hugging Face transformers' on the same weights (TP=2, TP=2 x PP=2), seeded sampling equals TP=1, and a
rank that dies, hangs or fails at start-up ends the engine with an error naming it and leaves no process.

Until the model side splits the layers, every rank holds the whole model (replicated): these tests check
the processes, the broadcast of the step message, the sampling rank's answer, the sampled ids shared
with every rank and the pipeline transfer (with a replicated model the last stage's output is exactly
what it received from the stage before, see parallel/pipeline.py)."""
from __future__ import annotations

import os

import psutil
import pytest
import torch

from splitserve.core.engine_core import EngineDeadError
from splitserve.fault_injection import RANK_ENV_VAR
from splitserve.engine.llm import LLM
from splitserve.loading.resolve import load_tokenizer
from splitserve.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, make_tiny_llama_dir

pytestmark = pytest.mark.slow

SMALL = dict(max_model_len=256, cpu_kv_cache_gib=0.05, max_num_seqs=8)
PROMPTS = [[1, 422, 2301, 8830], [1, 504, 3575, 282, 4649, 314], [1, 77, 88, 99, 1000, 2000, 3000, 4000, 5000]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """8 query heads, 2 KV heads: the shape the tensor-parallel issue asks for."""
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny-tp"), load_tokenizer(None), num_kv_heads=2, tie=False,
                               num_attention_heads=8, seed=5)


@pytest.fixture(scope="module")
def hf_reference(tiny_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32).eval()
    return [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]


_EARLIER: set[int] = set()  # descendants that were there before this module ran (see the fixture below)


@pytest.fixture(scope="module", autouse=True)
def _earlier_processes():
    """Processes other modules left running on purpose (e.g. tests/e2e's session-scoped servers) are not
    this module's engines: counted once, before its first test, and left out of every count."""
    _EARLIER.update(p.pid for p in psutil.Process(os.getpid()).children(recursive=True))
    yield
    _EARLIER.clear()


def engine_processes() -> list[psutil.Process]:
    """This test process's descendants started by this module, less multiprocessing's resource tracker
    (it lives as long as we do)."""
    out = []
    for child in psutil.Process(os.getpid()).children(recursive=True):
        if child.pid in _EARLIER:
            continue
        try:
            if "resource_tracker" not in " ".join(child.cmdline()):
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


def rank_processes() -> list[psutil.Process]:
    """engine_processes less the grammar process (the engine starts it too)."""
    out = []
    for p in engine_processes():
        try:
            if "structured_output.grammar_process" not in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def assert_no_processes_left(timeout: float = 20.0, which=engine_processes) -> None:
    gone, alive = psutil.wait_procs(which(), timeout=timeout)
    assert not alive, f"processes left behind: {[p.pid for p in alive]}"


def greedy(llm: LLM):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0, ignore_eos=True),
                        use_tqdm=False)
    return [(o.outputs[0].token_ids, [float(lp[t]) for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def assert_matches(got, want) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, want):
        assert list(tokens) == ref_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_ranks_give_transformers_greedy_tokens(tiny_dir, hf_reference, tp, pp):
    llm = LLM(tiny_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, **SMALL)
    assert len(rank_processes()) == tp * pp
    assert_matches(greedy(llm), hf_reference)
    llm.engine.core.shutdown()
    assert_no_processes_left()


def test_seeded_sampling_with_two_ranks_equals_one(tiny_dir):
    """With async scheduling on (the core schedules step N+1 before N's answer) and penalties (which
    read each request's earlier tokens on the host, in the rank) against one process stepping
    synchronously."""
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, top_p=0.9, seed=100 + i, ignore_eos=True,
                             repetition_penalty=1.5 if i % 2 else 1.0)
              for i in range(len(PROMPTS))]
    # and a constrained request: its bitmask rows travel in the step message to the sampling rank
    from splitserve.sampling_params import StructuredOutputsParams
    params.append(SamplingParams(max_tokens=12, temperature=1.0, seed=7,
                                 structured_outputs=StructuredOutputsParams(choice=["alpha beta", "gamma", "delta"])))
    prompts = PROMPTS + ["Pick one:"]
    one = [o.outputs[0].token_ids for o in LLM(tiny_dir, async_scheduling=False, **SMALL).generate(
        prompts, params, use_tqdm=False)]
    llm = LLM(tiny_dir, tensor_parallel_size=2, async_scheduling=True, **SMALL)
    assert llm.engine.core.async_scheduling
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[-1].outputs[0].text in ("alpha beta", "gamma", "delta")
    two = [o.outputs[0].token_ids for o in outs]
    llm.engine.core.shutdown()
    assert two == one
    assert_no_processes_left()


def test_ngram_speculation_with_two_ranks_equals_one_without(tmp_path):
    """TP=2 with n-gram drafts (the sampling rank verifies and broadcasts the outcome; async
    scheduling on; a fixed k so that every step verifies): greedy tokens and logprobs equal one
    process without speculation. A 32-token vocabulary, so that the random model repeats itself and
    drafts are accepted."""
    path = make_tiny_llama_dir(tmp_path, load_tokenizer(None), num_kv_heads=2, tie=False, num_attention_heads=8,
                               seed=5, vocab_size=32)
    prompts = [{"prompt_token_ids": p} for p in ([1, 4, 22, 30] * 3, [1, 5, 7, 28, 9, 3] * 3, [1, 7, 8, 9, 10] * 3)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    one = [o.outputs[0] for o in LLM(path, **SMALL).generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, tensor_parallel_size=2, async_scheduling=True, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}, **SMALL)
    two = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    accepted = llm.engine.core.scheduler.spec_num_accepted_tokens
    llm.engine.core.shutdown()
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    for a, b in zip(two, one):
        assert [list(x) for x in a.logprobs] == [list(x) for x in b.logprobs]
    assert accepted > 0
    assert_no_processes_left()


@pytest.mark.parametrize("kind,expected", [
    ("exit", "rank 1 exited with code 3"),
    ("hang", "no answer to step"),
])
def test_a_rank_that_dies_or_hangs_ends_the_engine(tiny_dir, monkeypatch, kind, expected):
    monkeypatch.setenv(RANK_ENV_VAR, f"rank=1,step=3,kind={kind}")
    llm = LLM(tiny_dir, tensor_parallel_size=2, step_timeout_s=60 if kind == "exit" else 10, **SMALL)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1), use_tqdm=False)  # first steps: one-time costs
    with pytest.raises(EngineDeadError, match=expected) as info:
        llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)
    assert info.value.process_lost
    assert_no_processes_left(which=rank_processes)
    # The grammar process (started with the engine) ends with its shutdown, or when the LLM goes.
    llm.engine.core.shutdown()
    assert_no_processes_left()


def test_out_of_memory_at_start_up_names_the_rank_and_the_memory(tiny_dir, monkeypatch):
    monkeypatch.setenv(RANK_ENV_VAR, "rank=1,kind=startup_oom")
    with pytest.raises(RuntimeError, match=r"rank 1 \(cpu\) ran out of memory at start-up: .*Tried to allocate 20.00 GiB"):
        LLM(tiny_dir, tensor_parallel_size=2, **SMALL)
    assert_no_processes_left()


def three_free_ports() -> int:
    """A port p with p, p + 1 and p + 2 free (the rendezvous, the step messages, the results)."""
    import socket
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port > 65530:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port + 1))
                b.bind(("127.0.0.1", port + 2))
            return port
        except OSError:
            continue
    raise RuntimeError("no three consecutive free ports")


def test_two_nodes_on_one_machine(tiny_dir, hf_reference, tmp_path):
    """Node 1 is a headless `splitserve serve` given its place by torchrun's environment variables;
    node 0 is this process's engine. Each holds one pipeline stage; the steps reach node 1 over tcp."""
    import subprocess
    import sys
    port = three_free_ports()
    env = {**os.environ, "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    log = open(tmp_path / "node1.log", "w+")
    node1 = subprocess.Popen([sys.executable, "-m", "splitserve", "serve", tiny_dir, "-pp", "2",
                              "--max-model-len", "256", "--cpu-kv-cache-gib", "0.05", "--max-num-seqs", "8"],
                             stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        llm = LLM(tiny_dir, pipeline_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1",
                  master_port=port, **SMALL)
        assert len(rank_processes()) == 3  # our rank 0; node 1: its launcher and rank 1
        assert_matches(greedy(llm), hf_reference)
        llm.engine.core.shutdown()
        assert node1.wait(timeout=60) == 0, open(log.name).read()[-3000:]
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
        log.close()
    assert_no_processes_left()


def test_prompt_logprobs_with_ranks_are_refused_not_dropped(tiny_dir):
    """The rank workers do not compute prompt logprobs yet: a request asking for them is an error up
    front (before anything is queued), never an answer without them."""
    llm = LLM(tiny_dir, tensor_parallel_size=2, **SMALL)
    try:
        with pytest.raises(ValueError, match="prompt_logprobs is not supported yet with several ranks"):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)
        assert len(llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2
    finally:
        llm.engine.core.shutdown()
    assert_no_processes_left()
