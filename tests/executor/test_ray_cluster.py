"""The Ray backend on a test cluster of two simulated nodes (ray.cluster_utils.Cluster: two raylets on
this host, each with its own CPUs and custom resources "node0" / "node1", plus "rank_slot": 1 each so
that a bundle taking one lands one rank per node):

- TP=2 (a tiny 8-head Llama; the default model's 9 heads do not split in two) and PP=2 (the default
  model) with one rank per node give TP=1's greedy tokens, and the rank actors are gone after shutdown;
- removing a node under a running TP=2 engine ends its requests with an error naming the dead rank
  (no hang) and leaves no rank actor;
- two engine cores in Ray actors (RayCoreHost), one per node, served through the front's two tcp://
  sockets with the front <-> core messages, give TP=1's tokens; killing one node's raylet ends that
  core (its host says the node died, its process is gone) while the other keeps serving;
- `splitserve serve -pp 2 --distributed-executor-backend ray --ray-address local` starts its own Ray,
  serves, and after SIGTERM no process it started is left (by PID); `splitserve serve -tp 2` with
  $RAY_ADDRESS joins the test cluster, and after SIGTERM its rank actors there are gone (by PID).
Kept small for two cores: 2 logical CPUs a node, no dashboard, small object stores, fast node-death
detection (health checks every 0.5 s)."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import psutil
import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from splitserve.core.engine_core import EngineDeadError  # noqa: E402
from splitserve.engine.llm import LLM  # noqa: E402
from splitserve.loading.resolve import load_tokenizer  # noqa: E402
from splitserve.sampling_params import SamplingParams  # noqa: E402
from tests.hf_reference import make_tiny_llama_dir  # noqa: E402

pytestmark = pytest.mark.slow

SMALL = dict(max_model_len=256, cpu_kv_cache_gib=0.05, max_num_seqs=8)
PROMPTS = ["The capital of France is", "1, 2, 3,", "Once upon a time"]
PROMPT_IDS = [1, 504, 3575, 282, 4649, 314]
NEW_TOKENS = 8
STORE = 80 * 1024 ** 2
NODE_DEATH = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}


def node_args(i: int) -> dict:
    return dict(num_cpus=2, resources={f"node{i}": 1, "rank_slot": 1}, object_store_memory=STORE)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args=dict(include_dashboard=False, _system_config=NODE_DEATH,
                                                          **node_args(0)))
    c.add_node(**node_args(1))
    ray.init(address=c.address, logging_level="WARNING")
    yield c
    ray.shutdown()
    c.shutdown()


def second_node(c: Cluster):
    """The worker node, added again if an earlier test removed it."""
    if not c.worker_nodes:
        c.add_node(**node_args(1))
    return next(iter(c.worker_nodes))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny-ray"), load_tokenizer(None), num_kv_heads=2, tie=False,
                               num_attention_heads=8, seed=5)


def greedy(llm: LLM, max_tokens: int = NEW_TOKENS) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def reference(model: str | None) -> list[list[int]]:
    llm = LLM(model, **SMALL)
    try:
        return greedy(llm)
    finally:
        llm.engine.core.shutdown()


def rank_pids(llm: LLM) -> list[int]:
    return [pid for _, _, pid in llm.engine.core.executor.ranks.where]


def assert_gone(pids: list[int], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.2)
    alive = [p for p in pids if psutil.pid_exists(p)]
    assert not alive, f"processes left behind: {alive}"


def ray_llm(c: Cluster, model: str | None, **kw) -> LLM:
    second_node(c)
    return LLM(model, distributed_executor_backend="ray", ray_bundle_resource="rank_slot", **kw, **SMALL)


@pytest.mark.parametrize("model,layout", [("tiny", dict(tensor_parallel_size=2)), (None, dict(pipeline_parallel_size=2))],
                         ids=["tp2-tiny", "pp2-default"])
def test_one_rank_per_node_gives_one_rank_tokens(cluster, tiny_dir, model, layout):
    model = tiny_dir if model == "tiny" else None
    want = reference(model)
    llm = ray_llm(cluster, model, **layout)
    ranks = llm.engine.core.executor.ranks
    assert len({node for node, _, _ in ranks.where}) == 2, ranks.where  # one rank on each node
    pids = rank_pids(llm)
    assert greedy(llm) == want
    llm.engine.core.shutdown()
    assert_gone(pids)


def test_a_dead_node_ends_the_requests_with_an_error(cluster, tiny_dir):
    llm = ray_llm(cluster, tiny_dir, tensor_parallel_size=2, distributed_timeout_s=60)
    pids = rank_pids(llm)
    node = second_node(cluster)
    killer = threading.Timer(2.0, cluster.remove_node, args=(node,), kwargs=dict(allow_graceful=False))
    killer.start()
    started = time.monotonic()
    try:
        with pytest.raises(EngineDeadError, match=r"^rank 1 \(Ray actor on [\d.]+\) died") as info:
            greedy(llm, max_tokens=240)  # several seconds of decoding: the node goes mid-way
    finally:
        killer.join()
    assert time.monotonic() - started < 60, "the engine took too long to notice"
    assert info.value.process_lost
    assert "node has died" in str(info.value)  # Ray's word for the cause, not only the peer's broken collective
    llm.engine.core.shutdown()
    assert_gone(pids)


def test_ranks_the_cluster_cannot_place_are_a_clear_error(cluster, tiny_dir):
    """Three ranks, one per node, on two nodes: Ray cannot place them; the engine says so, naming what
    it asked for and what the cluster has, within distributed_timeout_s, and leaves nothing reserved."""
    second_node(cluster)
    with pytest.raises(RuntimeError, match=r"Ray could not place the ranks .* 3 bundles of .*STRICT_SPREAD"):
        LLM(tiny_dir, tensor_parallel_size=1, pipeline_parallel_size=3, distributed_executor_backend="ray",
            ray_placement_strategy="STRICT_SPREAD", distributed_timeout_s=3, **SMALL)
    from ray.util import placement_group_table
    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())


# -- engine cores in Ray actors (the data-parallel replicas' hosts) ----------------------------------------
class Front:
    """The front's side of one core: a PUSH and a PULL socket bound on tcp:// (what engine/ binds)."""

    def __init__(self, ctx, ip: str):
        import zmq
        from splitserve.protocol.core_messages import Codec, CoreToFront, FrontToCore
        self.push, self.pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        self.input_addr = f"tcp://{ip}:{self.push.bind_to_random_port(f'tcp://{ip}')}"
        self.output_addr = f"tcp://{ip}:{self.pull.bind_to_random_port(f'tcp://{ip}')}"
        self.enc, self.dec = Codec(FrontToCore), Codec(CoreToFront)

    def ready(self, host, timeout: float = 180):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pull.poll(200):
                return self.dec.decode(self.pull.recv())
            assert host.alive(), host.exit_description()
        raise AssertionError("no CoreReady")

    def add(self, rid: str, max_tokens: int) -> None:
        from splitserve.protocol.core_messages import AddRequests, EngineCoreRequest
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        self.push.send(self.enc.encode(AddRequests([EngineCoreRequest(rid, PROMPT_IDS, params, (2,),
                                                                      len(PROMPT_IDS) + max_tokens, time.time())])))

    def collect(self, rid: str, timeout: float = 60) -> tuple[list[int], str | None]:
        from splitserve.protocol.core_messages import EngineCoreOutputs
        tokens, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pull.poll(200):
                msg = self.dec.decode(self.pull.recv())
                for out in msg.outputs if isinstance(msg, EngineCoreOutputs) else ():
                    if out.request_id == rid:
                        tokens += out.new_token_ids
                        if out.finish_reason:
                            return tokens, out.finish_reason
        return tokens, None

    def shutdown(self) -> None:
        from splitserve.protocol.core_messages import Shutdown
        self.push.send(self.enc.encode(Shutdown()))


