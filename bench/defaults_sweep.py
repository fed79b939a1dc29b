"""LoGRA's two knobs, update_ratio and the KL budget, on examples/minimal_loop.py's task at two
model sizes, with AdamW on the same weights as the reference; seeds 0-2.

Every run is `minimal_loop.train` (a plain REINFORCE loop, batch 32, 40 updates by default)
with one setting: update_ratio 6e-5 (the paper's) or 1e-2 (the example's), and a KL budget of
2e-4 -> 2e-5 nats per token (the paper's), 5e-2 -> 1e-2 (the example's) or 2e-1 -> 5e-2,
cosine over the run. Sizes: the example's 2-layer width-64 Qwen2 and a 4-layer width-128 one
(same task, same vocabulary of 32). Printed per setting, over the seeds: the mean reward of
the first 5 and last 5 updates (mean, and min..max over seeds), the share of updates with
alpha at its cap alpha_max = 3 (the budget did not bind), and the median of realised /
predicted KL.

    python bench/defaults_sweep.py                 # the table, about 3 minutes on 2 CPU cores
    python bench/defaults_sweep.py --updates 10    # shorter
    python bench/defaults_sweep.py --markdown      # and write it into bench/README.md
    python bench/defaults_sweep.py --large --markdown   # the 85M-parameter model: ~25 minutes

`--large` runs the same task on a 16-layer width-768 Qwen2 (85M parameters, the examples'
std-0.2 initialisation; `--init-std 0.02`, transformers' default, for weights at a pretrained
LLM's scale: bench:defaults_sweep_85m_std002, without the middle budget) for 20 updates, with the settings the rule in kl_control.py names
for a policy that must move far (update_ratio 1e-2, the toy budgets) beside the paper's, and
AdamW; it is a separate table (bench:defaults_sweep_85m) since one run takes minutes here.
"""

import argparse
import os
import statistics
import sys
import time

import torch

import report  # bench/report.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import minimal_loop  # noqa: E402

SIZES = {"2 layers, width 64": dict(hidden=64, num_layers=2), "4 layers, width 128": dict(hidden=128, num_layers=4)}
UPDATE_RATIOS = (6e-5, 1e-2)
BUDGETS = ((2e-4, 2e-5), (5e-2, 1e-2), (2e-1, 5e-2))  # (start, end) nats per token
LARGE = {"16 layers, width 768 (85M)": dict(hidden=768, num_layers=16)}
LARGE_SETTINGS = [("logra", 6e-5, (2e-4, 2e-5)), ("logra", 1e-2, (5e-2, 1e-2)), ("logra", 1e-2, (2e-1, 5e-2)),
                  ("adamw", None, None)]
ALPHA_MAX = 3.0


def block(args) -> str:
    """The bench/README.md block a run's table goes to: by size and initialisation."""
    return "defaults_sweep" + ("_85m" if args.large else "") + ("" if args.init_std == 0.2 else "_std002")


def spread(values) -> str:
    return f"{statistics.mean(values):.3f} ({min(values):.3f}..{max(values):.3f})"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--updates", type=int, default=None, help="updates per run (40; 20 with --large)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--large", action="store_true", help="the 85M-parameter model instead of the two toys")
    p.add_argument("--init-std", type=float, default=0.2, help="std of the random weights (the examples' 0.2; "
                   "0.02 is transformers' default, the scale of a pretrained LLM's weights)")
    args = report.parse_args(p, "defaults_sweep", "defaults_sweep_85m", "defaults_sweep_85m_std002",
                             which=lambda a: [block(a)])
    args.updates = args.updates or (20 if args.large else 40)
    torch.set_num_threads(2)
    sizes = LARGE if args.large else SIZES
    large = LARGE_SETTINGS if args.init_std == 0.2 else [x for x in LARGE_SETTINGS if x[2] != (5e-2, 1e-2)]
    settings = large if args.large else (
        [("logra", ur, b) for ur in UPDATE_RATIOS for b in BUDGETS] + [("adamw", None, None)])
    header = ["model", "optimizer", "update_ratio", "KL budget (nats/token)", "reward, first 5 updates",
              "reward, last 5 updates", "alpha at its cap", "realised / predicted KL (median)", "wall per run"]
    print(report.table(header, []), flush=True)  # the rows follow as the runs finish
    rows, t_all = [], time.perf_counter()
    for size, shape in sizes.items():
        for method, ur, budget in settings:
            first, last, capped, ratios, walls = [], [], [], [], []
            for seed in args.seeds:
                kw = dict(update_ratio=ur, kl_start=budget[0], kl_end=budget[1]) if method == "logra" else {}
                t0 = time.perf_counter()
                run = minimal_loop.train(method, updates=args.updates, batch=args.batch, seed=seed,
                                         log=lambda line: None, init_std=args.init_std, **shape, **kw)
                walls.append(time.perf_counter() - t0)
                first.append(statistics.mean(run["rewards"][:5]))
                last.append(statistics.mean(run["rewards"][-5:]))
                capped += [a >= ALPHA_MAX * (1 - 1e-9) for a in run["alphas"]]
                ratios += [real / pred for pred, real in run["kls"] if pred > 0]
            rows.append([size, method, f"{ur:g}" if ur else "", f"{budget[0]:g} -> {budget[1]:g}" if budget else "",
                         spread(first), spread(last),
                         f"{100 * sum(capped) / len(capped):.0f}%" if capped else "",
                         f"{statistics.median(ratios):.2f}" if ratios else "", f"{statistics.median(walls):.1f} s"])
            print(report.row(rows[-1]), flush=True)
    total = time.perf_counter() - t_all
    note = (f"examples/minimal_loop.py's task (reward: the share of 6 response tokens that are token 7; chance "
            f"1/32), {args.updates} updates of batch {args.batch}, seeds {', '.join(map(str, args.seeds))}: mean "
            f"(min..max over seeds); weights drawn at std {args.init_std:g}; LoGRA rank 32, alpha_max {ALPHA_MAX:g}, "
            f"AdamW lr 3e-3 on the same target weights. " + ("The paper's sizes are not measured here. " if args.large else
                       "Toy sizes (the 85M model: the next table; the paper's sizes are not measured here). ") +
            f"Whole sweep: {total / 60:.1f} min on this CPU ({torch.get_num_threads()} threads).")
    print("\n" + note)
    if args.markdown:
        report.publish(block(args), note + "\n\n" + report.table(header, rows))


if __name__ == "__main__":
    main()
