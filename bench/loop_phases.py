"""The per-update cost of examples/minimal_loop.py's two optimizers, phase by phase, at toy size;
and, with `--against REV`, the same for the method files of another git revision, in the same run.

    python bench/loop_phases.py                      # this tree: LoGRA's phases beside AdamW's update
    python bench/loop_phases.py --against HEAD       # before (HEAD's method files) / after (the work tree)
    python bench/loop_phases.py --against HEAD --markdown   # and write the table into bench/README.md

Each measurement is a fresh process (one thread, as the example runs) that builds the example's
2-layer width-64 Qwen2, samples one batch of 32 responses with it, and times 30 updates on that
batch after 5 unmeasured ones: for LoGRA the forward and backward into the sketches, RowAdam's
`prepare`, the KL probe, `solve_alpha` and `merge`, and the realised KL of the merged step;
for AdamW the forward and backward into .grad and `step`. The processes of the two trees
alternate, three rounds each, and every figure is the median over the rounds of each
process's median. With `--against`, the other revision's sketch.py, rowadam.py, kl_control.py
and ppo.py are taken with `git archive` into a temporary folder and imported from there (the
example's loop and this script are this tree's); they must keep the API the example calls.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHOD = ("sketch.py", "rowadam.py", "kl_control.py", "ppo.py")
LOGRA = ("forward + backward", "prepare", "probe", "merge", "realised KL")
ADAMW = ("forward + backward", "step")


def worker(tree: str, updates: int = 30, warm: int = 5) -> dict:
    """Median milliseconds of each phase, importing the method files from `tree`."""
    sys.path.insert(0, tree)
    import torch

    import kl_control
    import ppo  # noqa: F401  (the example's loss imports it; from `tree`, before the example)
    import sketch
    from rowadam import RowAdam

    sys.path.insert(1, os.path.join(ROOT, "examples"))
    import minimal_loop

    torch.set_num_threads(1)
    out = {}
    for method in ("logra", "adamw"):
        model = minimal_loop.tiny_model(0)
        if method == "logra":
            layers = sketch.attach(model, rank=32, seed=0)
            opt = RowAdam(layers, base_seed=0, update_ratio=1e-2)
        else:
            targets = [m.weight for m in sketch.target_modules(model).values()]
            for p in model.parameters():
                p.requires_grad_(any(p is t for t in targets))
            opt = torch.optim.AdamW(targets, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
        prompts = torch.randint(0, minimal_loop.VOCAB, (32, minimal_loop.PROMPT), generator=torch.Generator().manual_seed(0))
        ids, mask = minimal_loop.rollout(model, prompts, torch.Generator().manual_seed(1))
        advantages = torch.randn(32, generator=torch.Generator().manual_seed(2))
        phases = {name: [] for name in (LOGRA if method == "logra" else ADAMW)}
        for update in range(warm + updates):
            laps = [time.perf_counter()]
            minimal_loop.loss_of(model, ids, mask, advantages).backward()
            laps.append(time.perf_counter())
            if method == "logra":
                opt.prepare()
                laps.append(time.perf_counter())
                probe = kl_control.probe(model, layers, opt.directions, ids, mask, keep_positions=ids.numel())
                laps.append(time.perf_counter())
                opt.merge(kl_control.solve_alpha(probe.kl1, budget=1e-2))
                laps.append(time.perf_counter())
                kl_control.realised_kl(probe, model, ids, mask)
            else:
                opt.step()
                opt.zero_grad(set_to_none=True)
            laps.append(time.perf_counter())
            if update >= warm:
                for name, t0, t1 in zip(phases, laps, laps[1:]):
                    phases[name].append(1e3 * (t1 - t0))
        out[method] = {name: statistics.median(v) for name, v in phases.items()}
    return out


def measure(tree: str) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", tree], capture_output=True,
                         text=True, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return json.loads(out.stdout.strip().splitlines()[-1])


def export(rev: str, folder: str) -> str:
    """The method files of git revision `rev`, written into `folder`."""
    archive = os.path.join(folder, "method.tar")
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", rev, *METHOD], stdout=f, check=True)
    with tarfile.open(archive) as t:
        t.extractall(folder, filter="data")
    return folder


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--against", metavar="REV", help="also time the method files of this git revision (before)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    if "--worker" in sys.argv:
        print(json.dumps(worker(p.parse_args().worker)))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import report  # bench/report.py

    args = report.parse_args(p, "loop_phases")
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"after": ROOT} if not args.against else {"before": export(args.against, tmp), "after": ROOT}
        runs = {name: [] for name in trees}
        for _ in range(args.rounds):  # the trees alternate, so a slower spell of the machine hits both
            for name, tree in trees.items():
                runs[name].append(measure(tree))
    med = {name: {m: {ph: statistics.median(r[m][ph] for r in rs) for ph in rs[0][m]} for m in ("logra", "adamw")}
           for name, rs in runs.items()}
    cols = list(trees)
    header = ["phase", *(f"{c} (ms)" for c in cols)] + (["after / before"] if len(cols) == 2 else [])
    rows = []
    for method, phases in (("logra", LOGRA), ("adamw", ADAMW)):
        for ph in phases:
            values = [med[c][method][ph] for c in cols]
            rows.append([f"{'LoGRA' if method == 'logra' else 'AdamW'}: {ph}", *(f"{v:.2f}" for v in values)]
                        + ([f"{values[1] / values[0]:.2f}"] if len(values) == 2 else []))
        totals = [sum(med[c][method].values()) for c in cols]
        rows.append([f"**{'LoGRA' if method == 'logra' else 'AdamW'}: the update**", *(f"{v:.2f}" for v in totals)]
                    + ([f"{totals[1] / totals[0]:.2f}"] if len(totals) == 2 else []))
    ratio = [sum(med[c]["logra"].values()) / sum(med[c]["adamw"].values()) for c in cols]
    rows.append(["LoGRA's update / AdamW's", *(f"{v:.2f}x" for v in ratio)] + ([""] if len(cols) == 2 else []))
    table = report.table(header, rows)
    note = (f"examples/minimal_loop.py's toy (2 layers, width 64, 32 responses of 10 tokens), one thread; median "
            f"of {args.rounds} processes' medians over 30 updates each"
            + (f"; before: the method files of `{args.against}`" if args.against else "") + ".")
    print(table + "\n\n" + note)
    if args.markdown:
        report.publish("loop_phases", note + "\n\n" + table)


if __name__ == "__main__":
    main()
