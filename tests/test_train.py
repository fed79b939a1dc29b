"""train.py end to end, in subprocesses: smoke runs, 1 vs 2 processes, SIGKILL and resume, bad input."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from subproc import ROOT, env

# A few small updates: a short warm-up (cached for the module), batch 8, 16 held-out problems.
SMALL = ["--warmup-steps", "300", "--batch", "8", "--eval-problems", "16", "--eval-every", "0", "--rank", "8"]


def run(args, *, check=True, **kw):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT,
                         capture_output=True, text=True, env=kw.pop("env", env()), timeout=300, **kw)
    if check and out.returncode != 0:
        raise AssertionError(f"train.py failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out


def read_checkpoint(run_dir):
    """The latest sharded (DCP) checkpoint of a run, gathered into one dict."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    latest = os.path.join(run_dir, open(os.path.join(run_dir, "latest")).read().strip())
    out = os.path.join(latest + ".pt")
    dcp_to_torch_save(latest, out)
    state = torch.load(out, weights_only=False)
    os.remove(out)
    return state


def model_state(run_dir):
    return read_checkpoint(run_dir)["model"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.mark.parametrize("optimizer", ["logra", "adam"])
def test_smoke_run(runs, optimizer):
    d = runs / f"smoke-{optimizer}"
    out = run([*SMALL, "--updates", "3", "--optimizer", optimizer, "--run-dir", str(d)])
    rows = [json.loads(line) for line in open(d / "metrics.jsonl")]
    assert [r["update"] for r in rows] == [0, 1, 2, 3]
    assert "pass1" in rows[0] and all(-0.01 <= r["reward"] <= 1.0 for r in rows[1:])
    assert "step 3 | reward" in out.stdout
    assert json.load(open(d / "config.json"))["optimizer"] == optimizer
    state = read_checkpoint(d)
    assert state["run"]["update"] == 3 and set(state) == {"model", "optimizer", "run"}
    if optimizer == "logra":
        assert all(0 < r["alpha"] <= 3.0 and r["kl_pred"] >= 0 for r in rows[1:])
        assert state["optimizer"]["update"] == 3
    else:
        assert state["optimizer"]["state"]  # AdamW moments were saved
        # Annealed with the KL budget's cosine (2e-2 -> 5e-3 over 150 updates): lr 1e-4 at
        # update 0, then sqrt(budget ratio) of it; the cosine's own values, written out.
        lrs = [r["lr"] for r in rows[1:]]
        budget = [5e-3 + 0.5 * (2e-2 - 5e-3) * (1 + math.cos(math.pi * t / 149)) for t in range(3)]
        for lr, b in zip(lrs, budget):
            assert math.isclose(lr, 1e-4 * math.sqrt(b / 2e-2), rel_tol=1e-12)
        assert lrs[0] == 1e-4 and lrs[0] > lrs[1] > lrs[2]
        # AdamW syncs full bf16 target weights; LoGRA's factors are a fraction of that.
        logra = [json.loads(line) for line in open(runs / "smoke-logra" / "metrics.jsonl")][1:]
        assert max(r["sync_bytes"] for r in logra) < 0.5 * min(r["sync_bytes"] for r in rows[1:])


def test_one_and_two_processes_agree(runs):
    # The KL probe scores the first responses of each rank; probing all 8 makes the probed
    # set the same for 1 and 2 processes.
    args = [*SMALL, "--updates", "3", "--micro-batch", "4", "--probe-responses", "8"]
    one, two = runs / "world1", runs / "world2"
    run([*args, "--run-dir", str(one)])
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          os.path.join(ROOT, "train.py"), *args, "--run-dir", str(two)],
                         cwd=ROOT, capture_output=True, text=True, env=env(), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    a, b = model_state(one), model_state(two)
    base = torch.load(next(runs.glob("base-tiny-*.pt")), weights_only=True)
    moved = max((a[k] - base[k]).abs().max().item() for k in a)
    assert moved > 0
    # Same rollouts (per-prompt sampling seeds), same global batch, each rank's micro-batch the
    # one process's micro-batch: the sketches are summed in the same order (a reduce-scatter of
    # two terms), and RowAdam's reductions are float64 partial sums rounded once: bitwise.
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"1 vs 2 processes: max |dW| {diff:.2e}, accumulated update {moved:.2e}")
    assert all(torch.equal(a[k], b[k]) for k in a), (diff, moved)
    m1 = [json.loads(l) for l in open(one / "metrics.jsonl")][1:]
    m2 = [json.loads(l) for l in open(two / "metrics.jsonl")][1:]
    assert [r["accuracy"] for r in m1] == [r["accuracy"] for r in m2]  # the same responses
    assert any(r["accuracy"] > 0 for r in m1)  # some advantages were non-zero: the policy moved


