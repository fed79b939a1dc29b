"""train.py end to end. Fast tier, in this process: smoke runs of the three optimizers, bad input,
a resume refused, the engine's output check (a run it leaves bitwise alone, a stale engine it
stops). Slow tier, in subprocesses: 1 vs 2 processes (the output check on each rank), two
torchrun "nodes" on this machine, resumes on other numbers of ranks, runs that heal (SIGTERM and
the same command again, a rank SIGKILLed under torchrun --max-restarts, a full disk)."""

import copy
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import in_process
import premises
from infra.engine import HFEngine
from subproc import ROOT, env, model_state, read_checkpoint, two_nodes

# A few small updates from the tiny preset's base policy (shipped for seed 0: conftest.runs), batch 8,
# 16 held-out problems.
SMALL = ["--batch", "8", "--eval-problems", "16", "--eval-every", "0", "--rank", "8"]


def run(args, *, check=True, **kw):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT,
                         capture_output=True, text=True, env=kw.pop("env", env()), timeout=300, **kw)
    if check and out.returncode != 0:
        raise AssertionError(f"train.py failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out


@pytest.mark.parametrize("optimizer", ["logra", "adam"])
def test_smoke_run(runs, optimizer):
    d = runs / f"smoke-{optimizer}"
    out = in_process.run([*SMALL, "--updates", "3", "--optimizer", optimizer, "--run-dir", str(d)])
    assert "base policy: loaded" in out.stdout  # the shipped one (tests/data): regenerate it if this fails
    assert "at its cap" not in out.stdout
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
        if not (runs / "smoke-logra").exists():
            in_process.run([*SMALL, "--updates", "3", "--run-dir", str(runs / "smoke-logra")])
        logra = [json.loads(line) for line in open(runs / "smoke-logra" / "metrics.jsonl")][1:]
        assert max(r["sync_bytes"] for r in logra) < 0.5 * min(r["sync_bytes"] for r in rows[1:])
    # The method's own state, counted by hand from the tiny preset's widths: per decoder layer the
    # seven targets' (out d, in k) are q (64, 64), k and v (32, 64), o (64, 64), gate and up
    # (176, 64), down (64, 176); two layers. AdamW: fp32 gradient and two moments per weight;
    # LoGRA at rank 8: fp32 sketch S and direction U (d, 8), fp32 row moments (d,), int8 signs (8, k).
    shapes = [(64, 64), (32, 64), (32, 64), (64, 64), (176, 64), (176, 64), (64, 176)] * 2
    expected = {"adam": sum(3 * 4 * d * k for d, k in shapes),
                "logra": sum(2 * 4 * d * 8 + 4 * d + 8 * k for d, k in shapes)}[optimizer]
    assert all(r["state_mib"] * 2**20 == expected for r in rows[1:]), (expected, [r["state_mib"] for r in rows])


def test_lora_deltas_never_exceed_a_full_sync(runs):
    """--optimizer lora --sync delta in one process: whatever share of the elements an update
    changes (LoRA's first merge moves B off zero: most elements, on some CPUs all; an update
    whose rollouts all scored alike: none), its delta sends at least the changed values and at
    most a full bf16 sync and the payloads' headers (the dense form where that is smaller:
    infra/wire.sparse_delta); the run checks the engine's fingerprints after each. Bounds that hold
    by construction, not a share that depends on which responses a CPU's rounding samples."""
    d = runs / "lora-delta"
    in_process.run([*SMALL, "--updates", "2", "--optimizer", "lora", "--sync", "delta", "--run-dir", str(d)])
    rows = [json.loads(line) for line in open(d / "metrics.jsonl")][1:]
    full = 2 * sum(d * k for d, k in [(64, 64), (32, 64), (32, 64), (64, 64), (176, 64), (176, 64), (64, 176)]) * 2
    headers = 2 * (40 + 7 * 400)  # two payloads (one per decoder layer) of 7 targets, as in test_delta_sync_...
    assert len(rows) == 2 and all(0 <= r["sync_changed"] <= 1 for r in rows), rows
    assert all(r["sync_changed"] * full <= r["sync_bytes"] <= full + headers for r in rows), rows


@pytest.mark.slow
def test_lora_syncs_its_merged_weights_and_resumes_bitwise(runs):
    """--optimizer lora: the engine gets the merged weights every update (train.py checks the
    fingerprints after every sync; a mismatch would stop the run), the learning rate anneals
    from lora_lr as AdamW's does, and a resume from checkpoint-2 ends bitwise where the
    uninterrupted run ended (base weights, adapters, AdamW's moments)."""
    d = runs / "lora"
    run([*SMALL, "--updates", "3", "--optimizer", "lora", "--save-every", "2", "--run-dir", str(d)])
    rows = [json.loads(line) for line in open(d / "metrics.jsonl")][1:]
    assert [r["update"] for r in rows] == [1, 2, 3] and rows[0]["lr"] == 1e-3 > rows[1]["lr"] > rows[2]["lr"]
    full = read_checkpoint(d, "checkpoint-3")
    adapters = [k for k in full["model"] if ".lora_B." in k]
    assert len(adapters) == 14 and any(full["model"][k].abs().max() > 0 for k in adapters)  # B moved off 0
    assert all(".lora_" in k for k in full["optimizer"]["state"])  # only the adapters have moments
    # Its own state: adapters A (8, k) and B (d, 8) per target, each with a gradient and two
    # moments, fp32 (the targets' shapes as in test_smoke_run).
    shapes = [(64, 64), (32, 64), (32, 64), (64, 64), (176, 64), (176, 64), (64, 176)] * 2
    assert all(r["state_mib"] * 2**20 == sum(4 * 4 * 8 * (d + k) for d, k in shapes) for r in rows)
    again = runs / "lora-resumed"
    shutil.copytree(d, again)
    run([*SMALL, "--updates", "3", "--optimizer", "lora", "--save-every", "2", "--resume", str(again),
         "--resume-from", "checkpoint-2"])
    resumed = read_checkpoint(again, "checkpoint-3")
    for part in ("model", "optimizer"):
        a, b = torch.utils._pytree.tree_leaves(full[part]), torch.utils._pytree.tree_leaves(resumed[part])
        assert len(a) == len(b) and all(torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in zip(a, b))


# The KL probe scores the first responses of each rank; probing all 8 makes the probed set the
# same for any number of ranks. Checkpoints at 2 and 4, for the resumes on other rank counts. The
# engine's outputs are checked after every sync (on each rank, its own engine's).
RANKS = [*SMALL, "--updates", "4", "--micro-batch", "4", "--probe-responses", "8", "--save-every", "2",
         "--check-outputs", "1"]


@pytest.fixture
def split_rows():
    """The premise of a bitwise 1-process-against-2-ranks comparison (premises.split_rows_skip)."""
    reason = premises.split_rows_skip(premises.TINY_WIDTHS)
    if reason:
        pytest.skip(reason)


def two_ranks(args, two):
    """train.py with `args` as 2 torchrun ranks (run dir `two`)."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          os.path.join(ROOT, "train.py"), *args, "--run-dir", str(two)],
                         cwd=ROOT, capture_output=True, text=True, env=env(), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def one_and_two_ranks(args, one, two):
    """train.py with `args` in one process (run dir `one`) and as 2 torchrun ranks (`two`)."""
    run([*args, "--run-dir", str(one)])
    two_ranks(args, two)
    return one, two


@pytest.mark.slow
def test_one_and_two_processes_agree(runs, split_rows):
    one, two = one_and_two_ranks(RANKS, runs / "world1", runs / "world2")
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


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["logra", "adam", "lora"])
def test_delta_sync_on_one_and_two_ranks(runs, optimizer, split_rows):
    """--sync delta (the bf16 elements an update changed; the engine keeps no master) on 1 rank
    and on 2, where each rank compares its rows with its shadow and the changes are gathered:
    every sync ends with the engine's fingerprint equal to the trainer's (the run checks, and
    stops otherwise); both send the same bytes at every update (the same changes, gathered)
    and end with the same weights and the same share of elements changed; no delta sends more
    than a full bf16 sync of the targets, headers aside (LoRA's first merge changes most
    elements, on some CPUs every one: such targets go dense, tests/test_sync.py)."""
    args = [*RANKS, "--optimizer", optimizer, "--sync", "delta"]
    one, two = one_and_two_ranks(args, runs / f"delta1-{optimizer}", runs / f"delta2-{optimizer}")
    a, b = model_state(one), model_state(two)
    assert all(torch.equal(a[k], b[k]) for k in a)
    sent = [[r["sync_bytes"] for r in map(json.loads, open(d / "metrics.jsonl")) if "sync_bytes" in r]
            for d in (one, two)]
    full = 2 * sum(d * k for d, k in [(64, 64), (32, 64), (32, 64), (64, 64), (176, 64), (176, 64), (64, 176)]) * 2
    # A payload's header: 40 bytes and a JSON line of at most 400 bytes per target (a name, six
    # numbers, two checksums of at most 20 digits each); one payload per decoder layer.
    headers = 2 * (40 + 7 * 400)
    assert sent[0] == sent[1] and len(sent[0]) == 4 and max(sent[0]) <= full + headers, (sent, full)
    changed = [[r["sync_changed"] for r in map(json.loads, open(d / "metrics.jsonl")) if "sync_bytes" in r]
               for d in (one, two)]
    # The share logged is the share sent: its bf16 values alone are 2 bytes an element of full / 2
    # (none where an update's rollouts all scored alike, all where a first merge changes every
    # element, as on some CPUs).
    assert changed[0] == changed[1] and all(0 <= c <= 1 and c * full <= s for c, s in zip(changed[0], sent[0]))


# Groups of 4 responses per prompt, RLOO's advantages: two groups, one on each rank of two.
GROUPS = [*SMALL, "--updates", "6", "--micro-batch", "4", "--probe-responses", "8", "--save-every", "2",
          "--group-size", "4", "--advantage", "rloo"]


@pytest.mark.slow
def test_groups_one_and_two_processes_and_a_killed_run_agree(runs, split_rows):
    """--group-size 4: a run on 2 ranks, and a run on 1 SIGKILLed after its fourth update and
    continued, end with bitwise the same weights and log the same accuracy and share of flat
    groups at every update (each rank draws its groups' responses from their own seeds)."""
    two, killed = runs / "groups2", runs / "groups1"
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          os.path.join(ROOT, "train.py"), *GROUPS, "--run-dir", str(two)],
                         cwd=ROOT, capture_output=True, text=True, env=env(), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "G 4 (no signal " in out.stdout
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *GROUPS, "--run-dir", str(killed)],
                            cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_rows(killed / "metrics.jsonl", 5)  # base row + 4 updates: checkpoint-2 at least is saved
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    again = run([*GROUPS, "--run-dir", str(killed)])
    assert f"continued {killed} at update " in again.stdout
    a, b = model_state(two), model_state(killed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    base = torch.load(next(runs.glob("base-tiny-*.pt")), weights_only=True)
    assert max((a[k] - base[k]).abs().max().item() for k in a) > 0
    m2, m1 = ([json.loads(line) for line in open(d / "metrics.jsonl")][1:] for d in (two, killed))
    assert [r["update"] for r in m1] == list(range(1, 7))
    assert [(r["accuracy"], r["zero_variance"], r["group_size"]) for r in m1] == \
        [(r["accuracy"], r["zero_variance"], r["group_size"]) for r in m2]
    assert all(r["zero_variance"] in (0.0, 0.5, 1.0) for r in m1)  # 2 groups an update
    assert any(r["zero_variance"] < 1.0 for r in m1)  # some group had a signal: the policy moved on it


def test_a_prompts_responses_sit_on_one_rank_with_their_own_seeds():
    """infra/engine.py's rollout_slots: response j of an update answers prompt j // G; every rank
    holds whole groups; the seeds are distinct and the same on 1, 2 or 4 ranks; G = 1 the paper's."""
    from infra.engine import rollout_slots

    cfg = dict(batch=16, group_size=4, seed=0)
    for update in (0, 3):
        whole = rollout_slots(update, **cfg, world=1, rank=0)
        for world in (2, 4):
            parts = [rollout_slots(update, **cfg, world=world, rank=rank) for rank in range(world)]
            assert [i for p, _ in parts for i in p] == whole[0] and [s for _, q in parts for s in q] == whole[1]
            for prompts, _ in parts:  # whole groups: each prompt 4 times, only on this rank
                assert all(prompts.count(p) == 4 for p in prompts)
        prompts, seeds = whole
        assert prompts == [update * 4 + j // 4 for j in range(16)]
        assert len(set(seeds)) == 16
    assert rollout_slots(2, **dict(cfg, group_size=1), world=1, rank=0)[0] == list(range(32, 48))  # one per prompt


def wait_for_rows(metrics, rows, timeout=240):
    """Until a run's metrics.jsonl has `rows` lines; fails, saying so, after `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.exists() and sum(1 for _ in open(metrics)) >= rows:
            return
        time.sleep(0.01)
    raise AssertionError(f"{metrics} did not reach {rows} rows within {timeout} s")


@pytest.mark.slow
def test_sigterm_saves_and_the_same_command_continues_bitwise(runs):
    """A SIGTERM stops the run at an update, with a checkpoint, exit 75; the same command run
    again continues from it without --resume and ends bitwise where an undisturbed run ends."""
    args = [*SMALL, "--updates", "8", "--save-every", "1"]
    whole, stopped = runs / "whole", runs / "stopped"
    if not (whole / "latest").exists():
        run([*args, "--run-dir", str(whole)])
    args = [*SMALL, "--updates", "8", "--save-every", "4", "--run-dir", str(stopped)]  # the stop saves its own
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_rows(stopped / "metrics.jsonl", 3)  # base row + 2 updates
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, out[-2000:] + err[-2000:]
    line = next(line for line in out.splitlines() if line.startswith("stopped on SIGTERM at update "))
    at = int(line.split()[5].rstrip(":"))
    assert 2 <= at < 8 and open(stopped / "latest").read() == f"checkpoint-{at}"
    assert [json.loads(r)["update"] for r in open(stopped / "metrics.jsonl")] == list(range(at + 1))
    again = run(args)
    assert f"continued {stopped} at update {at} (checkpoint-{at}, verified)" in again.stdout
    a, b = model_state(whole), model_state(stopped)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [json.loads(r)["update"] for r in open(stopped / "metrics.jsonl")] == list(range(9))


@pytest.mark.slow
def test_tensorboard_and_wandb_follow_a_killed_and_continued_run(runs):
    """Every metrics row is a TensorBoard scalar and a W&B row. Killed after update 6 (rows up
    to 6 written, checkpoint-4 saved) and continued from checkpoint-4, the run's event data,
    read back with tensorboard's own reader, holds every update once with the values of the
    final metrics.jsonl, and W&B (offline) wrote one run, resumed, under the same id."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    d = runs / "watched"
    args = [*SMALL, "--updates", "12", "--save-every", "4", "--run-dir", str(d), "--wandb", "logra-tests"]
    watched = env(WANDB_MODE="offline", WANDB_SILENT="true")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT, env=watched,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_rows(d / "metrics.jsonl", 7)  # base row + 6 updates
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    logged = [json.loads(r)["update"] for r in open(d / "metrics.jsonl")]
    saved = read_checkpoint(d)["run"]["update"]
    assert saved < max(logged) < 12, (saved, logged)  # rows beyond the checkpoint: TensorBoard must drop them
    out = run(args, env=watched)
    assert f"continued {d} at update {saved}" in out.stdout
    rows = [json.loads(r) for r in open(d / "metrics.jsonl")]
    assert [r["update"] for r in rows] == list(range(13))
    acc = EventAccumulator(str(d / "tensorboard"))
    acc.Reload()
    for key in ("reward", "kl_pred", "alpha", "mismatch", "time_s"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == list(range(1, 13)), (key, [e.step for e in events])
        want = [float(torch.tensor(r[key], dtype=torch.float32)) for r in rows[1:]]
        assert [e.value for e in events] == want, key
    assert [e.step for e in acc.Scalars("pass1")] == [0]
    run_id = open(d / "wandb-id").read().strip()
    offline = sorted(p.name for p in (d / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(name.endswith(run_id) for name in offline), offline
    assert all(list((d / "wandb" / name).glob("*.wandb")) for name in offline)


@pytest.mark.parametrize("args, extra_env, message", [
    (["--model", "huge"], {}, "invalid choice"),
    (["--rank", "65"], {}, "must be in 1..64"),
    (["--batch", "7"], {"WORLD_SIZE": "2"}, "does not split across 2 ranks"),
])
def test_bad_input_exits_before_work(runs, tmp_path, args, extra_env, message):
    d = tmp_path / "never"
    out = in_process.run([*args, "--run-dir", str(d)], check=False, **extra_env)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert not d.exists()


def test_resume_with_other_configuration_is_refused(runs):
    d = runs / "smoke-logra"
    if not d.exists():
        in_process.run([*SMALL, "--updates", "3", "--run-dir", str(d)])
    before = (d / "latest").stat().st_mtime
    out = in_process.run([*SMALL, "--updates", "5", "--resume", str(d)], check=False)
    assert out.returncode == 2 and "different configuration (updates)" in out.stderr
    assert (d / "latest").stat().st_mtime == before
    out = in_process.run([*SMALL, "--updates", "5", "--run-dir", str(d)], check=False)
    assert out.returncode == 2 and "holds another run (its options differ: updates)" in out.stderr
    assert (d / "latest").stat().st_mtime == before
    out = in_process.run([*SMALL, "--updates", "3", "--run-dir", str(d)])  # the same command: continued, nothing left
    assert f"continued {d} at update 3" in out.stdout and (d / "latest").stat().st_mtime == before


def elastic(args, port, *more):
    """torchrun with 2 ranks and a c10d rendezvous, as the README runs it for restarts: with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (its environment, env()) each restart of every rank
    meets at a fresh store; a shared one keeps the dead ranks' addresses, and gloo tries them."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *more, "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}", os.path.join(ROOT, "train.py"),
            *args]


def two_rank_reference(runs):
    args = [*SMALL, "--updates", "6", "--save-every", "1", "--micro-batch", "4"]
    whole = runs / "whole2"
    if not (whole / "latest").exists():
        out = subprocess.run(elastic([*args, "--run-dir", str(whole)], 29561), cwd=ROOT, capture_output=True,
                             text=True, env=env(), timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
    return args, whole


@pytest.mark.slow
def test_torchrun_restarts_a_killed_rank_and_the_run_ends_bitwise(runs):
    """2 ranks (FSDP2, row-sharded LoGRA state saved as DTensors) under torchrun --max-restarts
    1: one rank SIGKILLed mid-run, torchrun restarts both, they continue from the newest
    checkpoint by themselves and end with bitwise the weights and moments of an undisturbed run."""
    args, whole = two_rank_reference(runs)
    killed = runs / "killed2"
    proc = subprocess.Popen(elastic([*args, "--run-dir", str(killed)], 29562, "--max-restarts", "1"), cwd=ROOT,
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_rows(killed / "metrics.jsonl", 3)  # base row + 2 updates
    rank1 = [pid for pid in workers(str(killed)) if b"LOCAL_RANK=1" in open(f"/proc/{pid}/environ", "rb").read()]
    os.kill(rank1[0], signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    assert f"continued {killed} at update " in out, out[-2000:]
    a, b = model_state(whole), model_state(killed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    moments = read_checkpoint(killed)["optimizer"]["moments"]
    assert all(torch.equal(moments[k], read_checkpoint(whole)["optimizer"]["moments"][k]) for k in moments)


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_both_ranks_at_one_update(runs):
    """torchrun forwards a SIGTERM to both ranks: they agree on one update, both write their
    shards of its checkpoint, and the same command run again ends bitwise where an undisturbed
    run ends."""
    args, whole = two_rank_reference(runs)
    stopped = runs / "stopped2"
    cmd = elastic([*args, "--run-dir", str(stopped)], 29563)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_rows(stopped / "metrics.jsonl", 2)  # base row + 1 update
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    line = next((line for line in out.splitlines() if line.startswith("stopped on SIGTERM at update ")), None)
    assert line, out[-2000:] + err[-3000:]
    at = int(line.split()[5].rstrip(":"))
    manifest = json.load(open(stopped / f"checkpoint-{at}" / "manifest.json"))
    assert at < 6 and manifest["world"] == 2 and {f["rank"] for f in manifest["files"].values()} == {0, 1}
    assert 'train.py", line' not in err  # both ranks stopped cleanly (torchrun's own exit is its own)
    again = subprocess.run(elastic([*args, "--run-dir", str(stopped)], 29564), cwd=ROOT, capture_output=True,
                           text=True, env=env(), timeout=300)
    assert again.returncode == 0 and f"continued {stopped} at update {at}" in again.stdout, again.stderr[-3000:]
    a, b = model_state(whole), model_state(stopped)
    assert all(torch.equal(a[k], b[k]) for k in a)


def workers(marker):
    """The pids of train.py processes (torchrun's workers) whose command line mentions `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if marker.encode() in cmd and any(c.endswith(b"train.py") for c in cmd) and b"torch.distributed.run" not in cmd:
            found.append(int(pid))
    return found


@pytest.mark.slow
def test_a_save_that_runs_out_of_space_stops_with_one_line(runs, tmp_path):
    """The run directory on a 1.4 MB file system: checkpoints 1 and 2 fit, 3 does not. One line
    names the file and the free space, exit 2, and checkpoint-2 (latest) still verifies."""
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs mount namespaces (unshare --mount, as root) to make a small file system")
    d = runs / "small-disk"  # next to the module's cached base policy (on the big disk)
    check = ("import sys; from infra import checkpoint; "
             "p = checkpoint.resume_path(sys.argv[1], None, rank=0, world=1); print('verified', p)")
    script = (f'py="$1"; shift; mkdir -p "$0" && mount -t tmpfs -o size=1400k none "$0" && "$py" train.py "$@" '
              f'--run-dir "$0"; echo "exit $?"; "$py" -c "{check}" "$0"; cat "$0/latest"')
    args = [*SMALL, "--updates", "6", "--save-every", "1"]
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(d),
                          sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=env(), timeout=300)
    lines = [line for line in out.stderr.splitlines() if line.startswith("train.py: error:")]
    assert len(lines) == 1 and "exit 2" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
    assert lines[0].startswith("train.py: error: saving checkpoint-3 failed (rank 0 writing checkpoint-3/__0_0.distcp:")
    assert "MiB free on the file system of" in lines[0] and "checkpoint-2 and latest are as they were" in lines[0]
    assert f"verified {d}/checkpoint-2" in out.stdout and out.stdout.rstrip().endswith("checkpoint-2")
    assert 'train.py", line' not in out.stderr


# --- several nodes: two torchrun "nodes" on this machine (c10d rendezvous on 127.0.0.1) -----------

def nodes_run(runs):
    """The 2 nodes x 1 rank run of RANKS (made once for the module)."""
    d = runs / "nodes"
    if not (d / "latest").exists():
        for code, out, err in two_nodes([*RANKS, "--run-dir", str(d)], 29571, runs):
            assert code == 0, out[-2000:] + err[-4000:]
    return d


@pytest.mark.slow
def test_two_nodes_agree_with_one_node(runs):
    """2 nodes x 1 rank end bitwise where 1 node x 2 ranks ends (and one process): the layout
    changes where the ranks run, not what they compute. config.json and the manifest say how
    the ranks were laid out."""
    d = nodes_run(runs)
    if not (runs / "world2" / "latest").exists():  # test_one_and_two_processes_agree's 2-rank run (the same
        two_ranks(RANKS, runs / "world2")            # shapes on both sides here: no premise of the machine's)
    a, b = model_state(d), model_state(runs / "world2")
    assert all(torch.equal(a[k], b[k]) for k in a)
    layout = {"nodes": 2, "ranks_per_node": 1, "world": 2, "engine_gpus": []}
    assert json.load(open(d / "config.json"))["layout"] == layout
    assert json.load(open(d / "checkpoint-4" / "manifest.json"))["layout"] == layout
    assert json.load(open(runs / "world2" / "config.json"))["layout"]["ranks_per_node"] == 2


@pytest.mark.slow
def test_resume_on_other_numbers_of_ranks(runs, tmp_path, split_rows):
    """The 2-rank run resumed from checkpoint-2 on 1 process ends bitwise equal to it (one and
    two processes sum the sketches in the same order); on 4 ranks, whose micro-batches are half
    as long (other sums), it continues to within float rounding. Each update is logged once.
    The engine starts from the run directory's own copy of the base policy (infra/policy.py), so
    a copied run directory resumes from the bits it was trained from."""
    d = nodes_run(runs)
    final = model_state(d)
    halfway = read_checkpoint(d, "checkpoint-2")["model"]
    moved = max((final[k] - halfway[k]).abs().max().item() for k in final)
    for ranks in (1, 4):
        again = tmp_path / f"on{ranks}"
        shutil.copytree(d, again)
        args = [*RANKS, "--resume", str(again), "--resume-from", "checkpoint-2"]
        if ranks == 1:
            out = run(args)
        else:
            out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
                                  "--master_port", "29573", os.path.join(ROOT, "train.py"), *args], cwd=ROOT,
                                 capture_output=True, text=True, env=env(), timeout=300)
            assert out.returncode == 0, out.stdout + out.stderr
        assert (f"resumed {again} at update 2 (checkpoint-2, verified; written by 2 nodes x 1 training rank, now "
                f"1 node x {ranks} training rank") in out.stdout
        assert [json.loads(line)["update"] for line in open(again / "metrics.jsonl")] == [0, 1, 2, 3, 4]
        state = model_state(again)
        diff = max((state[k] - final[k]).abs().max().item() for k in final)
        print(f"resumed on {ranks} rank(s): max |dW| {diff:.2e} against the 2-rank run, update 2->4 {moved:.2e}")
        if ranks == 1:
            assert all(torch.equal(state[k], final[k]) for k in final)
        else:
            assert diff < 1e-6 < 1e-3 * moved, (diff, moved)  # rounding, where the updates moved ~1e-3


def files(folder):
    """Every file under a folder: its bytes and its mtime (a folder's own mtime may change: the
    probe's files come and go)."""
    return {os.path.relpath(os.path.join(f, n), folder): (open(os.path.join(f, n), "rb").read(),
                                                          os.stat(os.path.join(f, n)).st_mtime_ns)
            for f, _, names in os.walk(folder) for n in names}


@pytest.mark.slow
def test_a_run_dir_the_nodes_do_not_share_is_refused_on_every_node(runs, tmp_path):
    """Node 1 in its own mount namespace sees an empty folder where node 0 sees the runs: a new
    run and a resume both stop on both nodes with one line and exit code 2, within a bound,
    and nothing on node 0's side changes (no config, no checkpoint)."""
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs mount namespaces (unshare --mount, as root) to give one node its own file system")
    mounted = tmp_path / "mounted"
    shutil.copytree(nodes_run(runs), mounted / "old")
    for port, args in ((29575, ["--run-dir", str(mounted / "new")]),
                       (29576, ["--resume", str(mounted / "old"), "--resume-from", "checkpoint-2"])):
        before = files(mounted)
        t0 = time.monotonic()
        # The nodes look for each other's probe files for 2 s, not 10: this machine's are at once.
        results = two_nodes([*RANKS, *args], port, tmp_path, own_mount=mounted, timeout=240,
                            environ=env(LOGRA_PROBE_WAIT_S="2"))
        elapsed = time.monotonic() - t0
        for code, out, err in results:
            lines = [line for line in err.splitlines() if line.startswith("train.py: error:")]
            assert len(lines) == 1 and "is not one folder shared by every node" in lines[0], err[-3000:]
            assert "exitcode  : 2" in err  # torchrun's report of its worker's exit code
            assert 'train.py", line' not in err  # no traceback from train.py
        assert files(mounted) == before and sorted(os.listdir(mounted)) == ["old"]
        print(f"{args[0]}: refused on both nodes in {elapsed:.0f} s")
        assert elapsed < 200


def test_alpha_at_its_cap_is_said_once(runs):
    """An update_ratio far too small for the budget pins alpha at its cap: after 5 updates in a
    row the log says so once, naming --update-ratio (the smoke run, at the preset's, does not)."""
    out = in_process.run([*SMALL, "--updates", "7", "--update-ratio", "1e-9", "--run-dir", str(runs / "capped")])
    lines = [line for line in out.stdout.splitlines() if "at its cap" in line]
    assert len(lines) == 1 and "for 5 updates in a row" in lines[0] and "--update-ratio" in lines[0], lines


# -----------------------------------------------------------------------------
# The engine's outputs, checked after a sync (infra/engine_sync.py, check_outputs)

def test_the_output_check_is_on_by_default_on_gpus_only():
    """Every sync's on a GPU preset, none on a CPU one, whatever the flag says otherwise."""
    import train
    from infra import options

    def every(*argv):
        return options.resolve(*options.parse(list(argv), train.PRESETS), train.PRESETS).check_outputs

    assert [every("--model", m) for m in ("tiny", "smoke-0.5b", "7b", "smollm2-cpu")] == [0, 1, 1, 0]
    assert every("--model", "7b", "--check-outputs", "5") == 5 and every("--check-outputs", "2") == 2
    assert every("--model", "7b", "--check-outputs", "0") == 0 and every("--device", "cuda") == 1


def test_the_output_check_passes_and_changes_nothing(runs, monkeypatch):
    """--check-outputs 1 on a correct run: every sync's check passes, far within the tolerance, and
    the run is bitwise the run without it: the same metrics but times and memory (rollouts,
    rewards, log-prob gaps, KL), the same final weights. The check's samples have their own
    seeds; its forward takes no gradient."""
    from infra import engine_sync

    gaps = []
    check = engine_sync.check_outputs
    monkeypatch.setattr(engine_sync, "check_outputs", lambda *a, **kw: gaps.append(check(*a, **kw)) or gaps[-1])
    rows, weights = {}, {}
    for every in (1, 0):
        d = runs / f"check-outputs-{every}"
        in_process.run([*SMALL, "--updates", "3", "--check-outputs", str(every), "--run-dir", str(d)])
        rows[every] = [{k: v for k, v in json.loads(line).items()
                        if not k.startswith("time") and k not in ("mem_gib", "tokens_per_s")}
                       for line in open(d / "metrics.jsonl")]
        weights[every] = model_state(d)
    print(f"output check of a correct sync (tiny preset, HF engine): mean gaps {[f'{g:.2e}' for g in gaps]}")
    assert len(gaps) == 3 and all(0 < g < engine_sync.OUTPUT_TOLERANCE / 10 for g in gaps), gaps
    assert rows[1] == rows[0] and len(rows[0]) == 4
    assert weights[1].keys() == weights[0].keys() and all(torch.equal(weights[1][k], weights[0][k]) for k in weights[0])


class StaleEngine(HFEngine):
    """A fault: every sync reaches the engine's weights (its fingerprints agree with the
    trainer's), but its forward reads a copy of the weights it started with, as vLLM's kernels
    would read a repacked or captured copy that no sync refreshes."""

    def __init__(self, model, **kw):
        super().__init__(model, **kw)
        self.stale = copy.deepcopy(self.model)

    def generate(self, *args, **kw):
        synced, self.model = self.model, self.stale
        try:
            return super().generate(*args, **kw)
        finally:
            self.model = synced


def test_an_engine_whose_forward_reads_stale_weights_stops_the_run(runs, monkeypatch):
    """The stale engine passes every fingerprint check; the output check stops the run, once the
    trainer has moved (a step ten times the preset's), in one line that names the update, the
    gap, the tolerance and the likely cause (exit 1); the updates before it were recorded."""
    import train

    monkeypatch.setattr(train, "HFEngine", StaleEngine)
    d = runs / "stale-engine"
    out = in_process.run([*SMALL, "--updates", "8", "--update-ratio", "2e-2", "--kl-start", "0.2", "--kl-end", "0.05",
                          "--check-outputs", "1", "--run-dir", str(d)], check=False)
    assert out.returncode == 1, out.stdout + out.stderr
    line = out.stderr.strip()
    assert "\n" not in line and line.startswith("train.py: engine error: after update "), line
    assert "tolerance 0.2) while their weights' fingerprints agree" in line and "kernels read" in line, line
    failed = int(line.split("after update ")[1].split()[0])
    rows = [json.loads(line) for line in open(d / "metrics.jsonl")]
    assert 1 < failed <= 8 and [r["update"] for r in rows] == list(range(failed)), (failed, rows)
    print(line)
