"""One target layer, side by side: sketched_linear vs F.linear with a weight that requires grad.

Measures the bytes each keeps for backward (saved-tensor hooks, the weight itself excluded,
since both hold it anyway) and the backward time (median of interleaved repetitions).

    python bench/sketch_layer.py [--d 4096 --k 4096 --n 4096 --r 256 --reps 7] [--markdown]
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import report  # noqa: E402  (bench/report.py)
import sketch  # noqa: E402


def saved_bytes(fn, exclude):
    total = 0

    def pack(t):
        nonlocal total
        if t.untyped_storage().data_ptr() != exclude.untyped_storage().data_ptr():
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total, out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--d", type=int, default=4096)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--r", type=int, default=256)
    p.add_argument("--reps", type=int, default=7)
    args = report.parse_args(p, "sketch_layer")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.n, args.k, generator=g).requires_grad_(True)  # (N, k)
    w = torch.randn(args.d, args.k, generator=g) / args.k**0.5  # (d, k)
    dy = torch.randn(args.n, args.d, generator=g)  # (N, d)
    a = sketch.make_projection(args.r, args.k, 0)  # (r, k)
    s = torch.zeros(args.d, args.r)  # (d, r)
    wd = w.clone().requires_grad_(True)

    runs = {
        "dense F.linear": (lambda: F.linear(x, wd), wd),
        "sketched_linear": (lambda: sketch.sketched_linear(x, w, None, a, s), w),
    }
    kept, times = {}, {name: [] for name in runs}
    for rep in range(args.reps + 1):  # interleaved; the first round warms up
        for name, (fn, weight) in runs.items():
            kept[name], y = saved_bytes(fn, weight)
            t0 = time.perf_counter()
            y.backward(dy)
            dt = time.perf_counter() - t0
            if rep:
                times[name].append(dt)
            x.grad = wd.grad = None
    grad_bytes = {"dense F.linear": args.d * args.k * 4, "sketched_linear": args.d * args.r * 4}
    base = "dense F.linear"
    caption = (f"layer {args.d}x{args.k}, N = {args.n} tokens, r = {args.r}, fp32, "
               f"{torch.get_num_threads()} threads, median of {args.reps}")
    rows = []
    for name in runs:
        med = statistics.median(times[name])
        rows.append([name, f"{kept[name] / 2**20:.1f} MiB ({kept[name] / kept[base]:.3f}x)",
                     f"{grad_bytes[name] / 2**20:.1f} MiB ({grad_bytes[name] / grad_bytes[base]:.3f}x)",
                     f"{med * 1e3:.0f} ms ({med / statistics.median(times[base]):.2f}x)"])
    result = report.table(["", "kept for backward", "gradient buffer", "backward time"], rows)
    print(caption)
    print(result)
    if args.markdown:
        report.publish("sketch_layer", caption + "\n\n" + result)


if __name__ == "__main__":
    main()
