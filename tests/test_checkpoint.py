"""Verified checkpoints (checkpoint.py, as train.py runs them, in this process): damaged files
refused by name with nothing changed, the previous checkpoint offered and bitwise resumable;
2 ranks refusing together (the slow tier)."""

import hashlib
import json
import os
import shutil
import tempfile
import tomllib

import pytest
import torch

import in_process
import kl_control
import ppo
import sketch
import tiny_families
from infra import checkpoint, lifecycle
from distributed import run_gloo
from subproc import ROOT

# One short run, saved after every update (4 updates, --keep 2: checkpoint-3 and checkpoint-4
# remain), from the tiny preset's base policy (shipped for seed 0: conftest.runs), right about a
# third of the time: with a batch of 32 every update holds right and wrong answers (all wrong
# has a chance of 0.7^32, 1e-5), so the weights move before checkpoint-3 and again after it.
ARGS = ["--batch", "32", "--eval-problems", "16", "--eval-every", "0", "--rank", "8", "--updates", "4",
        "--save-every", "1"]


def snapshot(run_dir):
    """Every file and folder under a run directory: its bytes and its mtime."""
    out = {}
    for folder, dirs, files in os.walk(run_dir):
        for name in dirs + files:
            path = os.path.join(folder, name)
            data = open(path, "rb").read() if os.path.isfile(path) else None
            out[os.path.relpath(path, run_dir)] = (data, os.stat(path).st_mtime_ns)
    return out


