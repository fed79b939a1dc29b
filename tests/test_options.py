"""The configuration and its command line (infra/options.py, through planning.configure as
train.py runs it): every option value is either accepted or refused in one line with exit code
2, never a traceback, and values that no run can take are always refused; the presets are
Configs, and --help lists every field."""

import contextlib
import io
import json
import math
import os
import re
import sys
import tempfile
from unittest import mock

import pytest
from hypothesis import example, given, settings, strategies as st

import train
from infra import options, planning
from infra.errors import RunError


def test_rank_flag_is_the_sketch_rank():
    """--rank (the paper's word) sets the config's sketch_rank; the process rank is another thing."""
    cfg = resolve(["--rank", "8"])
    assert cfg.sketch_rank == 8 and not hasattr(cfg, "rank")


def resolve(argv):
    return options.resolve(*options.parse(argv, train.PRESETS), train.PRESETS)


INTS = [f.name for f in options.KNOBS if f.type is int] + ["keep"]
FLOATS = [f.name for f in options.KNOBS if f.type is float]
# The least sound value of each count (written out here, not read from options.py).
SMALLEST = {"sketch_rank": 1, "batch": 1, "micro_batch": 1, "updates": 1, "kl_horizon": 2, "probe_responses": 1,
            "probe_tokens": 0, "kl_real_positions": 0, "warmup_steps": 0, "eval_every": 0, "eval_problems": 1,
            "save_every": 0, "seed": 0, "keep": 1, "max_new_tokens": 1, "context": 2, "eval_samples": 1,
            "warmup_batch": 1, "group_size": 1}
SHARES = {"warmup_unboxed", "eval_top_p", "gpu_memory_utilization"}  # at most 1; only warmup_unboxed may be 0
NEVER = os.path.join(tempfile.gettempdir(), "logra-option-fuzz-never-made")
int_values = st.one_of(st.sampled_from([0, -1, 1, 2, 7, 10**30, -(10**30)]), st.integers(-5, 400))
float_values = st.one_of(st.sampled_from(["nan", "inf", "-inf", "0", "-0.0", "1e400", "1e-300", "2e-2", "5e-3"]),
                         st.floats().map(repr))


def configure(argv, world=None, environ=None):
    """(exit code, stdout, stderr) of planning.configure(argv, train.PRESETS) as train.main
    ends it: WORLD_SIZE as torchrun would set it for `world` ranks, or unset (a process started
    without torchrun), and the variables of `environ`; a RunError becomes its one line and exit
    code."""
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        os.environ.pop("WORLD_SIZE", None)
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        if world:
            os.environ["WORLD_SIZE"] = world
        os.environ.update(environ or {})
        try:
            planning.configure(argv, train.PRESETS)
            code = 0
        except RunError as e:
            print(e.line(), file=sys.stderr)
            code = e.exit_code
    return code, out.getvalue(), err.getvalue()


def clearly_wrong(preset, values) -> bool:
    """Values that no run can take: train.py must refuse these (it may refuse more)."""
    cfg = dict(train.PRESETS[preset].record(), **{k: float(v) if k in FLOATS else v for k, v in values.items()})
    if any(k in SMALLEST and cfg.get(k, SMALLEST[k]) < SMALLEST[k] for k in values):
        return True
    if any(not math.isfinite(cfg[k]) or cfg[k] < 0 or (cfg[k] == 0 and k != "warmup_unboxed") or
           (k in SHARES and cfg[k] > 1) for k in FLOATS if k in values):
        return True
    return cfg["kl_end"] > cfg["kl_start"] or cfg["max_new_tokens"] >= cfg["context"]  # the prompt needs room


@settings(max_examples=100, deadline=None)
@given(preset=st.sampled_from(["tiny", "tiny", "tiny", "7b", "smoke-0.5b"]), world=st.sampled_from([None, "1", "2"]),
       values=st.fixed_dictionaries({}, optional={**{k: int_values for k in INTS},
                                                  **{k: float_values for k in FLOATS}}))
@example(preset="tiny", world=None, values={})
@example(preset="tiny", world=None, values={"batch": 0})
@example(preset="tiny", world=None, values={"kl_end": "0.5"})
@example(preset="7b", world=None, values={})
def test_every_option_value_is_accepted_or_refused_in_one_line(preset, world, values):
    # --option=value: argparse itself reads "-1e+16" after a space as another option, not a value.
    argv = ["--model", preset, "--run-dir", NEVER] + [f"{options.flag(k)}={v}" for k, v in values.items()]
    code, out, err = configure(argv, world)
    assert not os.path.exists(NEVER) and out == ""
    if code == 0:
        assert err == "" and not clearly_wrong(preset, values)
    else:
        assert code == 2 and err.startswith("train.py: error: ") and err.count("\n") == 1, err
    if preset == "7b" and not values and world is None:  # this CPU machine: what to run, and where
        assert "torchrun --nproc_per_node 4 train.py --model 7b --model-path" in err


