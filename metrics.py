"""
metrics.py: what a run writes down: metrics.jsonl, its one line per update, its summary and curves.

What it is
----------
`metrics.jsonl` in the run directory holds one JSON object per line: `{"update": 0, "pass1":
..., "passk": ...}` for the base policy, then one row per update (`step_line` prints it; the
keys are train.py's `update_row`). `append` adds a row, `read` gives them back, `summary`
makes the closing lines of a run, `plot` draws curves.png (reward and held-out Pass@1,
predicted and realised KL against the budget, alpha), and `pyplot` is the one place that
imports matplotlib (an optional extra: `pip install -e ".[plot]"`), for the benches too.
`Laps` times an update's phases and `memory_gib` gives its peak memory (GPU, or the process's
resident set on a CPU). `global_sums` reduces a metric over ranks as sums and counts, and
`logprob_gap` is the engine/trainer log-prob gap of a batch.
"""

import json
import math
import resource
import time

import torch
import torch.distributed as dist


def append(path: str, row: dict, *, first: bool = False):
    """One row at the end of the log; `first` starts the log anew (a run's update 0)."""
    with open(path, "w" if first else "a") as f:
        f.write(json.dumps(row) + "\n")


def read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def step_line(row: dict) -> str:
    """One line per update: `step 12 | reward 0.41 | kl 1.9e-04 (real 2.0e-04) | alpha 0.80 | ...`."""
    return (f"step {row['update']} | reward {row['reward']:.3f} | "
            + (f"pass@1 {row['pass1']:.3f} | " if "pass1" in row else "")
            + f"kl {row['kl_pred']:.2e} (real {row['kl_real']:.2e}) | alpha {row['alpha']:.2f} | "
            f"budget {row['budget']:.2e} | mismatch {row['mismatch']:.1e} | mem {row['mem_gib']:.2f} GiB | "
            f"{row['time_s'] * 1e3:.0f} ms")


def summary(rows: list[dict], *, heldout: int, engine: str) -> list[str]:
    """The closing lines: held-out Pass@1 from the base policy to the last evaluation, the
    engine/trainer log-prob gap over the run, memory per update and updates per hour."""
    lines = []
    passes = [r["pass1"] for r in rows if "pass1" in r]
    if len(passes) >= 2:
        lines.append(f"held-out pass@1: base {passes[0]:.3f} -> final {passes[-1]:.3f} "
                     f"({100 * (passes[-1] - passes[0]):+.1f} points, {heldout} problems)")
    updates = [r for r in rows if "time_s" in r]
    if updates:
        lines.append(f"engine vs trainer log-prob per response token: mean gap "
                     f"{sum(r['logp_gap_mean'] for r in updates) / len(updates):.2e}, "
                     f"max {max(r['logp_gap_max'] for r in updates):.2e} ({engine} engine)")
        mem = [r["mem_gib"] for r in updates]
        lines.append(f"memory per update: average {sum(mem) / len(mem):.2f} GiB, peak {max(mem):.2f} GiB; "
                     f"{3600 / (sum(r['time_s'] for r in updates) / len(updates)):.0f} updates/h")
    return lines


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(rows: list[dict], path: str) -> bool:
    """curves.png of a run's rows; False (and nothing written) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    steps = [r for r in rows if "reward" in r]
    x = [r["update"] for r in steps]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(x, [r["reward"] for r in steps], label="train reward")
    axes[0].plot([r["update"] for r in rows if "pass1" in r], [r["pass1"] for r in rows if "pass1" in r],
                 "o-", label="held-out pass@1")
    axes[1].semilogy(x, [r["kl_pred"] for r in steps], label="predicted KL")
    axes[1].semilogy(x, [r.get("kl_real", math.nan) for r in steps], ".", label="realised KL")
    axes[1].semilogy(x, [r["budget"] for r in steps], "--", label="budget")
    axes[2].plot(x, [r["alpha"] for r in steps], label="alpha")
    for ax in axes:
        ax.set_xlabel("update")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -----------------------------------------------------------------------------
# Measured per update: wall time by phase, peak memory

class Laps:
    """Wall time per phase of an update; on a GPU each mark waits for the queued kernels."""

    def __init__(self, device):
        self.device, self.times, self.last = device, {}, time.perf_counter()

    def __call__(self, name):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.times[name] = self.times.get(name, 0.0) + now - self.last
        self.last = now


def memory_gib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # peak RSS (KiB on Linux)


# -----------------------------------------------------------------------------
# Reduced over ranks

def global_sums(sums, maxima=(), *, device) -> tuple[list[float], list[float]]:
    """Sums and maxima over every rank, in float64: each metric is reduced as sums and counts,
    never as an average of averages. The same code with one process."""
    totals = torch.tensor(list(sums), dtype=torch.float64, device=device)
    peaks = torch.tensor(list(maxima), dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(totals)
        if len(maxima):
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    return totals.tolist(), peaks.tolist()


def logprob_gap(rollout_logprobs, trainer_logprobs, mask) -> tuple[float, float]:
    """Mean and max of |engine log-prob - trainer log-prob| over every response token of the
    global batch: the mismatch that TIS and mismatch subtraction exist for, whatever the engine."""
    gap = (rollout_logprobs.double() - trainer_logprobs.double()).abs()[mask]  # (tokens,)
    (total, count), (peak,) = global_sums([gap.sum().item(), gap.numel()],
                                          [gap.max().item() if gap.numel() else 0.0], device=mask.device)
    return total / max(count, 1.0), peak
