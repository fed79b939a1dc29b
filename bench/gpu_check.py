"""The prepared device check: every GPU-only path of the project, one step at a time.

`bash bench/gpu_check.sh` runs the steps below on one GPU, each in its own process under its own
timeout, with no vLLM and nothing downloaded (models are built from configs), in at most about
6 minutes on one H100/H200. Each step prints one line, `ok|FAIL name figures`, and adds its
record to the JSON file (--out DIR, gpu_check.json) as soon as it ends, so a run cut short
still says how far it got. `--cpu` runs the same steps at small widths on the CPU: the suite's
full tier runs it (tests/test_gpu_check.py), so that a GPU minute is never lost to a typo.

    versions        Python, torch, transformers, Triton; every project module imported
    cuda            the CUDA context: its start time, the device, the memory free after it
    kernels         at 7B widths in bf16 (down_proj, 3584 x 18944, 4096 tokens, r = 256): the
                    sketch S = G A^T, RowAdam's direction and the merge against float64
                    recomputations written here from the paper's formulas
    merge_bitwise   rowadam.merge_rows on the CPU (whole) and on the GPU (two shards, other
                    chunks) bit for bit at r = 32, 64, 256, and the signs of A that each device
                    makes for itself (sketch.make_signs), A in fp32 and bf16
    engine_weights  the engine's exact bf16 + int16 weights (sync.EngineWeights) on the GPU, the
                    residuals there and in pinned host memory: a factor payload encoded,
                    decoded and merged gives the trainer's fp32 master bit for bit
    probe           kl_control's fast probe at 2 x 4096 tokens on a Qwen2 of 7B widths (2 decoder
                    layers, its 152k vocabulary): its peak memory against the plan's count
                    (infra/memory_plan.py), and the plain probe's KL1 and peak beside it
    fsdp2           one-rank FSDP2 as train.py shards (bf16 compute, fp32 master) with a 7B-width
                    decoder layer: the row-sharded sketch against the unsharded model's, then
                    RowAdam, the probe and the merge
    train           train.py end to end (LoGRA) on a random-init model of Qwen2.5-0.5B's shape
                    with the Hugging Face engine (the smoke-0.5b preset; on the CPU the tiny one)
    speed           the same preset through train.py, LoGRA and then AdamW, 8 updates each: the
                    median of every phase over the updates after the first 2 (rollout, train,
                    probe with RowAdam's prepare, merge, realised KL, sync), side by side
    depth7b         the paper's 7B at full depth on one GPU (Qwen2.5-7B's widths, 28 layers,
                    random weights, fp32 master weights under one-rank FSDP2 with bf16 compute,
                    activation checkpointing, r = 256, synthetic advantages, no engine): one
                    whole update of the paper's size, 16 micro-batches of 2 x 4096 tokens, timed
                    end to end after a warm-up update, LoGRA (train, prepare, probe, merge,
                    realised KL) and AdamW (train, step), each in its own process, with its
                    peak memory against the memory plan's for one rank (infra/memory_plan.py)

    best7b          each method at its fastest setting that fits: LoGRA and AdamW at the paper's
                    7B on one GPU (depth7b's update, one timed), activation checkpointing on and
                    off, a setting the memory plan says will not fit this GPU skipped before it
                    allocates; each setting's time, peak and plan, each method's best
    one_gpu7b       trainer and engine on one GPU: train.py --model 7b-random --gpus 1 within
                    74 GiB (--gpu-memory and the allocator's cap), 3 updates of 32 prompts x 256
                    new tokens; peak, phases, generated tokens per second, one target of the
                    engine against a factor-merging copy of it after every refresh, the output check

    python bench/gpu_check.py STEP [--cpu] [--out DIR]    one step (what gpu_check.sh runs)
    python bench/gpu_check.py --depth7b-one METHOD [--cpu] [--checkpointing on|off] [--fit]
                                                          one method of depth7b or best7b (its child process)
    python bench/gpu_check.py --table FILE [FILE ...] [--markdown]   bench/README.md's GPU tables from runs' JSON
"""

import argparse
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time

import report  # bench/report.py (puts the repository root on sys.path)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ["versions", "cuda", "kernels", "merge_bitwise", "engine_weights", "probe", "fsdp2", "train", "speed",
         "depth7b", "best7b", "one_gpu7b"]
# The widths: the 7B preset's on a GPU, small ones on the CPU.
GPU = dict(hidden=3584, inter=18944, heads=28, kv_heads=4, vocab=152064, tokens=4096, rank=256)
CPU = dict(hidden=256, inter=1024, heads=4, kv_heads=2, vocab=1024, tokens=256, rank=32)
# depth7b's model: Qwen2.5-7B's own widths on a GPU (train.py's 7b preset), full depth at small widths on the CPU
DEPTH_CPU = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=28, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False, rope_theta=10000.0,
                 rms_norm_eps=1e-6)


class Failed(Exception):
    """A check whose figures are wrong: the step prints FAIL with them."""


