"""The tensor-parallel all-reduce inside a captured CUDA graph, with a world size of 1 (one GPU).

The parallel layers skip the collective when the group has one rank; this script calls the custom op
`splitserve::all_reduce` itself over a real one-rank NCCL group, inside `torch.compile` and inside a
captured CUDA graph, checks the replayed result on fresh inputs, and times the op per message size
(decode-sized messages: [tokens, 4096] bf16). With several GPUs `benchmarks/tp_bench.sh` measures
the real thing.

    python benchmarks/tp_collectives_gpu.py
"""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from splitserve.parallel import communication  # noqa: F401  (registers the ops)
from splitserve.parallel.parallel_state import init_model_parallel


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    torch.cuda.set_device(0)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0,
                            device_id=torch.device("cuda", 0))
    init_model_parallel(tp_size=1, pp_size=1, rank=0, backend="nccl", init_method="unused")

    def layer(x, w):  # a row-parallel matmul and its all-reduce, as the model has them
        return torch.ops.splitserve.all_reduce(x @ w, "tp") + 1.0

    compiled = torch.compile(layer, fullgraph=True)
    rows = []
    for tokens in (1, 8, 64, 512):
        x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
        for _ in range(3):
            compiled(x, w)  # warm up (compile, NCCL communicator) outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compiled(x, w)
        fresh = torch.randn_like(x)
        x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        expected = (fresh.float() @ w.float() + 1.0).to(torch.bfloat16)
        torch.testing.assert_close(out, expected, atol=0.05, rtol=0.02)
        # time the op alone, captured
        y = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2):
            for _ in range(100):
                y = torch.ops.splitserve.all_reduce(y, "tp")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g2.replay()
        start.record()
        for _ in range(10):
            g2.replay()
        end.record()
        torch.cuda.synchronize()
        rows.append((tokens, start.elapsed_time(end) / 1000 * 1000))  # ms for 1000 ops -> µs per op
    print("all_reduce inside torch.compile + CUDA graph, world size 1, NCCL: results equal the reference")
    print(f"{'tokens x 4096 bf16':>20s} {'µs per all_reduce (captured)':>30s}")
    for tokens, us in rows:
        print(f"{tokens:>20d} {us:>30.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