@pytest.mark.parametrize("argv, world, says", [
    (["--advantage", "grpo"], None, "--advantage grpo compares a response with the others of its prompt: it needs "
                                    "--group-size 2 or more"),
    (["--advantage", "rloo", "--group-size", "1"], None, "--advantage rloo compares a response"),
    (["--group-size", "3"], None, "--batch 64 does not split into whole groups of --group-size 3 on each of 1 "
                                  "rank(s): use a multiple of 3"),
    (["--group-size", "64", "--advantage", "drgrpo"], "2", "--batch 64 does not split into whole groups of "
                                                          "--group-size 64 on each of 2 rank(s): use a multiple of 128"),
    (["--group-size", "0"], None, "--group-size 0 must be >= 1"),
])
def test_group_options_are_refused_in_one_line(argv, world, says):
    code, out, err = configure(["--run-dir", NEVER, *argv], world)
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith(f"train.py: error: {says}"), err
    assert not os.path.exists(NEVER)


def test_group_options_that_fit_are_taken():
    for argv, world in ((["--group-size", "8", "--advantage", "grpo"], None), (["--group-size", "32"], "2"),
                        (["--model", "7b", "--dry-run", "--group-size", "16", "--advantage", "rloo"], None)):
        code, _, err = configure(["--run-dir", NEVER, *argv], world)
        assert code == 0 and err == "", err
    cfg = resolve([])
    assert (cfg.group_size, cfg.advantage) == (1, "running")  # the paper's, in every preset
    assert all((p.group_size, p.advantage) == (1, "running") for p in train.PRESETS.values())


def test_context_beyond_the_models_positions_is_refused():
    """The tiny preset's Qwen2 has 32 positions: --context 33 cannot run; 32 can."""
    code, _, err = configure(["--run-dir", NEVER, "--context", "33"])
    assert code == 2 and "--context 33 exceeds the model's max_position_embeddings 32" in err
    assert configure(["--run-dir", NEVER, "--context", "32"]) == (0, "", "")


def test_the_task_options_belong_to_their_task():
    """--task reasoning-gym: a chat checkpoint's preset, its own options (a mixture's name or
    tasks with weights, a level), none of the math task's data; each refusal one line."""
    gym = ["--model", "tiny-math", "--model-path", NEVER, "--run-dir", NEVER, "--task", "reasoning-gym"]
    for argv, words in [
        (["--model", "tiny", "--task", "reasoning-gym"], "the chat tasks need a chat checkpoint's preset"),
        (["--model", "tiny", "--task", "math"], "the chat tasks need a chat checkpoint's preset"),
        (["--model", "7b", "--gym-level", "3"], "--gym-level: an option of --task reasoning-gym"),
        ([*gym, "--train-data", "d.jsonl"], "--train-data: an option of --task math"),
        ([*gym, "--grader", "number"], "--grader: an option of --task math"),
        (["--model", "tiny", "--grader", "number"], "--grader: an option of --task math"),
        ([*gym, "--shots", "s.jsonl"], "--shots: an option of --task math"),
        ([*gym, "--gym-tasks", "chain_sum:0"], "--gym-tasks chain_sum:0: give hard, or distinct"),
        ([*gym, "--gym-level", "-1"], "--gym-level -1 must be >= 0"),
        ([*gym, "--gym-tasks", "chain_sum,no_such_task"], "'no_such_task' is not a Reasoning Gym task"),
        (["--model", "tiny-math", "--run-dir", NEVER, "--task", "reasoning-gym"], "needs --model-path DIR (a local"),
    ]:
        code, _, err = configure([*argv, "--run-dir", NEVER])
        assert code == 2 and words in err and err.count("\n") == 1, (argv, err)
    cfg = planning.configure(["--model", "27b", "--task", "reasoning-gym", "--model-path", "/ckpt", "--dry-run"],
                             train.PRESETS)[1]
    assert (cfg.task, cfg.gym_tasks, cfg.gym_level) == ("reasoning-gym", "hard", 2)
    assert cfg.train_data is None and cfg.eval_data is None
    math_cfg = planning.configure(["--model", "27b", "--model-path", "/ckpt", "--dry-run"], train.PRESETS)[1]
    assert math_cfg.gym_tasks is None and math_cfg.gym_level is None  # a math run's configuration is unchanged
    assert math_cfg.grader is None  # math-verify, the paper's (tasks.GRADERS)
    strict = planning.configure(["--model", "27b", "--model-path", "/ckpt", "--grader", "number", "--dry-run"],
                                train.PRESETS)[1]
    assert strict.grader == "number" and strict.record()["grader"] == "number"  # config.json records it
    shown = planning.configure(["--model", "27b", "--model-path", "/ckpt", "--shots", "s.jsonl", "--dry-run"],
                               train.PRESETS)[1]
    assert math_cfg.shots is None and shown.record()["shots"] == "s.jsonl"
    layout = planning.planned_layout(None, cfg)
    line = planning.launch_commands(cfg, layout, train.PRESETS["27b"].engine_gpus)[0]
    assert "--model 27b --model-path /ckpt --task reasoning-gym --gym-tasks hard --gym-level 2" in line, line