def qwen2(w, layers, dtype, device):
    """A Qwen2 of widths `w` with `layers` decoder layers, random weights (seeded)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=w["hidden"], intermediate_size=w["inter"], num_attention_heads=w["heads"],
                         num_key_value_heads=w["kv_heads"], num_hidden_layers=layers, vocab_size=w["vocab"],
                         max_position_embeddings=w["tokens"], tie_word_embeddings=False)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.to(dtype)


def rel(got, want) -> float:
    """||got - want|| / ||want|| in float64."""
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm()).item()


# --- the steps: each returns its figures (a dict), or raises Failed ---------------------------

def versions(w, device):
    import importlib
    import platform

    import torch

    figures = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("transformers", "triton", "numpy"):
        try:
            figures[name] = importlib.import_module(name).__version__
        except ImportError:
            figures[name] = None
    modules = ["sketch", "rowadam", "kl_control", "sync", "ppo", "train"]
    modules += sorted("infra." + f[:-3] for f in os.listdir(os.path.join(ROOT, "infra"))
                      if f.endswith(".py") and f != "__init__.py")
    failed = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # the report is the point: every module, whatever fails
            failed[name] = f"{type(e).__name__}: {e}"
    figures["modules"] = len(modules)
    if failed:
        figures["failed"] = failed
        raise Failed(figures)
    return figures


def cuda(w, device):
    import torch

    if device == "cpu":
        return {"device": "cpu", "threads": torch.get_num_threads()}
    t0 = time.time()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    capability = ".".join(map(str, torch.cuda.get_device_capability()))
    return {"device": torch.cuda.get_device_name(), "capability": capability,
            "context_s": round(time.time() - t0, 2), "total_gib": round(total / 2**30, 2),
            "free_gib": round(free / 2**30, 2), "allocated_mib": round(torch.cuda.memory_allocated() / 2**20, 1)}


def reference_direction(s, v, step, beta2=0.95, eps=1e-8):
    """RowAdam's direction from the paper's formulas, in float64, written apart from rowadam.py."""
    v = beta2 * v + (1 - beta2) * (s * s).mean(dim=1)
    root = (v / (1 - beta2**step)).sqrt()
    den = root + max(eps * root.mean().item(), 2.2250738585072014e-308)
    scale = den.min() / den
    scale = scale / (scale * scale).mean().sqrt()
    d = scale[:, None] * s
    return d * (s.norm() / d.norm())


def kernels(w, device):
    import torch

    import rowadam
    import sketch

    d, k, n, r = w["hidden"], w["inter"], w["tokens"], w["rank"]  # down_proj: (d, k)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, k, generator=g, device=device).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(d, k, generator=g, device=device) / math.sqrt(k)).to(torch.bfloat16)
    dy = torch.randn(n, d, generator=g, device=device).to(torch.bfloat16)
    signs = sketch.make_signs(r, k, sketch.projection_seed(0, 0, "model.layers.0.mlp.down_proj"), device=device)
    a = sketch.projection_from_signs(signs)  # (r, k) fp32
    s = torch.zeros(d, r, device=device)
    a_act = sketch.projection_from_signs(signs, torch.bfloat16)  # A as a layer forms it for bf16 activations
    sketch.sketched_linear(x, weight, None, a_act, s).backward(dy)
    s_ref = (dy.double().t() @ x.detach().double()) @ a.double().t()  # G A^T, G = dY^T X
    p = x.detach() @ a_act.t()  # (N, r) bf16: the P that forward keeps
    fp32_product = dy.float().t() @ p.float()  # the product in fp32, as before projection 2's release
    kind = "fp32 out" if sketch._FP32_OUT_MM.get(torch.device(device).type) else "rounded to bf16"  # sketch_product's path
    figures = {"sketch_rel_err": rel(s, s_ref), "sketch_rel_err_fp32_product": rel(fp32_product, s_ref),
               "sketch_product": kind, "input_grad_rel_err": rel(x.grad, dy.double() @ weight.double())}
    v = torch.rand(d, device=device) * s.square().mean()
    u, _ = rowadam.row_adam_direction(s, v, step=3)
    figures["rowadam_rel_err"] = rel(u, reference_direction(s.double().cpu(), v.double().cpu(), 3))
    master = torch.randn(d, k, generator=g, device=device) / math.sqrt(k)
    f = (u * 1e-3).to(torch.bfloat16)
    merged = master.clone()
    rowadam.merge_rows(merged, f, a, avoid_ties=False)
    want = master.double() - (f.double() @ a.double()).float().double()  # fp32 W - fp32(F A), F A in float64
    figures["merge_differing"] = int((merged.double() != want.float().double()).sum())
    figures["merge_moved"] = float((merged - master).abs().max())
    if not (figures["sketch_rel_err"] < 2 * figures["sketch_rel_err_fp32_product"] + 1e-6  # the bound
            and figures["sketch_rel_err"] < 1e-2 and figures["input_grad_rel_err"] < 1e-2
            and figures["rowadam_rel_err"] < 1e-5 and figures["merge_differing"] == 0 and figures["merge_moved"] > 0):
        raise Failed(figures)
    return figures


def merge_bitwise(w, device):
    import torch

    import rowadam
    import sketch

    d, k = w["hidden"], w["inter"]
    figures = {}
    for r in (32, 64, 256):
        seed = sketch.projection_seed(7, 3, "model.layers.0.mlp.down_proj")
        a_cpu, a_dev = sketch.make_projection(r, k, seed), sketch.make_projection(r, k, seed, device=device)
        g = torch.Generator().manual_seed(r)
        master = torch.randn(d, k, generator=g)
        f = (torch.randn(d, r, generator=g) * 1e-4).to(torch.bfloat16)
        whole, parts = master.clone(), master.to(device)
        rowadam.merge_rows(whole, f, a_cpu)
        cut = d // 3
        rowadam.merge_rows(parts[:cut], f.to(device), a_dev, row_offset=0, chunk_rows=128)
        rowadam.merge_rows(parts[cut:], f.to(device), a_dev, row_offset=cut, chunk_rows=512)
        signs_cpu, signs_dev = sketch.make_signs(r, k, seed), sketch.make_signs(r, k, seed, device=device)
        figures[f"r{r}"] = {"signs_equal": torch.equal(signs_cpu, signs_dev.cpu()),  # each device made its own
                            "projection_equal": torch.equal(a_cpu, a_dev.cpu()) and torch.equal(
                                sketch.projection_from_signs(signs_cpu, torch.bfloat16),
                                sketch.projection_from_signs(signs_dev, torch.bfloat16).cpu()),
                            "merge_differing": int((whole != parts.cpu()).sum())}
    if not all(v["signs_equal"] and v["projection_equal"] and v["merge_differing"] == 0 for v in figures.values()):
        raise Failed(figures)
    return figures


def engine_weights(w, device):
    import torch

    import rowadam
    import sketch
    import sync
    from infra import wire
    from infra.checksum import checksums
    from infra.engine_weights import StreamedEngineWeights

    trainer = qwen2(dict(w, vocab=256), 1, torch.float32, device)
    modules = sketch.target_modules(trainer)
    with torch.no_grad():
        for m in modules.values():
            rowadam.avoid_bf16_ties_(m.weight)  # a tie-free start, as engine_sync.start makes it
    r, figures = w["rank"], {}
    for where in (None, "cpu"):  # residuals beside the weights, and in pinned host memory (27B)
        engine_model = qwen2(dict(w, vocab=256), 1, torch.bfloat16, device)
        engine_model.load_state_dict({k: v.to(torch.bfloat16) for k, v in trainer.state_dict().items()})
        engine = StreamedEngineWeights(engine_model, base_seed=0, rank=r, residual_device=where, checksums=checksums)
        masters = {n: m.weight.detach().clone() for n, m in modules.items()}
        # the start: the trainer's fp32 masters, exactly (engine_sync.start's full sync)
        engine.load_full(wire.decode(wire.encode(sync.full_payload(masters, update=0, base_seed=0, rank=r,
                                                                   dtype=torch.float32))))
        g = torch.Generator().manual_seed(1)
        factors = {n: (torch.randn(m.shape[0], r, generator=g) * 1e-4).to(torch.bfloat16).to(device)
                   for n, m in masters.items()}
        for update in range(2):
            for name, wt in masters.items():
                a = sketch.make_projection(r, wt.shape[1], sketch.projection_seed(0, update, name), device=device)
                rowadam.merge_rows(wt, factors[name], a)
            t0 = time.time()
            engine.apply(wire.decode(wire.encode(sync.Payload(update, 0, r, factors))))
            if device == "cuda":
                torch.cuda.synchronize()
            seconds = time.time() - t0
        differing = sum(int((engine.master(n) != masters[n]).sum()) for n in masters)
        residual_mib = round(engine.state_bytes() / 2**20, 1)
        figures["residuals_" + ("on_host" if where else "beside_weights")] = {
            "differing": differing, "apply_s": round(seconds, 3), "residual_mib": residual_mib}
    if any(v["differing"] for v in figures.values()):
        raise Failed(figures)
    return figures


def peak_bytes(device, run):
    """`run()`'s result and its peak memory above what was live before: CUDA's allocator peak,
    or on the CPU the live tensor bytes of a dispatch mode (bench/memory_check.py's)."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = run()
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - base
    from memory_check import LiveBytes

    with LiveBytes() as live:
        out = run()
    return out, live.peak


def probe(w, device):
    import torch

    import kl_control
    from infra import probe_decoder
    import sketch
    from infra import memory_plan

    model = qwen2(w, 2, torch.bfloat16, device).requires_grad_(False)
    r, batch, tokens = w["rank"], 2, w["tokens"]
    layers = sketch.attach(model, rank=r, seed=0)
    g = torch.Generator(device=device).manual_seed(0)
    directions = [torch.randn(layer.module.weight.shape[0], r, generator=g, device=device) * 1e-4
                  for layer in layers]
    ids = torch.randint(0, w["vocab"], (batch, tokens), generator=g, device=device)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, 0] = False
    call = dict(max_responses=batch, max_tokens=tokens)
    t0 = time.time()
    fast, fast_peak = peak_bytes(device, lambda: probe_decoder.fast_probe(model, layers, directions, ids, mask, **call))
    fast_s = time.time() - t0
    plan = memory_plan.estimate(model.config.to_dict(), 1, r, context=tokens, probe_forward_tokens=batch * tokens,
                                kl_real_positions=0, compute_bytes=2)
    planned = plan["trainer_probe_activation_bytes"] + plan["trainer_logra_phases"]["probe"]
    gib = 2**30
    figures = {"tokens": f"{batch} x {tokens}", "fast_kl1": fast.kl1, "fast_s": round(fast_s, 2),
               "fast_peak_gib": round(fast_peak / gib, 3), "plan_gib": round(planned / gib, 3),
               "attention_plan_gib": round(plan["trainer_probe_attention_bytes"] / gib, 3),
               "peak_over_plan": round(fast_peak / planned, 3)}
    try:
        t0 = time.time()
        plain, plain_peak = peak_bytes(device, lambda: kl_control.probe(model, layers, directions, ids, mask,
                                                                              **call))
        figures.update(plain_kl1=plain.kl1, plain_s=round(time.time() - t0, 2),
                       plain_peak_gib=round(plain_peak / gib, 3), kl1_rel_diff=abs(plain.kl1 / fast.kl1 - 1))
    except torch.OutOfMemoryError as e:  # the plain path holds (B, T, V) logits: a figure, not a failure
        figures["plain"] = f"out of memory: {str(e).splitlines()[0][:120]}"
    if not (fast_peak <= 1.1 * planned and figures.get("kl1_rel_diff", 0) < 2e-2 and math.isfinite(fast.kl1)):
        raise Failed(figures)
    return figures


