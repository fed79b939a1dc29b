"""
infra/run_dir.py: the run directory, held by one run at a time; what it holds decides whether a
run starts anew, continues, or is refused.

What it is
----------
- `hold(run_dir)`: rank 0 takes the directory's lock before anything in it is read for the run
  or written, and gets a `Hold`; a second run on the directory (started at the same moment,
  or later on any node) stops with one line naming the holder. `Hold.release(undo=...)` lets
  go: the lock file is removed, and a run refused before it wrote anything also removes the
  directory it made, so that it leaves the file system as it found it.
- `inspect(record, run_dir, resume)`: what the directory holds, only read: a new run, a run to
  continue (this run's config.json and its history), or a refusal in one line.
- `clean_stray(run_dir)`: the temporary files (`*.tmp<pid>`) that a killed run's atomic writes
  left, removed by the next holder.

The lock
--------
An exclusive POSIX record lock (fcntl.lockf) on `RUN_DIR/run.lock`, whose bytes name the holder
(host, pid, start time). The kernel drops the lock when its process ends in any way, SIGKILL
and a power loss included, so a killed run never leaves the directory stuck: the next run
takes the lock over. POSIX locks are what NFS (v4, or v3 with lockd) and Lustre (mounted with
`flock`) carry between nodes, so a second run on another node is refused as well; one file
system that supports no locks at all gets a warning line and no protection. The holder removes
the file when it lets go, while still holding the lock, and a run that takes the lock checks
that the file it locked is still the one at the path (a holder may unlink it between another
run's open and lock): two runs never hold two files of one name.

What the directory holds
------------------------
Its history is its checkpoint folders and its metrics.jsonl rows: what a run must not lose.

- nothing of a run (no directory, or a config.json and nothing else: a run that stopped in its
  set-up): a new run;
- this run's config.json (the same options, but MAY_CHANGE) and its history: continued, from
  the checkpoint `latest` names or, when `latest` is missing, from the newest checkpoint that
  verifies (checkpoint.py, said in one line);
- anything else is refused in one line that says how to go on: another run's options (pass
  the same, or another --run-dir), a history without config.json, metrics rows and no
  checkpoint (`rm -r` it to start anew), `latest` that is not a regular file, a path that is a
  file.
"""

import dataclasses
import errno
import fcntl
import json
import os
import re
import socket
import time

from infra.checkpoint import checkpoints
from infra.errors import RunError, os_advice, os_cause

LOCK_NAME = "run.lock"
STRAY = re.compile(r".+\.tmp\d+")  # checkpoint.stage's temporary names: `<file>.tmp<pid>`
# What a resume may change: where its ranks and engines run, how long a wait may last, how
# many engine restarts it allows, how often the engine's outputs are checked (a check changes nothing),
# and whether activations are recomputed in backward and the memory plan's figure for it (--checkpointing
# auto decides at each start from the GPU's free memory; recomputing changes memory and time, not the update).
MAY_CHANGE = ("layout", "engine_gpus", "engine_timeout", "dist_timeout", "engine_restarts", "check_outputs",
              "checkpointing", "plan_gib")
# Options added after runs were saved without them, and the value those runs had.
ADDED = {"group_size": 1, "advantage": "running", "kl_entropy_share": 0.0, "kl_per_response": 2.0, "eval_base": True,
         "curve_problems": 0, "curve_samples": 0}


class RunDirError(RunError):
    """A run directory that this run cannot take: held by another run, holding another run, or
    not writable. The message is one line that says what to do."""


# -----------------------------------------------------------------------------
# The lock

@dataclasses.dataclass
class Hold:
    """A run's hold on its directory: the locked file's descriptor (None where the file system
    has no locks), and the folders this run made, deepest first (undone by a release that asks
    for it)."""
    run_dir: str
    fd: int = None
    made: list = dataclasses.field(default_factory=list)

    def release(self, *, undo: bool = False):
        """Let go of the directory: its lock file removed (while still locked), then the lock.
        `undo`: the run was refused before it wrote anything, so the folders it made go too
        (only empty ones: another run's files are never touched)."""
        if self.fd is not None:
            try:
                os.remove(os.path.join(self.run_dir, LOCK_NAME))
            except OSError:  # already gone, or a read-only file system: the lock goes with the process
                pass
            os.close(self.fd)
            self.fd = None
        if undo:
            _remove_empty(self.made)
            self.made = []


