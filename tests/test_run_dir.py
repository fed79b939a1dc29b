"""infra/run_dir.py: the lock (two processes, a killed holder, a file in the way), what a
directory holds (new, continued, refused), a killed run's temporary files; and the pieces of
the operator's path that live elsewhere: a torn metrics line (checkpoint.truncate_rows), a
failed append (metrics.append), a write's temporary file (checkpoint.write_atomic), a save's
advice by cause, launch.Preemption's second signal and hold."""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from infra import checkpoint, run_dir
from subproc import ROOT, env

HOLDER = """
import sys, time
from infra import run_dir
h = run_dir.hold(sys.argv[1])
print("held", flush=True)
time.sleep(float(sys.argv[2]))
h.release()
print("released", flush=True)
"""


def hold_in_child(path, seconds):
    """A process that takes the lock of `path` and keeps it `seconds`; returned once it holds it."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), str(seconds)], cwd=ROOT, env=env(),
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_run_that_loses_the_race_by_microseconds_still_names_the_holder(tmp_path):
    """Two runs started together: the winner writes its name just after it takes the lock, and
    the loser, refused at that moment, reads an empty file; it reads again until the name is
    there (the refusal names the holder whatever the machine's timing), or says it has none."""
    import threading

    path = tmp_path / "run.lock"
    path.write_text("")
    later = threading.Timer(0.2, lambda: path.write_text("host h pid 7 since now"))
    later.start()
    assert run_dir.holder(str(path)) == "host h pid 7 since now"
    later.join()
    path.write_text("")
    assert run_dir.holder(str(path), wait=0.05) == "its holder has not written its name"


@pytest.mark.slow
def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    d = tmp_path / "run"
    child = hold_in_child(d, 30)
    try:
        with pytest.raises(run_dir.RunDirError) as e:
            run_dir.hold(str(d))
        message = str(e.value)
        assert "\n" not in message and f"--run-dir {d} is in use by another run" in message
        assert f"pid {child.pid}" in message and "host " in message
    finally:
        child.kill()
        child.wait()
    # SIGKILLed: the kernel dropped its lock; the next run takes it over (the stale file's name replaced)
    h = run_dir.hold(str(d))
    assert f"pid {os.getpid()}" in open(d / run_dir.LOCK_NAME).read()
    h.release()
    assert os.listdir(d) == []  # the holder removes its lock file when it lets go


def test_a_refused_hold_changes_nothing_and_a_released_one_leaves_nothing(tmp_path):
    d = tmp_path / "a" / "b" / "run"
    h = run_dir.hold(str(d))
    assert d.is_dir() and h.made == [str(d), str(d.parent), str(d.parent.parent)]
    h.release(undo=True)  # a run refused before it wrote anything: the folders it made go too
    assert not (tmp_path / "a").exists()
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(run_dir.RunDirError, match="is a file, not a folder"):
        run_dir.hold(str(f))
    assert f.read_text() == "x"


@pytest.mark.slow
def test_a_read_only_folder_is_one_line(tmp_path):
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs mount namespaces (unshare --mount, as root) to make a read-only file system")
    code = ("import sys; from infra import run_dir\n"
            "try:\n    run_dir.hold(sys.argv[1] + '/run')\nexcept run_dir.RunDirError as e:\n    print(e)")
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          'mount -t tmpfs -o ro none "$0" && exec "$@"', str(tmp_path), sys.executable, "-c", code,
                          str(tmp_path)], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == (f"--run-dir {tmp_path}/run cannot be used ({tmp_path}/run: Read-only file "
                                  f"system): give a folder on a writable file system"), out.stdout + out.stderr


CFG = {"preset": "tiny", "seed": 0, "updates": 3, "layout": {"nodes": 1}, "model": {"hidden_size": 8}}


def make_run(d, *, checkpoints=(), rows=0, config=CFG):
    d.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    for n in checkpoints:
        (d / f"checkpoint-{n}").mkdir()
    if rows:
        (d / "metrics.jsonl").write_text("".join(json.dumps({"update": i}) + "\n" for i in range(rows)))


