"""train.py run in the test's own process: `train.main(argv)` as `python train.py ARGV` runs it,
with its output, its exit code, and nothing of it left behind (signal handlers, environment,
torch's thread count), so that refusals, dry runs and one-process runs cost no interpreter
start. The run gets what a subprocess of subproc.env() gets: one thread, offline, no torchrun
variables."""

import contextlib
import dataclasses
import io
import os
import signal
from unittest import mock

import torch

import train
from infra import launch


@dataclasses.dataclass
class Ran:
    """What `python train.py ARGV` would have given: exit code, stdout, stderr."""
    returncode: int
    stdout: str
    stderr: str


def run(argv, *, check=True, **environ) -> Ran:
    """train.main(argv) here: its exit code (0, or SystemExit's), stdout and stderr. `environ`:
    variables set for the run (WORLD_SIZE=2 plans a torchrun world without starting one).
    `check`: raise with the output if the run did not succeed."""
    out, err = io.StringIO(), io.StringIO()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    threads = torch.get_num_threads()
    with mock.patch.dict(os.environ), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK"):
            os.environ.pop(name, None)
        os.environ.update(HF_HUB_OFFLINE="1", **environ)
        torch.set_num_threads(1)
        try:
            train.main(argv)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        finally:
            torch.set_num_threads(threads)
            for s, handler in handlers.items():
                signal.signal(s, handler)
            launch.release()
    ran = Ran(code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"train.py {' '.join(argv)} failed ({code}):\n{ran.stdout}\n{ran.stderr}")
    return ran
