"""
infra/lifecycle.py: a run's life around its loop: opened, resumed, recorded, checkpointed,
stopped on a signal, closed.

What it is
----------
- `open_run(...)`: the signal handlers first (launch.Preemption: from here on a signal ends in
  exit 75), the process group (launch.start_processes), the checks that need it with every
  rank's verdict agreed (planning.check_nodes), the run directory held by this run alone and
  what it holds (run_dir.py: new, continued, or refused), the checkpoint to resume verified.
  Nothing is written yet but the directory's lock. Returns an `Opened` record, whose `cfg`
  holds the model's widths as the checkpoint gives them.
- `Opened.commit()`: once the caller has read its inputs (task data, tokenizer, model), the
  directory becomes this run's: a new run's config.json, the temporary files a killed run
  left removed. A refusal before it leaves the file system as it was (the lock and a
  directory made for it removed at exit).
- `Run`: what train.py's loop needs of its set-up, and the run's records and stops:
  `resume()` (a verified checkpoint's state; the metrics log), `record_base(...)` and
  `record(completed, row, times)` (the line per update, metrics.jsonl, a checkpoint when one
  is due, a signal's stop), `save(completed)` (checkpoint.py, of `run_state`),
  `stop_if_signalled(completed)` (one all_reduce; every rank stops at the same update, saved,
  exit 75), `close(summary)` (a run that completed).
"""

import atexit
import dataclasses
import hashlib
import json
import os
import sys

import torch

import kl_control
from infra import checkpoint, launch, metrics, planning, run_dir as run_dirs
from infra.errors import os_advice, os_cause
from infra.options import Config


@dataclasses.dataclass
class Opened:
    """A run's processes and directory: this process's device and rank, the layout every rank
    agreed on, the verified checkpoint to resume (or None), the signal handlers, the log, the
    configuration (the model's widths its checkpoint's), the directory's hold (rank 0's lock;
    None on other ranks)."""
    device: torch.device
    rank: int
    layout: launch.Layout
    resume: str
    preemption: launch.Preemption
    log: object
    cfg: Config = None
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
                body = json.dumps({**self.cfg.record(), "layout": self.layout.record()}, indent=1).encode()
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


def open_run(cfg: Config, world: int, run_dir: str, resume_option=None, resume_from=None) -> Opened:
    """The signal handlers, the process group, the checks every rank agrees on, the directory
    held and inspected, the verified resume; only the directory's lock is written."""
    preemption = launch.Preemption()  # SIGTERM, SIGINT: every rank stops at the same update (exit 75)
    device, rank = launch.start_processes(cuda=cfg.device == "cuda", world=world, timeout=cfg.dist_timeout)
    log = print if rank == 0 else (lambda *a, **k: None)
    # The layout, what each node has (its GPUs, vLLM, the checkpoint), the shared run directory:
    # one verdict on every rank, none left waiting.
    layout, cfg, planned = planning.check_nodes(cfg, run_dir, resume_option)
    if planned:  # the memory plan's figure and --checkpointing's choice (config.json records both)
        log(planned)
    # One run at a time: rank 0 takes the directory's lock before anything in it is read for
    # this run, and a second run on it stops here, naming the holder.
    hold = launch.agreed(lambda: run_dirs.hold(run_dir, warn=log) if rank == 0 else None)
    opened = Opened(device, rank, layout, None, preemption, log, cfg, run_dir, hold)
    atexit.register(opened.release)
    try:
        # What the directory holds (a new run, this run to continue, or a refusal), then the
        # checkpoint to resume verified, every rank its own shards, before anything is loaded.
        verdict = launch.agreed(run_dirs.inspect, cfg.record(), run_dir, resume_option)
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


# -----------------------------------------------------------------------------
# A training run's state, as a checkpoint holds it

def run_state(model, opt, logra: bool, baseline, mismatch, update: int) -> dict:
    """Everything a resume needs, as DCP saves it (each rank its shards): weights, RowAdam's or
    AdamW's state, the baseline's and the mismatch EMA's `state_dict()`, the update count.
    Rollouts draw from per-prompt seeds (engine.py, departure 1), so no random state is saved."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model),
            "optimizer": opt.state_dict() if logra else get_optimizer_state_dict(model, opt),
            "run": {"update": update, "baseline": json.dumps(baseline.state_dict()),
                    "mismatch": json.dumps(mismatch.state_dict())}}


def load_run_state(path: str, model, opt, logra: bool, baseline, mismatch, layout) -> int:
    """A verified checkpoint (checkpoint.resume_path) into the run's objects; its update count.
    DCP reshards what another number of ranks wrote: every sharded tensor is a DTensor in the
    file, and nothing in it belongs to one rank."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = run_state(model, opt, logra, baseline, mismatch, 0)  # the template, filled in place
    if logra and "optimizer.projection" not in checkpoint.saved_keys(path):
        del state["optimizer"]["projection"]  # saved before projections had versions: RowAdam refuses it as 1
    try:
        checkpoint.load(path, state)
    except Exception as e:  # DCP raises the same on every rank
        words = (str(e).strip().splitlines() or [""])[0]
        written = launch.layout_change(checkpoint.read_manifest(path)[0], layout) or "the layout that wrote it"
        raise checkpoint.CheckpointError(f"{path} cannot be loaded by {layout.describe()} ({written}): "
                                         f"{type(e).__name__}: {words}") from e
    set_model_state_dict(model, state["model"])
    if logra:
        try:
            opt.load_state_dict(state["optimizer"])
        except ValueError as e:  # another projection, rank, seed or set of layers: one line
            raise checkpoint.CheckpointError(f"{os.path.basename(path)}: {e}") from e
    else:
        set_optimizer_state_dict(model, opt, state["optimizer"])
    baseline.load_state_dict(json.loads(state["run"]["baseline"]))
    mismatch.load_state_dict(json.loads(state["run"]["mismatch"]))
    return state["run"]["update"]