def fsdp2(w, device):
    import torch
    import torch.distributed as dist

    import kl_control
    from infra import probe_decoder
    import rowadam
    import sketch
    from infra import policy
    from infra.batched import BatchedRowAdam
    from infra.row_shard import RowShard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    try:
        small = dict(w, vocab=1024, tokens=512)
        sharded, plain = qwen2(small, 1, torch.float32, device), qwen2(small, 1, torch.float32, device)
        for model in (sharded, plain):
            policy.freeze_for(model, "logra", sketch_rank=None, lora_alpha=None, seed=0)
        if device == "cuda":
            policy.shard(sharded, 1, "logra", torch.device(device))  # bf16 compute over fp32 master weights
        else:  # policy.shard leaves one CPU rank unsharded; fp32 FSDP2 here, so that the path runs
            from torch.distributed.fsdp import fully_shard

            for layer in sharded.model.layers:
                fully_shard(layer)
            fully_shard(sharded)
        if device == "cuda":  # bf16 parameters, as FSDP2's MixedPrecisionPolicy casts them; buffers (RoPE's
            for p in plain.parameters():  # inverse frequencies) stay fp32, as under FSDP2
                p.data = p.data.to(torch.bfloat16)
        r = w["rank"]
        ids = torch.randint(0, 1024, (2, 512), generator=torch.Generator().manual_seed(0)).to(device)
        mask = torch.ones_like(ids, dtype=torch.bool)
        mask[:, 0] = False
        sketches = []
        for model, group in ((sharded, dist.group.WORLD), (plain, None)):
            layers = sketch.attach(model, rank=r, seed=0, shard=None if group is None else RowShard(group))
            logits = model(input_ids=ids).logits.float()
            torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
            sketches.append((model, layers))
        (model, layers), (_, plain_layers) = sketches
        figures = {"sketch_rel_err": max(rel(a.sketch, b.sketch) for a, b in zip(layers, plain_layers))}
        opt = BatchedRowAdam(layers, seed=0, update_ratio=1e-3)
        opt.prepare()
        kl1 = probe_decoder.fast_probe(model, layers, opt.directions, ids, mask, max_responses=2).kl1
        alpha = kl_control.solve_alpha(kl1, budget=1e-3)
        before = [rowadam.local_rows(layer.module.weight)[0].clone() for layer in layers]
        opt.merge(alpha)
        moved = max(float((rowadam.local_rows(layer.module.weight)[0] - b).abs().max())
                    for layer, b in zip(layers, before))
        figures.update(kl1=kl1, alpha=alpha, weight_moved=moved,
                       weight_dtype=str(rowadam.local_rows(layers[0].module.weight)[0].dtype))
        if not (figures["sketch_rel_err"] < 2e-2 and math.isfinite(kl1) and kl1 > 0 and moved > 0):
            raise Failed(figures)
        return figures
    finally:
        dist.destroy_process_group()


