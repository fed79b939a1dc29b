"""What a run writes down (metrics.py): the log's rows back as written, the line per update,
the run summary from rows written out here, and curves.png."""

import errno
import json
import math
import os

import pytest

from infra import metrics

ROW = {"update": 3, "reward": 0.5, "kl_pred": 1.5e-3, "kl_real": 1.25e-3, "alpha": 0.75, "budget": 2e-3,
       "mismatch": 2.5e-4, "mem_gib": 0.5, "time_s": 0.25, "logp_gap_mean": 1e-3, "logp_gap_max": 0.5}


def test_rows_come_back_and_a_first_row_starts_the_log(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    metrics.append(path, {"update": 9})  # a stale row of an abandoned run
    metrics.append(path, {"update": 0, "pass1": 0.25}, first=True)
    metrics.append(path, ROW)
    assert metrics.read(path) == [{"update": 0, "pass1": 0.25}, ROW]


def test_a_disk_that_fills_inside_a_row_leaves_the_rows_before_it(tmp_path, monkeypatch):
    """The disk fills half way through a row (the kernel takes part of the line, then refuses
    the rest): the row is cut back off and the error raised, so the log holds only whole rows
    (tests/test_operator.py fills a real tmpfs; here the partial write happens every time)."""
    path = str(tmp_path / "metrics.jsonl")
    metrics.append(path, {"update": 0, "pass1": 0.25}, first=True)
    write = os.write

    def part(fd, data):  # half of the line goes in, then the disk is full
        monkeypatch.setattr(os, "write", full)
        return write(fd, bytes(data[:len(data) // 2]))

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", part)
    with pytest.raises(OSError, match="No space"):
        metrics.append(path, ROW)
    monkeypatch.setattr(os, "write", write)
    assert open(path).read() == '{"update": 0, "pass1": 0.25}\n'
    metrics.append(path, ROW)  # space again: the next row follows the whole ones
    assert metrics.read(path) == [{"update": 0, "pass1": 0.25}, ROW]


def test_step_line():
    assert metrics.step_line(ROW) == ("step 3 | reward 0.500 | kl 1.50e-03 (real 1.25e-03) | alpha 0.75 | "
                                      "budget 2.00e-03 | mismatch 2.5e-04 | mem 0.50 GiB | 250 ms")
    assert "| pass@1 0.625 |" in metrics.step_line(dict(ROW, pass1=0.625))


def test_summary():
    rows = [{"update": 0, "pass1": 0.25}, dict(ROW, update=1, mem_gib=0.5, time_s=0.5),
            dict(ROW, update=2, pass1=0.75, mem_gib=1.0, time_s=1.5, logp_gap_mean=3e-3, logp_gap_max=0.25)]
    assert metrics.summary(rows, heldout=8, engine="hf") == [
        "held-out pass@1: base 0.250 -> final 0.750 (+50.0 points, 8 problems)",
        "engine vs trainer log-prob per response token: mean gap 2.00e-03, max 5.00e-01 (hf engine)",
        "memory per update: average 0.75 GiB, peak 1.00 GiB; 3600 updates/h"]
    grouped = [rows[0], *(dict(r, group_size=4, zero_variance=z) for r, z in zip(rows[1:], (0.25, 0.5)))]
    assert metrics.summary(grouped, heldout=8, engine="hf")[2] == \
        "groups of 4 responses per prompt: 38% on average were equally rewarded (no signal), 50% at most"
    assert "| G 4 (no signal 25%) |" in metrics.step_line(grouped[1])
    assert "| G " not in metrics.step_line(dict(ROW, group_size=1))  # the paper's one response: not shown


def test_plot(tmp_path):
    if metrics.pyplot() is None:
        pytest.fail("matplotlib is part of the test set-up (the plot extra)")
    path = str(tmp_path / "curves.png")
    assert metrics.plot([{"update": 0, "pass1": 0.25}, ROW, dict(ROW, update=4, kl_real=math.nan)], path)
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 1000


def test_rows_are_strict_json_and_each_method_shows_its_own_quantities(tmp_path):
    path = str(tmp_path / "m.jsonl")
    adam = {"update": 1, "reward": 0.5, "kl_pred": math.nan, "kl_real": math.nan, "alpha": math.nan, "lr": 1e-4,
            "budget": math.inf, "mismatch": 1e-3, "mem_gib": 0.5, "time_s": 0.02}
    metrics.append(path, adam, first=True)

    def refuse(token):
        raise ValueError(f"not strict JSON: {token}")

    row = json.loads(open(path).read(), parse_constant=refuse)  # NaN, Infinity: refused
    assert row["kl_pred"] is None and row["budget"] is None and row["lr"] == 1e-4
    assert metrics.step_line(row) == "step 1 | reward 0.500 | lr 1.00e-04 | mismatch 1.0e-03 | mem 0.50 GiB | 20 ms"
    logra = dict(adam, kl_pred=1.9e-4, kl_real=2.0e-4, alpha=0.8, budget=2e-4, lr=None)
    assert "| kl 1.90e-04 (real 2.00e-04) | alpha 0.80 | budget 2.00e-04 |" in metrics.step_line(logra)


def test_progress_in_a_log_file_is_a_plain_line_now_and_then(capsys):
    bar = metrics.Progress(4, "warm-up steps", every=0.0)  # pytest's stderr is no terminal
    for _ in range(4):
        bar.update()
    bar.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("warm-up steps: 1/4 (25%), ") and "s left" in lines[0]
    assert lines[3].startswith("warm-up steps: 4/4 (100%), ") and "left" not in lines[3]
    quiet = metrics.Progress(4, "other ranks", every=0.0, enabled=False)
    quiet.update(4)
    quiet.close()
    assert capsys.readouterr().out == ""