def test_presets_are_configs_and_every_field_but_the_structure_has_a_flag():
    """Every preset is an options.Config (a field without a default is one every preset gives,
    or it does not build); every field is a knob with its own flag, but the two that a preset
    alone sets (its name, the model's widths), and the run's own flags are apart from them."""
    assert all(isinstance(p, options.Config) for p in train.PRESETS.values())
    structure = {n for n, f in options.FIELDS.items() if f.metadata.get("structure")}
    assert structure == {"preset", "model", "plan_gib"}
    assert {f.name for f in options.KNOBS} == set(options.FIELDS) - structure
    flags = [options.flag(n) for n in options.FIELDS if n not in structure] + [f"--{f.name.replace('_', '-')}"
                                                                              for f in options.FLAGS]
    assert len(flags) == len(set(flags)) and options.flag("sketch_rank") == "--rank"
    with pytest.raises(TypeError, match="sketch_rank"):
        options.Config(task="arithmetic")  # a field without a default left out: no preset


def test_help_lists_every_flag(capsys):
    """python train.py --help: one entry for each of the run's flags, then one for every field of
    options.Config (a bool knob with its --no- form)."""
    with mock.patch.dict(os.environ, COLUMNS="100"), pytest.raises(SystemExit) as done:
        options.parse(["--help"], train.PRESETS)
    out = capsys.readouterr().out
    assert done.value.code == 0
    entries = [line.split()[0].rstrip(",") for line in out.splitlines() if re.match(r"  --", line)]
    expected = [options.flag(f.name) for f in options.FLAGS] + [options.flag(f.name) for f in options.KNOBS]
    assert [e for e in entries if e != "--help"] == expected, out
    for f in options.KNOBS:
        if f.type is bool:
            assert f"  {options.flag(f.name)}, --no-{options.flag(f.name)[2:]}\n" in out, out


# The preset keys that gained a flag (issue 31): a value in bound, and values out of bound.
NEW_FLAGS = {
    "temperature": ("0.5", ["0", "-1", "nan", "inf"]),
    "alpha_max": ("2.0", ["0", "-3", "inf"]),
    "eval_samples": ("3", ["0", "-2"]),
    "eval_top_p": ("0.5", ["0", "1.5", "nan"]),
    "warmup_batch": ("32", ["0"]),
    "warmup_lr": ("1e-4", ["0", "nan"]),
    "warmup_unboxed": ("0.25", ["-0.1", "1.01", "nan"]),
    "gpu_memory_utilization": ("0.5", ["0", "1.2"]),
}


@pytest.mark.parametrize("key", sorted(NEW_FLAGS))
def test_new_flags_override_the_preset_and_refuse_out_of_bound_values(key):
    good, bad_values = NEW_FLAGS[key]
    typ, flag = options.FIELDS[key].type, options.flag(key)
    cfg = resolve([flag, good])
    assert getattr(cfg, key) == typ(good) != getattr(train.PRESETS["tiny"], key)
    assert configure(["--run-dir", NEVER, f"{flag}={good}"]) == (0, "", "")
    for bad in bad_values:
        code, out, err = configure(["--run-dir", NEVER, f"{flag}={bad}"])
        assert code == 2 and out == "" and err.count("\n") == 1, (bad, err)
        assert err.startswith(f"train.py: error: {flag} {typ(bad)} must be "), (bad, err)