def train(w, device):
    import gpu_smoke  # bench/gpu_smoke.py: one bounded train.py run

    preset, warmup = ("smoke-0.5b", 100) if device == "cuda" else ("tiny", 20)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            rows, wall = gpu_smoke.run("logra", 3, warmup, tmp, timeout=float(os.environ.get("STEP_TIMEOUT", 300)),
                                       preset=preset)
        except SystemExit as e:
            raise Failed({"error": str(e)}) from None
        saved = json.load(open(os.path.join(tmp, "logra", "config.json")))
    figures = {"preset": preset, "check_outputs": saved.get("check_outputs"), "updates": len(rows),
               "wall_s": round(wall, 1), "sync_s": round(statistics.median(r.get("time_sync", 0) for r in rows[1:]), 3),
               "update_s": round(statistics.median(r["time_s"] for r in rows[1:]), 3),
               "mem_gib": max(r["mem_gib"] for r in rows), "sketch_norm": [r["sketch_norm"] for r in rows]}
    if len(rows) != 3 or figures["check_outputs"] != (1 if device == "cuda" else 0):  # the output check's default
        raise Failed(figures)
    return figures


def speed(w, device):
    """LoGRA's and AdamW's updates side by side through train.py (bench/gpu_smoke.py's runs, which
    share the preset's warm-up): each phase's median over the updates after the first `SKIP`."""
    import gpu_smoke

    preset, warmup, updates, skip = ("smoke-0.5b", 100, 8, 2) if device == "cuda" else ("tiny", 20, 6, 2)
    deadline = time.time() + float(os.environ.get("STEP_TIMEOUT", 230))
    figures = {"preset": preset, "updates_timed": updates - skip}
    with tempfile.TemporaryDirectory() as tmp:
        for method in ("logra", "adam"):
            try:
                rows, _ = gpu_smoke.run(method, updates, warmup, tmp, timeout=deadline - time.time(), preset=preset)
            except SystemExit as e:
                raise Failed(dict(figures, error=str(e))) from None
            later = rows[skip:]
            median = lambda key: round(statistics.median(r.get(key, 0.0) for r in later), 4)  # noqa: E731
            figures[f"{method}_update_s"] = median("time_s")
            figures[f"{method}_sync_s"] = median("time_sync")
            figures[f"{method}_phases_s"] = {k: median("time_" + k) for k in PHASES}
            figures[f"{method}_sync_mib"] = round(rows[-1]["sync_bytes"] / 2**20, 2)
            figures[f"{method}_mem_gib"] = round(max(r["mem_gib"] for r in rows), 3)
            if method == "logra":
                figures["logra_nonzero_sketches"] = sum(r["sketch_norm"] > 0 for r in later)
    figures["update_ratio"] = round(figures["logra_update_s"] / figures["adam_update_s"], 3)
    figures["sync_ratio"] = round(figures["logra_sync_s"] / figures["adam_sync_s"], 3)
    figures["targets_met"] = {"update_le_1.2x_adam": figures["update_ratio"] <= 1.2,
                              "sync_le_adam": figures["sync_ratio"] <= 1.0}
    if not figures["logra_nonzero_sketches"]:  # no update changed the weights: not a real update's time
        raise Failed(figures)
    return figures


PHASES = ("rollout", "train", "probe", "merge", "kl_real", "sync")  # train.py's laps (probe: with prepare)


def depth7b(w, device):
    """The paper's 7B at full depth, one process per method (`depth7b_one`): end-to-end update
    times and peak memory, against the memory plan's peak for one rank."""
    import subprocess

    deadline = time.time() + float(os.environ.get("STEP_TIMEOUT", 230))
    figures = {}
    for method in ("logra", "adam"):
        cmd = [sys.executable, os.path.abspath(__file__), "--depth7b-one", method] + (["--cpu"] if device == "cpu" else [])
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=max(deadline - time.time(), 1))
        except subprocess.TimeoutExpired:
            raise Failed(dict(figures, error=f"{method}: no end within the step's time")) from None
        if out.returncode:
            raise Failed(dict(figures, error=f"{method}: exit {out.returncode}: {out.stderr.strip()[-400:]}"))
        got = json.loads(out.stdout.strip().splitlines()[-1])
        figures.update({f"{method}_{k}": v for k, v in got.items() if k not in ("plan_gib", "shape")})
        figures.setdefault("shape", got["shape"])
        figures[f"{method}_plan_gib"] = got["plan_gib"]
    figures["plan_gib"] = figures["logra_plan_gib"]  # LoGRA's planned peak (the figure)
    if "adam_update_s" in figures:
        figures["update_ratio"] = round(figures["logra_update_s"] / figures["adam_update_s"], 3)
    if device == "cuda":
        figures["logra_peak_over_plan"] = round(figures["logra_peak_gib"] / figures["logra_plan_gib"], 3)
        if "adam_peak_gib" in figures:
            figures["adam_peak_over_plan"] = round(figures["adam_peak_gib"] / figures["adam_plan_gib"], 3)
    if not (math.isfinite(figures["logra_kl1"]) and figures["logra_kl1"] > 0 and figures["logra_moved"] > 0):
        raise Failed(figures)
    return figures


