"""NIXL KV transfer between two processes on one GPU (or host memory with --device cpu): a prefill
side holding a Llama-3-8B-shape KV pool (32 layers, 8 KV heads of 128, bf16, 16-token blocks) and a
decode side that READs a 4,096-token request's blocks (256 blocks x 32 layers, 0.5 GiB) through
splitserve.kv_transfer.nixl_transport, as the NixlConnector does, into contiguous blocks of its own.

One run measures every case of `--cases` (layout:source block stride:UCX threads):
- layout `layer`: one tensor per layer, as the runner allocates the pool today (a (layer, block) is a
  descriptor; NIXL merges runs adjacent on both sides); `block`: the layers are views into one
  block-major buffer (a block of every layer is one descriptor);
- stride 1: the request's source blocks are contiguous; 2: every other block (nothing to merge);
- threads: `num_threads` of the reader's agent (0: one UCX worker posts every descriptor; N: a READ
  of >= 1,024 descriptors is split over N workers).
Prints a table: the time per READ (post to DONE seen), the bandwidth, NIXL's own post and transfer
times and descriptor count (telemetry), and whether the bytes arrived (per-layer checksums).

    python benchmarks/nixl_kv_transfer.py [--tokens 4096] [--repeats 20] [--device cuda]
        [--cases layer:1:0,layer:2:0,layer:2:4,layer:2:8,block:1:0,block:2:0,block:2:4]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

LAYERS, BLOCK = 32, (2, 16, 8, 128)  # a block of a layer: K and V, 16 tokens, 8 heads of 128


def make_pool(args, layout: str, seed: int | None):
    """The per-layer tensors of a pool: random (seed) or zeros, layer-major or block-major."""
    import torch
    g = torch.Generator(device=args.device).manual_seed(seed or 0)
    fill = (lambda *s: torch.randn(*s, generator=g, device=args.device, dtype=torch.float32).to(torch.bfloat16)) \
        if seed is not None else (lambda *s: torch.zeros(*s, device=args.device, dtype=torch.bfloat16))
    if layout == "block":
        buf = fill(args.pool_blocks, LAYERS, *BLOCK)
        return [buf[:, layer] for layer in range(LAYERS)]
    return [fill(args.pool_blocks, *BLOCK) for _ in range(LAYERS)]


def checksums(pool, blocks):
    import torch
    idx = torch.tensor(blocks, device=pool[0].device)
    return [float(t.index_select(0, idx).float().sum()) for t in pool]


def source_blocks(args, stride: int) -> list[int]:
    return list(range(7, 7 + stride * (args.tokens // 16), stride))


def cases(args) -> list[tuple[str, int, int]]:
    out = []
    for c in args.cases.split(","):
        layout, stride, threads = c.split(":")
        assert layout in ("layer", "block"), c
        out.append((layout, int(stride), int(threads)))
    return out


def prefill_side(args, to_decode, from_decode):
    from splitserve.kv_transfer.nixl_transport import NixlKVTransport
    layouts = sorted({c[0] for c in cases(args)})
    pools = {lay: make_pool(args, lay, seed=1) for lay in layouts}
    transports = {lay: NixlKVTransport(f"prefill-{lay}", pools[lay]) for lay in layouts}
    sums = {(lay, s): checksums(pools[lay], source_blocks(args, s)) for lay in layouts for s in (1, 2)}
    to_decode.put(({lay: t.metadata() for lay, t in transports.items()}, sums))
    while from_decode.empty():  # the readers' notifications (they would pile up otherwise)
        for t in transports.values():
            t.notifications()
        time.sleep(0.001)
    for t in transports.values():
        t.close()


def decode_side(args, from_prefill, to_prefill, results):
    import torch
    from splitserve.kv_transfer.nixl_transport import NixlKVTransport
    metas, sums = from_prefill.get()
    pools, readers = {}, {}
    n = args.tokens // 16
    dst = list(range(n))
    rows = []
    for layout, stride, threads in cases(args):
        if layout not in pools:
            pools[layout] = make_pool(args, layout, seed=None)
        if (layout, threads) not in readers:
            t = NixlKVTransport(f"decode-{layout}-{threads}", pools[layout], num_threads=threads, telemetry=True)
            readers[layout, threads] = (t, t.add_peer(metas[layout]))
        transport, peer = readers[layout, threads]
        for c in pools[layout]:
            c[dst] = 0  # a READ that moved nothing cannot pass the checksum on an earlier case's bytes
        src = source_blocks(args, stride)
        times, tele = [], []
        for i in range(args.repeats + 1):  # the first is a warm-up
            if args.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            h = transport.read(peer, src, dst, f"req-{i}".encode())
            while (state := transport.state(h)) == "PROC":
                pass
            times.append(time.perf_counter() - t0)
            tele.append(transport.telemetry(h))
            transport.release(h)
            assert state == "DONE", state
        got = checksums(pools[layout], dst)
        ok = all(abs(a - b) <= 1e-3 * max(1.0, abs(a)) for a, b in zip(got, sums[layout, stride]))
        rows.append((layout, stride, threads, times[1:], tele[1:], ok))
    results.put((rows, n * LAYERS * pools[next(iter(pools))][0][0].numel() * 2))
    for t, _ in readers.values():
        t.close()
    to_prefill.put("bye")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--pool-blocks", type=int, default=1024)
    p.add_argument("--device", default="cuda")
    p.add_argument("--cases", default="layer:1:0,layer:2:0,layer:2:4,layer:2:8,block:1:0,block:2:0,block:2:4",
                   help="layout:source block stride:reader UCX threads, comma-separated (see the module's doc)")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    a, b, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=prefill_side, args=(args, a, b)), ctx.Process(target=decode_side, args=(args, a, b, results))]
    for pr in procs:
        pr.start()
    rows, nbytes = results.get(timeout=900)
    for pr in procs:
        pr.join(60)
    print(f"NIXL READ of {args.tokens} tokens of Llama-3-8B-shape KV ({nbytes / 2**30:.2f} GiB, {args.device}), "
          f"into contiguous blocks; median of {args.repeats}")
    print("| pool layout | source blocks | UCX threads | descriptors | median ms | min ms | GB/s | NIXL post ms | "
          "NIXL xfer ms | bytes equal |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for layout, stride, threads, times, tele, ok in rows:
        med = statistics.median(times)
        post = statistics.median(t["post_us"] for t in tele) / 1e3
        xfer = statistics.median(t["xfer_us"] for t in tele) / 1e3
        print(f"| {layout}-major | {'contiguous' if stride == 1 else f'every {stride}th' if stride > 2 else 'every other'} "
              f"| {threads} | {tele[-1]['descriptors']} | {med * 1e3:.2f} | {min(times) * 1e3:.2f} | "
              f"{nbytes / med / 1e9:.1f} | {post:.2f} | {xfer:.2f} | {ok} |")


if __name__ == "__main__":
    main()
