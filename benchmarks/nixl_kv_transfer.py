"""NIXL KV transfer between two processes on one GPU (or host memory with --device cpu): a prefill
side holding a Llama-3-8B-shape KV pool (32 layers, 8 KV heads of 128, bf16, 16-token blocks) and a
decode side that READs a 4,096-token request's blocks (256 blocks x 32 layers, 0.5 GiB) through
splitserve.kv_transfer.nixl_transport, as the NixlConnector does. Prints the time per transfer and
the bandwidth, and checks the bytes arrived (per-layer checksums of both sides).

    python benchmarks/nixl_kv_transfer.py [--tokens 4096] [--repeats 20] [--device cuda]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time


def make_pool(args, fill: bool):
    import torch
    shape = (args.pool_blocks, 2, 16, 8, 128)
    g = torch.Generator(device=args.device).manual_seed(0)
    if fill:
        return [torch.randn(shape, generator=g, device=args.device, dtype=torch.float32).to(torch.bfloat16)
                for _ in range(32)]
    return [torch.zeros(shape, device=args.device, dtype=torch.bfloat16) for _ in range(32)]


def checksums(pool, blocks):
    import torch
    idx = torch.tensor(blocks, device=pool[0].device)
    return [float(t.index_select(0, idx).float().sum()) for t in pool]


def prefill_side(args, to_decode, from_decode):
    from splitserve.kv_transfer.nixl_transport import NixlKVTransport
    pool = make_pool(args, fill=True)
    transport = NixlKVTransport("prefill", pool)
    n = args.tokens // 16
    src_blocks = list(range(7, 7 + args.stride * n, args.stride))  # stride 2: every other block
    to_decode.put((transport.metadata(), src_blocks, checksums(pool, src_blocks)))
    done = 0
    while done < args.repeats + 1:  # the warm-up and the timed reads each notify once
        done += len(transport.notifications())
        time.sleep(0.001)
    from_decode.get()


def decode_side(args, from_prefill, to_prefill, results):
    import torch
    from splitserve.kv_transfer.nixl_transport import NixlKVTransport
    pool = make_pool(args, fill=False)
    transport = NixlKVTransport("decode", pool)
    meta, src_blocks, sums = from_prefill.get()
    peer = transport.add_peer(meta)
    dst_blocks = list(range(len(src_blocks)))
    times = []
    for i in range(args.repeats + 1):
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        h = transport.read(peer, src_blocks, dst_blocks, f"req-{i}".encode())
        while (state := transport.state(h)) == "PROC":
            pass
        times.append(time.perf_counter() - t0)
        transport.release(h)
        assert state == "DONE", state
    got = checksums(pool, dst_blocks)
    ok = all(abs(a - b) <= 1e-3 * max(1.0, abs(a)) for a, b in zip(got, sums))
    nbytes = len(src_blocks) * 32 * transport.layout.block_bytes
    results.put((times[1:], nbytes, ok))
    to_prefill.put("bye")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--pool-blocks", type=int, default=1024)
    p.add_argument("--device", default="cuda")
    p.add_argument("--stride", type=int, default=1, help="1: the request's blocks contiguous in the source "
                   "pool (NIXL merges them into one descriptor per layer); 2: every other block")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    a, b, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=prefill_side, args=(args, a, b)), ctx.Process(target=decode_side, args=(args, a, b, results))]
    for pr in procs:
        pr.start()
    times, nbytes, ok = results.get(timeout=600)
    for pr in procs:
        pr.join(60)
    med = statistics.median(times)
    print(f"| NIXL READ {args.tokens} tokens (block stride {args.stride}), Llama-3-8B KV ({nbytes / 2**30:.2f} GiB, {args.device}) | "
          f"median {med * 1e3:.2f} ms, min {min(times) * 1e3:.2f} ms | {nbytes / med / 1e9:.1f} GB/s | bytes equal: {ok} |")


if __name__ == "__main__":
    main()
