"""bench/gpu_smoke.py's runs are bounded and a failure names its step, without a GPU: its
train.py subprocess is a stand-in that never ends, or fails."""

import os
import subprocess
import sys

import pytest

from subproc import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import gpu_smoke  # noqa: E402


class Proc:
    """A stand-in for the torchrun process: `communicate` times out `hangs` times, then returns."""

    def __init__(self, returncode=0, err="", hangs=0):
        self.pid, self.returncode, self.err, self.hangs = 4242, returncode, err, hangs

    def communicate(self, timeout=None):
        if self.hangs:
            self.hangs -= 1
            raise subprocess.TimeoutExpired("torchrun", timeout)
        return "its output", self.err


def test_a_run_that_never_ends_is_killed_and_one_that_fails_names_its_step(tmp_path, monkeypatch):
    killed = []
    monkeypatch.setattr(gpu_smoke.os, "killpg", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setattr(gpu_smoke.subprocess, "Popen", lambda *a, **kw: Proc(hangs=1))
    with pytest.raises(SystemExit, match=r"gpu_smoke.py: logra run: no end within 5 s \(killed\)"):
        gpu_smoke.run("logra", 2, 0, str(tmp_path), timeout=5)
    assert killed == [(4242, gpu_smoke.signal.SIGKILL)]  # its whole process group
    monkeypatch.setattr(gpu_smoke.subprocess, "Popen",
                        lambda *a, **kw: Proc(returncode=1, err="...\ntrain.py: error: CUDA out of memory"))
    with pytest.raises(SystemExit, match="adam run: failed with exit 1: train.py: error: CUDA out of memory"):
        gpu_smoke.run("adam", 2, 0, str(tmp_path), timeout=5)