def depth7b_one(method: str, device: str, timed: int = 2, micro: int = 16, checkpointing: bool = True,
                fit: bool = False) -> dict:
    """One method's updates at the paper's size: a warm-up update of 2 micro-batches, then
    `timed` whole updates of `micro` micro-batches of 2 x 4096 tokens (4 of 2 x 64 on the CPU: a
    rehearsal, whose figures do not depend on how many micro-batches an update sums), each
    phase timed end to end; the peak memory over the timed updates (CUDA's allocator; on the CPU
    the process's peak RSS, which the plan does not count), and the memory plan's peak for the
    same shapes on one rank (infra/memory_plan.peak), with activation checkpointing of every
    decoder layer or without. `fit`: first ask the plan, as train.py's --checkpointing auto
    does, whether the update fits this GPU's free memory (memory_plan.fits; on the CPU a
    rehearsal's budget, `rehearsal_gpu`), and skip it before anything is allocated where not."""
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import kl_control
    from infra import probe_decoder
    import ppo
    import train
    from infra import memory_plan, policy

    cuda = device == "cuda"
    widths = dict(train.PRESETS["7b"].model) if cuda else dict(DEPTH_CPU)
    tokens, r, batch = (4096, 256, 2) if cuda else (64, 32, 2)
    plan = memory_plan.estimate(widths, 1, r, micro_batch=batch, context=tokens, probe_forward_tokens=batch * tokens,
                                kl_real_positions=256, compute_bytes=2 if cuda else 4, cuda=cuda)
    planned = memory_plan.peak(plan, method, checkpointing)
    result = {"shape": f"{widths['num_hidden_layers']} layers, {micro} x {batch} x {tokens} tokens, r = {r}",
              "checkpointing": "on" if checkpointing else "off", "micro_batch": f"{batch} x {tokens}",
              "plan_gib": round(planned / 2**30, 2)}
    if fit:
        gpu = torch.cuda.mem_get_info()[0] if cuda else rehearsal_gpu(plan)
        result["gpu_free_gib"] = round(gpu / 2**30, 2)
        if not memory_plan.fits(planned, gpu):  # the plan says it will not fit: nothing allocated
            return dict(result, skipped=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29543")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    dev = torch.device(device)
    torch.manual_seed(0)
    with dev:
        model = Qwen2ForCausalLM(Qwen2Config(**dict(widths, max_position_embeddings=tokens)))
    policy.freeze_for(model, method, sketch_rank=r, lora_alpha=None, seed=0)
    policy.shard(model, 1, method, dev)  # FSDP2 on one GPU, bf16 compute over fp32 master weights (as train.py)
    opt, layers = policy.make_optimizer(model, method, sketch_rank=r, seed=0, update_ratio=6e-5, adam_lr=1e-6,
                                        lora_lr=1e-5, checkpointing=checkpointing)
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(3, widths["vocab_size"], (micro, batch, tokens), generator=g, device=dev)
    mask = torch.zeros(micro, batch, tokens, dtype=torch.bool, device=dev)
    mask[:, :, tokens // 4:] = True  # the last three quarters "generated"
    advantages = torch.randn(micro, batch, generator=g, device=dev).sign()

    def update(micro_batches):
        laps, last = {}, [time.perf_counter()]

        def lap(name):
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            laps[name] = now - last[0]
            last[0] = now

        n = int(mask[:micro_batches].sum())  # the update's response tokens (one rank: the global count)
        for i in range(micro_batches):
            logits = model(input_ids=ids[i], use_cache=False).logits  # (2, T, V)
            logp = ppo.response_logprobs(logits, ids[i])  # (2, T)
            loss, _ = ppo.policy_loss(logp, advantages[i], mask[i], rollout_logprobs=logp.detach(), num_tokens=n)
            loss.backward()
            del logits, logp, loss
        lap("train")
        if method == "adam":
            opt.step()
            opt.zero_grad(set_to_none=True)
            lap("step")
            return laps, {}
        opt.prepare()
        lap("prepare")
        probe = probe_decoder.fast_probe(model, layers, opt.directions, ids[0], mask[0], max_responses=batch,
                                         keep_positions=256)  # the paper's 2 responses, 256 positions kept for kl_real
        alpha = kl_control.solve_alpha(probe.kl1, budget=2e-4)
        lap("probe")
        before = layers[-1].module.weight.to_local()[:4].clone() if cuda else layers[-1].module.weight[:4].clone()
        opt.merge(alpha)
        lap("merge")
        kl_real = kl_control.realised_kl(probe, model, ids[0], mask[0])
        lap("kl_real")
        after = layers[-1].module.weight.to_local()[:4] if cuda else layers[-1].module.weight[:4]
        return laps, {"kl1": probe.kl1, "alpha": alpha, "kl_real": kl_real,
                      "moved": float((after - before).abs().max())}

    phase = "warm-up"
    try:
        update(2)
        times, seen = [], {}
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        for i in range(timed):
            phase = f"timed update {i + 1}"
            laps, seen = update(micro)
            times.append(laps)
        # CUDA's allocator peak over the timed updates; on the CPU the process's peak RSS (not the plan's measure)
        peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except torch.OutOfMemoryError as e:
        return dict(result, oom=True, oom_phase=phase, error=str(e).splitlines()[0][:160])
    finally:
        dist.destroy_process_group()
    med = {k: statistics.median(t[k] for t in times) for k in times[0]}  # each phase's median over the timed updates
    result.update(update_s=round(sum(med.values()), 3), phases_s={k: round(v, 3) for k, v in med.items()},
                  peak_gib=round(peak / 2**30, 2), oom=False, **seen)
    return result


def rehearsal_gpu(plan) -> float:
    """The CPU rehearsal's stand-in for a GPU's free memory: as an H200 holds the 7B's settings
    (bench/results/gpu_check: AdamW with checkpointing at 126 GiB, not without), the midpoint of
    AdamW's planned peaks with and without checkpointing, so that best7b's skip is rehearsed."""
    from infra import memory_plan

    return memory_plan.FIT_MARGIN * (memory_plan.peak(plan, "adam", True) + memory_plan.peak(plan, "adam", False)) / 2


def best7b(w, device):
    """Each method at its fastest setting that fits (issue 72, item 1): LoGRA and AdamW at the
    paper's 7B on one GPU (`depth7b_one`: 16 micro-batches of 2 x 4096 tokens, one timed update
    after a warm-up one), with activation checkpointing and without, each in its own process;
    a setting the memory plan says will not fit this GPU's free memory is skipped before
    anything is allocated (recorded `skipped`), one that runs out of memory recorded `oom`. The
    best of each method is its fastest setting that ran."""
    import subprocess

    deadline = time.time() + float(os.environ.get("STEP_TIMEOUT", 170))
    settings, figures = [], {}
    for method in ("logra", "adam"):
        for checkpointing in ("on", "off"):
            cmd = [sys.executable, os.path.abspath(__file__), "--depth7b-one", method, "--checkpointing", checkpointing,
                   "--fit"] + (["--cpu"] if device == "cpu" else [])
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=max(deadline - time.time(), 1))
            except subprocess.TimeoutExpired:
                raise Failed(dict(figures, settings=settings, error=f"{method} {checkpointing}: no end within the "
                                  f"step's time")) from None
            if out.returncode:
                why = f"{method} {checkpointing}: exit {out.returncode}: {out.stderr.strip()[-400:]}"
                raise Failed(dict(figures, settings=settings, error=why))
            got = json.loads(out.stdout.strip().splitlines()[-1])
            figures.setdefault("shape", got["shape"])
            entry = {"method": method, "checkpointing": checkpointing, "micro_batch": got["micro_batch"],
                     "plan_gib": got["plan_gib"], "gpu_free_gib": got.get("gpu_free_gib")}
            if got.get("skipped"):
                entry["skipped"] = True
            elif got.get("oom"):
                entry.update(oom=True, oom_phase=got["oom_phase"])
            else:
                entry.update(update_s=got["update_s"], peak_gib=got["peak_gib"], phases_s=got["phases_s"])
                if device == "cuda":
                    entry["peak_over_plan"] = round(got["peak_gib"] / got["plan_gib"], 3)
                if method == "logra" and not (math.isfinite(got["kl1"]) and got["kl1"] > 0 and got["moved"] > 0):
                    raise Failed(dict(figures, settings=settings + [entry], error="LoGRA's update moved nothing"))
            settings.append(entry)
    figures["settings"] = settings
    for method in ("logra", "adam"):
        ran = [e["update_s"] for e in settings if e["method"] == method and "update_s" in e]
        figures[f"{method}_best_update_s"] = min(ran) if ran else None
    logra, adam = figures["logra_best_update_s"], figures["adam_best_update_s"]
    if logra is None:  # LoGRA fits one GPU with checkpointing at 7B (46 GiB): it must have run
        raise Failed(figures)
    if adam is not None:
        figures["best_ratio"] = round(logra / adam, 3)
    figures["targets_met"] = {"logra_best_le_0.8x_adam_best": adam is not None and logra <= 0.8 * adam,
                              "plans_within_10pct": all(abs(e.get("peak_over_plan", 1) - 1) <= 0.1 for e in settings)}
    return figures


def one_gpu7b(w, device):
    """Trainer and engine on one GPU (issue 72, item 2): train.py --model 7b-random --gpus 1
    --gpu-memory 74, with torch.cuda.set_per_process_memory_fraction at the same 74 GiB (any GPU
    then holds what an 80 GB H100 does), 3 updates of 32 prompts x 256 new tokens, in its own
    process (`one_gpu7b_child`). Its figures: each update's peak (CUDA's allocator, train.py's
    mem_gib), the GPU's memory, the phases' medians over updates 2-3 (sync: the cast refresh,
    train.py's fingerprints and its output check), generated tokens per second of rollout,
    `engine_equal` (after every refresh, the engine's cast bf16 weight of one target, the first
    sketched layer `engine_equal_target`, bit for bit what a factor-merging copy of that target
    holds: sync.EngineWeights' bf16 + int16 residual, started from the trainer's fp32 master and
    fed the factors the trainer merged, A regenerated from the seed; `engine_equal_moved`: how
    many of its bf16 values the 3 updates changed), `output_check` (train.py's check of the
    engine's log-probs against the trainer's after every sync: each mean gap) and the plan's
    peak. On the CPU: the tiny preset with --gpus 1 and a short warm-up, the same figures."""
    import subprocess

    timeout = float(os.environ.get("STEP_TIMEOUT", 150))
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, os.path.abspath(__file__), "--one-gpu7b-child", tmp]
        cmd += ["--cpu"] if device == "cpu" else []
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise Failed({"error": "no end within the step's time"}) from None
        if out.returncode:
            raise Failed({"error": f"exit {out.returncode}: {(out.stderr.strip() or out.stdout.strip())[-600:]}"})
        child = json.loads(out.stdout.strip().splitlines()[-1])
        rows = [json.loads(line) for line in open(os.path.join(tmp, "run", "metrics.jsonl"))][1:]
        saved = json.load(open(os.path.join(tmp, "run", "config.json")))
    later = rows[1:]
    median = lambda key: round(statistics.median(r.get(key, 0.0) for r in later), 3)  # noqa: E731
    figures = {"preset": saved["preset"], "updates": len(rows),
               "checkpointing": "on" if saved["checkpointing"] else "off",
               "peak_gib": round(max(r["mem_gib"] for r in rows), 2), "gpu_total_gib": child["gpu_total_gib"],
               "gpu_memory_gib": saved["gpu_memory"], "plan_gib": round(saved["plan_gib"], 2),
               "phases_s": {k: median("time_" + k) for k in PHASES}, "update_s": median("time_s"),
               "generated_tokens_per_s": round(statistics.median(r["tokens"] / r["time_rollout"] for r in later), 1),
               "sync_bytes": max(r["sync_bytes"] for r in rows), "engine_equal": child["engine_equal"],
               "engine_equal_target": child["engine_equal_target"], "engine_equal_moved": child["engine_equal_moved"],
               "output_check": child["output_check"]}
    if device == "cuda":
        figures["peak_over_plan"] = round(figures["peak_gib"] / figures["plan_gib"], 3)
    if not (figures["updates"] == 3 and figures["engine_equal"] and figures["output_check"]["passed"]
            and figures["sync_bytes"] == 0 and (device == "cpu" or figures["peak_gib"] <= saved["gpu_memory"])):
        raise Failed(figures)
    return figures