def test_core_hosts_one_per_node_serve_and_a_dead_node_ends_only_its_core(cluster):
    import zmq
    from splitserve.engine.args import EngineArgs
    from splitserve.engine.core_loop import core_process_main
    from splitserve.executor.ray_core_host import RayCoreHost
    second_node(cluster)
    one = LLM(**SMALL)
    want = list(one.generate([PROMPT_IDS], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids)
    one.engine.core.shutdown()
    config = EngineArgs(**SMALL).create_engine_config()
    ip = ray.util.get_node_ip_address()
    ctx = zmq.Context()
    fronts = [Front(ctx, ip) for _ in range(2)]
    hosts = [RayCoreHost(config, f.input_addr, f.output_addr, core_process_main, resources={f"node{i}": 0.01})
             for i, f in enumerate(fronts)]
    try:
        for h in hosts:
            h.start()
        for f, h in zip(fronts, hosts):
            ready = f.ready(h)
            assert ready.error is None and ready.num_blocks > 0
        node_ids = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        for i, h in enumerate(hosts):
            assert f"node{i}" in node_ids[h.node], (i, h.node)  # placed where its resource is
        pids = [h.pid for h in hosts]
        assert all(pids)
        for i, f in enumerate(fronts):
            f.add(f"warm{i}", NEW_TOKENS)
        for i, f in enumerate(fronts):
            assert f.collect(f"warm{i}") == (want, "length")
        fronts[1].add("long", 240)
        time.sleep(1.0)
        node = second_node(cluster)
        os.kill(node.all_processes["raylet"][0].process.pid, signal.SIGKILL)  # the node's raylet alone
        deadline = time.monotonic() + 30
        while hosts[1].alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not hosts[1].alive()
        assert "node has died" in hosts[1].exit_description(), hosts[1].exit_description()
        assert_gone(pids[1:])  # the core's process does not outlive its raylet
        cluster.remove_node(node, allow_graceful=False)  # the rest of that node's processes
        fronts[0].add("after", NEW_TOKENS)  # the other core keeps serving
        assert fronts[0].collect("after") == (want, "length")
        assert hosts[0].alive()
        fronts[0].shutdown()
        hosts[0].join(20)
        assert "exited with code 0" in hosts[0].exit_description()
        assert_gone(pids)
    finally:
        for h in hosts:
            h.kill()
        ctx.destroy(linger=0)


# -- the server, starting its own Ray ------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, log: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, open(log).read()[-3000:]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, open(log).read()[-3000:]
        time.sleep(0.5)


def test_serve_on_its_own_ray_and_sigterm_leaves_nothing():
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="splitserve-ray-server-", suffix=".log", delete=False)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-m", "splitserve", "serve", "--host", "127.0.0.1", "--port", str(port), "-pp", "2",
           "--distributed-executor-backend", "ray", "--ray-address", "local", "--max-model-len", "256",
           "--cpu-kv-cache-gib", "0.05"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log.name)
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == NEW_TOKENS
        tree = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in tree)
        assert "raylet" in names and "gcs_server" in names, names  # Ray's own processes, under the server
        assert sum("RankActor" in " ".join(p.cmdline()) for p in tree) == 2, names
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, open(log.name).read()[-3000:]
        gone, alive = psutil.wait_procs(tree, timeout=30)
        assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def actor_processes(name: str) -> set[int]:
    """This test's descendants (the test cluster's workers among them) that are Ray actors of a class."""
    out = set()
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if f"ray::{name}" in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_serve_joins_a_cluster_by_ray_address_and_sigterm_ends_its_actors(cluster, tiny_dir):
    second_node(cluster)
    before = actor_processes("RankActor")
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="splitserve-ray-server-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "splitserve", "serve", tiny_dir, "--host", "127.0.0.1", "--port", str(port),
           "-tp", "2", "--distributed-executor-backend", "ray", "--ray-bundle-resource", "rank_slot",
           "--max-model-len", "256", "--cpu-kv-cache-gib", "0.05"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RAY_ADDRESS": cluster.address})
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log.name)
        ranks = actor_processes("RankActor") - before
        assert len(ranks) == 2  # in the test cluster's nodes, not under the server
        assert not ranks & {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, open(log.name).read()[-3000:]
        assert_gone(list(ranks))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_data_parallel_replicas_one_per_node_and_a_dead_node_fails_only_its_replica(cluster):
    """LLM(data_parallel_size=2, data_parallel_backend="ray"): the front's two engine cores are Ray
    actors, one per node (a rank_slot each); both serve TP=1's tokens; the second node's raylet killed
    mid-run fails that replica's requests with an error naming it, and the other replica serves on."""
    second_node(cluster)
    want = reference(None)
    llm = LLM(data_parallel_size=2, data_parallel_backend="ray", ray_bundle_resource="rank_slot", **SMALL)
    engine = llm.engine.engine
    try:
        nodes = [r.placement.host.node for r in engine.replicas]
        assert len(set(nodes)) == 2, nodes
        pids = [r.placement.pid for r in engine.replicas]
        assert greedy(llm) == want
        assert all(r.num_routed > 0 for r in engine.replicas)
        victim = next(i for i, r in enumerate(engine.replicas) if r.placement.host.node != ray.get_runtime_context().get_node_id())
        long = [[random.Random(i).randrange(100, 40000) for _ in range(6)] for i in range(8)]
        failure: list[BaseException] = []

        def run_long():
            try:
                llm.generate(long, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), use_tqdm=False)
            except BaseException as e:  # noqa: BLE001 - the test inspects it
                failure.append(e)
        t = threading.Thread(target=run_long)
        t.start()
        time.sleep(2.0)
        node = second_node(cluster)
        os.kill(node.all_processes["raylet"][0].process.pid, signal.SIGKILL)
        t.join(120)
        assert not t.is_alive() and failure, "the requests on the dead node's replica must fail, not hang"
        assert f"engine replica {victim} failed" in str(failure[0]), failure[0]
        assert_gone([pids[victim]])
        cluster.remove_node(node, allow_graceful=False)
        assert greedy(llm) == want  # the other replica serves on
    finally:
        llm.engine.shutdown()
    assert_gone([p for p in pids if p is not None])