def wait_for_rows(metrics, rows, timeout=240):
    """Until a run's metrics.jsonl has `rows` lines (or `timeout` seconds have passed)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.exists() and sum(1 for _ in open(metrics)) >= rows:
            return
        time.sleep(0.01)


def test_sigkill_and_resume_is_bitwise(runs):
    args = [*SMALL, "--updates", "8", "--save-every", "1"]
    whole, killed = runs / "whole", runs / "killed"
    run([*args, "--run-dir", str(whole)])
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args, "--run-dir", str(killed)],
                            cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_rows(killed / "metrics.jsonl", 4)  # base row + 3 updates
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = read_checkpoint(killed)["run"]["update"]
    assert saved < 8, "the run finished before it was killed"
    out = run([*args, "--resume", str(killed)])
    assert f"resumed {killed} at update {saved}" in out.stdout
    a, b = model_state(whole), model_state(killed)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("args, extra_env, message", [
    (["--model", "huge"], {}, "invalid choice"),
    (["--rank", "65"], {}, "must be in 1..64"),
    (["--batch", "7"], {"WORLD_SIZE": "2"}, "does not split across 2 ranks"),
])
def test_bad_input_exits_before_work(runs, tmp_path, args, extra_env, message):
    d = tmp_path / "never"
    out = run([*args, "--run-dir", str(d)], check=False, env=env(**extra_env))
    assert out.returncode != 0 and message in out.stderr
    assert not d.exists()


def test_resume_with_other_configuration_is_refused(runs):
    d = runs / "smoke-logra"
    if not d.exists():
        run([*SMALL, "--updates", "3", "--run-dir", str(d)])
    before = (d / "latest").stat().st_mtime
    out = run([*SMALL, "--updates", "5", "--resume", str(d)], check=False)
    assert out.returncode != 0 and "different configuration (updates)" in out.stderr
    assert (d / "latest").stat().st_mtime == before
    out = run([*SMALL, "--updates", "3", "--run-dir", str(d)], check=False)
    assert out.returncode != 0 and "already holds a run" in out.stderr


def kill_all(marker):
    """SIGKILL every process whose command line mentions `marker`, all at once."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read() and int(pid) != os.getpid():
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def torchrun(args, **kw):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
            kw.get("port", "29561"), os.path.join(ROOT, "train.py"), *args]


def test_two_rank_sigkill_and_resume_is_bitwise(runs):
    """2 ranks (FSDP2, row-sharded LoGRA state saved as DTensors): killed and resumed, the run
    ends with bitwise the weights of an uninterrupted one."""
    args = [*SMALL, "--updates", "4", "--save-every", "1", "--micro-batch", "4"]
    whole, killed = runs / "whole2", runs / "killed2"
    out = subprocess.run(torchrun([*args, "--run-dir", str(whole)]), cwd=ROOT, capture_output=True, text=True,
                         env=env(), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    proc = subprocess.Popen(torchrun([*args, "--run-dir", str(killed)], port="29562"), cwd=ROOT, env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_rows(killed / "metrics.jsonl", 3)  # base row + 2 updates
    kill_all(str(killed))  # torchrun and both ranks (torchrun's workers have their own process groups)
    proc.wait()
    saved = read_checkpoint(killed)["run"]["update"]
    assert saved < 4, "the run finished before it was killed"
    out = subprocess.run(torchrun([*args, "--resume", str(killed)], port="29563"), cwd=ROOT, capture_output=True,
                         text=True, env=env(), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"resumed {killed} at update {saved}" in out.stdout
    a, b = model_state(whole), model_state(killed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    moments = read_checkpoint(killed)["optimizer"]["moments"]
    assert all(torch.equal(moments[k], read_checkpoint(whole)["optimizer"]["moments"][k]) for k in moments)
