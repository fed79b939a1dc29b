"""Whether this tree's train.py writes the same metrics.jsonl as another revision's, and resumes its
checkpoints: issue 71 item 4, the check of the redesign's moves.

    python bench/same_rows.py --against 38d926b                     # logra, adam and lora, 150 updates each
    python bench/same_rows.py --against 38d926b --updates 10        # shorter runs
    python bench/same_rows.py --against 38d926b --resume-check --markdown   # bench/README.md's table

Issue 71 lands the redesign's moves first, in commits after which `python train.py` at seed 0
with `--optimizer logra`, `adam` and `lora` writes the same metrics.jsonl as 38d926b in every
field but times, rates and memory, and a checkpoint written by 38d926b resumes. This script runs
`python train.py --optimizer OPT` (the tiny preset, seed 0; `--updates N` passed to both) in
REV's tree (`git archive` into a temporary folder) and in this one, one process at a time, each
with one thread and offline, both from tests/data's base policy (placed where each tree's
infra/policy.base_policy_path looks, as tests/conftest.py's `runs` does: no warm-up runs; a run
that does not print "base policy: loaded" fails). It then compares the two metrics.jsonl row by
row, every field but those in IGNORED, for exact equality, floats as written in the JSON.

`--resume-check`: REV's tree runs logra for 6 updates with a checkpoint every 3; a copy of that
run directory is resumed in this tree from checkpoint-3, and its rows and checkpoint-6 (weights,
optimizer state, the run's counters, every tensor bitwise) must equal REV's uninterrupted run's
(rows 0-3 are REV's own, copied; rows 4-6 are this tree's).

IGNORED (fnmatch patterns; every other field must be equal, `state_mib` included: it counts the
method's state in bytes, not measured memory):
    time_*        each phase's wall seconds (infra/lifecycle.py's record)
    time_s        their sum, the update's wall seconds
    tokens_per_s  a rate: the update's tokens over its wall seconds
    mem_gib       measured peak memory (the process's resident set on a CPU)
"""

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
BASE = os.path.join(ROOT, "tests", "data", "base-tiny-seed0.pt")  # the tiny preset's base policy, seed 0
IGNORED = {  # fnmatch pattern: why it may differ between two runs of the same code
    "time_*": "each phase's wall seconds (infra/lifecycle.py's record)",
    "time_s": "their sum, the update's wall seconds",
    "tokens_per_s": "a rate: the update's tokens over its wall seconds",
    "mem_gib": "measured peak memory (the process's resident set on a CPU)",
}
RESUME = ["--optimizer", "logra", "--updates", "6", "--save-every", "3"]  # resumed from checkpoint-3
# Where a tree's infra/policy.py caches the tiny preset's base policy for a run directory (argv[1]).
WHERE = ("import sys, train; from infra import policy, tasks; c = train.PRESETS['tiny']; "
         "print(policy.base_policy_path(c.model, tasks.Arithmetic(0, c.eval_problems), sys.argv[1], preset='tiny', "
         "seed=0, warmup=dict(steps=c.warmup_steps, batch=c.warmup_batch, lr=c.warmup_lr, unboxed=c.warmup_unboxed)))")
ABSENT = "(absent)"


def ignored(field: str) -> bool:
    return any(fnmatch.fnmatchcase(field, pattern) for pattern in IGNORED)


def read_rows(path: str) -> list:
    """metrics.jsonl's rows, every float kept as the text the JSON holds (compared as written)."""
    with open(path) as f:
        return [json.loads(line, parse_float=str) for line in f if line.strip()]