def test_what_a_directory_holds(tmp_path):
    cfg = dict(CFG, layout={"nodes": 2})  # the layout may change on a resume
    assert not run_dir.inspect(cfg, str(tmp_path / "none")).continues
    make_run(tmp_path / "setup-only")  # a run that stopped in its set-up: nothing to lose
    assert not run_dir.inspect(cfg, str(tmp_path / "setup-only")).continues
    make_run(tmp_path / "run", checkpoints=(1, 2), rows=3)
    v = run_dir.inspect(cfg, str(tmp_path / "run"))
    assert v.continues and v.checkpoints == ("checkpoint-2", "checkpoint-1") and v.rows == 3

    def refused(d, match, **kw):
        with pytest.raises(run_dir.RunDirError, match=match) as e:
            run_dir.inspect(kw.pop("cfg", cfg), str(d), **kw)
        assert "\n" not in str(e.value)
        return str(e.value)

    refused(tmp_path / "run", r"holds another run \(its options differ: updates\)", cfg=dict(cfg, updates=4))
    # A run saved before --group-size and --advantage existed ran with one response per prompt
    # and the running baseline: it continues with those, and only with those.
    grouped = dict(cfg, group_size=1, advantage="running")
    assert run_dir.inspect(grouped, str(tmp_path / "run")).continues
    refused(tmp_path / "run", r"its options differ: advantage, group_size\)",
            cfg=dict(grouped, group_size=4, advantage="rloo"))
    refused(tmp_path / "run", r"different configuration \(seed\)", cfg=dict(cfg, seed=1), resume=str(tmp_path / "run"))
    # --checkpointing auto decides at each start from the GPU's free memory: a GPU run saved with it on (or before
    # the plan's figure was recorded) continues with it off, a new figure, or neither recorded
    for saved, now in ((dict(checkpointing=True), dict(checkpointing=False, plan_gib=61.8)),
                       (dict(checkpointing=False, plan_gib=61.8), dict(checkpointing=True, plan_gib=53.24))):
        make_run(tmp_path / f"gpu-{len(saved)}", checkpoints=(1,), rows=2, config=dict(cfg, **saved))
        assert run_dir.inspect(dict(cfg, **now), str(tmp_path / f"gpu-{len(saved)}")).continues
    make_run(tmp_path / "rows-only", rows=5)  # metrics of a run and no checkpoint: never started anew silently
    m = refused(tmp_path / "rows-only", r"holds this run's metrics.jsonl \(5 rows, to update 4\) but no checkpoint")
    assert f"rm -r {tmp_path / 'rows-only'}" in m
    make_run(tmp_path / "latest-only")  # every checkpoint removed by hand, the pointer kept
    (tmp_path / "latest-only" / "latest").write_text("checkpoint-3")
    refused(tmp_path / "latest-only", "holds this run's latest pointer but no checkpoint to continue from")
    make_run(tmp_path / "no-config", checkpoints=(1,), config=None)
    refused(tmp_path / "no-config", "holds a run's checkpoints or metrics but no config.json")
    for kind in ("symlink", "folder"):
        d = tmp_path / f"latest-{kind}"
        make_run(d, checkpoints=(1,), rows=2)
        if kind == "symlink":
            (d / "elsewhere").write_text("checkpoint-1")
            os.symlink(d / "elsewhere", d / "latest")
        else:
            (d / "latest").mkdir()
        refused(d, f"latest is a {kind}; it must be the regular file a save writes")
    (tmp_path / "file").write_text("")
    refused(tmp_path / "file", "is a file, not a folder")
    refused(tmp_path / "none", "no such folder", resume=str(tmp_path / "none"))


# config.json as train.py wrote it before the configuration was a typed object (December 2026),
# and the command line of each: the run it holds continues under today's code.
SAVED = {"tiny": ["--updates", "1", "--warmup-steps", "20", "--eval-every", "0", "--eval-problems", "8"],
         "tiny-math-lora": ["--model", "tiny-math", "--model-path", "/tmp/tm/model", "--train-data",
                            "/tmp/tm/train.jsonl", "--eval-data", "/tmp/tm/eval.jsonl", "--optimizer", "lora",
                            "--group-size", "4", "--advantage", "rloo"],
         "tiny-math-gym": ["--model", "tiny-math", "--model-path", "/tmp/tm/model", "--task", "reasoning-gym",
                           "--context", "512", "--sync", "delta"]}


@pytest.mark.parametrize("name", sorted(SAVED))
def test_a_configuration_saved_before_the_typed_config_continues(tmp_path, name):
    """A run directory whose config.json came from the untyped configuration (a flat dict
    holding only the keys its preset had) is this run's under the typed one: it continues with
    the same command line, and another option is refused as before."""
    import dataclasses

    import train
    from infra import options, planning

    text = open(os.path.join(ROOT, "tests", "data", f"saved-config-{name}.json")).read()
    saved = json.loads(text.replace("/tmp/tm/", f"{tmp_path}/"))
    argv = [a.replace("/tmp/tm/", f"{tmp_path}/") for a in SAVED[name]]
    if saved["model"].get("model_type"):  # a chat checkpoint: its widths come from its config.json
        os.makedirs(tmp_path / "model")
        (tmp_path / "model" / "config.json").write_text(json.dumps(saved["model"]))
    make_run(tmp_path / "run", checkpoints=(1,), rows=2, config=saved)
    cfg = options.resolve(*options.parse(argv, train.PRESETS), train.PRESETS)
    cfg = dataclasses.replace(cfg, model=planning.read_model_config(cfg))
    assert run_dir.inspect(cfg.record(), str(tmp_path / "run")).continues
    with pytest.raises(run_dir.RunDirError, match=r"its options differ: seed\)"):
        run_dir.inspect(dataclasses.replace(cfg, seed=1).record(), str(tmp_path / "run"))


