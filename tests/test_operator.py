"""What an operator meets: a lost or odd `latest`, a torn metrics line, a run directory that is a
file (in this process: the fast tier); two runs on one directory, signals in the set-up and in a
stop's teardown, read-only and full file systems (small tmpfs mounts in a mount namespace), all
through train.py in subprocesses (the slow tier). Every refusal is one line and an exit code,
with no traceback, and leaves the run directory's files as they were (hashes before and after)."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import in_process
from subproc import ROOT, env

# Tiny and fast: no warm-up (a random base policy is enough to exercise the run's files).
QUICK = ["--warmup-steps", "0", "--batch", "8", "--eval-problems", "16", "--eval-every", "0", "--rank", "8"]


def train(args, *, timeout=300, **kw):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, env=kw.pop("env", env()), timeout=timeout, **kw)


def start(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE):
    """train.py in the background; its output unbuffered, so that a test can follow it."""
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT,
                            env=env(PYTHONUNBUFFERED="1"), stdout=stdout, stderr=stderr, text=True)


def one_line(out, code, starts):
    """The run ended with `code` and said why in exactly one stderr line, with no traceback."""
    lines = [line for line in out.stderr.splitlines() if line.startswith("train.py:")]
    assert out.returncode == code and len(lines) == 1, f"{out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert lines[0].startswith(starts), lines[0]
    return lines[0]


def tree(folder):
    """Every entry under `folder`: a file's sha256, a symlink's target, a folder's mark."""
    found = {}
    for base, dirs, names in os.walk(folder):
        for name in dirs + names:
            path = os.path.join(base, name)
            rel = os.path.relpath(path, folder)
            if os.path.islink(path):
                found[rel] = "-> " + os.readlink(path)
            elif os.path.isdir(path):
                found[rel] = "dir"
            else:
                found[rel] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return found


def rows(d):
    return [json.loads(line)["update"] for line in open(d / "metrics.jsonl")]


# --- one run at a time ------------------------------------------------------------------------

@pytest.mark.slow
def test_two_runs_on_one_directory(tmp_path):
    """The same command twice at once: one runs, the other stops in one line naming the holder;
    a third with another seed, started while the first runs, is refused the same way. The
    runner is then stopped (SIGTERM, exit 75): its log holds every update once, its config is
    the first's, and its lock is gone."""
    d = tmp_path / "run"
    args = [*QUICK, "--updates", "100000", "--save-every", "5", "--run-dir", str(d)]  # runs until stopped
    errs = [open(tmp_path / f"err{i}", "w+") for i in range(2)]  # files: a full pipe would stall a run
    a, b = (start(args, stdout=subprocess.DEVNULL, stderr=err) for err in errs)
    deadline = time.time() + 240
    while not (d / "metrics.jsonl").exists() and time.time() < deadline:
        time.sleep(0.1)
    late = train([*args, "--seed", "1"])
    while a.poll() is None and b.poll() is None and time.time() < deadline:  # the loser ends in its set-up
        time.sleep(0.1)
    loser, loser_err = (a, errs[0]) if a.poll() is not None else (b, errs[1])
    winner = b if loser is a else a
    assert winner.poll() is None  # still running: it holds the directory until it is stopped
    winner.send_signal(signal.SIGTERM)
    assert winner.wait(timeout=120) == 75
    refusal = f"train.py: error: --run-dir {d} is in use by another run (host "
    loser_err.seek(0)
    for code, err in ((loser.returncode, loser_err.read()), (late.returncode, late.stderr)):
        lines = [line for line in err.splitlines() if line.startswith("train.py:")]
        assert code == 2 and len(lines) == 1 and lines[0].startswith(refusal), err[-3000:]
        assert f"pid {winner.pid} since " in lines[0] and "Traceback" not in err
    updates = rows(d)
    assert updates == list(range(len(updates))) and len(updates) >= 2
    assert json.load(open(d / "config.json"))["seed"] == 0
    assert "run.lock" not in os.listdir(d)  # let go when the run ended
    for err in errs:
        err.close()


# --- what a directory holds ---------------------------------------------------------------------