def compare(reference: list, candidate: list) -> dict:
    """Two runs' rows, row by row, every field but the ignored ones: {"rows": pairs compared,
    "fields": distinct fields compared, "values": values compared, "differing": values (and
    rows) that differ, "first": the first difference, (row index, update, field, reference's
    value, candidate's value), or None}. A row or field that one side lacks is a difference."""
    fields, values, differing, first = set(), 0, 0, None
    for i in range(max(len(reference), len(candidate))):
        a, b = (rows[i] if i < len(rows) else None for rows in (reference, candidate))
        if a is None or b is None:
            differing += 1
            first = first or (i, (a or b).get("update"), "(the whole row)", "row" if a else ABSENT, "row" if b else ABSENT)
            continue
        for field in [f for f in [*a, *(f for f in b if f not in a)] if not ignored(f)]:
            fields.add(field)
            values += 1
            x, y = a.get(field, ABSENT), b.get(field, ABSENT)
            if x != y:
                differing += 1
                first = first or (i, a.get("update"), field, x, y)
    return dict(rows=min(len(reference), len(candidate)), fields=len(fields), values=values, differing=differing,
                first=first)


def describe(result: dict, names=("REV", "this tree")) -> str:
    """"all equal", or the first difference and how many values differ."""
    if result["first"] is None:
        return "all equal"
    i, update, field, x, y = result["first"]
    short = lambda v: (s if len(s := json.dumps(v) if not isinstance(v, str) else v) <= 60 else s[:57] + "...")
    return (f"{result['differing']} differ; first: row {i} (update {update}), `{field}`: {short(x)} ({names[0]}) "
            f"vs {short(y)} ({names[1]})")


def leaves(obj, path=""):
    """(path, leaf) of a nested dict/list, as a checkpoint holds them."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{path}[{i}]")
    else:
        yield path, obj


def same_checkpoint(a_dir: str, b_dir: str, name: str) -> tuple:
    """(leaves compared, the first differing path or None) of checkpoint `name` of two runs,
    each gathered by torch's own converter (as tests/subproc.py's read_checkpoint does)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    states = []
    for run_dir in (a_dir, b_dir):
        gathered = os.path.join(run_dir, name + ".pt")
        dcp_to_torch_save(os.path.join(run_dir, name), gathered)
        states.append(dict(leaves(torch.load(gathered, weights_only=False))))
        os.remove(gathered)
    a, b = states
    equal = lambda x, y: (torch.is_tensor(x) and torch.is_tensor(y) and x.dtype == y.dtype and torch.equal(x, y)) \
        if torch.is_tensor(x) or torch.is_tensor(y) else x == y
    return len(a), next((p for p in [*a, *(p for p in b if p not in a)] if p not in a or p not in b
                         or not equal(a[p], b[p])), None)


