"""
infra/lifecycle.py: a run's life around its loop: opened, checkpointed, stopped on a signal,
closed.

What it is
----------
- `open_run(...)`: the signal handlers first (launch.Preemption: from here on a signal ends in
  exit 75), the process group (launch.start_processes), the checks that need it with every
  rank's verdict agreed (options.check_nodes), the run directory held by this run alone and
  what it holds (run_dir.py: new, continued, or refused), the checkpoint to resume verified.
  Nothing is written yet but the directory's lock. Returns an `Opened` record.
- `Opened.commit()`: once the caller has read its inputs (task data, tokenizer, model), the
  directory becomes this run's: a new run's config.json, the temporary files a killed run
  left removed. A refusal before it leaves the file system as it was (the lock and a
  directory made for it removed at exit).
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

from infra import checkpoint, launch, options, run_dir as run_dirs
from infra.errors import os_advice, os_cause


@dataclasses.dataclass
class Opened:
    """A run's processes and directory: this process's device and rank, the layout every rank
    agreed on, the verified checkpoint to resume (or None), the signal handlers, the log, the
    directory's hold (rank 0's lock; None on other ranks)."""
    device: torch.device
    rank: int
    layout: launch.Layout
    resume: str
    preemption: launch.Preemption
    log: object
    cfg: dict = None
    run_dir: str = None
    hold: object = None
    committed: bool = False

    def commit(self):
        """The directory becomes this run's (the module docstring): rank 0 writes a new run's
        config.json atomically and removes a killed run's temporary files. Agreed: a failed
        write stops every rank with one line."""
        launch.agreed(self._commit if self.rank == 0 else lambda: None)
        self.committed = True

    def _commit(self):
        try:
            stray = run_dirs.clean_stray(self.run_dir)
            if not self.resume:
                body = json.dumps({**self.cfg, "layout": self.layout.record()}, indent=1).encode()
                checkpoint.write_atomic(os.path.join(self.run_dir, "config.json"), body)
        except OSError as e:
            raise run_dirs.RunDirError(f"--run-dir {self.run_dir} cannot be written ({os_cause(e)}): "
                                       f"{os_advice(e)}") from None
        if stray:
            self.log(f"removed {len(stray)} temporary file(s) a killed run left in {self.run_dir}: {', '.join(stray)}")

    def release(self):
        """Let go of the directory: the lock file removed, and, for a run refused before
        commit(), the folders made for the lock. Called when the run ends, however it ends
        (train.py's start_run on an error, Run's stops, and at exit); once is enough."""
        if self.hold is not None:
            self.hold.release(undo=not self.committed)
            self.hold = None


def open_run(cfg: dict, world: int, run_dir: str, resume_option=None, resume_from=None) -> Opened:
    """The signal handlers, the process group, the checks every rank agrees on, the directory
    held and inspected, the verified resume; only the directory's lock is written."""
    preemption = launch.Preemption()  # SIGTERM, SIGINT: every rank stops at the same update (exit 75)
    device, rank = launch.start_processes(cuda=cfg["device"] == "cuda", world=world, timeout=cfg["dist_timeout"])
    log = print if rank == 0 else (lambda *a, **k: None)
    # The layout, what each node has (its GPUs, vLLM, the checkpoint), the shared run directory:
    # one verdict on every rank, none left waiting.
    layout = options.check_nodes(cfg, run_dir, resume_option)
    # One run at a time: rank 0 takes the directory's lock before anything in it is read for
    # this run, and a second run on it stops here, naming the holder.
    hold = launch.agreed(lambda: run_dirs.hold(run_dir, warn=log) if rank == 0 else None)
    opened = Opened(device, rank, layout, None, preemption, log, cfg, run_dir, hold)
    atexit.register(opened.release)
    try:
        # What the directory holds (a new run, this run to continue, or a refusal), then the
        # checkpoint to resume verified, every rank its own shards, before anything is loaded.
        verdict = launch.agreed(run_dirs.inspect, cfg, run_dir, resume_option)
        if verdict.continues:
            option = f"--resume {run_dir}" if resume_option else f"--run-dir {run_dir}"
            opened.resume = launch.agreed(checkpoint.resume_path, run_dir, resume_from, rank=rank, world=world,
                                          option=option)
            if not resume_from and not os.path.lexists(os.path.join(run_dir, "latest")):
                log(f"{run_dir}: latest is missing; continuing from {os.path.basename(opened.resume)}, the newest "
                    f"checkpoint that verifies")
    except BaseException:
        opened.release()  # refused: the directory as it was found
        raise
    return opened


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
    synced: dict = None  # the trainer's fingerprint at the last sync: what the engines hold
    shadow: dict = None  # --sync delta: this rank's rows of what the engines hold, bf16 (train.delta_sync)

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
        preemption.hold()  # stopping now: a further signal must not change the exit status (75)
        if self.saved != completed:
            self.save(completed)
        self.log(f"stopped on {preemption.received} at update {completed}: checkpoint-{completed} saved; run the "
                 f"same command again to continue (exit {launch.REQUEUE_EXIT})")
        self.engine.close()
        self.opened.release()
        launch.stop_processes()
        sys.exit(launch.REQUEUE_EXIT)

    def close(self):
        """The end of a run that completed: its engine stopped, its directory let go, and the
        closers registered with atexit (the engine's, the metrics log's, the directory's)
        removed, so that nothing of the run outlives main (train.py's __main__)."""
        self.engine.close()
        self.opened.release()
        for close in (self.engine.close, self.metrics_log.close if self.metrics_log else None, self.opened.release):
            atexit.unregister(close)