def one_gpu7b_child(out: str, device: str) -> dict:
    """one_gpu7b's process: the allocator capped (CUDA), then train.py's main with the one-GPU
    layout, every refresh and output check of the run watched (the module functions train.py
    calls, wrapped here). `engine_equal`: a factor-merging copy of one target (`factor_copy`, on
    the trainer's device) started from the trainer's fp32 master before the first update and
    fed, after each refresh, the factors that update's merge returned (train.py's logra_step,
    wrapped), its bf16 weight compared bit for bit with the engine's cast one."""
    import torch

    import sync
    import train
    from infra import engine_sync, launch, one_gpu

    gib, total = 74, None
    if device == "cuda":
        total = torch.cuda.mem_get_info()[1]
        torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total)
        argv = ["--model", "7b-random", "--gpus", "1", "--gpu-memory", str(gib), "--updates", "3", "--no-eval-base"]
    else:  # the tiny preset at a short warm-up, this CPU as its one device
        argv = ["--model", "tiny", "--gpus", "1", "--gpu-memory", str(gib), "--updates", "3", "--no-eval-base",
                "--warmup-steps", "20", "--batch", "16", "--eval-problems", "16", "--eval-every", "0",
                "--check-outputs", "1"]
    equal, gaps, merged = [], [], []  # merged: (layer, its factor) of the update not yet refreshed
    copy = {}  # "engine": the factor_copy, "start": its bf16 weight before the first update
    refresh, check_outputs, logra_step = one_gpu.refresh, engine_sync.check_outputs, train.logra_step

    def watched_step(model, opt, layers, rollout, budget_of, cfg, timer):
        layer = layers[0]
        if not copy:  # before the first merge: the trainer's fp32 master, tie-free since engine_sync.start
            master = one_gpu.master_weight(layer.module).detach()
            copy["engine"] = factor_copy(layer.name, master, base_seed=cfg.seed, rank=cfg.sketch_rank)
            copy["start"] = copy["engine"].slots[layer.name].weight.clone()
        step = logra_step(model, opt, layers, rollout, budget_of, cfg, timer)
        merged.append((layer, step["factors"][0]))
        return step

    def watched_refresh(engine, modules, **kw):
        sent = refresh(engine, modules, **kw)
        layer, f = merged.pop()
        mine = copy["engine"]
        mine.apply(sync.Payload(kw["update"], mine.base_seed, mine.rank, {layer.name: layer.all_rows(f)}))
        equal.append(torch.equal(engine.weights.slots[layer.name].weight.view(torch.int16),
                                 mine.slots[layer.name].weight.view(torch.int16)))
        return sent

    def watched_check(*args, **kw):
        gaps.append(check_outputs(*args, **kw))
        return gaps[-1]

    one_gpu.refresh, engine_sync.check_outputs, train.logra_step = watched_refresh, watched_check, watched_step
    train.main([*argv, "--run-dir", os.path.join(out, "run")])
    mine = copy.get("engine")
    name = next(iter(mine.slots)) if mine else None
    moved = int((mine.slots[name].weight.view(torch.int16) != copy["start"].view(torch.int16)).sum()) if mine else 0
    launch.release()  # as train.py's __main__: the run's objects freed while the interpreter is whole
    return {"gpu_total_gib": round(total / 2**30, 2) if total else None,
            "engine_equal": len(equal) == 3 and all(equal) and not merged, "engine_equal_target": name,
            "engine_equal_moved": moved,
            "output_check": {"checks": len(gaps), "worst_mean_gap": max(gaps) if gaps else None,
                             "tolerance": engine_sync.OUTPUT_TOLERANCE, "passed": len(gaps) == 3}}