def test_stray_temporary_files_are_removed(tmp_path):
    make_run(tmp_path, checkpoints=(2,))
    for name in ("latest.tmp123", "checkpoint-2/manifest.json.tmp77", "metrics.jsonl.tmp9"):
        (tmp_path / name).write_text("x")
    (tmp_path / "notes.tmp").write_text("kept")  # not a `.tmp<pid>` name
    assert sorted(run_dir.clean_stray(str(tmp_path))) == ["checkpoint-2/manifest.json.tmp77", "latest.tmp123",
                                                  "metrics.jsonl.tmp9"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "config.json", "notes.tmp"]


def test_a_torn_last_metrics_line_is_dropped_and_a_damaged_one_refused(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = "".join(json.dumps({"update": i, "reward": 0.5}) + "\n" for i in range(4))
    path.write_text(good + '{"update": 4, "rew')  # an append cut short: no newline
    note = checkpoint.truncate_rows(str(path), 2)
    assert note == f"dropped the torn last line of {path} (line 5, 18 bytes)"
    assert path.read_text() == "".join(good.splitlines(True)[:3])
    path.write_text(good + '{"update": 4, "rew\n')  # not JSON, newline or not
    assert "torn last line" in checkpoint.truncate_rows(str(path), 9) and path.read_text() == good
    path.write_text(good)
    before = path.stat().st_mtime_ns
    assert checkpoint.truncate_rows(str(path), 9) is None and path.stat().st_mtime_ns == before  # left as it is
    path.write_text(good.replace('{"update": 1', '{"upd'))
    with pytest.raises(checkpoint.CheckpointError, match=f"{path} line 2 is not a metrics row"):
        checkpoint.truncate_rows(str(path), 9)


def test_write_atomic_leaves_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "config.json"
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left")))
    with pytest.raises(OSError):
        checkpoint.write_atomic(str(target), b"{}")
    assert os.listdir(tmp_path) == []  # neither the file nor its .tmp<pid>


@pytest.mark.parametrize("err, advice", [(errno.ENOSPC, "free some space"),
                                         (errno.EPERM, "make it writable for this user, or give another folder"),
                                         (errno.EROFS, "give a folder on a writable file system")])
def test_a_failed_save_advises_by_its_cause(tmp_path, monkeypatch, err, advice):
    import torch
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.zeros(4)}
    checkpoint.save(str(tmp_path), state, 1, rank=0, world=1)
    monkeypatch.setattr(dcp, "save", lambda *a, **k: (_ for _ in ()).throw(
        OSError(err, os.strerror(err), str(tmp_path / "checkpoint-2" / "__0_0.distcp"))))
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.save(str(tmp_path), state, 2, rank=0, world=1)
    assert f"{advice}, then run the same command again" in str(e.value)
    assert ("free some space" in str(e.value)) == (err == errno.ENOSPC)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "latest"]


PREEMPTION = """
import os, signal, sys, time
from infra import launch
p = launch.Preemption()
os.kill(os.getpid(), signal.SIGTERM)
os.kill(os.getpid(), signal.SIGINT)  # within a second of the first: the same stop, ignored
print("first", p.received, flush=True)
if sys.argv[1] == "hold":
    p.hold()
time.sleep(1.1)
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)
    print("ignored", flush=True)
except KeyboardInterrupt as e:
    print("at once:", e, flush=True)
try:
    p.check("a wait")
except launch.Stopped as e:
    print(e.exit_code, e.line())
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["free", "hold"])
def test_a_second_sigint_and_a_held_stop(mode):
    out = subprocess.run([sys.executable, "-c", PREEMPTION, mode], cwd=ROOT, env=env(), capture_output=True,
                         text=True, timeout=60).stdout.splitlines()
    assert out[0] == "first SIGTERM"
    if mode == "free":  # a second Ctrl-C, a second after the first: at once (train.py: exit 75)
        assert out[1:] == ["at once: a second SIGINT: stopping at once"]
    else:  # a stop under way: every further signal is ignored, and check() no longer stops
        assert out[1:] == ["ignored"]


def test_a_signal_in_the_setup_stops_at_the_next_check():
    from infra import launch

    p = launch.Preemption()
    try:
        p.check("nothing")  # no signal: no stop
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        with pytest.raises(launch.Stopped) as e:
            p.check("the base policy's warm-up")
        assert e.value.exit_code == 75 and e.value.line() == (
            "train.py: stopped: stopped on SIGTERM during the base policy's warm-up, before any update: nothing "
            "to save; run the same command again to continue (exit 75)")
        p2 = launch.Preemption()
        p2.received, p2.setup = "SIGTERM", False  # in the loop: the stop waits for the update's end
        p2.check("a restart")
    finally:
        p.restore()
