"""The per-update cost of a loop of the README's shape at toy size, phase by phase: LoGRA with
every default beside AdamW on the same weights, at several batch sizes; with `--against REV`,
the same for the method files of another git revision, in the same run.

    python bench/loop_phases.py                         # batches of 32, 128 and 512 responses
    python bench/loop_phases.py --batch 32              # one batch size
    python bench/loop_phases.py --against HEAD          # before (HEAD's method files) / after (the work tree)
    python bench/loop_phases.py --compiled              # and the probe's decoder compiled (torch.compile)
    python bench/loop_phases.py --alone                 # and the method files alone (a copier's: no infra/)
    python bench/loop_phases.py --against 38d926b --alone --markdown   # bench/README.md's loop_phases_companions
    python bench/loop_phases.py --markdown              # and write the table into bench/README.md

The batch: examples/minimal_loop.py's toy (a 2-layer width-64 Qwen2), B responses of 6 tokens
after 4-token prompts, sampled once by the model. Each measurement is a fresh process (one
thread, alone) that times 30 updates on that batch after 5 unmeasured ones: for LoGRA the
forward and backward into the sketches, `RowAdam.prepare`, the KL probe (its defaults: the
paper's eighth of the batch, at least 128 scored tokens), `budget_for` and `solve_alpha`, and
`merge`; for AdamW the forward and backward into .grad and `step`. The realised KL, which
only measures, is timed apart and not counted in the update. The processes alternate (LoGRA,
AdamW, and with `--against` the two trees), three rounds each, and every figure is the median
over the rounds of each process's median. `--against REV` imports the other revision's
sketch.py, rowadam.py, kl_control.py and ppo.py (`git archive` into a temporary folder); they
must have the API this script calls. `--compiled` adds a row per batch: the work tree with
`written_decoder` (infra/probe_decoder.py; the probe's decoder and tangent, and the realised KL's forward)
under `torch.compile` (inductor, static shapes), each process with an empty compile cache, as a
user's first run has; the first update, which compiles, is the column "first update".
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
LOGRA = ("forward + backward", "prepare", "probe", "budget + alpha", "merge")
ADAMW = ("forward + backward", "step")


def worker(tree: str, batch: int, method: str, updates: int = 30, warm: int = 5) -> dict:
    """Median milliseconds of each phase of `method`'s update ("logra", "logra-compiled",
    "logra-alone" or "adamw"), importing the method files from `tree`, and the first update's
    seconds. "logra-alone": the method files as a copier has them, without their infra/ companions
    (rowadam.RowAdam and kl_control.probe, the reference path)."""
    sys.path.insert(0, tree)
    import torch

    import kl_control
    import ppo  # noqa: F401  (the example's loss imports it; from `tree`, before the example)
    import sketch
    from rowadam import RowAdam

    alone = method == "logra-alone"
    if not alone and os.path.exists(os.path.join(tree, "infra", "batched.py")):  # the companion train.py runs
        from infra.batched import BatchedRowAdam as RowAdam

    if not os.path.exists(os.path.join(tree, "infra")):  # an exported revision: its method files, no infra/
        import types  # the example imports the companions: the revision's own classes stand in for them

        for name, attrs in (("infra", {}), ("infra.batched", {"BatchedRowAdam": RowAdam}),
                            ("infra.probe_decoder", {"fast_probe": getattr(kl_control, "fast_probe", None)})):
            sys.modules[name] = types.SimpleNamespace(**attrs)
    sys.path.insert(1, os.path.join(ROOT, "examples"))
    import minimal_loop

    torch.set_num_threads(1)
    model = minimal_loop.tiny_model(0)
    # The fast probe: kl_control's own in a tree from before issue 71, else infra/probe_decoder.py's
    if hasattr(kl_control, "written_decoder"):
        fast = kl_control
    elif alone:
        fast = None
    else:
        sys.path.insert(1, ROOT)
        from infra import probe_decoder as fast
    if method == "logra-compiled":  # the probe's and the realised KL's decoder, compiled on first use
        fast.written_decoder = torch.compile(fast.written_decoder, dynamic=False)
    if method != "adamw":
        layers = sketch.attach(model, seed=0)
        opt = RowAdam(layers)
    else:
        targets = [m.weight for m in sketch.target_modules(model).values()]
        for p in model.parameters():
            p.requires_grad_(any(p is t for t in targets))
        opt = torch.optim.AdamW(targets, lr=minimal_loop.LR, betas=(0.9, 0.95), weight_decay=0.0)
    prompts = torch.randint(0, minimal_loop.VOCAB, (batch, minimal_loop.PROMPT),
                            generator=torch.Generator().manual_seed(0))
    ids, mask = minimal_loop.rollout(model, prompts, torch.Generator().manual_seed(1))
    advantages = torch.randn(batch, generator=torch.Generator().manual_seed(2))
    phases = {name: [] for name in (ADAMW if method == "adamw" else LOGRA + ("realised KL",))}
    first = None
    for update in range(warm + updates):
        laps = [time.perf_counter()]
        minimal_loop.loss_of(model, ids, mask, advantages).backward()
        laps.append(time.perf_counter())
        if method != "adamw":
            opt.prepare()
            laps.append(time.perf_counter())
            probe = (fast.fast_probe if fast else kl_control.probe)(model, layers, opt.directions, ids, mask,
                                                                    keep_positions=ids.numel())
            laps.append(time.perf_counter())
            alpha = kl_control.solve_alpha(probe.kl1, budget=kl_control.budget_for(probe))
            laps.append(time.perf_counter())
            opt.merge(alpha)
            laps.append(time.perf_counter())
            kl_control.realised_kl(probe, model, ids, mask)
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
        laps.append(time.perf_counter())
        first = laps[-1] - laps[0] if first is None else first
        if update >= warm:
            for name, t0, t1 in zip(phases, laps, laps[1:]):
                phases[name].append(1e3 * (t1 - t0))
    return {"first update": first, **{name: statistics.median(v) for name, v in phases.items()}}


def measure(tree: str, batch: int, method: str) -> dict:
    with tempfile.TemporaryDirectory() as cache:  # a compile cache of its own, empty: a first run's
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", tree, str(batch), method],
                             capture_output=True, text=True, check=True,
                             env=dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=cache))
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
    p.add_argument("--batch", type=int, nargs="+", default=[32, 128, 512], help="responses per batch")
    p.add_argument("--against", metavar="REV", help="also time the method files of this git revision (before)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compiled", action="store_true", help="also the work tree with the probe's decoder compiled")
    p.add_argument("--alone", action="store_true",
                   help="also the work tree's method files alone, without their infra/ companions (a copier's)")
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    if "--worker" in sys.argv:
        tree, batch, method = p.parse_args().worker
        print(json.dumps(worker(tree, int(batch), method)))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import report  # bench/report.py

    block = lambda a: "loop_phases_companions" if a.alone else "loop_phases"  # noqa: E731  (--alone: its own table)
    args = report.parse_args(p, "loop_phases", "loop_phases_companions", which=lambda a: [block(a)])
    header = ["batch", "tree", *(f"LoGRA: {ph}" for ph in LOGRA), "**LoGRA: the update**",
              *(f"AdamW: {ph}" for ph in ADAMW), "**AdamW: the update**", "LoGRA / AdamW", "(realised KL)",
              "first update (s)"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this": ROOT} if not args.against else {args.against: export(args.against, tmp), "this": ROOT}
        # (row's name, tree, LoGRA's worker): the trees as they are, and the work tree's probe compiled
        forms = [(name, tree, "logra") for name, tree in trees.items()]
        forms += [("this, probe compiled", ROOT, "logra-compiled")] if args.compiled else []
        forms += [("this, method files alone", ROOT, "logra-alone")] if args.alone else []
        for batch in args.batch:
            runs = {(name, m): [] for name, _, logra in forms for m in (logra, "adamw")}
            for _ in range(args.rounds):  # alternating, so that a slower spell of the machine hits all
                for name, tree, logra in forms:
                    for m in (logra, "adamw"):
                        runs[(name, m)].append(measure(tree, batch, m))
            for name, _, logra in forms:
                med = {m: {ph: statistics.median(r[ph] for r in runs[(name, m)]) for ph in runs[(name, m)][0]}
                       for m in (logra, "adamw")}
                update = sum(med[logra][ph] for ph in LOGRA)
                adamw = sum(med["adamw"][ph] for ph in ADAMW)
                rows.append([batch, name, *(f"{med[logra][ph]:.2f}" for ph in LOGRA), f"**{update:.2f}**",
                             *(f"{med['adamw'][ph]:.2f}" for ph in ADAMW), f"**{adamw:.2f}**",
                             f"{update / adamw:.2f}x", f"{med[logra]['realised KL']:.2f}",
                             f"{med[logra]['first update']:.2f}"])
                print(report.row(rows[-1]), flush=True)
    table = report.table(header, rows)
    note = ("Milliseconds per update, rollout excluded: examples/minimal_loop.py's toy (2 layers, width 64), B "
            "responses of 6 tokens after 4-token prompts, one thread, LoGRA with every default beside AdamW on the "
            f"same seven projections; median of {args.rounds} processes' medians over 30 updates each"
            + (f"; `{args.against}`: the method files of that revision" if args.against else "")
            + ("; probe compiled: the work tree with written_decoder under torch.compile (inductor, static "
               "shapes, an empty compile cache)" if args.compiled else "")
            + ("; method files alone: rowadam.RowAdam and kl_control.probe (the reference path a copier of the "
               "method files runs), where the other rows run train.py's companions, infra/batched.py's "
               "BatchedRowAdam and infra/probe_decoder.py's fast_probe" if args.alone else "")
            + ". The realised KL only measures and is not counted in the update. First update: the seconds of each "
              "process's first (unmeasured) update, LoGRA's with its realised KL; where compiled, it compiles.")
    print("\n" + table + "\n\n" + note)
    if args.markdown:
        report.publish(block(args), note + "\n\n" + table)


if __name__ == "__main__":
    main()