def test_a_lost_or_odd_latest_and_a_torn_log(tmp_path):
    d = tmp_path / "run"
    args = [*QUICK, "--updates", "3", "--save-every", "1", "--keep", "3", "--run-dir", str(d)]
    first = in_process.run(args, check=False)
    assert first.returncode == 0, first.stderr[-3000:]
    done = tree(d)

    # latest lost, and checkpoint-3's save cut short before its manifest: the newest checkpoint
    # that verifies is checkpoint-2; the same command continues from it and redoes update 3.
    os.remove(d / "latest")
    os.remove(d / "checkpoint-3" / "manifest.json")
    (d / "latest.tmp4242").write_text("checkpoint-3")  # what a killed save leaves
    out = in_process.run(args, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"{d}: latest is missing; continuing from checkpoint-2, the newest checkpoint that verifies" in out.stdout
    assert f"continued {d} at update 2" in out.stdout and "removed 1 temporary file(s)" in out.stdout
    assert rows(d) == [0, 1, 2, 3] and (d / "latest").read_text() == "checkpoint-3"
    assert tree(d)["checkpoint-3/__0_0.distcp"] == done["checkpoint-3/__0_0.distcp"]  # bitwise the same update

    # latest lost, other options: refused, nothing changed (config.json not overwritten)
    os.remove(d / "latest")
    before = tree(d)
    out = in_process.run([*args[:-4], "--updates", "5", "--save-every", "1", "--keep", "3", "--run-dir", str(d)],
                         check=False)
    one_line(out, 2, f"train.py: error: {d} holds another run (its options differ: updates)")
    assert tree(d) == before

    # latest a symlink, a folder: refused by name, nothing changed
    for make in (lambda p: os.symlink("checkpoint-3", p), os.mkdir):
        make(d / "latest")
        before = tree(d)
        line = one_line(in_process.run(args, check=False), 2, f"train.py: error: --run-dir {d}: {d}/latest is a ")
        assert "it must be the regular file a save writes" in line and tree(d) == before
        (os.remove if os.path.islink(d / "latest") else os.rmdir)(d / "latest")

    # a damaged checkpoint, continued without --resume: the refusal speaks of --run-dir
    (d / "latest").write_text("checkpoint-3")
    shard = d / "checkpoint-3" / "__0_0.distcp"
    good = shard.read_bytes()
    shard.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    before = tree(d)
    line = one_line(in_process.run(args, check=False), 2, f"train.py: error: --run-dir {d}: checkpoint-3/__0_0.distcp does not match")
    assert f"checkpoint-2 verifies: resume from it with --resume {d} --resume-from checkpoint-2" in line
    assert tree(d) == before
    shard.write_bytes(good)

    # a torn last metrics line (a power loss during an append): dropped, said, continued
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"update": 4, "rew')
    out = in_process.run(args, check=False)
    assert out.returncode == 0 and "dropped the torn last line of" in out.stdout, out.stderr[-3000:]
    assert rows(d) == [0, 1, 2, 3]

    # every checkpoint gone, latest kept: refused, with the ways on
    for c in ("checkpoint-1", "checkpoint-2", "checkpoint-3"):
        shutil.rmtree(d / c)
    before = tree(d)
    line = one_line(in_process.run(args, check=False), 2, f"train.py: error: --run-dir {d} holds this run's metrics.jsonl (4 rows, to update 3) "
                                    f"but no checkpoint to continue from")
    assert f"rm -r {d}" in line and "another --run-dir" in line and tree(d) == before


def test_a_run_dir_that_is_a_file(tmp_path):
    f = tmp_path / "notes"
    f.write_text("mine")
    one_line(in_process.run([*QUICK, "--run-dir", str(f)], check=False), 2, f"train.py: error: --run-dir {f} is a file, not a folder")
    assert f.read_text() == "mine" and os.listdir(tmp_path) == ["notes"]


# --- signals ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_sigterm_in_the_warm_up_stops_at_once(tmp_path):
    """A seed with no cached base policy warms up for minutes; SIGTERM once the run holds its
    directory (the warm-up follows within a second) stops it in the warm-up, at the next step:
    exit 75, nothing cached, and the run directory gone again (nothing was written to it but
    its lock)."""
    d = tmp_path / "warm"
    proc = start([*QUICK, "--seed", "11", "--warmup-steps", "30000", "--run-dir", str(d)])
    deadline = time.time() + 120
    while not (d / "run.lock").exists() and time.time() < deadline:  # the signal handlers are in place
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, (proc.returncode, err[-3000:])
    assert err.strip().splitlines()[-1] == ("train.py: stopped: stopped on SIGTERM during the base policy's "
                                             "warm-up, before any update: nothing to save; run the same command "
                                             "again to continue (exit 75)")
    assert "Traceback" not in err and os.listdir(tmp_path) == []  # no run directory, no cache, no .tmp


@pytest.mark.slow
def test_more_signals_during_a_stop_keep_exit_75(tmp_path):
    """SIGTERM asks for a stop; once the stop has begun (its line printed, the teardown under
    way), a further SIGTERM and two SIGINTs a second apart change nothing: exit 75."""
    d = tmp_path / "run"
    proc = start([*QUICK, "--updates", "500", "--save-every", "0", "--run-dir", str(d)])
    for line in proc.stdout:
        if line.startswith("step 2 |"):
            break
    proc.send_signal(signal.SIGTERM)
    for line in proc.stdout:
        if line.startswith("stopped on SIGTERM at update"):
            break
    for sig, pause in ((signal.SIGTERM, 0.0), (signal.SIGINT, 1.1), (signal.SIGINT, 0.0)):
        time.sleep(pause)
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            break
    proc.wait(timeout=60)
    assert proc.returncode == 75, proc.stderr.read()[-3000:]


def test_a_second_ctrl_c_is_one_line_and_75(monkeypatch, capsys):
    import train

    monkeypatch.setattr(train, "run", lambda argv: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(SystemExit) as e:
        train.main([])
    assert e.value.code == 75
    assert capsys.readouterr().err.startswith("train.py: stopped: a second SIGINT: stopped at once")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


# --- file systems: small tmpfs mounts in a mount namespace ---------------------------------------

def in_tmpfs(folder, script, *, size="4m", timeout=300):
    """`script` (sh) with a fresh tmpfs of `size` mounted at `folder` ($D) and $PY the
    interpreter, in a mount namespace of its own; its output."""
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs mount namespaces (unshare --mount, as root) to make a small file system")
    folder.mkdir(exist_ok=True)
    wrapped = f'mount -t tmpfs -o size={size} none "$D" && cd "$ROOT" && {script}'
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", wrapped], cwd=ROOT,
                          env=env(D=str(folder), PY=sys.executable, ROOT=ROOT, PYTHONUNBUFFERED="1"),
                          capture_output=True, text=True, timeout=timeout)


def quick(extra=""):
    return f'"$PY" train.py {" ".join(QUICK)} --run-dir "$D/run" {extra}'


@pytest.mark.slow
def test_a_read_only_file_system_at_start_and_at_resume(tmp_path):
    out = in_tmpfs(tmp_path / "ro", f'mount -o remount,ro "$D" && {quick()}')
    one_line(out, 2, f"train.py: error: --run-dir {tmp_path}/ro/run cannot be used ({tmp_path}/ro/run: Read-only "
                     f"file system): give a folder on a writable file system")
    out = in_tmpfs(tmp_path / "ro2", f'{quick("--updates 2 --save-every 1")} > /dev/null && '
                                     f'mount -o remount,ro "$D" && {quick("--updates 2 --save-every 1")}')
    one_line(out, 2, f"train.py: error: --run-dir {tmp_path}/ro2/run cannot be used ({tmp_path}/ro2/run/run.lock: "
                     f"Read-only file system)")


@pytest.mark.slow
def test_a_full_file_system_at_start_leaves_nothing(tmp_path):
    """One page: the lock fits, config.json does not. One line, the cause and the free space,
    and no 0-byte config.json, no temporary file, no run directory left."""
    out = in_tmpfs(tmp_path / "full", f'{quick()}; echo "exit $?"; ls -A "$D"', size="4k")
    lines = [line for line in out.stderr.splitlines() if line.startswith("train.py:")]
    assert len(lines) == 1 and "exit 2" in out.stdout, out.stdout + out.stderr[-3000:]
    assert lines[0].startswith(f"train.py: error: --run-dir {tmp_path}/full/run cannot be written "
                               f"({tmp_path}/full/run/config.json.tmp")
    assert lines[0].endswith("No space left on device (0.0 MiB free there)): free some space")
    assert out.stdout.strip().splitlines()[-1] == "exit 2" and "Traceback" not in out.stderr


@pytest.mark.slow
def test_a_disk_that_fills_mid_run_is_one_line(tmp_path):
    """The disk fills between two saves: the log's next write fails; one line names the file
    and the cause, exit 2, no traceback from any thread or at exit, and no torn row."""
    script = (f'{quick("--updates 500 --save-every 0")} & pid=$!; '
              f'while [ "$(cat "$D/run/metrics.jsonl" 2>/dev/null | wc -l)" -lt 3 ]; do sleep 0.1; done; '
              f'head -c 100M /dev/zero > "$D/fill" 2>/dev/null; wait $pid; echo "exit $?"; '
              f'"$PY" -c "import json, sys; [json.loads(l) for l in open(sys.argv[1])]; print(\'rows ok\')" '
              f'"$D/run/metrics.jsonl"')
    out = in_tmpfs(tmp_path / "fills", script, size="2m")
    lines = [line for line in out.stderr.splitlines() if line.startswith("train.py:")]
    assert len(lines) == 1 and "exit 2" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
    assert "No space left on device (0.0 MiB free there)" in lines[0] and ": free some space" in lines[0]
    assert "Traceback" not in out.stderr and "Exception" not in out.stderr, out.stderr[-3000:]
    assert "rows ok" in out.stdout
