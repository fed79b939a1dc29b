"""
infra/metrics.py: what a run writes down and shows: metrics.jsonl, TensorBoard and W&B, the line per
update, progress on long waits, the summary and curves.

What it is
----------
`metrics.jsonl` in the run directory holds one JSON object per line: `{"update": 0, "pass1":
..., "passk": ...}` for the base policy, then one row per update (`step_line` prints it; the
keys are `update_row`'s, which train.py's loop calls), and one row per event (an engine restart). The JSON is
strict: a value that does not apply (AdamW has no KL prediction, LoGRA no learning rate) is
`null`, never NaN, so that `jq` and JavaScript read it. `Log` writes each row there and, when
the packages are installed, as TensorBoard scalars under `RUN_DIR/tensorboard` and to W&B
(`--wandb PROJECT`; `WANDB_MODE=offline` works without a network). A resumed run continues the
same curves: TensorBoard's events after the checkpoint are purged (`purge_step`), W&B's run is
resumed by its id (kept in `RUN_DIR/wandb-id`), and the updates run again after a resume are
bitwise the ones logged before the stop, so nothing differs where W&B keeps its first values.
`summarise` prints the closing lines (`summary`) and draws curves.png (`plot`); `pyplot` is
the one place that imports matplotlib (an optional extra: `pip install -e ".[plot]"`), for the
benches too. `Progress` shows a bar with the time left on a terminal and a plain line every
`every` seconds in a log file. `Laps` times an update's phases and `memory_gib` gives its peak
memory (GPU, or the process's resident set on a CPU). `global_sums` reduces a metric over
ranks as sums and counts, and `logprob_gap` is the engine/trainer log-prob gap of a batch.
"""

import importlib.util
import json
import math
import os
import resource
import secrets
import sys
import threading
import time

import torch
import torch.distributed as dist

from infra.errors import RunError, os_advice, os_cause


class MetricsError(RunError):
    """The run's log cannot be written (a full or read-only file system): one line, the path
    and the cause."""


