"""GPU smoke run: LoGRA and dense AdamW side by side on one GPU, a few updates each.

A Qwen2.5-0.5B-shaped model (hidden 896, 24 layers, vocab 151936) built from a config, the
tiny arithmetic task, the Hugging Face engine in place of vLLM (vLLM is not needed), FSDP2 on
one rank with bf16 compute over fp32 master weights, activation checkpointing (`--checkpointing`,
on, as the committed tables ran: the preset's auto may turn it off): the `smoke-0.5b` preset of train.py. A random model never answers right, so every reward would be
-0.01, every advantage 0, every sketch 0: the preset first runs a short supervised warm-up on
the GPU (shared by both runs), so that rewards vary and the timed updates change the weights.
The script checks that and says so. Prints peak GPU memory and update time (median over the
updates after the first) side by side. Finishes in a few minutes on one H100/H200.

    python bench/gpu_smoke.py [--updates 4] [--warmup-steps 300] [--step-timeout 600]

Its `run` is what the device check's `train` and `speed` steps run (bench/gpu_check.py); their
JSON, not this script's print, makes bench/README.md's GPU tables.

Every step is bounded (a run: --step-timeout seconds, then its whole process group is killed)
and a failure names its step ("device checks: ...", "logra run: ...") in one line.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import report  # bench/report.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(optimizer, updates, warmup_steps, out_dir, timeout, preset="smoke-0.5b"):
    """One train.py run of the smoke preset (or `preset`); its update rows and wall time.
    Bounded: past `timeout` seconds its process group (torchrun and train.py) is killed."""
    run_dir = os.path.join(out_dir, optimizer)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", "29533",
           os.path.join(ROOT, "train.py"), "--model", preset, "--optimizer", optimizer,
           "--updates", str(updates), "--warmup-steps", str(warmup_steps), "--run-dir", run_dir,
           "--checkpointing"]  # on, as the measured tables ran it (the preset's default, auto, may turn it off)
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        print(out[-3000:], err[-3000:], sep="\n", flush=True)
        raise SystemExit(f"gpu_smoke.py: {optimizer} run: no end within {timeout} s (killed)")
    print(out[-3000:], err[-3000:] if proc.returncode else "", sep="\n", flush=True)
    if proc.returncode:
        last = (err.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"gpu_smoke.py: {optimizer} run: failed with exit {proc.returncode}: {last}")
    rows = [r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if "time_s" in r]
    return rows, time.time() - t0


def device_checks():
    """Bits that must not depend on the device: projections, merges; the sketch vs dense.
    Prints one line per check and returns the lines."""
    import torch

    sys.path.insert(0, ROOT)
    import rowadam
    import sketch

    seed = sketch.projection_seed(7, 3, "model.layers.0.mlp.down_proj")
    cpu, gpu = sketch.make_projection(256, 4864, seed), sketch.make_projection(256, 4864, seed, device="cuda")
    lines = [f"projection bit-identical on cpu and cuda: {torch.equal(cpu, gpu.cpu())}"]
    print(lines[-1])
    g = torch.Generator().manual_seed(0)
    w = torch.randn(896, 4864, generator=g)
    f = (torch.randn(896, 256, generator=g) * 1e-4).to(torch.bfloat16)
    w_cpu, w_gpu = w.clone(), w.cuda()
    rowadam.merge_rows(w_cpu, f, cpu)
    rowadam.merge_rows(w_gpu[:300], f.cuda(), gpu, row_offset=0, chunk_rows=128)  # another chunking, sharded
    rowadam.merge_rows(w_gpu[300:], f.cuda(), gpu, row_offset=300, chunk_rows=512)
    lines.append(f"merge bit-identical cpu (unsharded) vs cuda (2 shards): {torch.equal(w_cpu, w_gpu.cpu())}")
    print(lines[-1])
    x = torch.randn(4, 100, 4864, device="cuda", dtype=torch.float64, requires_grad=True)
    wt = torch.randn(896, 4864, device="cuda", dtype=torch.float64) / 70
    dy = torch.randn(4, 100, 896, device="cuda", dtype=torch.float64)
    a = gpu.double()
    s = torch.zeros(896, 256, device="cuda", dtype=torch.float64)
    sketch.sketched_linear(x, wt, None, a, s).backward(dy)
    ref = (dy.flatten(0, 1).t() @ x.detach().flatten(0, 1)) @ a.t()
    lines.append(f"sketch vs dense G A^T on cuda, float64: max rel err "
                 f"{((s - ref).abs().max() / ref.abs().max()).item():.1e}")
    print(lines[-1])
    return lines


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--updates", type=int, default=4)
    p.add_argument("--warmup-steps", type=int, default=300, help="supervised steps before the timed updates")
    p.add_argument("--step-timeout", type=float, default=600, help="seconds a run may take before it is killed")
    args = p.parse_args()
    import torch

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    try:
        result = ["; ".join(device_checks())]  # the paragraphs of the Markdown block
    except Exception as e:
        raise SystemExit(f"gpu_smoke.py: device checks: {type(e).__name__}: {e}") from None
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for optimizer in ("logra", "adam"):
            results[optimizer] = run(optimizer, args.updates, args.warmup_steps, tmp, args.step_timeout)
    # A timed update must be a real one: rewards that vary within a batch give non-zero
    # advantages, hence non-zero sketches (LoGRA) and a moved policy.
    for name, (rows, _) in results.items():
        varied = sum(0 < r["accuracy"] < 1 for r in rows)
        moved = sum(r["sketch_norm"] > 0 for r in rows) if name == "logra" else varied
        result.append(f"{name}: accuracy per update {[round(r['accuracy'], 3) for r in rows]}; rewards varied in "
                      f"{varied} of {len(rows)} updates"
                      + (f", non-zero sketches in {moved}" if name == "logra" else ""))
        print(result[-1])
        if not moved:
            result.append(f"WARNING: no {name} update changed the weights (no reward variance): its times are not "
                          f"those of a real update; raise --warmup-steps")
            print(result[-1])
    header = ["", "peak GPU memory (max over updates)", "update time (median, after the first)", "rollout", "train",
              "probe", "merge", "sync", "sync bytes", "wall"]
    table_rows = []
    base_mem = max(r["mem_gib"] for r in results["adam"][0])
    base_time = statistics.median(r["time_s"] for r in results["adam"][0][1:])
    for name, (rows, wall) in results.items():
        mem = max(r["mem_gib"] for r in rows)
        later = rows[1:]
        t = statistics.median(r["time_s"] for r in later)
        phases = [f"{statistics.median(r.get('time_' + k, 0.0) for r in later) * 1e3:.0f} ms"
                  for k in ("rollout", "train", "probe", "merge", "sync")]
        table_rows.append([name, f"{mem:.2f} GiB ({mem / base_mem:.2f}x)", f"{t * 1e3:.0f} ms ({t / base_time:.2f}x)",
                           *phases, f"{rows[-1]['sync_bytes'] / 2**20:.1f} MiB", f"{wall:.0f} s"])
    result.append(report.table(header, table_rows))
    print(result[-1])


if __name__ == "__main__":
    main()
