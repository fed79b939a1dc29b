"""Per-GPU training-state memory of the paper's presets under 4-way FSDP2, next to Table 1.

From the presets' shapes (memory_plan.estimate, on the meta device): fp32 weight shards;
dense AdamW's fp32 gradient and two moments for the seven target projections; LoGRA's row
shards of the sketches S and directions U (n, r) and row moments (n,), and the int8 signs of
the projections A (r, k), r = 256.
The paper's Table 1 reports the average GPU memory of whole runs, activations, the
unsharded bf16 layers in flight and allocator slack included: the difference is what those
take. Its dense baseline may train all parameters while this project's AdamW trains the
seven targets (infra/policy.py departure 1): for the 7B model the embedding and head would add
about 4.4 GiB per GPU of gradient and moments.

The 27B model is not public. We assume Qwen2.5-32B's widths (hidden 5120, intermediate
27648, 40 heads, 8 KV heads, vocab 152064) cut to 52 layers, which gives 26.9B parameters:
the paper's model is a Qwen model of that size, and these widths are Qwen's own at that scale.

It also prints the whole per-GPU plan of the 7B run (`python train.py --model 7b --dry-run`:
trainer state and step transients, activations, the engine GPU) with the figures that matter
for it, as the block `dry_run_7b`.

    python bench/memory_model.py [--markdown]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from infra import memory_plan  # noqa: E402
from infra import metrics  # noqa: E402
from infra import planning  # noqa: E402
import report  # noqa: E402  (bench/report.py)
import train  # noqa: E402

PAPER = {"1.5b": (9.18, 7.18), "7b": (31.82, 17.29), "27b": (None, 51.54)}  # Table 1, avg GiB/GPU
GIB = 2**30


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = report.parse_args(p, "memory_model", "dry_run_7b")
    header = ["model", "AdamW state (est.)", "paper AdamW avg", "implied rest", "LoGRA state (est.)",
              "paper LoGRA avg", "implied rest", "est. saving", "paper saving"]
    rows, table_rows = [], []
    for name in ("1.5b", "7b", "27b"):
        m = memory_plan.estimate(train.PRESETS[name].model, 4, 256)
        adam = (m["weights"] + m["adam_grads"] + m["adam_moments"]) / GIB
        logra = (m["weights"] + m["logra_sketches"] + m["logra_directions"] + m["logra_moments"]
                 + m["logra_projections"]) / GIB
        p_adam, p_logra = PAPER[name]
        rest_adam = f"{p_adam - adam:.2f} GiB" if p_adam else "-"
        paper_adam = f"{p_adam:.2f} GiB" if p_adam else "OOM"
        saving = f"{100 * (p_logra - p_adam) / p_adam:+.1f}%" if p_adam else "feasible"
        table_rows.append([f"{name} ({m['params'] / 1e9:.2f}B)", f"{adam:.2f} GiB", paper_adam, rest_adam,
                           f"{logra:.2f} GiB", f"{p_logra:.2f} GiB", f"{p_logra - logra:.2f} GiB",
                           f"{100 * (logra - adam) / adam:+.1f}%", saving])
        rows.append((name, adam, logra, p_adam, p_logra))
    result = report.table(header, table_rows)
    print(result)
    chart(rows)
    plan = dry_run_7b()
    print("\n" + plan)
    if args.markdown:
        report.publish("memory_model", result)
        report.publish("dry_run_7b", plan)


def dry_run_7b() -> str:
    """The 7B preset's plan as train.py --dry-run prints it, and what it says, in Markdown."""
    flags, cfg, _, _ = planning.configure(["--model", "7b", "--dry-run"], train.PRESETS)
    layout = planning.planned_layout(flags.nodes, cfg)
    m, big = planning.run_plan(cfg, layout.world), planning.run_plan(train.PRESETS["27b"], 4)
    lines = planning.plan_lines(cfg, m, layout)
    gib = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
    extra = m["logra_sketches"] + m["logra_directions"] + m["logra_moments"] + m["logra_projections"]
    said = (f"LoGRA's state beyond the fp32 weight shard is {gib(extra)} per training GPU (AdamW's: "
            f"{gib(m['adam_grads'] + m['adam_moments'])}), its optimizer step's largest transient "
            f"{gib(m['trainer_logra_transient_bytes'])} (AdamW's {gib(m['trainer_adam_transient_bytes'])}); "
            f"in all {gib(m['trainer_logra_bytes'])} against {gib(m['trainer_adam_bytes'])} "
            f"({m['trainer_logra_bytes'] / m['trainer_adam_bytes']:.2f}x) before activations. The engine holds the "
            f"trainer's exact fp32 master as bf16 weights ({gib(m['engine_weight_bytes'])}) plus int16 residuals "
            f"({gib(m['engine_residual_bytes'])}), which leaves {gib(m['engine_kv_cache_bytes'])} of KV cache on an "
            f"80 GB card; at 27B the residuals ({gib(big['engine_residual_bytes'])}) go to pinned host memory and "
            f"the KV cache keeps {gib(big['engine_kv_cache_bytes'])}. With `--sync delta` the engine keeps no "
            f"residual (KV cache {gib(m['engine_delta_kv_cache_bytes'])}, at 27B "
            f"{gib(big['engine_delta_kv_cache_bytes'])}) and each training GPU a bf16 shadow of its rows instead "
            f"({gib(m['trainer_delta_shadow_bytes'])}, at 27B {gib(big['trainer_delta_shadow_bytes'])}). "
            f"After backward the KL probe's forward with tangents takes {gib(m['trainer_probe_activation_bytes'])} "
            f"({gib(m['trainer_probe_attention_bytes'])} of it its attention's softmax and tangent, at 2 x 4096 tokens), more than "
            f"training's activations: a training GPU's estimated peak is {gib(peak(m))} (27B: {gib(peak(big))} of "
            f"80 GB). Activations and vLLM's overhead are estimates, not GPU measurements.")
    return "```\n" + "\n".join(lines) + "\n```\n\n" + said


def peak(m) -> int:
    """A LoGRA training GPU's estimated peak: its state and step transient, with the larger of
    training's activations and the KL probe's (which runs after backward)."""
    return m["trainer_logra_bytes"] + max(m["trainer_activation_bytes"], m["trainer_probe_activation_bytes"])


def chart(rows):
    plt = metrics.pyplot()
    if plt is None:
        print("no chart: pip install matplotlib")
        return
    fig, ax = plt.subplots(figsize=(7, 3.6))
    x = range(len(rows))
    ax.bar([i - 0.3 for i in x], [r[1] for r in rows], 0.2, label="AdamW state (est.)")
    ax.bar([i - 0.1 for i in x], [r[3] or 0 for r in rows], 0.2, label="AdamW paper avg (27b: OOM)")
    ax.bar([i + 0.1 for i in x], [r[2] for r in rows], 0.2, label="LoGRA state (est.)")
    ax.bar([i + 0.3 for i in x], [r[4] for r in rows], 0.2, label="LoGRA paper avg")
    ax.axhline(80, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(list(x), [r[0] for r in rows])
    ax.set_ylabel("GiB per training GPU (4-way FSDP)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "memory_model.png")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"chart: {path}")


if __name__ == "__main__":
    main()
