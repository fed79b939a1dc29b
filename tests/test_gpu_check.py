"""bench/gpu_check.sh, the prepared device check, runs to its end on this CPU at small widths
(`--cpu`), every step ok; its records, a step that overran, and the table built from them."""

import json
import os
import subprocess
import sys

import pytest

from subproc import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import gpu_check  # noqa: E402


@pytest.mark.slow
def test_the_device_check_runs_to_its_end_on_the_cpu(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_check.sh"), "--cpu", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith(("ok ", "FAIL "))]
    assert [line.split()[:2] for line in lines] == [["ok", step] for step in gpu_check.STEPS], out.stdout[-3000:]
    assert out.returncode == 0 and f"0 of {len(gpu_check.STEPS)} steps failed" in out.stdout
    records = json.load(open(tmp_path / "gpu_check.json"))
    assert [r["step"] for r in records] == gpu_check.STEPS and all(r["ok"] for r in records)
    by_step = {r["step"]: r["figures"] for r in records}
    # what the steps measured, not only that they ended
    assert by_step["kernels"]["sketch_rel_err"] < 1e-2 and by_step["kernels"]["merge_differing"] == 0
    assert all(v["merge_differing"] == 0 for v in by_step["merge_bitwise"].values())
    assert by_step["probe"]["kl1_rel_diff"] < 2e-2 and by_step["probe"]["peak_over_plan"] <= 1.1
    assert by_step["train"]["updates"] == 3 and any(n > 0 for n in by_step["train"]["sketch_norm"])
    assert by_step["kernels"]["sketch_rel_err"] < 2 * by_step["kernels"]["sketch_rel_err_fp32_product"]
    assert all(v["signs_equal"] for v in by_step["merge_bitwise"].values())
    # speed: both methods' phases, every one timed; depth7b: both methods' updates at full depth
    speed, depth = by_step["speed"], by_step["depth7b"]
    assert speed["logra_nonzero_sketches"] > 0 and speed["logra_phases_s"]["probe"] > 0
    assert speed["adam_phases_s"]["probe"] == 0 and speed["logra_sync_mib"] < speed["adam_sync_mib"]
    assert depth["shape"].startswith("28 layers") and depth["logra_kl1"] > 0 and depth["logra_moved"] > 0
    assert set(depth["logra_phases_s"]) == {"train", "prepare", "probe", "merge", "kl_real"}
    assert set(depth["adam_phases_s"]) == {"train", "step"} and not depth["adam_oom"]
    check_one_gpu_steps(by_step)  # issue 72's two steps, and the tables built from them
    tables = gpu_check.speed_table(str(tmp_path / "gpu_check.json"))
    assert "| AdamW | off | 2 x 64 | skipped (plan) |" in tables and "`one_gpu7b` (gpu_check.json): train.py" in tables


def check_one_gpu_steps(by_step):
    """What best7b and one_gpu7b measured at the CPU's shapes (their rehearsal budget skips AdamW
    without checkpointing, as an H200's memory does at 7B)."""
    best, one = by_step["best7b"], by_step["one_gpu7b"]
    settings = {(e["method"], e["checkpointing"]): e for e in best["settings"]}
    assert sorted(settings) == [("adam", "off"), ("adam", "on"), ("logra", "off"), ("logra", "on")]
    assert settings["adam", "off"].get("skipped") and "update_s" not in settings["adam", "off"]
    assert all(e["update_s"] > 0 and e["plan_gib"] > 0 for k, e in settings.items() if k != ("adam", "off"))
    assert best["logra_best_update_s"] == min(settings["logra", c]["update_s"] for c in ("on", "off"))
    assert best["adam_best_update_s"] == settings["adam", "on"]["update_s"]
    assert one["updates"] == 3 and one["engine_equal"] is True and one["sync_bytes"] == 0
    assert one["engine_equal_moved"] > 0 and one["engine_equal_target"]  # a factor-merged copy that moved
    assert one["output_check"]["passed"] and one["output_check"]["checks"] == 3 and one["plan_gib"] >= 0
    assert one["generated_tokens_per_s"] > 0 and set(one["phases_s"]) == set(gpu_check.PHASES)


def test_a_failed_step_is_recorded_and_the_table_says_what_did_not_run(tmp_path, capsys):
    gpu_check.record(str(tmp_path), "versions", True, {"torch": "2.11.0"}, 3.2)
    gpu_check.record(str(tmp_path), "cuda", False, {"error": "no end within 60 s (killed)"}, 0.0)
    assert capsys.readouterr().out.splitlines() == ['ok versions {"torch": "2.11.0"}',
                                                    'FAIL cuda {"error": "no end within 60 s (killed)"}']
    table = gpu_check.table(str(tmp_path / "gpu_check.json"))
    assert table.startswith("Run by `bash bench/gpu_check.sh` on an unknown device (torch 2.11.0)")
    assert "| versions | ok | 3 s | torch 2.11.0 |" in table
    assert "| cuda | **FAIL** | 0 s | error no end within 60 s (killed) |" in table
    assert ("not run (the check was cut short): kernels, merge_bitwise, engine_weights, probe, fsdp2, train, speed, "
            "depth7b, best7b, one_gpu7b") in table


def test_a_step_that_raises_is_a_fail_line_and_the_next_step_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(gpu_check.CPU, "inter", 0)  # a projection of width 0 is refused: the step raises
    assert not gpu_check.run_step("merge_bitwise", True, str(tmp_path))
    assert gpu_check.run_step("versions", True, str(tmp_path))
    assert [r["ok"] for r in json.load(open(tmp_path / "gpu_check.json"))] == [False, True]
    assert capsys.readouterr().out.startswith("FAIL merge_bitwise {\"error\": ")
