"""
infra/errors.py: the one exception type a run stops on.

Every file of infra/ raises its own subclass of `RunError` (OptionError, CheckpointError,
TaskError, LaunchError and Stopped, ArchitectureError, LoraError, EngineError, RunDirError,
MetricsError) with a message of one line that says what to change. train.py catches `RunError` in one place, its `__main__`: it prints
`train.py: <label>: <message>` on stderr and exits with the error's `exit_code`, once per node
when every rank raised the same error (`agreed`, set by launch.agree).

    exit 2   a refusal: a bad option, a checkpoint that does not verify, missing task data,
             a layout the nodes cannot hold; nothing was started or changed
    exit 1   an engine that died, stayed silent or failed a command, past what healing allows
    exit 75  a stop on SIGTERM or SIGINT (launch.Preemption): run the same command again

`os_cause(e)` words a file-system error for such a line: the path and the cause, and the free
space only when space is the cause.
"""

import errno
import os
import shutil


class RunError(Exception):
    """A run that stops with one line. `exit_code`: the process's status; `label`: the word
    after "train.py:"; `agreed`: every rank raised it (launch.agree), so one rank per node
    prints it."""

    exit_code = 2
    label = "error"
    agreed = False

    def line(self) -> str:
        """The one line train.py prints for it: `train.py: error: ...`."""
        return f"train.py: {self.label}: {self}"


NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # the causes that freeing space (or quota) cures


def os_cause(e: OSError, path: str = None) -> str:
    """`PATH: <cause>` of a file-system error, e.g. "runs/x/config.json: No space left on device
    (0.0 MiB free there)" or "runs/x: Read-only file system". `path`: when the error names none."""
    where = getattr(e, "filename", None) or path
    cause = e.strerror or type(e).__name__
    if e.errno in NO_SPACE and where:
        try:
            folder = where if where and os.path.isdir(where) else os.path.dirname(os.path.abspath(where or "."))
            cause += f" ({shutil.disk_usage(folder).free / 2**20:.1f} MiB free there)"
        except OSError:
            pass
    return f"{where}: {cause}" if where else cause


def os_advice(e: OSError) -> str:
    """What to do about a file-system error: free space for a full disk or quota, else make the
    place writable."""
    if e.errno in NO_SPACE:
        return "free some space"
    if e.errno == errno.EROFS:
        return "give a folder on a writable file system"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "make it writable for this user, or give another folder"
    return "fix the file system"
