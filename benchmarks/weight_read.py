"""The device's weight-read rate at decode: batch-1 bf16 matmuls over 3.8 GB of distinct weights (32
matrices of 14336 x 4096, more than L2 holds), replayed in one CUDA graph. The bandwidth that the
decode-time floor of a model (its weight bytes / this rate) is taken at.

    python benchmarks/weight_read.py
"""
import torch


def main() -> None:
    weights = [torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(32)]
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    for w in weights:
        torch.mm(x, w.t())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            torch.mm(x, w.t())
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    best = sorted(times)[len(times) // 2]
    print(f"weight read: {nbytes / 1e9:.2f} GB in {best * 1e3:.3f} ms (median of 20) = {nbytes / best / 1e12:.2f} TB/s")


if __name__ == "__main__":
    main()