def gathered(checkpoint):
    """A DCP checkpoint folder gathered into one dict (by torch's own converter)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(checkpoint, os.path.join(tmp, "c.pt"))
        return torch.load(os.path.join(tmp, "c.pt"), weights_only=False)


def flip(path, where=None):
    data = bytearray(open(path, "rb").read())
    i = len(data) // 2 if where is None else where
    data[i] ^= 0x01
    open(path, "wb").write(bytes(data))


def truncate(path):
    os.truncate(path, os.path.getsize(path) // 2)


@pytest.fixture(scope="module")
def run(runs):
    """The one real run of this module (in this process). Copies sit next to it: the warm-up's
    cache (base-tiny-*.pt) is looked up beside the run directory."""
    d = runs / "ckpt"
    in_process.run([*ARGS, "--run-dir", str(d)])
    return d


def copy_of(run, name):
    d = run.parent / name
    shutil.copytree(run, d)
    return d


def resume_in_process(run_dir, *extra):
    """train.main(--resume) in this process: it must stop (exit 2) before the model exists."""
    out = in_process.run([*ARGS, "--resume", str(run_dir), *extra], check=False)
    return out.returncode, out.stderr


def test_project_version_is_pyprojects():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        assert checkpoint.PROJECT_VERSION == tomllib.load(f)["project"]["version"]


def test_manifest_covers_every_file_and_keeps_two(run):
    assert sorted(checkpoint.checkpoints(run)) == ["checkpoint-3", "checkpoint-4"]  # --keep 2 (the default)
    assert open(run / "latest").read() == "checkpoint-4"  # the bare name, as scripts read it
    for name in ("checkpoint-3", "checkpoint-4"):
        manifest = json.load(open(run / name / "manifest.json"))
        assert manifest["version"] == "0.1.0" and manifest["update"] == int(name.split("-")[1])
        files = set(os.listdir(run / name)) - {"manifest.json"}
        assert set(manifest["files"]) == files == {".metadata", "__0_0.distcp"}
        for f in files:  # hashlib over the whole file: a reference independent of the chunked reads
            data = open(run / name / f, "rb").read()
            assert manifest["files"][f] == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "rank": 0}
        assert checkpoint.check_checkpoint(str(run), name, 0, 1) is None


@pytest.mark.parametrize("file", ["checkpoint-4/__0_0.distcp", "checkpoint-4/.metadata",
                                  "checkpoint-4/manifest.json", "latest"])
@pytest.mark.parametrize("damage", [flip, truncate])
def test_damaged_checkpoint_is_refused_and_nothing_changes(run, file, damage):
    d = copy_of(run, f"{damage.__name__}-{file.replace('/', '-')}")
    damage(d / file)
    before = snapshot(d)
    code, err = resume_in_process(d)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"train.py: error: --resume {d}: ")
    if file == "latest":  # the pointer names no checkpoint; the newest one itself is sound
        assert "latest is damaged" in err and f"checkpoint-4 verifies: resume from it with --resume {d} " \
                                               f"--resume-from checkpoint-4" in err
    else:
        assert f"{file} " in err and f"checkpoint-3 verifies: resume from it with --resume {d} " \
                                      f"--resume-from checkpoint-3" in err
    assert snapshot(d) == before


def test_every_changed_byte_of_manifest_and_pointer_is_caught(run):
    """Not only the middle byte: each byte of manifest.json, and each of `latest`, changed in turn
    (among them JSON whitespace and the digit of the pointer)."""
    d = copy_of(run, "every-byte")
    raw = open(d / "checkpoint-4" / "manifest.json", "rb").read()
    for i in range(len(raw)):
        flip(d / "checkpoint-4" / "manifest.json", i)
        assert checkpoint.read_manifest(str(d / "checkpoint-4"))[1] is not None, i
        flip(d / "checkpoint-4" / "manifest.json", i)  # and back
    kept = checkpoint.checkpoints(str(d))
    for i in range(len("checkpoint-4")):
        flip(d / "latest", i)
        assert checkpoint.read_pointer(str(d), kept)[1] is not None, i
        flip(d / "latest", i)
    assert checkpoint.read_pointer(str(d), kept) == ("checkpoint-4", None)
    # A pointer moved back to an existing older checkpoint is caught too: the newer one has a manifest.
    (d / "latest").write_text("checkpoint-3")
    code, err = resume_in_process(d)
    assert code == 2 and "latest names checkpoint-3 but checkpoint-4 is newer" in err


def test_previous_checkpoint_is_offered_and_resumes_bitwise(run):
    """End to end: train.py refuses the damaged newest checkpoint and names the previous one;
    resumed from it, the run ends with bitwise the weights and moments of the uninterrupted run."""
    d = copy_of(run, "resume-previous")
    flip(d / "checkpoint-4" / "__0_0.distcp")
    before = snapshot(d)
    out = in_process.run([*ARGS, "--resume", str(d)], check=False)
    assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1, out.stderr
    assert "checkpoint-4/__0_0.distcp does not match its sha256" in out.stderr
    assert f"--resume {d} --resume-from checkpoint-3" in out.stderr
    assert snapshot(d) == before
    out = in_process.run([*ARGS, "--resume", str(d), "--resume-from", "checkpoint-3"])
    assert f"resumed {d} at update 3 (checkpoint-3, verified)" in out.stdout
    whole, resumed, previous = (gathered(p / c) for p, c in ((run, "checkpoint-4"), (d, "checkpoint-4"),
                                                            (run, "checkpoint-3")))
    base = torch.load(next(run.parent.glob("base-tiny-*.pt")), weights_only=True)
    # The test can fail: the weights moved before checkpoint-3 and again in update 4.
    assert any(not torch.equal(previous["model"][k], base[k]) for k in base)
    assert any(not torch.equal(previous["model"][k], whole["model"][k]) for k in base)
    assert all(torch.equal(whole["model"][k], resumed["model"][k]) for k in whole["model"])
    moments = whole["optimizer"]["moments"]
    assert all(torch.equal(moments[k], resumed["optimizer"]["moments"][k]) for k in moments)
    assert open(d / "latest").read() == "checkpoint-4" and checkpoint.check_checkpoint(str(d), "checkpoint-4", 0, 1) is None
    # metrics.jsonl: one row per update, the update run again logged once, as in the uninterrupted run
    rows = [json.loads(line) for line in open(d / "metrics.jsonl")]
    assert [r["update"] for r in rows] == list(range(5))
    whole_rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["reward"] for r in rows[1:]] == [r["reward"] for r in whole_rows[1:]]


def test_a_checkpoint_of_the_first_projection_is_refused(run, monkeypatch):
    """A checkpoint saved before projections had versions (RowAdam's state without `projection`,
    i.e. projection 1: sketch.py) is refused in one line naming the version (exit 2), and so is a
    later projection than this release knows, with nothing changed."""
    import rowadam

    saved = rowadam.RowAdam.state_dict
    monkeypatch.setattr(rowadam.RowAdam, "state_dict", lambda self: {
        k: v for k, v in saved(self).items() if k != "projection"})  # as a release before the versions saved it
    d = run.parent / "first-projection"
    in_process.run([*ARGS, "--run-dir", str(d)])
    monkeypatch.undo()
    assert "optimizer.projection" not in checkpoint.saved_keys(str(d / "checkpoint-3"))
    before = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
    out = in_process.run([*ARGS, "--resume", str(d), "--resume-from", "checkpoint-3"], check=False)
    said = [line for line in out.stderr.splitlines() if "projection 1" in line]
    assert out.returncode == 2 and len(said) == 1 and "saved under projection 1" in said[0], (out.stdout, out.stderr)
    assert {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()} == before  # metrics, latest, config
    # A state of projection 1 or of a later release is refused before anything changes.
    opt = rowadam.RowAdam(sketch.attach(tiny_families.model("qwen2"), rank=4, seed=0))
    for version in (1, 3):
        with pytest.raises(ValueError, match=f"saved under projection {version}; this release makes A by projection 2"):
            opt.load_state_dict(dict(opt.state_dict(), projection=version, update=7))
        assert opt.update == 0


def test_other_version_and_other_configuration_are_refused(run):
    d = copy_of(run, "other-version")
    body = json.load(open(d / "checkpoint-4" / "manifest.json"))
    body.pop("manifest_sha256")
    (d / "checkpoint-4" / "manifest.json").write_bytes(checkpoint.manifest_bytes(dict(body, version="0.0.9")))
    before = snapshot(d)
    code, err = resume_in_process(d)
    assert code == 2 and "checkpoint-4 was written by LoGRA 0.0.9 and this is LoGRA 0.1.0" in err
    code, err = resume_in_process(d, "--updates", "5")
    assert code == 2 and "different configuration (updates)" in err
    code, err = resume_in_process(d, "--resume-from", "checkpoint-9")
    assert code == 2 and f"{d} holds no checkpoint-9" in err
    assert snapshot(d) == before


# --- 2 ranks --------------------------------------------------------------------------------

def _two_ranks(rank, world, run_dir):
    """On 2 gloo ranks: two checkpoints through checkpoint.save of lifecycle.run_state, of a small
    FSDP2-sharded stand-in model and its AdamW state (the files are under test here, not the
    values; a Qwen2 would add seconds of imports per process); then rank 1's shard of the newer
    one damaged, and the resume's verification (checkpoint.resume_path, as train.main calls it)
    on both ranks. Each rank writes down how it stopped."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 16)).sum().backward()
    opt.step()  # AdamW's moments exist, row-sharded like the weights
    for update in (1, 2):
        state = lifecycle.run_state(model, opt, False, ppo.RunningBaseline(weight=0.1),
                                    kl_control.Mismatch(momentum=0.7), update)
        checkpoint.save(run_dir, state, update, rank=rank, world=world)
    if rank == 0:
        flip(os.path.join(run_dir, "checkpoint-2", "__1_0.distcp"))
        before = snapshot(run_dir)
    dist.barrier()
    message = None
    try:
        checkpoint.resume_path(run_dir, None, rank=rank, world=world)
    except checkpoint.CheckpointError as e:
        message = str(e)
    dist.barrier()
    result = {"message": message, "unchanged": snapshot(run_dir) == before if rank == 0 else None}
    with open(f"{run_dir}-rank{rank}.json", "w") as f:
        json.dump(result, f)