def hold(run_dir: str, *, warn=print) -> Hold:
    """Take `run_dir`'s lock (made with the directory if need be), or raise RunDirError naming
    the holder. `warn`: where the one warning line of a file system without locks goes."""
    if os.path.lexists(run_dir) and not os.path.isdir(run_dir):
        raise RunDirError(f"--run-dir {run_dir} is a file, not a folder: pass a folder (made if missing)")
    made = []  # deepest first
    try:
        missing, folder = [], os.path.abspath(run_dir)
        while not os.path.isdir(folder):
            missing.append(folder)
            folder = os.path.dirname(folder)
        for folder in reversed(missing):
            try:
                os.mkdir(folder)
                made.insert(0, folder)
            except FileExistsError:  # another run made it this moment: the lock decides
                pass
        path = os.path.join(run_dir, LOCK_NAME)
        for _ in range(3):  # a holder that removed the file between our open and lock: try the new one
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EACCES, errno.EAGAIN):
                    raise RunDirError(f"--run-dir {run_dir} is in use by another run ({holder(path)}): wait for it "
                                      f"to end, stop it, or pass another --run-dir") from None
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    warn(f"warning: the file system of {run_dir} has no file locks: nothing stops a second run "
                         f"on this directory")
                    return Hold(run_dir, None, made)
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                record = f"host {socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
                os.ftruncate(fd, 0)
                os.pwrite(fd, record.encode(), 0)
                return Hold(run_dir, fd, made)
            os.close(fd)
        raise RunDirError(f"--run-dir {run_dir}: its lock file keeps being replaced; is another run starting there?")
    except RunDirError:
        _remove_empty(made)
        raise
    except OSError as e:
        _remove_empty(made)
        raise RunDirError(f"--run-dir {run_dir} cannot be used ({os_cause(e)}): {os_advice(e)}") from None


def holder(path: str, wait: float = 2.0) -> str:
    """Who holds a lock file, from its bytes: "host H pid P since T". A holder writes its name
    right after it takes the lock: a run that lost the race by microseconds finds the file
    still empty, and reads it again for up to `wait` seconds."""
    end = time.monotonic() + wait
    while True:
        try:
            with open(path) as f:
                name = f.read().strip()
        except (OSError, UnicodeDecodeError):
            return "holder unknown"
        if name or time.monotonic() >= end:
            return name or "its holder has not written its name"
        time.sleep(0.01)


def _remove_empty(folders):
    for folder in folders:  # deepest first; one that is not empty (another run's files) stays
        try:
            os.rmdir(folder)
        except OSError:
            pass


# -----------------------------------------------------------------------------
# What the directory holds

@dataclasses.dataclass
class Verdict:
    """`continues`: the directory holds this run to continue; `rows`: its metrics.jsonl rows;
    `checkpoints`: its checkpoint folders, newest first."""
    continues: bool
    rows: int = 0
    checkpoints: tuple = ()