def train(tree: str, args: list, *, loaded=True) -> tuple:
    """`python train.py ARGS` in `tree`, alone, one thread, offline: (wall seconds, stdout)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    for name in ("PYTHONPATH", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(name, None)
    t0 = time.time()
    out = subprocess.run([sys.executable, "train.py", *args], cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"train.py {' '.join(args)} in {tree} failed ({out.returncode}):\n"
                           f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    if loaded and "base policy: loaded" not in out.stdout:
        raise RuntimeError(f"train.py in {tree} did not load tests/data's base policy:\n{out.stdout[-3000:]}")
    return time.time() - t0, out.stdout


def place_base(tree: str, runs: str) -> None:
    """tests/data's base policy where `tree`'s code looks for the runs under `runs`."""
    os.makedirs(runs, exist_ok=True)
    out = subprocess.run([sys.executable, "-c", WHERE, os.path.join(runs, "run")], cwd=tree, capture_output=True,
                         text=True, env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))
    if out.returncode:
        raise RuntimeError(f"{tree}: where is the base policy cached?\n{out.stderr[-3000:]}")
    shutil.copyfile(BASE, out.stdout.strip().splitlines()[-1])


def git(*words) -> str:
    return subprocess.run(["git", "-C", ROOT, *words], capture_output=True, text=True, check=True).stdout.strip()


def measure(args, out: str, names: tuple, row) -> tuple:
    """The table's rows, run after run (each printed by `row` as it is done), and whether a
    checkpoint differed; the trees and runs under `out`."""
    tree, runs = os.path.join(out, "tree"), {t: os.path.join(out, f"runs-{t}") for t in ("rev", "here")}
    shutil.rmtree(tree, ignore_errors=True)
    os.makedirs(tree)
    archive = subprocess.run(["git", "-C", ROOT, "archive", args.against], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    trees = {"rev": tree, "here": ROOT}
    for t in trees:
        place_base(trees[t], runs[t])
    table, failed, updates = [], False, ["--updates", str(args.updates)] * (args.updates is not None)
    for opt in args.optimizers.split(","):
        seconds = {}
        for t in ("rev", "here"):
            run_dir = os.path.join(runs[t], opt)
            shutil.rmtree(run_dir, ignore_errors=True)
            seconds[t], _ = train(trees[t], ["--optimizer", opt, "--run-dir", run_dir, *updates])
        result = compare(*(read_rows(os.path.join(runs[t], opt, "metrics.jsonl")) for t in ("rev", "here")))
        table.append([f"`--optimizer {opt}`{' --updates ' + str(args.updates) if updates else ''}", result["rows"],
                      result["fields"], result["values"], f"{seconds['rev']:.0f}", f"{seconds['here']:.0f}",
                      describe(result, names)])
        row(table[-1])
    if args.resume_check:
        whole, resumed = os.path.join(runs["rev"], "resume-whole"), os.path.join(runs["here"], "resume-resumed")
        for d in (whole, resumed):
            shutil.rmtree(d, ignore_errors=True)
        t_rev, _ = train(tree, [*RESUME, "--run-dir", whole])
        shutil.copytree(whole, resumed)
        t_here, said = train(ROOT, [*RESUME, "--resume", resumed, "--resume-from", "checkpoint-3"], loaded=False)
        if "resumed" not in said or "checkpoint-3" not in said:
            raise RuntimeError(f"the resume did not say it resumed from checkpoint-3:\n{said[-3000:]}")
        result = compare(*(read_rows(os.path.join(d, "metrics.jsonl")) for d in (whole, resumed)))
        count, wrong = same_checkpoint(whole, resumed, "checkpoint-6")
        failed = wrong is not None
        table.append([f"`{names[0]}`'s logra checkpoint-3 resumed here, to update 6", result["rows"], result["fields"],
                      result["values"], f"{t_rev:.0f}", f"{t_here:.0f}", describe(result, names) + (
                          f"; checkpoint-6: all {count} tensors and values bitwise equal" if not failed
                          else f"; checkpoint-6 differs first at `{wrong}` (of {count} leaves)")])
        row(table[-1])
    return table, failed


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", required=True, metavar="REV", help="the revision whose rows this tree must write")
    p.add_argument("--optimizers", default="logra,adam,lora")
    p.add_argument("--updates", type=int, help="passed to both runs (default: the preset's own)")
    p.add_argument("--resume-check", action="store_true", help="resume REV's logra checkpoint-3 in this tree")
    p.add_argument("--out", help="keep the trees and runs in this folder (default: a temporary one, removed)")
    import report  # bench/report.py: its import starts the block's cost clock
    args = report.parse_args(p, "same_rows")
    rev = git("rev-parse", "--short", args.against)
    dirty = git("status", "--porcelain", "--", "*.py", ":!bench", ":!tests", ":!examples")  # what train.py imports
    here = f"this tree ({git('rev-parse', '--short', 'HEAD')}{' + changes' if dirty else ''})"
    header = ["run", "rows", "fields", "values compared", f"`{rev}` s", "this tree s", "result"]
    print(report.row(header), flush=True)
    out = args.out or tempfile.mkdtemp(prefix="same-rows-")
    try:
        table, failed = measure(args, out, (rev, "this tree"), lambda cells: print(report.row(cells), flush=True))
    finally:
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)
    text = (f"`python train.py` (the tiny preset, seed 0, its HF engine, one process, one thread) in `{rev}`'s tree and "
            f"in {here}, one run at a time, from tests/data's base policy; metrics.jsonl compared row by row for exact "
            f"equality in every field but {', '.join(f'`{f}`' for f in IGNORED)} (times, rates, memory); s: wall "
            "seconds of each run.\n\n" + report.table(header, table))
    print("\n" + text)
    if args.markdown:
        report.publish("same_rows", text)
    sys.exit(1 if failed or not all(r[-1].startswith("all equal") for r in table) else 0)


if __name__ == "__main__":
    main()