def strict(row: dict) -> dict:
    """The row with every non-finite float (a value that does not apply) as None."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}


def append(path: str, row: dict, *, first: bool = False):
    """One row at the end of the log, strict JSON; `first` starts the log anew (a run's update 0).
    A write that fails (a full disk) is cut back to the rows before it, then raises: the log
    never keeps a torn line that this process wrote (a power loss can leave one; a resume
    drops it, checkpoint.truncate_rows)."""
    line = memoryview((json.dumps(strict(row), allow_nan=False) + "\n").encode())
    # Unbuffered: a buffered file's truncate would first flush the rest of the line, fail on
    # the full disk again, and leave the torn part in place.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if first else os.O_APPEND), 0o644)
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        try:
            while line:  # a write may take part of the line (the disk fills in it)
                line = line[os.write(fd, line):]
        except OSError:
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass
            raise
    finally:
        os.close(fd)


def read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def step_line(row: dict) -> str:
    """One line per update, each method's own quantities: LoGRA's `kl 1.9e-04 (real 2.0e-04) |
    alpha 0.80 | budget ...`, AdamW's `lr 1.0e-04`."""
    if row.get("lr") is None:  # LoGRA
        real = "n/a" if row.get("kl_real") is None or not math.isfinite(row["kl_real"]) else f"{row['kl_real']:.2e}"
        method = f"kl {row['kl_pred']:.2e} (real {real}) | alpha {row['alpha']:.2f} | budget {row['budget']:.2e}"
    else:
        method = f"lr {row['lr']:.2e}"
    return (f"step {row['update']} | reward {row['reward']:.3f} | "
            + (f"G {row['group_size']} (no signal {100 * row['zero_variance']:.0f}%) | " if "zero_variance" in row
               else "")
            + (f"pass@1 {row['pass1']:.3f} | " if "pass1" in row else "")
            + f"{method} | mismatch {row['mismatch']:.1e} | mem {row['mem_gib']:.2f} GiB | "
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
        flat = [r["zero_variance"] for r in updates if "zero_variance" in r]
        if flat:
            lines.append(f"groups of {updates[-1]['group_size']} responses per prompt: {100 * sum(flat) / len(flat):.0f}% "
                         f"on average were equally rewarded (no signal), {100 * max(flat):.0f}% at most")
        mem = [r["mem_gib"] for r in updates]
        lines.append(f"memory per update: average {sum(mem) / len(mem):.2f} GiB, peak {max(mem):.2f} GiB; "
                     f"{3600 / (sum(r['time_s'] for r in updates) / len(updates)):.0f} updates/h")
    return lines


def summarise(metrics_path: str, curves: str, *, heldout: int, engine: str):
    """The run's closing lines (summary) and its curves.png."""
    rows = read(metrics_path)
    for line in summary(rows, heldout=heldout, engine=engine):
        print(line)
    print(f"curves: {curves}" if plot(rows, curves) else
          "no plot: install matplotlib (pip install -e '.[plot]') to get curves.png")


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
    value = lambda r, k: math.nan if r.get(k) is None else r[k]  # noqa: E731  (null: does not apply)
    axes[1].semilogy(x, [value(r, "kl_pred") for r in steps], label="predicted KL")
    axes[1].semilogy(x, [value(r, "kl_real") for r in steps], ".", label="realised KL")
    axes[1].semilogy(x, [value(r, "budget") for r in steps], "--", label="budget")
    axes[2].plot(x, [value(r, "alpha") for r in steps], label="alpha")
    for ax in axes:
        ax.set_xlabel("update")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def update_row(completed, rewards, correct, rollout, trainer_logp, kl_step, loss_stats, *, mismatch, sync_bytes,
               num_tokens, seconds, device, sync_changed=None, group_size=1, flat_groups=None) -> dict:
    """The metrics row of one update (train.py's loop): rewards and accuracy over the global
    batch (sums and counts reduced across ranks), the step's KL control (`kl_step`: kl1,
    alpha, budget, sketch_norm, kl_real, probed), AdamW's or LoRA's learning rate (its `lr`;
    None for LoGRA) and the method's state on this rank (its `state` bytes:
    policy.state_bytes), the engine/trainer log-prob gap, the mismatch estimate, the sync's
    bytes (and with --sync delta the share of target elements it changed, `sync_changed`),
    memory and throughput over the update's `seconds`; with groups of `group_size` > 1
    responses per prompt, the share of groups whose rewards were all equal (`flat_groups`:
    this rank's count), which give no signal."""
    flat = [] if flat_groups is None else [float(flat_groups)]
    (reward_sum, correct_sum, count, *flat), _ = global_sums(
        [rewards.sum().item(), correct.sum().item(), len(rewards), *flat], device=device)
    groups = {"group_size": group_size, **({"zero_variance": flat[0] / (count / group_size)} if flat else {})}
    gap_mean, gap_max = logprob_gap(rollout.logprobs, trainer_logp, rollout.mask)
    tis = loss_stats.get("tis_weight")
    return {"update": completed, "reward": reward_sum / count, "accuracy": correct_sum / count,
            "kl_pred": kl_step["alpha"]**2 * kl_step["kl1"], "kl_real": kl_step["kl_real"], "alpha": kl_step["alpha"],
            "probe_responses": kl_step["probed"], "lr": kl_step["lr"], "budget": kl_step["budget"],
            "mismatch": mismatch,
            "sketch_norm": kl_step["sketch_norm"], "tis_weight": None if tis is None else float(tis),
            "logp_gap_mean": gap_mean, "logp_gap_max": gap_max, "sync_bytes": sync_bytes,
            "mem_gib": memory_gib(device), "responses": int(count), "tokens": num_tokens,
            "tokens_per_s": num_tokens / seconds, **groups,
            **({} if sync_changed is None else {"sync_changed": sync_changed}), "state_mib": kl_step["state"] / 2**20}


# -----------------------------------------------------------------------------
# Where the rows go: metrics.jsonl, TensorBoard, W&B

class Log:
    """The run's rows: metrics.jsonl always; TensorBoard scalars when `tensorboard` is
    installed; W&B when `wandb_project` is given. `start`: the update a resumed run continues
    from (TensorBoard's later events are purged). Made on rank 0 only."""

    def __init__(self, run_dir: str, *, start: int, config: dict, wandb_project=None):
        self.path, self.tb, self.wandb, self.failed = os.path.join(run_dir, "metrics.jsonl"), None, None, False
        if importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_tensorboard_thread()
            try:
                self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=start + 1 if start else None)
            except OSError as e:
                raise MetricsError(f"TensorBoard's events cannot be written ({os_cause(e)}): {os_advice(e)}") from None
        if wandb_project:
            import wandb

            id_file = os.path.join(run_dir, "wandb-id")
            if not os.path.exists(id_file) or not start:
                with open(id_file, "w") as f:
                    f.write(secrets.token_hex(8))
            with open(id_file) as f:
                run_id = f.read().strip()
            self.wandb = wandb.init(project=wandb_project, id=run_id, resume="allow", dir=run_dir, config=config,
                                    name=os.path.basename(os.path.abspath(run_dir)))

    def append(self, row: dict, *, first: bool = False):
        """The row in metrics.jsonl, TensorBoard and W&B; MetricsError (one line) when a file
        cannot be written."""
        try:
            self._append(row, first)
        except OSError as e:
            self.failed = True
            raise MetricsError(f"the run's metrics cannot be written ({os_cause(e, self.path)}): {os_advice(e)}; "
                               f"the newest checkpoint stands: run the same command again to continue") from None

    def _append(self, row, first):
        append(self.path, row, first=first)
        scalars = {k: float(v) for k, v in strict(row).items()
                   if k != "update" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if "event" in row:  # an engine restart: its cost on the curves
            scalars = {f"{row['event']}_seconds": float(row.get("seconds", 0.0))}
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, global_step=row["update"])
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=row["update"])

    def close(self):
        """TensorBoard's and W&B's files closed. After a write failed (already reported) a
        failing close is silent; a first failure here is one line on stderr, not a traceback
        (it runs at exit)."""
        try:
            if self.tb is not None:
                self.tb.close()
            if self.wandb is not None:
                self.wandb.finish()
        except OSError as e:
            if not self.failed:
                print(f"train.py: warning: TensorBoard's events could not be closed ({os_cause(e)})", file=sys.stderr)


