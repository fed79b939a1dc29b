"""The default run side by side: LoGRA, the annealed AdamW baseline and LoRA at the same rank on
the tiny preset, over seeds, with the same tuning effort for each (three values of one knob).

LoGRA's knob is the KL budget's start (`--kl-start`; the end stays 5e-3), AdamW's and LoRA's
their learning rates (`--adam-lr`, `--lora-lr`); the middle values are the preset's defaults. Every run is the
plain `python train.py` command with those options, in its own run directory; runs of one
seed share the cached base policy (the warm-up is made once per seed). Printed: held-out
Pass@1 of the base, the final and the best evaluation, the gain, and the wall time of each
run, then mean +- sd of the gain over the seeds per setting.

    python bench/tiny_sweep.py                      # defaults only, seeds 0 1 2
    python bench/tiny_sweep.py --sweep              # the three values of each knob
    python bench/tiny_sweep.py --out /tmp/sweep     # where the run directories go
    python bench/tiny_sweep.py --markdown           # and write the tables into the READMEs
    python bench/tiny_sweep.py --groups --markdown  # groups: G = 8 with GRPO's and RLOO's advantages

`--groups` runs LoGRA and AdamW with 8 responses per prompt (`--group-size 8`, 8 prompts of
the batch of 64) and GRPO's or RLOO's advantages, beside the paper's one response per prompt
and running baseline (the default runs), the same 64 responses an update, seeds 0-2.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import report  # bench/report.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(out, method, seed, *options):
    """One `python train.py` run with `options` (flag, value pairs), or its results if its run
    directory already holds them."""
    pairs = list(zip(options[::2], options[1::2]))
    tag = f"{method}-seed{seed}" + "".join(f"-{option.strip('-')}{value}" for option, value in pairs)
    run_dir = os.path.join(out, tag)
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--optimizer", method, "--seed", str(seed),
           "--run-dir", run_dir] + [str(o) for o in options]
    if not os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        t0 = time.time()
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "stdout.txt"), "w") as out:  # what the user sees
            subprocess.run(cmd, check=True, cwd=ROOT, stdout=out)
        with open(os.path.join(run_dir, "wall.txt"), "w") as f:
            f.write(f"{time.time() - t0:.1f}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    passes = [r["pass1"] for r in rows if "pass1" in r]
    updates = [r for r in rows if "time_s" in r]
    wall = float(open(os.path.join(run_dir, "wall.txt")).read())
    return dict(base=passes[0], final=passes[-1], best=max(passes), gain=100 * (passes[-1] - passes[0]), wall=wall,
                update_ms=[1e3 * r["time_s"] for r in updates], sync_bytes=[r["sync_bytes"] for r in updates],
                zero_variance=[r["zero_variance"] for r in updates if "zero_variance" in r],
                mem=max(r["mem_gib"] for r in updates), cmd=" ".join(["python train.py"] + cmd[2:]))


def spread(values, fmt):
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{format(statistics.mean(values), fmt)} +- {format(sd, fmt.lstrip('+'))}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "sweep"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--groups", action="store_true", help="G = 8 with GRPO and RLOO beside the paper's G = 1")
    args = report.parse_args(p, "tiny_sweep", "tiny_sweep_summary", "default_run", "one_update", "tiny_sweep_sweep",
                             "tiny_sweep_groups", "groups_summary",
                             which=lambda a: ["tiny_sweep_sweep"] if a.sweep else
                             ["tiny_sweep_groups", "groups_summary"] if a.groups else
                             ["tiny_sweep", "tiny_sweep_summary", "default_run", "one_update"])
    if args.groups:
        return groups(args)
    settings = [("logra", None, None), ("adam", None, None), ("lora", None, None)]
    if args.sweep:
        settings = [("logra", "--kl-start", v) for v in (1e-2, 2e-2, 4e-2)] + \
                   [("adam", "--adam-lr", v) for v in (3e-5, 1e-4, 3e-4)] + \
                   [("lora", "--lora-lr", v) for v in (3e-4, 1e-3, 3e-3)]
    header = ["method", "setting", "seed", "base", "final", "best", "gain (points)", "wall"]
    print(report.table(header, []))  # the rows follow as the runs finish
    runs, summary, updates = [], [], {}
    for method, option, value in settings:
        results = []
        for seed in args.seeds:
            r = run(args.out, method, seed, *((option, value) if option else ()))
            results.append(r)
            runs.append([method, f"{option or 'default'} {value or ''}", seed, f"{r['base']:.3f}", f"{r['final']:.3f}",
                         f"{r['best']:.3f}", f"{r['gain']:+.1f}", f"{r['wall']:.0f} s"])
            print(report.row(runs[-1]), flush=True)
        updates[method, option, value] = statistics.median(t for r in results for t in r["update_ms"])
        summary.append([method, f"{option or 'default'} {value or ''}", spread([r["base"] for r in results], ".3f"),
                        spread([r["final"] for r in results], ".3f"), spread([r["gain"] for r in results], "+.1f"),
                        updates[method, option, value],
                        f"{statistics.median(b for r in results for b in r['sync_bytes']) / 1e3:.0f} KB",
                        f"{min(r['mem'] for r in results):.2f}-{max(r['mem'] for r in results):.2f} GiB"])
    # each median update beside AdamW's at its default rate (the runs' own, on this machine)
    adam = updates.get(("adam", None, None))
    for row in summary:
        row[5] = f"{row[5]:.0f} ms" + (f" ({row[5] / adam:.2f}x)" if adam else "")
    means = report.table([f"mean +- sd over seeds {', '.join(map(str, args.seeds))}", "setting", "base", "final",
                          "gain (points)", "median update (x AdamW's)", "sync per update", "peak RSS"], summary)
    print("\n" + means)
    if args.markdown:
        report.publish("tiny_sweep_sweep" if args.sweep else "tiny_sweep",
                       report.table(header, runs) + "\n\n" + means)
        if not args.sweep:
            report.publish("tiny_sweep_summary", means)  # README.md's headline table
            # What `python train.py` prints (the first seed's LoGRA run), as README.md shows it.
            with open(os.path.join(args.out, f"logra-seed{args.seeds[0]}", "stdout.txt")) as f:
                lines = [line.rstrip("\n").replace(ROOT + os.sep, "") for line in f
                         if not line.startswith("base policy: warm-up steps:")]  # its progress lines: a wait
            steps = [i for i, line in enumerate(lines) if line.startswith("step ")]
            shown = lines[:steps[0] + 3] + ["..."] + lines[steps[-1]:]
            report.publish("default_run", "```\n" + "\n".join(shown) + "\n```")
            report.publish("one_update", one_update(args.out, args.seeds[0]))
            # The curves of the first seed's two runs, as bench/README.md shows them.
            for method in ("logra", "adam"):
                shutil.copyfile(os.path.join(args.out, f"{method}-seed{args.seeds[0]}", "curves.png"),
                                os.path.join(ROOT, "bench", "results", f"tiny-{method}-curves.png"))


def one_update(out: str, seed: int, step: int = 2) -> str:
    """Update `step` of the seed's default LoGRA run, told from its metrics row (and the AdamW
    run's, for the bytes of a full sync): every figure is the run's own."""
    import train

    cfg = train.PRESETS["tiny"]
    rows = {m: {r["update"]: r for r in map(json.loads, open(os.path.join(out, f"{m}-seed{seed}", "metrics.jsonl")))}
            for m in ("logra", "adam")}
    r, last = rows["logra"][step], rows["logra"][cfg.updates]
    kl1 = r["kl_pred"] / r["alpha"] ** 2
    wanted = (r["budget"] / kl1) ** 0.5  # the alpha that would spend the whole budget
    capped = r["alpha"] >= cfg.alpha_max
    spent = (f"`alpha` = {r['alpha']:g}, its cap ({wanted:.1f} would spend the budget)" if capped else
             f"`alpha` = {r['alpha']:.2f}, which spends the budget")
    rows_ = [
        ("rollout, reward", f"the engine (bf16, changed only by syncs) samples {cfg.batch} responses to two-digit "
                            f"additions at temperature {cfg.temperature:g}; 1 for a right `\\boxed{{}}` sum, -0.01 "
                            f"otherwise; `A = r - b`, b a running mean",
         f"reward {r['reward']:.3f} ({round(r['accuracy'] * cfg.batch)} of {cfg.batch} right)"),
        ("backward, RowAdam", f"REINFORCE with TIS over {r['tokens']} response tokens into the "
                              f"{7 * cfg.model['num_hidden_layers']} sketches `S = G A^T` (no weight gradient); rows "
                              f"rescaled into directions `U`, `||U A|| = update_ratio ||W||`",
         f"r = {cfg.sketch_rank}, update_ratio {cfg.update_ratio:g}"),
        ("KL probe", f"the step's tangent through the model on {r['probe_responses']} responses: `KL(alpha) = "
                     f"alpha^2 KL1`; the budget (cosine schedule less the mismatch {r['mismatch']:.1e})",
         f"KL1 {kl1:.2e}, budget {r['budget']:.2e}"),
        ("alpha, merge", "`W -= bf16(alpha U) A` in the fp32 weights; every layer to the next A",
         f"{spent}; predicted KL {r['kl_pred']:.2e}, realised {r['kl_real']:.2e}"),
        ("sync", "the same bf16 factors and the seed; the engine merges them, fingerprints compared",
         f"{r['sync_bytes'] / 1e3:.0f} KB (AdamW's: {rows['adam'][step]['sync_bytes'] / 1e3:.0f} KB)"),
    ]
    return (f"Update {step} of the run above, from its `metrics.jsonl` (at update {cfg.updates}, where the budget "
            f"binds, `alpha` is {last['alpha']:.2f}):\n\n"
            + report.table(["phase", "what happens", "this update"], rows_))


def groups(args):
    """--groups: LoGRA and AdamW with G = 1 (the paper's running baseline) and G = 8 (GRPO,
    RLOO), the same 64 responses an update; the gain per seed, its mean +- sd, and whether
    LoGRA's mean lies within the seeds' spread (mean +- sd) of AdamW's with the same groups."""
    settings = [(1, "running"), (8, "grpo"), (8, "rloo")]
    header = ["method", "G", "advantage", *(f"gain, seed {s}" for s in args.seeds), "gain, mean +- sd", "base",
              "final", "zero-variance groups"]
    print(report.table(header, []))
    rows, gains = [], {}
    for method in ("logra", "adam"):
        for G, advantage in settings:
            extra = ("--group-size", G, "--advantage", advantage) if G > 1 else ()
            results = [run(args.out, method, seed, *extra) for seed in args.seeds]
            gains[method, G, advantage] = [r["gain"] for r in results]
            flat = [v for r in results for v in r["zero_variance"]]
            rows.append([method, G, advantage, *(f"{r['gain']:+.1f}" for r in results),
                         spread([r["gain"] for r in results], "+.1f"), spread([r["base"] for r in results], ".3f"),
                         spread([r["final"] for r in results], ".3f"),
                         f"{100 * statistics.mean(flat):.0f}%" if flat else ""])
            print(report.row(rows[-1]), flush=True)
    verdicts = []
    for G, advantage in settings:
        logra, adam = gains["logra", G, advantage], gains["adam", G, advantage]
        sd = statistics.stdev(adam) if len(adam) > 1 else 0.0
        within = abs(statistics.mean(logra) - statistics.mean(adam)) <= sd
        verdicts.append(f"G = {G}, {advantage}: LoGRA gains on {sum(g > 0 for g in logra)} of {len(logra)} seeds; "
                        f"its mean gain {statistics.mean(logra):+.1f} is {'within' if within else 'outside'} AdamW's "
                        f"{statistics.mean(adam):+.1f} +- {sd:.1f} points.")
    note = (f"The tiny preset (`python train.py`, 150 updates of 64 responses), seeds "
            f"{', '.join(map(str, args.seeds))}: held-out Pass@1 gain (points) from the base policy to the last "
            f"evaluation; G responses per prompt, so 64 / G prompts an update. Zero-variance groups: the mean share "
            f"of groups whose responses were all equally rewarded (no signal under GRPO or RLOO).")
    table = report.table(header, rows)
    print("\n" + "\n".join(verdicts))
    if args.markdown:
        report.publish("tiny_sweep_groups", note + "\n\n" + table + "\n\n" + "\n".join(f"- {v}" for v in verdicts))
        report.publish("groups_summary", "\n".join(f"- {v}" for v in verdicts))


if __name__ == "__main__":
    main()
