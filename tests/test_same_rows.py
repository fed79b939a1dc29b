"""bench/same_rows.py's comparison of two runs' metrics.jsonl rows (issue 71 item 4), on rows made
by hand: no train.py runs here."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import same_rows  # noqa: E402

BASE = {"update": 0, "start": "4668880036a74e3d", "pass1": 0.318359375, "eval_texts": [{"question": "1+2=", "score": 1.0}]}
STEP = {"update": 1, "reward": 0.43187499046325684, "alpha": 3.0, "lr": None, "state_mib": 0.335693359375,
        "mem_gib": 0.4516, "tokens_per_s": 910.6, "time_rollout": 0.196, "time_s": 0.302}


def rows(**changes):
    """The two hand-made rows, `changes` applied to the update's row."""
    return [dict(BASE), {**STEP, **changes}]


def test_equal_rows_pass():
    result = same_rows.compare(rows(), rows())
    assert result["first"] is None and result["differing"] == 0 and same_rows.describe(result) == "all equal"
    assert result["rows"] == 2 and result["values"] == len(BASE) + len(STEP) - 4  # four ignored fields
    assert result["fields"] == len(set(BASE) | set(STEP)) - 4


def test_a_differing_float_is_reported_with_its_row_and_field():
    result = same_rows.compare(rows(), rows(reward=0.4318749904632569))
    assert result["differing"] == 1 and result["first"] == (1, 1, "reward", 0.43187499046325684, 0.4318749904632569)
    assert "row 1 (update 1), `reward`" in same_rows.describe(result)


def test_floats_are_compared_as_written(tmp_path):
    """1.0 and 1 are the same number but not the same JSON; read_rows keeps a float's text."""
    for name, value in (("a", "1.0"), ("b", "1")):
        (tmp_path / name).write_text(json.dumps(BASE) + "\n" + json.dumps(STEP)[:-1] + f', "x": {value}}}\n')
    a, b = same_rows.read_rows(tmp_path / "a"), same_rows.read_rows(tmp_path / "b")
    assert a[1]["reward"] == "0.43187499046325684"
    assert same_rows.compare(a, b)["first"] == (1, 1, "x", "1.0", 1)


def test_times_rates_and_memory_are_ignored_state_bytes_are_not():
    changed = rows(time_rollout=9.0, time_s=9.0, time_eval=2.0, tokens_per_s=1.0, mem_gib=3.0)
    assert same_rows.compare(rows(), changed)["first"] is None
    assert same_rows.compare(rows(), rows(state_mib=0.5))["first"][2] == "state_mib"


def test_a_missing_row_or_field_is_reported():
    result = same_rows.compare(rows(), rows()[:1])
    assert result["rows"] == 1 and result["first"] == (1, 1, "(the whole row)", "row", same_rows.ABSENT)
    fewer = rows()
    del fewer[1]["alpha"]
    assert same_rows.compare(rows(), fewer)["first"] == (1, 1, "alpha", 3.0, same_rows.ABSENT)
    assert same_rows.compare(fewer, rows())["first"] == (1, 1, "alpha", same_rows.ABSENT, 3.0)
