"""
infra/lifecycle.py: a run's life around its loop: opened, checkpointed, stopped on a signal,
closed.

What it is
----------
- `open_run(...)`: the process group (launch.start_processes), the checks that need it with
  every rank's verdict agreed (options.check_nodes), the checkpoint to resume verified before
  anything is written, the run directory and its config.json, and the signal handlers
  (launch.Preemption). Returns an `Opened` record.
- `Run`: what train.py's loop needs of its set-up, and the run's stops: `save(completed)` (a
  checkpoint, checkpoint.py), `stop_if_signalled(completed)` (one all_reduce; every rank
  stops at the same update, saved, exit 75), `close()` (a run that completed).
"""

import atexit
import dataclasses
import json
import os
import sys

import torch

from infra import checkpoint, launch, options


@dataclasses.dataclass
class Opened:
    """A run's processes and directory: this process's device and rank, the layout every rank
    agreed on, the verified checkpoint to resume (or None), the signal handlers, the log."""
    device: torch.device
    rank: int
    layout: launch.Layout
    resume: str
    preemption: launch.Preemption
    log: object


def open_run(cfg: dict, world: int, run_dir: str, resume_option=None, resume_from=None) -> Opened:
    """The process group, the checks every rank agrees on, the verified resume, the directory."""
    device, rank = launch.start_processes(cuda=cfg["device"] == "cuda", world=world, timeout=cfg["dist_timeout"])
    log = print if rank == 0 else (lambda *a, **k: None)
    # The layout, what each node has (its GPUs, vLLM, the checkpoint), the shared run directory
    # (one that holds this run is continued): one verdict on every rank, none left waiting.
    layout, resume_dir = options.check_nodes(cfg, run_dir, resume_option, resume_from)
    # The checkpoint to resume is verified (every rank its own shards) before anything is
    # written or loaded: a refused resume leaves the run directory exactly as it was.
    resume = launch.agreed(checkpoint.resume_path, run_dir, resume_from, rank=rank, world=world) \
        if resume_dir else None
    os.makedirs(run_dir, exist_ok=True)
    if rank == 0 and not resume:
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump({**cfg, "layout": layout.record()}, f, indent=1)
    preemption = launch.Preemption()  # SIGTERM, SIGINT: every rank stops at the same update, saved
    return Opened(device, rank, layout, resume, preemption, log)


@dataclasses.dataclass
class Run:
    """What the loop needs of the set-up, and the run's two stops: a checkpoint and a signal."""
    cfg: dict
    opened: Opened
    world: int
    run_dir: str
    keep: int
    task: object
    model: torch.nn.Module
    engine: object
    opt: object
    layers: list  # LoGRA's sketched layers (sketch.attach), else None
    baseline: object  # ppo.RunningBaseline
    mismatch: object  # kl_control.Mismatch
    start: int = 0  # the update the loop starts at (0, or a resumed checkpoint's)
    metrics_log: object = None  # metrics.Log on rank 0, else None
    saved: int = None  # the update of the newest checkpoint

    def __post_init__(self):
        self.device, self.rank, self.log = self.opened.device, self.opened.rank, self.opened.log
        self.logra = self.cfg["optimizer"] == "logra"  # else the dense AdamW baseline or LoRA
        self.metrics_path = os.path.join(self.run_dir, "metrics.jsonl")

    def save(self, completed: int):
        """A checkpoint of `completed` updates: every rank writes its shards (checkpoint.py)."""
        state = checkpoint.run_state(self.model, self.opt, self.logra, self.baseline, self.mismatch, completed)
        checkpoint.save(self.run_dir, state, completed, rank=self.rank, world=self.world, keep=self.keep,
                        layout=self.opened.layout.record())
        self.saved = completed

    def stop_if_signalled(self, completed: int):
        """One all_reduce (launch.Preemption.agreed): if any rank received SIGTERM or SIGINT,
        every rank stops here, at the same update, with a checkpoint of the `completed` updates
        unless the newest is one, and exits REQUEUE_EXIT. A resume redoes an abandoned update
        bit for bit (rollouts draw per-prompt seeds)."""
        preemption = self.opened.preemption
        if not preemption.agreed():
            return
        if self.saved != completed:
            self.save(completed)
        self.log(f"stopped on {preemption.received} at update {completed}: checkpoint-{completed} saved; run the "
                 f"same command again to continue (exit {launch.REQUEUE_EXIT})")
        self.engine.close()
        launch.stop_processes()
        sys.exit(launch.REQUEUE_EXIT)

    def close(self):
        """The end of a run that completed: its engine stopped, and the closers train.py
        registered with atexit (the engine's, the metrics log's) removed, so that nothing of the
        run outlives main (train.py's __main__)."""
        self.engine.close()
        for close in (self.engine.close, self.metrics_log.close if self.metrics_log else None):
            atexit.unregister(close)