def test_checkpointing_flag_overrides_the_preset_either_way():
    """--checkpointing on|off|auto, the bare flag on and --no-checkpointing off as before; auto
    (the default) stays for the memory plan to decide on GPUs (planning.settle_memory) and is on
    on a CPU (tiny-math's, as before the flag); config.json records True or False."""
    def checkpointing(*argv):
        return resolve(list(argv)).checkpointing
    assert checkpointing() is False and checkpointing("--checkpointing") is True  # tiny: off
    assert checkpointing("--checkpointing", "on") is True and checkpointing("--checkpointing=off") is False
    assert checkpointing("--checkpointing", "auto") is True  # on a CPU
    assert checkpointing("--model", "tiny-math") is True  # the paper's presets' auto, on a CPU
    assert checkpointing("--model", "smoke-0.5b") == "auto" and checkpointing("--model", "7b") == "auto"
    assert checkpointing("--model", "smoke-0.5b", "--no-checkpointing") is False
    assert checkpointing("--model", "smoke-0.5b", "--checkpointing", "on") is True
    assert resolve(["--checkpointing", "off"]).record()["checkpointing"] is False


@pytest.mark.parametrize("value", ["maybe", "ON", "1", "true"])
def test_a_bad_checkpointing_value_is_refused_in_one_line(value):
    code, out, err = configure(["--run-dir", NEVER, f"--checkpointing={value}"])
    assert code == 2 and out == "" and err == f"train.py: error: --checkpointing {value}: one of on, off, auto\n"
    assert not os.path.exists(NEVER)


def dry_run(argv, environ):
    """What train.run prints for `--dry-run argv` under torchrun's variables `environ` (none: a
    process started without torchrun)."""
    out = io.StringIO()
    with mock.patch.dict(os.environ), contextlib.redirect_stdout(out):
        os.environ.pop("WORLD_SIZE", None)
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        os.environ.update(environ)
        train.run(["--dry-run", *argv])
    return out.getvalue()


def test_dry_run_under_torchrun_plans_its_nodes():
    """`train.py --model 7b --dry-run` under torchrun's variables for 2 nodes x 4 (WORLD_SIZE 8,
    LOCAL_WORLD_SIZE 4) plans 2 nodes x 4 training ranks, each node with its 4 engine GPUs,
    exactly as --nodes 2 does, not 1 node x 8 (issue 32, item 11); variables that split into
    no whole number of ranks per node, and a --nodes that contradicts them, are refused in one
    line."""
    two_by_four = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    plan = json.loads(dry_run(["--model", "7b", "--json"], two_by_four))
    assert plan["layout"] == {"nodes": 2, "ranks_per_node": 4, "world": 8, "engine_gpus": [4, 5, 6, 7]}
    assert plan["world"] == 8
    assert plan == json.loads(dry_run(["--model", "7b", "--nodes", "2", "--json"], {}))
    assert plan == json.loads(dry_run(["--model", "7b", "--nodes", "2", "--json"], two_by_four))  # agrees
    text = dry_run(["--model", "7b"], two_by_four)
    assert "FSDP2 over 8 training ranks" in text
    assert ("layout: 2 nodes x 4 training ranks; on each node, training ranks on GPUs 0..3 and their vLLM engines "
            "on GPUs 4,5,6,7") in text
    assert "launch: on each of the 2 nodes: torchrun --nnodes 2 --nproc_per_node 4 " in text
    # One node of 4 (torchrun --nproc_per_node 4), and WORLD_SIZE alone: one node, as before.
    for environ in ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, {"WORLD_SIZE": "4"}):
        layout = json.loads(dry_run(["--model", "7b", "--json"], environ))["layout"]
        assert layout == {"nodes": 1, "ranks_per_node": 4, "world": 4, "engine_gpus": [4, 5, 6, 7]}, environ
    for environ, argv, words in [
        ({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"}, [], "WORLD_SIZE 6 is not a multiple of LOCAL_WORLD_SIZE 4"),
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "0"}, [], "WORLD_SIZE 8 is not a multiple of LOCAL_WORLD_SIZE 0"),
        (two_by_four, ["--nodes", "1"], "--nodes 1 contradicts torchrun's WORLD_SIZE 8 and LOCAL_WORLD_SIZE 4 "
                                        "(2 nodes): leave --nodes out, or give --nodes 2"),
        ({"WORLD_SIZE": "8"}, ["--nodes", "3"], "--nodes 3 does not divide torchrun's WORLD_SIZE 8"),
    ]:
        code, out, err = configure(["--model", "7b", "--dry-run", *argv], environ=environ)
        assert code == 2 and out == "" and err.startswith("train.py: error: ") and err.count("\n") == 1, err
        assert words in err, (environ, argv, err)