def factor_copy(name, master, *, base_seed, rank):
    """sync.EngineWeights over one target `name`: a bf16 weight and an int16 residual on
    `master`'s device, loaded with the fp32 `master` (exact: no bf16 ties), then merging each
    payload's F with A regenerated from the seed as a factor-synced engine does."""
    import torch

    import sync

    class One(sync.EngineWeights):
        def _blocks(self, model):
            return [(name, model, 0, model.shape[0])]

    engine = One(torch.empty(master.shape, dtype=torch.bfloat16, device=master.device), base_seed=base_seed, rank=rank)
    engine.load_full(sync.full_payload({name: master}, update=0, base_seed=base_seed, rank=rank, dtype=torch.float32))
    return engine


# --- running a step, recording it, the table ---------------------------------------------------

def record(out: str, name: str, ok: bool, figures, seconds: float) -> None:
    """Add one step's record to out/gpu_check.json (rewritten whole, so it is valid JSON after
    every step) and print its line."""
    path = os.path.join(out, "gpu_check.json")
    records = json.load(open(path)) if os.path.exists(path) else []
    records.append({"step": name, "ok": ok, "seconds": round(seconds, 1), "figures": figures})
    os.makedirs(out, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(records, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    print(f"{'ok' if ok else 'FAIL'} {name} {json.dumps(figures, default=str)}", flush=True)


def run_step(name: str, cpu: bool, out: str) -> bool:
    device = "cpu" if cpu else "cuda"
    t0 = time.time()
    try:
        figures, ok = globals()[name](CPU if cpu else GPU, device), True
    except Failed as e:
        figures, ok = e.args[0], False
    except Exception as e:  # any error is this step's FAIL line, and the next step still runs
        figures, ok = {"error": f"{type(e).__name__}: {str(e)[:300]}"}, False
    record(out, name, ok, figures, time.time() - t0)
    return ok


def figure(v) -> str:
    """A figure as the table shows it: floats to 3 significant digits, dicts and lists inside too."""
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} {figure(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(figure(x) for x in v) + "]"
    return str(v)


def newest_records(paths):
    """{step: (path, record)}: each step's record from the first of `paths` (the newest run
    first) that holds it."""
    chosen = {}
    for path in paths:
        for record in json.load(open(path)):
            chosen.setdefault(record["step"], (path, record))
    return chosen


def table(paths) -> str:
    """bench/README.md's table of the device check from one run's JSON, or several runs' (the
    newest first: each step from the newest run that has it, the run named in its row)."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    chosen = newest_records(paths)
    several = len(paths) > 1
    rows = []
    for step in [s for s in STEPS if s in chosen] + [s for s in chosen if s not in STEPS]:
        path, r = chosen[step]
        rows.append([r["step"], "ok" if r["ok"] else "**FAIL**", f"{r['seconds']:.0f} s",
                     *([os.path.basename(path)] if several else []),
                     "; ".join(f"{k} {figure(v)}" for k, v in r["figures"].items())])
    missing = [s for s in STEPS if s not in chosen]
    by_step = {step: r["figures"] for step, (_, r) in chosen.items()}
    where = by_step.get("cuda", {}).get("device", "an unknown device")
    torch_version = by_step.get("versions", {}).get("torch", "?")
    files = ", ".join(os.path.relpath(p, ROOT) for p in paths)
    lines = [f"Run by `bash bench/gpu_check.sh` on {where} (torch {torch_version}); the table built from "
             f"{'the JSON of ' + str(len(paths)) + ' runs, the newest first' if several else 'its JSON'} ({files}).",
             report.table(["step", "result", "time", *(["run"] if several else []), "figures"], rows)]
    if missing:
        lines.append(f"not run (the check was cut short): {', '.join(missing)}")
    return "\n\n".join(lines)


def speed_table(paths) -> str:
    """The `speed` step's phases side by side (train.py's laps: the probe's includes RowAdam's
    prepare, the sync its fingerprints and output check), the `depth7b` step's, `best7b`'s
    settings and `one_gpu7b`'s run."""
    chosen = newest_records([paths] if isinstance(paths, str) else paths)
    out = []
    if "speed" in chosen:
        path, r = chosen["speed"]
        f = r["figures"]
        rows = []
        for name, key in [("update", "update_s")] + [(p, p) for p in PHASES]:
            logra = f["logra_update_s"] if key == "update_s" else f["logra_phases_s"][key]
            adam = f["adam_update_s"] if key == "update_s" else f["adam_phases_s"][key]
            label = {"probe": "probe (with RowAdam's prepare)", "kl_real": "realised KL",
                     "merge": "merge (AdamW: its step)", "sync": "sync (with fingerprints and the output check)"}
            rows.append([label.get(name, name), f"{logra * 1e3:.0f} ms", f"{adam * 1e3:.0f} ms",
                         f"{logra / adam:.2f}x" if adam else ""])
        rows.append(["sync bytes", f"{f['logra_sync_mib']:.1f} MiB", f"{f['adam_sync_mib']:.1f} MiB",
                     f"{f['logra_sync_mib'] / f['adam_sync_mib']:.2f}x"])
        rows.append(["peak GPU memory", f"{f['logra_mem_gib']:.2f} GiB", f"{f['adam_mem_gib']:.2f} GiB",
                     f"{f['logra_mem_gib'] / f['adam_mem_gib']:.2f}x"])
        out += [f"`speed` ({os.path.basename(path)}): train.py's `{f['preset']}` preset, LoGRA and AdamW on one GPU "
                f"with the Hugging Face engine, medians over updates 3-{2 + f['updates_timed']} of each run:",
                report.table(["phase", "LoGRA", "AdamW", "LoGRA / AdamW"], rows)]
    if "depth7b" in chosen:
        path, r = chosen["depth7b"]
        f = r["figures"]
        phases = ["train", "prepare", "probe", "merge", "kl_real", "step"]
        rows = [["update, end to end", f"{f['logra_update_s']:.2f} s",
                 f"{f['adam_update_s']:.2f} s" if not f.get("adam_oom") else "out of memory",
                 f"{f['update_ratio']:.3f}x" if "update_ratio" in f else ""]]
        for phase in phases:
            logra, adam = f["logra_phases_s"].get(phase), f.get("adam_phases_s", {}).get(phase)
            rows.append([phase, "" if logra is None else f"{logra:.3f} s", "" if adam is None else f"{adam:.3f} s", ""])
        for method in ("logra", "adam"):
            if f.get(f"{method}_peak_gib") is not None:
                rows.append([f"peak memory ({'LoGRA' if method == 'logra' else 'AdamW'}) against the plan",
                             *([f"{f['logra_peak_gib']:.2f} GiB / {f['logra_plan_gib']:.2f} GiB", ""] if method == "logra"
                               else ["", f"{f['adam_peak_gib']:.2f} GiB / {f['adam_plan_gib']:.2f} GiB"]),
                             f"{f[f'{method}_peak_over_plan']:.3f}" if f"{method}_peak_over_plan" in f else ""])
        out += [f"`depth7b` ({os.path.basename(path)}): {f['shape']}; Qwen2.5-7B's widths, random weights, fp32 master "
                f"weights under one-rank FSDP2 with bf16 compute, activation checkpointing, synthetic advantages, no "
                f"engine; medians of 2 whole updates after a warm-up one, each method in its own process; the plan: "
                f"infra/memory_plan.py for one rank (`WORLD_SIZE=1 python train.py --model 7b --dry-run`):",
                report.table(["", "LoGRA", "AdamW", "LoGRA / AdamW (peak / plan)"], rows)]
    if "best7b" in chosen:
        path, r = chosen["best7b"]
        f = r["figures"]
        rows = [[{"logra": "LoGRA", "adam": "AdamW"}[e["method"]], e["checkpointing"], e["micro_batch"],
                 f"{e['update_s']:.2f} s" if "update_s" in e else "skipped (plan)" if e.get("skipped") else
                 "out of memory", f"{e['peak_gib']:.2f} GiB" if "peak_gib" in e else "", f"{e['plan_gib']:.2f} GiB",
                 f"{e['peak_over_plan']:.3f}" if "peak_over_plan" in e else ""] for e in f["settings"]]
        best = ", ".join(f"{name} {f[key]:.2f} s" for name, key in (("LoGRA", "logra_best_update_s"),
                                                                     ("AdamW", "adam_best_update_s")) if f.get(key))
        out += [f"`best7b` ({os.path.basename(path)}): {f['shape']}, each method with activation checkpointing and "
                f"without, one timed update each; the best: {best}"
                + (f" ({f['best_ratio']:.3f}x)" if "best_ratio" in f else "") + ":",
                report.table(["method", "checkpointing", "micro-batch", "update", "peak", "plan", "peak / plan"],
                             rows)]
    if "one_gpu7b" in chosen:
        path, r = chosen["one_gpu7b"]
        f = r["figures"]
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in f["phases_s"].items())
        out.append(f"`one_gpu7b` ({os.path.basename(path)}): train.py --model {f['preset']} --gpus 1 within "
                   f"{f['gpu_memory_gib']:g} GiB, {f['updates']} updates, checkpointing {f['checkpointing']}: peak "
                   f"{f['peak_gib']:.2f} GiB (plan {f['plan_gib']:.2f} GiB), update {f['update_s']:.2f} s ({phases}), "
                   f"{f['generated_tokens_per_s']:.0f} generated tokens/s, engine equal to a factor-merging copy of "
                   f"{f.get('engine_equal_target', 'one target')} {f['engine_equal']}, output check "
                   f"{f['output_check']['passed']} (worst mean gap "
                   f"{figure(f['output_check']['worst_mean_gap'])} nats)")
    return "\n\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", nargs="?", choices=STEPS)
    p.add_argument("--cpu", action="store_true", help="the same steps at small widths on the CPU")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"), help="where gpu_check.json goes")
    p.add_argument("--table", nargs="+", metavar="FILE",
                   help="runs' gpu_check.json, the newest first: print bench/README.md's tables of them")
    p.add_argument("--fail", nargs=2, metavar=("STEP", "WHY"), help="record STEP as failed (gpu_check.sh: a timeout)")
    p.add_argument("--depth7b-one", choices=["logra", "adam"], help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", choices=["on", "off"], default="on", help=argparse.SUPPRESS)
    p.add_argument("--fit", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--one-gpu7b-child", metavar="DIR", help=argparse.SUPPRESS)
    args = report.parse_args(p, "gpu_check", "gpu_speed")
    if args.depth7b_one:
        sys.path.insert(0, os.path.join(ROOT, "bench"))
        timed = 1 if args.fit else 2  # best7b: one timed update a setting
        print(json.dumps(depth7b_one(args.depth7b_one, "cpu" if args.cpu else "cuda", timed=timed,
                                     micro=4 if args.cpu else 16, checkpointing=args.checkpointing == "on",
                                     fit=args.fit)), flush=True)
    elif args.one_gpu7b_child:
        print(json.dumps(one_gpu7b_child(args.one_gpu7b_child, "cpu" if args.cpu else "cuda")), flush=True)
    elif args.fail:
        record(args.out, args.fail[0], False, {"error": args.fail[1]}, 0.0)
    elif args.table:
        body, speeds = table(args.table), speed_table(args.table)
        print(body + "\n\n" + speeds)
        if args.markdown:
            report.publish("gpu_check", body)
            report.publish("gpu_speed", speeds)
    elif args.step:
        sys.path.insert(0, os.path.join(ROOT, "bench"))
        raise SystemExit(0 if run_step(args.step, args.cpu, args.out) else 1)
    else:
        p.error("give a STEP, --table FILE or --fail STEP WHY")


if __name__ == "__main__":
    main()