# -----------------------------------------------------------------------------
# The run around its loop

@dataclasses.dataclass
class Run:
    """What the loop needs of the set-up, and the run's records and stops."""
    cfg: Config
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
    shadow: dict = None  # --sync delta: this rank's rows of what the engines hold, bf16 (engine_sync.delta)

    def __post_init__(self):
        self.device, self.rank, self.log = self.opened.device, self.opened.rank, self.opened.log
        self.logra = self.cfg.optimizer == "logra"  # else the dense AdamW baseline or LoRA
        self.metrics_path = os.path.join(self.run_dir, "metrics.jsonl")
        self.capped, self.warned = 0, False  # updates in a row with alpha at its cap; said (watch_alpha)

    def resume(self, *, explicit: bool, wandb=None):
        """A resumed run's state from its verified checkpoint (the update it continues from, its
        metrics rows after it dropped), said in one line; then, on rank 0, the metrics log
        (TensorBoard's and W&B's files complete however the run ends). `explicit`: --resume."""
        opened = self.opened
        if opened.resume:
            self.start = self.saved = launch.agreed(load_run_state, opened.resume, self.model, self.opt, self.logra,
                                                    self.baseline, self.mismatch, opened.layout)
            if self.rank == 0 and (torn := checkpoint.truncate_rows(self.metrics_path, self.start)):
                self.log(torn)  # a torn last row, dropped
            moved = launch.layout_change(checkpoint.read_manifest(opened.resume)[0], opened.layout)
            self.log(f"{'resumed' if explicit else 'continued'} {self.run_dir} at update {self.start} "
                     f"({os.path.basename(opened.resume)}, verified{'; ' + moved if moved else ''})"
                     f"{'' if explicit else ' (another --run-dir starts anew)'}")
        if self.rank == 0:
            self.metrics_log = metrics.Log(self.run_dir, start=self.start, config=self.cfg.record(),
                                           wandb_project=wandb)
            atexit.register(self.metrics_log.close)

    def record_base(self, held_out: dict | None):
        """The start: the log's first row, with a digest of the engine's starting weights (their
        fingerprint: runs that share it sampled from the same policy) and the base policy's
        held-out evaluation (engine.evaluate's), and its line; None: not evaluated."""
        start = hashlib.sha256(json.dumps(sorted(self.synced.items())).encode()).hexdigest()[:16]
        if held_out is not None:
            k, passk = held_out["eval_samples"], held_out["passk"]
            self.log(f"step 0 | base policy | pass@1 {held_out['pass1']:.3f}"
                     f"{f' | pass@{k} {passk:.3f}' if k > 1 else ''} on {held_out['eval_problems']} held-out problems")
        if self.metrics_log:
            self.metrics_log.append({"update": 0, "start": start, **(held_out or {})}, first=True)

    def watch_alpha(self, alpha: float) -> None:
        """Count the updates in a row with alpha at --alpha-max; when they reach
        kl_control.CAPPED_UPDATES, say once a run (as kl_control.LoGRAOptimizer warns) that the
        budget does not bind and that --update-ratio is the knob."""
        self.capped = self.capped + 1 if alpha >= self.cfg.alpha_max else 0
        if self.capped >= kl_control.CAPPED_UPDATES and not self.warned:
            self.warned = True
            self.log(f"warning: alpha has been at its cap --alpha-max {self.cfg.alpha_max:g} for {self.capped} updates "
                     f"in a row: the KL budget does not bind, --update-ratio (now {self.cfg.update_ratio:g}) sets the "
                     f"step; change it only if a held-out metric says so (bench/README.md, defaults)")

    def record(self, completed: int, row: dict, times: dict):
        """An update done: its phases' times in the row, its line, the row and the engine's events
        (restarts, infra/heal.py) in metrics.jsonl, a checkpoint when one is due, and a signal's
        stop once the update is complete."""
        row.update({f"time_{k}": v for k, v in times.items()}, time_s=sum(times.values()))
        self.log(metrics.step_line(row))
        events = self.engine.take_events()
        if self.metrics_log:
            for entry in (row, *({"update": completed, **event} for event in events)):
                self.metrics_log.append(entry)
        if self.cfg.save_every and (completed % self.cfg.save_every == 0 or completed == self.cfg.updates):
            self.save(completed)
        if completed < self.cfg.updates:
            self.stop_if_signalled(completed)

    def save(self, completed: int):
        """A checkpoint of `completed` updates: every rank writes its shards (checkpoint.py)."""
        state = run_state(self.model, self.opt, self.logra, self.baseline, self.mismatch, completed)
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

    def close(self, summary: str):
        """The end of a run that completed: rank 0 prints the summary and draws its curves at
        `summary` (metrics.summarise); the engine stopped, the directory let go, and the closers
        registered with atexit (the engine's, the metrics log's, the directory's) removed, so
        that nothing of the run outlives main (train.py's __main__); every rank done before any
        tears the process group down."""
        if self.rank == 0:
            metrics.summarise(self.metrics_path, summary, heldout=len(self.task.heldout), engine=self.cfg.engine)
        self.engine.close()
        self.opened.release()
        for close in (self.engine.close, self.metrics_log.close if self.metrics_log else None, self.opened.release):
            atexit.unregister(close)
        launch.stop_processes()