@pytest.mark.slow
def test_two_ranks_refuse_a_damaged_shard_of_rank_1(tmp_path):
    d = tmp_path / "two"
    d.mkdir()
    run_gloo(_two_ranks, 2, str(d))
    manifest = json.load(open(d / "checkpoint-2" / "manifest.json"))
    # The manifest holds both ranks' shards, each hashed by the rank that wrote it.
    assert {f: e["rank"] for f, e in manifest["files"].items()} == {".metadata": 0, "__0_0.distcp": 0,
                                                                   "__1_0.distcp": 1}
    results = [json.load(open(f"{d}-rank{r}.json")) for r in (0, 1)]
    refusal = (f"--resume {d}: checkpoint-2/__1_0.distcp does not match its sha256 in "
               f"checkpoint-2/manifest.json (damaged); checkpoint-1 verifies: resume from it with --resume {d} "
               f"--resume-from checkpoint-1")
    # Rank 1 found it; rank 0, whose own files are sound, refuses with the same line.
    assert all(r["message"] == refusal for r in results), results
    assert results[0]["unchanged"]
    shard = d / "checkpoint-2" / "__1_0.distcp"
    flip(shard)  # back as it was written: then it matches (hashlib over the whole file)
    assert manifest["files"]["__1_0.distcp"]["sha256"] == hashlib.sha256(shard.read_bytes()).hexdigest()