def _quiet_tensorboard_thread():
    """TensorBoard writes its events in a thread, which prints its own traceback when a write
    fails (a full disk) before the next flush raises the same error in the main thread, where
    Log turns it into one line. The thread's print is dropped; every other thread's error is
    printed as before."""
    hook = threading.excepthook
    if getattr(hook, "logra_quiet", False):
        return

    def quiet(args):
        if type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(args.exc_type, OSError):
            return
        hook(args)
    quiet.logra_quiet = True
    threading.excepthook = quiet


# -----------------------------------------------------------------------------
# Progress on a long wait: a bar on a terminal, a line now and then in a log

class Progress:
    """`Progress(total, what)`; `update(n=1)`; `close()`. On a terminal, tqdm's bar with the
    time left; otherwise a plain line (`what: 1200/3000 (40%), 31 s, about 47 s left`) at most
    every `every` seconds, and one at the end. `enabled=False` (a rank other than 0) is silent.
    `interrupt`: a callable run at every update, which may raise to end the wait (a signal's
    stop, launch.Preemption.check)."""

    def __init__(self, total: int, what: str, *, every: float = 30.0, enabled: bool = True, interrupt=None):
        self.total, self.what, self.every, self.done, self.bar = total, what, every, 0, None
        self.interrupt = interrupt  # called at every update, so that a stop can be taken there
        self.enabled, self.t0, self.last = enabled, time.monotonic(), time.monotonic()
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=what, leave=False, dynamic_ncols=True)

    def update(self, n: int = 1):
        if self.interrupt is not None:
            self.interrupt()
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and time.monotonic() - self.last >= self.every:
            self.last = time.monotonic()
            print(self.line(), flush=True)

    def line(self) -> str:
        spent = time.monotonic() - self.t0
        left = spent / self.done * (self.total - self.done) if self.done else float("nan")
        return (f"{self.what}: {self.done}/{self.total} ({100 * self.done / max(self.total, 1):.0f}%), {spent:.0f} s"
                + (f", about {left:.0f} s left" if self.done < self.total and math.isfinite(left) else ""))

    def close(self):
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and time.monotonic() - self.t0 >= self.every:
            print(self.line(), flush=True)


# -----------------------------------------------------------------------------
# Measured per update: wall time by phase, peak memory

class Laps:
    """Wall time per phase of an update; on a GPU each mark waits for the queued kernels, and
    the GPU's peak memory counts from the start of the update (memory_gib)."""

    def __init__(self, device):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
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
    if dist.is_initialized():  # every rank passes as many of each: the same collectives run everywhere
        if len(sums):
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
