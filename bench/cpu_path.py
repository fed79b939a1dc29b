"""The CPU path's thread split, measured: train.py's LoGRA update on SmolLM2-135M-Instruct with
its vLLM CPU engine, the trainer's threads and the engine's cores set each way, side by side.

    python bench/cpu_path.py --checkpoint DIR [--updates 6] [--markdown]

On a CPU the trainer and its engine share the machine's cores and take turns: the engine
samples (rollout) and merges a sync's factors while the trainer waits, the trainer trains,
probes and merges while the engine waits. train.py's choice (infra/vllm_engine.py's
`cpu_share` and `trainer_threads`): the engine's worker bound to all of the rank's cores and
the trainer on all of them too. The other splits are set from outside, as a user would:

    torch's and vLLM's own   OMP_NUM_THREADS=<cores> VLLM_CPU_OMP_THREADS_BIND=auto (what the
                             code did before: the trainer on every core, vLLM's worker on the
                             cores its "auto" leaves after reserving one)
    one thread each          OMP_NUM_THREADS=1 (the engine bound to one core)
    the trainer on half      OMP_NUM_THREADS=<cores/2> VLLM_CPU_OMP_THREADS_BIND=<every core>

Each is one `train.py --model smollm2-cpu` run of `--updates` LoGRA updates (bench/real_model.py's
checkpoint and task, no evaluation), one after another, alone on the machine; the table gives
per-phase medians over the updates after the first (its one-off warm-up), the update, the sync's
share of it and each update against train.py's choice. Block `cpu_path` in bench/README.md.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH)
import real_model  # noqa: E402  (bench/real_model.py: its checkpoint and task)

PHASES = real_model.PHASES
CHOSEN = "train.py's choice"


def splits(cores: int) -> dict:
    """{name: the environment's changes} of each split on a machine with `cores` cores."""
    every = str(cores)
    return {
        "torch's and vLLM's own": {"OMP_NUM_THREADS": every, "VLLM_CPU_OMP_THREADS_BIND": "auto"},
        "one thread each": {"OMP_NUM_THREADS": "1"},
        "the trainer on half": {"OMP_NUM_THREADS": str(max(1, cores // 2)),  # the engine bound to every core
                                "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(os.sched_getaffinity(0))))},
        CHOSEN: {},
    }


def run(checkpoint: str, data, out: str, name: str, env: dict, updates: int) -> list[dict]:
    """One run of the split `name`; its update rows."""
    from infra import metrics

    run_dir = os.path.join(out, name.replace(" ", "-").replace("'", ""))
    shutil.rmtree(run_dir, ignore_errors=True)
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")}
    command = [sys.executable, os.path.join(ROOT, "train.py"), "--model", "smollm2-cpu", "--model-path", checkpoint,
               "--train-data", data["train"], "--eval-data", data["validation"], "--optimizer", "logra", "--seed", "0",
               "--updates", str(updates), "--eval-every", "0", "--no-eval-base", "--save-every", "0",
               "--run-dir", run_dir]
    print(f"run ({name}):", " ".join(command), flush=True)
    with open(run_dir + ".log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=dict(environ, **env))
    if done.returncode != 0:
        sys.exit(f"cpu_path.py: the run '{name}' stopped (exit {done.returncode}); see {run_dir}.log")
    return [r for r in metrics.read(os.path.join(run_dir, "metrics.jsonl")) if "time_s" in r]


def table(results: dict) -> str:
    """Per split: per-phase medians, the update, the sync's share, and the update against the choice's."""
    import report

    med = {name: {k: statistics.median([r.get(k, 0.0) for r in rows[1:]]) for k in
                  [f"time_{p}" for p in PHASES] + ["time_s"]} for name, rows in results.items()}
    chosen = med[CHOSEN]["time_s"]
    lines = [[name] + [f"{m[f'time_{p}']:.2f}" for p in PHASES] + [f"{m['time_s']:.2f}",
             f"{m['time_sync'] / m['time_s']:.1%}", f"{m['time_s'] / chosen:.2f}x"] for name, m in med.items()]
    return report.table(["split"] + [f"{p} s" for p in PHASES] + ["update s", "sync share", "update / choice's"],
                        lines)


def main():
    import report

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="SmolLM2-135M-Instruct (bench/real_model.py --convert-only)")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "cpu-path"))
    p.add_argument("--updates", type=int, default=6)
    args = report.parse_args(p, "cpu_path")
    data = real_model.write_task(os.path.join(args.out, "data"), real_model.TASKS["words"])
    cores = len(os.sched_getaffinity(0))
    results = {name: run(args.checkpoint, data, args.out, name, env, args.updates)
               for name, env in splits(cores).items()}
    markdown = (f"SmolLM2-135M-Instruct, LoGRA (rank 64, 8 responses of up to 64 tokens an update), one vLLM CPU "
                f"engine, {cores} cores; medians over updates 2-{args.updates} of each run:\n\n" + table(results))
    print(markdown)
    if args.markdown:
        report.publish("cpu_path", markdown)


if __name__ == "__main__":
    main()