def inspect(record: dict, run_dir: str, resume=None) -> Verdict:
    """What `run_dir` holds for a run whose configuration is `record` (plain values, as its
    config.json holds them: options.Config.record) (the module docstring's "What the directory
    holds"); only read. `resume`: the run was given --resume RUN_DIR."""
    option = f"--resume {resume}" if resume else f"--run-dir {run_dir}"
    if os.path.lexists(run_dir) and not os.path.isdir(run_dir):
        raise RunDirError(f"{option} is a file, not a folder: pass a folder (made if missing)")
    if not os.path.isdir(run_dir):
        if resume:
            raise RunDirError(f"{option}: no such folder")
        return Verdict(False)
    try:
        kept = tuple(checkpoints(run_dir))
        rows = count_rows(os.path.join(run_dir, "metrics.jsonl"))
        latest = os.path.join(run_dir, "latest")
        if os.path.lexists(latest) and (os.path.islink(latest) or not os.path.isfile(latest)):
            kind = "a symlink" if os.path.islink(latest) else "a folder" if os.path.isdir(latest) else "not a file"
            raise RunDirError(f"{option}: {latest} is {kind}; it must be the regular file a save writes (the name of "
                              f"the newest checkpoint): remove it, and the run continues from the newest checkpoint "
                              f"that verifies")
        history = bool(kept or rows or os.path.lexists(latest))
        config_path = os.path.join(run_dir, "config.json")
        if not history:
            if resume:
                raise RunDirError(f"{option}: no checkpoint there to continue from")
            return Verdict(False)  # nothing of a run: a new run (a config.json left by a set-up is replaced)
        if not os.path.exists(config_path):
            raise RunDirError(f"{option} holds a run's checkpoints or metrics but no config.json: pass another "
                              f"--run-dir, or remove it to start anew (rm -r {run_dir})")
        saved = read_config(config_path, option)
    except OSError as e:
        raise RunDirError(f"{option} cannot be read ({os_cause(e)})") from None
    if isinstance(saved.get("model"), dict) and "model_type" in (record.get("model") or {}):  # a run from
        saved["model"].setdefault("model_type", record["model"]["model_type"])  # before model_type was recorded
    for key, value in ADDED.items():  # a run saved before the option existed ran with its old value
        if key in record:
            saved.setdefault(key, value)
    # A key that one side lacks is None there: a field that does not apply to the run (another
    # task's option), which a configuration saved before every field was recorded left out.
    diff = sorted(k for k in set(saved) | set(record) if saved.get(k) != record.get(k) and k not in MAY_CHANGE)
    if diff and resume:
        raise RunDirError(f"{option}: the run was made with a different configuration ({', '.join(diff)}); pass "
                          f"the same options as the original run")
    if diff:
        raise RunDirError(f"{run_dir} holds another run (its options differ: {', '.join(diff)}): pass the same "
                          f"options to continue it, or another --run-dir")
    if not kept:
        what = (f"metrics.jsonl ({rows} rows, to update {rows_last_update(os.path.join(run_dir, 'metrics.jsonl'))})"
                if rows else "latest pointer")
        raise RunDirError(f"{option} holds this run's {what} but no checkpoint to continue from: remove it to start "
                          f"anew (rm -r {run_dir}), or pass another --run-dir")
    return Verdict(True, rows, kept)


def read_config(path: str, option: str) -> dict:
    try:
        with open(path) as f:
            saved = json.load(f)
    except ValueError:  # not JSON (nor UTF-8)
        saved = None
    if not isinstance(saved, dict):
        raise RunDirError(f"{option}: {path} is damaged (not a JSON object); it holds the run's options")
    return saved


def count_rows(path: str) -> int:
    """The non-empty lines of a JSON-lines log (0 when there is none)."""
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def rows_last_update(path: str):
    """The `update` of the last row that parses, or "?"."""
    last = "?"
    with open(path, "rb") as f:
        for line in f:
            try:
                last = json.loads(line)["update"]
            except (ValueError, KeyError, TypeError):
                pass
    return last


# -----------------------------------------------------------------------------
# What a killed run left

def clean_stray(run_dir: str) -> list[str]:
    """Remove the `*.tmp<pid>` files of atomic writes cut short (checkpoint.stage: `latest`,
    manifest.json, metrics.jsonl, config.json), in the directory and its checkpoint folders.
    Called by the lock's holder: no other run is writing them. Returns what it removed."""
    removed = []
    folders = [run_dir] + [os.path.join(run_dir, n) for n in sorted(os.listdir(run_dir))
                           if n.startswith("checkpoint-") and os.path.isdir(os.path.join(run_dir, n))]
    for folder in folders:
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if STRAY.fullmatch(name) and os.path.isfile(path) and not os.path.islink(path):
                os.remove(path)
                removed.append(os.path.relpath(path, run_dir))
    return removed
