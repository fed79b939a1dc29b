"""The same tiny run on several layouts of ranks over torchrun "nodes" on this machine: one
process, 1 node x 2, 2 nodes x 1, 1 node x 4 and 2 nodes x 2 (c10d rendezvous on 127.0.0.1,
gloo). Each layout's final weights against the one-node run of the same number of ranks (the
layout should change where ranks run, not what they compute) and against one process, with
the wall time of each run.

    python bench/layouts.py [--markdown] [--updates N]

The test suite runs 2 nodes x 1 (tests/test_train.py); 2 nodes x 2 is here, as it needs 4
processes at once.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import report  # noqa: E402  (bench/report.py)
from subproc import read_checkpoint  # noqa: E402  (tests/subproc.py: a run's checkpoint gathered)

ROOT = report.ROOT
# A few updates of the tiny preset, small enough for 4 processes on 2 cores. The probe scores
# every response (8), so that its sample does not depend on the number of ranks.
ARGS = ["--warmup-steps", "300", "--batch", "8", "--micro-batch", "2", "--probe-responses", "8", "--eval-problems",
        "16", "--eval-every", "0", "--rank", "8"]
LAYOUTS = [(1, 1), (1, 2), (2, 1), (1, 4), (2, 2)]  # (nodes, ranks per node)


def launch(nodes, ranks, run_dir, port):
    """Start train.py in the layout; wait; the seconds it took."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    args = [*ARGS, "--run-dir", run_dir]
    if nodes * ranks == 1:
        commands = [[sys.executable, os.path.join(ROOT, "train.py"), *args]]
    else:
        commands = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc_per_node",
                     str(ranks), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
                     f"bench-{port}", os.path.join(ROOT, "train.py"), *args] for _ in range(nodes)]
    t0 = time.perf_counter()
    logs = [open(f"{run_dir}-node{n}.log", "w") for n in range(nodes)]
    procs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
             for c, log in zip(commands, logs)]
    codes = [p.wait(timeout=1800) for p in procs]
    seconds = time.perf_counter() - t0
    if any(codes):
        raise SystemExit(f"{nodes} x {ranks} failed ({codes}); see {run_dir}-node*.log")
    return seconds


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--updates", type=int, default=4)
    args = report.parse_args(p, "layouts")
    ARGS.extend(["--updates", str(args.updates), "--save-every", str(args.updates)])  # one checkpoint, at the end
    with tempfile.TemporaryDirectory() as tmp:
        seconds, final = {}, {}
        for i, (nodes, ranks) in enumerate(LAYOUTS):
            d = os.path.join(tmp, f"{nodes}x{ranks}")
            seconds[nodes, ranks] = launch(nodes, ranks, d, 29651 + i)
            final[nodes, ranks] = read_checkpoint(d)["model"]
            print(f"{nodes} node(s) x {ranks} rank(s): {seconds[nodes, ranks]:.0f} s", flush=True)
        base = torch.load(next(p for p in (os.path.join(tmp, n) for n in os.listdir(tmp)) if
                               os.path.basename(p).startswith("base-tiny-")), weights_only=True)

    def gap(a, b):
        return max((final[a][k] - final[b][k]).abs().max().item() for k in final[a])

    rows = []
    for nodes, ranks in LAYOUTS:
        world = nodes * ranks
        same_world = (1, world)
        against_node = "" if same_world == (nodes, ranks) else (
            "bitwise equal" if gap((nodes, ranks), same_world) == 0 else f"max abs diff {gap((nodes, ranks), same_world):.1e}")
        against_one = "bitwise equal" if gap((nodes, ranks), (1, 1)) == 0 else \
            f"max abs diff {gap((nodes, ranks), (1, 1)):.1e}"
        moved = max((final[nodes, ranks][k] - base[k]).abs().max().item() for k in base)
        rows.append([f"{nodes} x {ranks}", world, f"{seconds[nodes, ranks]:.0f} s", f"{moved:.1e}",
                     against_node or "-", against_one if world > 1 else "-"])
    header = ["nodes x ranks", "world", "wall time", "weights moved (max abs, from the base policy)",
              "weights against 1 node x the same ranks", "weights against one process"]
    result = (f"{args.updates} updates of the tiny preset (batch 8, micro-batch 2, rank 8); every run on this "
              f"machine, one process per rank, gloo.\n\n" + report.table(header, rows))
    print(result)
    if args.markdown:
        report.publish("layouts", result)


if __name__ == "__main__":
    main()
