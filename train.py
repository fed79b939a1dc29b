"""
train.py: the whole LoGRA RL loop, top to bottom (arXiv:2610.06647).

    python train.py                                   # the tiny preset on this CPU, end to end
    python train.py --optimizer adam                  # the dense AdamW baseline, same task
    torchrun --nproc_per_node 2 train.py --model tiny # FSDP2 over 2 CPU processes (gloo)
    python train.py --resume runs/tiny-logra          # continue a run from its checkpoint (verified first)
    torchrun --nproc_per_node 4 train.py --model 7b   # the paper's run: 4 GPUs + 4 vLLM engines
    python train.py --model 7b --dry-run              # its sharding plan and memory, no GPU
    python train.py --model 7b --dry-run --nodes 2    # the same on 2 nodes, with the launch lines

One update, in the order the paper runs it (the loop in `run`):

    rollout   the engine (a bf16 copy of the policy, changed only by sync payloads) samples
              one response per prompt at temperature 1.0, with per-token log-probs
              (--group-size G: G responses per prompt, on one rank: infra/engine.py)
    reward    1 for a correct boxed answer, -0.01 otherwise                      (ppo.py)
    baseline  A = r - b, b a running mean over the global batch                  (ppo.py)
              (--advantage grpo, drgrpo, rloo: against the response's group)
    loss      REINFORCE with truncated importance sampling, / global response tokens
    backward  into the sketches S = G A^T; no weight gradient exists             (sketch.py)
    RowAdam   per-row scaling of the sketches, one global scale -> U             (rowadam.py)
    KL probe  forward-mode AD predicts KL(alpha) = alpha^2 KL1; alpha spends the budget
              (cosine 2e-4 -> 2e-5 for the paper's presets, minus the mismatch) (kl_control.py)
    merge     W -= bf16(alpha U) A_t in the fp32 master weights; A_t -> A_{t+1}  (rowadam.py)
    sync      the same bf16 factors go to the engine, which merges them itself;
              fingerprints confirm both hold the same weights                   (sync.py)
              (--sync delta, any optimizer: the bf16 elements the update changed)

The dense baseline (--optimizer adam) runs the same loop with backward into .grad, one
AdamW step in place of RowAdam, the probe and the merge, and full bf16 weights as its sync;
LoRA (--optimizer lora, the paper's Table 2) the same with adapters as its weights.

This file is the update and its wiring. What runs it but is not the method is in infra/, one
concept a file (the README's Files table): options, launch, lifecycle, policy, tasks, engine
(the rollout interface and the in-process Hugging Face engine), vllm_engine, heal, checkpoint,
metrics, memory_plan, architectures, lora. Each raises its own RunError (infra/errors.py);
`main` turns it into one line and an exit code.

Shape legend: B responses of this rank (b of a micro-batch), T tokens of a padded response
with its prompt, V vocabulary.

Departures from the paper
-------------------------
1. The paper's baseline is "Adam with learning-rate annealing" and gives no schedule:
   lr_t = adam_lr sqrt(budget_t / budget_0), the KL budget's cosine, so that AdamW's step
   anneals by the same factor as LoGRA's (whose step goes as sqrt(KL)). Test:
   tests/test_train.py, test_smoke_run[adam].
2. The KL probe scores the first `probe_responses` (2) responses of each rank, as the paper
   does, and more until they hold `probe_tokens` generated tokens: the paper's responses run
   to thousands of tokens, the tiny task's to a few, and KL1 from 16 tokens is noise (the
   tiny preset scores 512, i.e. all its responses). The sample grows with the number of
   ranks. Test: tests/test_train_paper_path.py, test_probe_count_sizes_the_probe_in_tokens.
   With groups (--group-size G > 1, not the paper's), the "first" responses are taken across
   groups: the first response of each of the rank's groups, then the second of each, and so
   on (`logra_step`), so that two probed responses never answer the same prompt while the
   rank has two groups; the realised KL is measured on the same rows.

Implementation notes
--------------------
- Rollouts draw their randomness per response (a seed from the run seed, the update and the
  response's global index: infra/engine.py's `rollout_slots`), so one process and two sample the
  same responses, a prompt's G responses differ, and a resumed run is bitwise the run that was
  not interrupted (infra/engine.py).
"""

import atexit
import copy
import math
import os
import sys

import torch
import torch.distributed as dist

import kl_control
import ppo
import rowadam
import sketch
import sync
from infra import checkpoint, launch, lifecycle, lora, metrics, options, policy, tasks, vllm_engine
from infra.engine import HFEngine, evaluate, rollout_slots
from infra.errors import RunError


# -----------------------------------------------------------------------------
# Presets: every model size in one table, picked by name (--model)

# The setup of the paper's Table 1 (arXiv:2610.06647): one node, 4 training GPUs with FSDP + 4 vLLM
# engines, DAPO-Math-17k for training and MATH-500 for evaluation; its hyperparameters as the
# paper states them (rank 256, KL budget 2e-4 -> 2e-5, 128 prompts per update, AdamW at 1e-6).
PAPER = dict(
    task="math", sync="factors", sketch_rank=256, batch=128, micro_batch=2, group_size=1, advantage="running",
    updates=200, temperature=1.0,
    max_new_tokens=3072, context=4096, update_ratio=6e-5, kl_start=2e-4, kl_end=2e-5, kl_horizon=300, alpha_max=3.0,
    probe_responses=2, probe_tokens=0, kl_real_positions=256, adam_lr=1e-6, lora_lr=1e-5, lora_alpha=32.0,
    warmup_steps=0, eval_every=10,
    eval_problems=500, eval_samples=4, gym_tasks="hard", gym_level=2,
    eval_temperature=0.7, eval_top_p=0.7, checkpointing=True, save_every=20, seed=0, device="cuda",
    engine="vllm", engine_gpus="4,5,6,7", engine_timeout=1800, dist_timeout=3600, engine_restarts=3,
    train_data="BytedTsinghua-SIA/DAPO-Math-17k", eval_data="HuggingFaceH4/MATH-500",
)

SMOLLM2_135M = dict(  # SmolLM2-135M(-Instruct)'s widths, a Llama
    model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
    rope_theta=100000.0, rms_norm_eps=1e-5)
PRESETS = {
    # A CPU run of a minute or two. head_dim 32 (2 heads of 32): vLLM's CPU attention kernel
    # refuses 16, so `--engine vllm` runs the same model. 3000 warm-up steps make every seed's
    # base policy add reliably, so that the box is what RL has to learn (infra/tasks.py).
    "tiny": dict(
        task="arithmetic", sync="factors",
        model=dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False),
        sketch_rank=32, batch=64, micro_batch=64, group_size=1, advantage="running", updates=150,
        temperature=1.0, max_new_tokens=8,
        update_ratio=2e-3, kl_start=2e-2, kl_end=5e-3, kl_horizon=150, alpha_max=3.0, probe_responses=2,
        probe_tokens=512, kl_real_positions=1024,
        adam_lr=1e-4, lora_lr=1e-3, lora_alpha=32.0, warmup_steps=3000, warmup_batch=128, warmup_lr=3e-3,
        warmup_unboxed=0.7,
        eval_every=25, eval_problems=256, eval_samples=2, eval_temperature=1.0, eval_top_p=1.0,
        checkpointing=False, save_every=10, seed=0, device="cpu", engine="hf",
        context=32, gpu_memory_utilization=0.1, engine_timeout=300, dist_timeout=1800, engine_restarts=3,
    ),
    # The GPU smoke preset (bench/gpu_smoke.py): the tiny task on a Qwen2.5-0.5B-shaped model;
    # a short warm-up makes the policy sometimes right, so the timed updates are real updates.
    "smoke-0.5b": dict(
        task="arithmetic", sync="factors",
        model=dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                   num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
                   vocab_size=151936),
        sketch_rank=256, batch=32, micro_batch=8, group_size=1, advantage="running", updates=4,
        temperature=1.0, max_new_tokens=8,
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
    # SmolLM2-135M-Instruct, a Llama: the paper's KL budgets and update ratio (per token or
    # relative, not tied to size), rank 64 (~11% of its 576-wide inputs; the paper's 256 is 7%
    # of 3584), 32 prompts an update, responses of up to 512 tokens, 100 MATH-500 problems.
    "smollm2-135m": dict(PAPER, hf_id="HuggingFaceTB/SmolLM2-135M-Instruct", model=SMOLLM2_135M,
        sketch_rank=64, batch=32, micro_batch=4, updates=100, max_new_tokens=512, context=1024, eval_every=10,
        eval_problems=100, device="cpu", engine_gpus="1", gpu_memory_utilization=0.3, checkpointing=False),
    # The same model at a CPU's settings: bench/real_model.py's runs (why these: bench/README.md).
    "smollm2-cpu": dict(PAPER, hf_id=None, train_data=None, eval_data=None, model=SMOLLM2_135M, sketch_rank=64,
                        batch=8, micro_batch=4, updates=20, max_new_tokens=64, context=512, update_ratio=2e-3,
                        kl_start=1e-2, kl_end=2e-3, kl_horizon=20, adam_lr=1e-5, lora_lr=1e-4, eval_every=10,
                        eval_problems=200, eval_samples=1, save_every=0, checkpointing=False, device="cpu",
                        gpu_memory_utilization=0.1, engine_timeout=600),
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

def main(argv=None):
    """train.py's one exit for a stop that a module raised (infra/errors.py): a refusal (exit
    2), an engine lost beyond healing (exit 1) or a stop on a signal (exit 75), as one line on
    stderr; once per node when every rank raised it. A second Ctrl-C (KeyboardInterrupt) and
    a file-system error that no module words (an OSError) end in one line too (launch.stop_of)."""
    try:
        return run(argv)
    except (RunError, KeyboardInterrupt, OSError) as raised:
        e = launch.stop_of(raised)
        if not (e.agreed and os.environ.get("LOCAL_RANK", "0") != "0"):
            print(e.line(), file=sys.stderr)
        if dist.is_initialized():  # every rank stops here together (the refusal was agreed)
            dist.destroy_process_group()
        sys.exit(e.exit_code)


def run(argv=None):
    """The run the command line asks for: --dry-run's plan, or the set-up and the loop of updates."""
    args, cfg, world, run_dir = options.configure(argv, PRESETS)
    if args.dry_run:
        return options.dry_run(cfg, options.planned_layout(args.nodes, cfg), PRESETS[cfg["preset"]].get("engine_gpus"),
                               as_json=args.json)
    r = start_run(args, cfg, world, run_dir)  # processes, task, policy, engine, optimizer, resume
    model, engine, task, opt, device = r.model, r.engine, r.task, r.opt, r.device
    modules = sketch.target_modules(model)  # the seven projections of every decoder layer, by name
    held_out = dict(samples=cfg["eval_samples"], temperature=cfg["eval_temperature"], top_p=cfg["eval_top_p"],
                    max_new_tokens=cfg["max_new_tokens"], seed=cfg["seed"])  # evaluation's sampling
    per_rank = cfg["batch"] // world
    if r.start == 0:
        first_pass, first_passk = evaluate(engine, task, **held_out, world=world, rank=r.rank, device=device)
        passk = f" | pass@{cfg['eval_samples']} {first_passk:.3f}" if cfg["eval_samples"] > 1 else ""
        r.log(f"step 0 | base policy | pass@1 {first_pass:.3f}{passk} on {len(task.heldout)} held-out problems")
        if r.metrics_log:
            r.metrics_log.append({"update": 0, "pass1": first_pass, "passk": first_passk}, first=True)

    for update in range(r.start, cfg["updates"]):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        timer = metrics.Laps(device)
        # --- rollout ---------------------------------------------------------------------
        prompts, seeds = rollout_slots(update, batch=cfg["batch"], group_size=cfg["group_size"], seed=cfg["seed"],
                                       world=world, rank=r.rank)
        problems = [task.train_problem(i) for i in prompts]
        rollout = engine.generate(task.prompt_ids(problems), seeds, temperature=cfg["temperature"],
                                  max_new_tokens=cfg["max_new_tokens"])
        # Padded to the global batch's longest sequence (one all_reduce): a rank's trainer
        # tensors then have the shapes one process gives them, and so its kernels' sum order.
        _, (longest,) = metrics.global_sums([], [rollout.ids.shape[1]], device=device)
        rollout = rollout.padded(int(longest), task.eos)
        timer("rollout")
        r.stop_if_signalled(update)  # nothing of this update has changed the trainer yet: abandon it

        # --- reward ----------------------------------------------------------------------
        correct = torch.tensor([task.correct(p, y) for p, y in zip(problems, rollout.responses)], device=device)
        rewards = ppo.outcome_reward(correct)  # (B,)

        # --- baseline: the paper's running one, or each response against its group ----------
        if cfg["advantage"] == "running":
            advantages = r.baseline.advantages(rewards)  # (B,)
        else:  # a group's responses are contiguous rows of one rank (rollout_slots)
            advantages = ppo.GROUP_ADVANTAGES[cfg["advantage"]](rewards, cfg["group_size"])
        flat = ppo.zero_variance_groups(rewards, cfg["group_size"]) if cfg["group_size"] > 1 else None

        # --- loss, backward into the sketches (LoGRA) or into .grad (AdamW, LoRA) ------------
        num_tokens = ppo.global_token_count(rollout.mask)
        trainer_logp = torch.zeros_like(rollout.logprobs)  # (B, T), for the mismatch estimate
        loss_stats = {}
        for s in range(0, per_rank, cfg["micro_batch"]):
            rows = slice(s, s + cfg["micro_batch"])
            logits = model(input_ids=rollout.ids[rows], use_cache=False).logits  # (b, T, V)
            logp = ppo.response_logprobs(logits, rollout.ids[rows], cfg["temperature"])  # (b, T)
            loss, loss_stats = ppo.policy_loss(logp, advantages[rows], rollout.mask[rows],
                                               rollout_logprobs=rollout.logprobs[rows], num_tokens=num_tokens)
            loss.backward()
            trainer_logp[rows] = logp.detach()
        # One finiteness check of the update's inputs (one host read), before any step is taken.
        ppo.check_finite(advantages=advantages, rollout_logprobs=torch.where(rollout.mask, rollout.logprobs, 0),
                         trainer_logprobs=torch.where(rollout.mask, trainer_logp, 0))
        # The engine/trainer log-prob gap on EOS responses (shrinks LoGRA's KL budget; logged).
        r.mismatch.observe(rollout.logprobs, trainer_logp, rollout.mask, rollout.eos)
        timer("train")

        # --- RowAdam, KL probe, merge (LoGRA), or the AdamW step -----------------------------
        budget = kl_control.kl_budget(update, start=cfg["kl_start"], end=cfg["kl_end"], horizon=cfg["kl_horizon"])
        if r.logra:
            kl_step = logra_step(model, opt, r.layers, rollout, r.mismatch.adjust(budget), cfg, timer)
            state = policy.state_bytes(opt, r.layers, cfg["optimizer"])
        else:
            for group in opt.param_groups:  # lr_t = lr sqrt(budget_t / budget_0) (departure 1; LoRA: infra/lora.py)
                group["lr"] = opt.defaults["lr"] * math.sqrt(budget / cfg["kl_start"])
            opt.step()
            state = policy.state_bytes(opt, r.layers, cfg["optimizer"])  # gradients and moments, all there now
            opt.zero_grad(set_to_none=True)
            kl_step = dict(kl1=math.nan, alpha=math.nan, budget=math.nan, sketch_norm=math.nan, kl_real=math.nan,
                           probed=0, factors=None)
            timer("merge")

        # --- sync ----------------------------------------------------------------------------
        changed = None  # --sync delta: the share of target elements whose bf16 value changed
        if r.logra and cfg["sync"] == "factors":
            sync_bytes = factor_sync(engine, r.layers, kl_step["factors"], update=update, cfg=cfg)
        elif cfg["sync"] == "delta":  # any optimizer: the bf16 elements this update changed
            sync_bytes, changed = delta_sync(engine, modules, r.shadow, r.synced, update=update, cfg=cfg)
        else:  # AdamW, LoRA (merged), or the paper's control: full bf16 target weights, one layer at a time
            sync_bytes = full_sync(engine, modules, update=update + 1, cfg=cfg, dtype=torch.bfloat16)
        r.synced = fingerprint(model, cfg)
        sync.check_fingerprints(r.synced, engine.fingerprint())
        timer("sync")

        # --- log, evaluate, checkpoint ------------------------------------------------------
        completed = update + 1  # updates completed
        row = metrics.update_row(completed, rewards, correct, rollout, trainer_logp, kl_step, loss_stats,
                                 lr=None if r.logra else opt.param_groups[0]["lr"], mismatch=r.mismatch.m,
                                 sync_bytes=sync_bytes, num_tokens=num_tokens, seconds=sum(timer.times.values()),
                                 device=device, group_size=cfg["group_size"], flat_groups=flat)
        if cfg["eval_every"] and (completed % cfg["eval_every"] == 0 or completed == cfg["updates"]):
            row["pass1"], row["passk"] = evaluate(engine, task, **held_out, world=world, rank=r.rank, device=device)
            timer("eval")
        if changed is not None:
            row["sync_changed"] = changed
        row["state_mib"] = state / 2**20  # the method's own state on this rank (policy.state_bytes)
        row.update({f"time_{k}": v for k, v in timer.times.items()})
        row["time_s"] = sum(timer.times.values())
        r.log(metrics.step_line(row))
        events = engine.take_events()  # engine restarts (infra/heal.py), with their cause and cost
        if r.metrics_log:
            for entry in (row, *({"update": completed, **event} for event in events)):
                r.metrics_log.append(entry)
        if cfg["save_every"] and (completed % cfg["save_every"] == 0 or completed == cfg["updates"]):
            r.save(completed)
        if completed < cfg["updates"]:
            r.stop_if_signalled(completed)  # the update is complete: stop after it

    # --- summary ---------------------------------------------------------------------------
    if r.rank == 0:
        metrics.summarise(r.metrics_path, os.path.join(run_dir, "curves.png"), heldout=len(task.heldout),
                          engine=cfg["engine"])
    r.close()
    launch.stop_processes()  # every rank done (rank 0's summary too) before any tears the group down


def logra_step(model, opt, layers, rollout, budget, cfg, timer) -> dict:
    """RowAdam, the KL probe, alpha, the merge and the realised KL of the merged step: the
    step's KL control (kl1, alpha, budget, sketch_norm, kl_real, probed) and the merged
    `factors` the sync sends. A failure before the merge discards the prepared update, so
    weights and optimizer state stay as they were."""
    temperature, ids, mask = cfg["temperature"], rollout.ids, rollout.mask
    # --- RowAdam ---------------------------------------------------------------------------
    sketch_norm = opt.prepare()
    # --- KL probe --------------------------------------------------------------------------
    if cfg["group_size"] > 1:  # the probe scores the first responses: the first of each group, then the second...
        order = torch.arange(len(ids), device=ids.device).view(-1, cfg["group_size"]).t().reshape(-1)
        ids, mask = ids[order], mask[order]
    probed = kl_control.probe_count(mask, cfg["probe_responses"], cfg["probe_tokens"])  # departure 2
    try:  # KL1, and the policy's logits at the first scored positions (the realised KL's "before")
        probe = kl_control.probe(model, layers, opt.directions, ids, mask, temperature=temperature,
                                 max_responses=probed, keep_positions=cfg["kl_real_positions"])
        kl1 = probe.kl1
        alpha = kl_control.solve_alpha(kl1, budget=budget, alpha_max=cfg["alpha_max"])
    except Exception:
        opt.discard()  # nothing is merged: weights and optimizer state stay as they were
        raise
    timer("probe")
    # --- merge -----------------------------------------------------------------------------
    factors = opt.merge(alpha)
    timer("merge")
    # The realised KL of the merged step on the same tokens: the paper calls the prediction
    # "an estimate used for control, not a guarantee", so every step's is measured and logged.
    kl_real = math.nan
    if probe.logits is not None:
        kl_real = kl_control.realised_kl(probe, model, ids, mask)  # the probe's own positions
        timer("kl_real")
    return dict(kl1=kl1, alpha=alpha, budget=budget, sketch_norm=sketch_norm, kl_real=kl_real, probed=probed,
                factors=factors)


# -----------------------------------------------------------------------------
# The three syncs: the engine made the trainer's, then kept so each update

def exact_engine(cfg) -> bool:
    """Whether the engines merge LoGRA's factors, and so keep the trainer's fp32 master (sync.py)."""
    return cfg["optimizer"] == "logra" and cfg["sync"] == "factors"


def start_engine_weights(engine, model, modules, cfg, update):
    """The engine's weights made the trainer's before the first rollout. LoGRA's engines merge
    the factors themselves: they start from the trainer's exact fp32 master, with no bf16 ties,
    so that bf16 + an int16 residual holds it (rowadam.py, on bf16 ties). AdamW's, --sync
    full's and --sync delta's engines only ever receive bf16 weights or elements. Fingerprints
    confirm. Returns the trainer's fingerprint and --sync delta's shadow (delta_sync)."""
    exact = exact_engine(cfg)
    if exact:
        with torch.no_grad():
            for module in modules.values():
                rowadam.avoid_bf16_ties_(rowadam.local_rows(module.weight)[0])
    dtype = torch.float32 if exact else torch.bfloat16
    if hasattr(engine, "attach"):  # a supervised engine is rebuilt the same way after a restart (infra/heal.py)
        engine.attach(resync=lambda target, at: full_sync(target, modules, update=at, cfg=cfg, dtype=dtype),
                      fingerprint=lambda: fingerprint(model, cfg))
    full_sync(engine, modules, update=update, cfg=cfg, dtype=dtype)
    shadow = {n: engine_rows(m)[0].clone() for n, m in modules.items()} if cfg["sync"] == "delta" else None
    synced = fingerprint(model, cfg)
    sync.check_fingerprints(synced, engine.fingerprint())
    return synced, shadow


def factor_sync(engine, layers, factors, *, update, cfg) -> int:
    """The merged factors F to the engine, one decoder layer per payload: each layer's rows are
    gathered across ranks (row-sharded F) for that payload only. Returns the bytes sent."""
    by_name = {layer.name: (layer, f) for layer, f in zip(layers, factors)}
    sent = 0
    for names in sync.layer_groups(by_name):
        part = {n: by_name[n][0].all_rows(by_name[n][1]) for n in names}  # (d, r) each
        sent += engine.apply(sync.Payload(update, cfg["seed"], cfg["sketch_rank"], part))
    return sent


def delta_sync(engine, modules, shadow, base, *, update, cfg) -> tuple[int, float]:
    """The bf16 elements this update changed, to the engine, one decoder layer per payload: each
    rank compares its rows of what the engines run with `shadow` (those rows at the last sync),
    and the changes are gathered across ranks. `base`: the trainer's fingerprint at the last
    sync, which the engine checks its weights against before it writes. Returns the bytes sent
    and the share of target elements that changed."""
    sent = changed = total = 0
    for names in sync.layer_groups(modules):
        part = {}
        for n in names:
            rows, offset, shape = engine_rows(modules[n])  # (n, k) bf16
            changes = sync.gather_changes(*sync.changed_elements(shadow[n], rows, offset))  # (c,), (c,)
            shadow[n].copy_(rows)
            part[n] = sync.sparse_delta(shape, *changes, base[n], whole=lambda n=n: target_weight(modules[n]))
            changed, total = changed + changes[0].numel(), total + shape[0] * shape[1]
        sent += engine.apply(sync.Payload(update, cfg["seed"], cfg["sketch_rank"], part, kind="sparse"))
    return sent, changed / total


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


def engine_rows(module):
    """(this rank's rows of a target as the engines run it, in bf16; their first row; the whole
    weight's shape): W's own shard, or the rows of LoRA's merged weight (formed whole: collective)."""
    weight = module.base_layer.weight if hasattr(module, "base_layer") else module.weight
    rows, offset = rowadam.local_rows(weight)
    if hasattr(module, "base_layer"):
        rows = lora.merged_weight(module)[offset:offset + rows.shape[0]]
    return rows.detach().to(torch.bfloat16), offset, tuple(weight.shape)


def fingerprint(model, cfg):
    """The trainer's fingerprint of what the engines should hold (sync.fingerprint)."""
    return sync.fingerprint(model, weight=lora.merged_weight if cfg["optimizer"] == "lora" else None)


# -----------------------------------------------------------------------------
# Set-up: processes, the task, the policy and its engine, the optimizer, a resume

def start_run(args, cfg, world, run_dir) -> lifecycle.Run:
    """The process group and the run directory (lifecycle.open_run), the task, the policy and
    its engine, the optimizer, the baseline and mismatch estimate, a resume, the engine's
    weights made the trainer's: everything the loop needs."""
    opened = lifecycle.open_run(cfg, world, run_dir, args.resume, args.resume_from)
    try:
        return _start_run(args, cfg, world, run_dir, opened)
    except BaseException:
        opened.release()  # the directory let go now (a refusal before commit: as it was found)
        raise


def _start_run(args, cfg, world, run_dir, opened) -> lifecycle.Run:
    rank, log = opened.rank, opened.log
    # --- the task, the policy (fp32 master weights, FSDP2-sharded), its rollout engine -------
    task, model, engine = setup(cfg, opened, run_dir)
    atexit.register(engine.close)  # also when the run stops on an error: no engine process is left
    opt, layers = policy.make_optimizer(model, cfg["optimizer"], sketch_rank=cfg["sketch_rank"], seed=cfg["seed"],
                                        update_ratio=cfg["update_ratio"], adam_lr=cfg["adam_lr"],
                                        lora_lr=cfg["lora_lr"], checkpointing=cfg["checkpointing"])
    r = lifecycle.Run(cfg, opened, world, run_dir, args.keep, task, model, engine, opt, layers,
                      baseline=ppo.RunningBaseline(weight=0.1), mismatch=kl_control.Mismatch(momentum=0.7))
    if opened.resume:
        r.start = r.saved = launch.agreed(checkpoint.load_run_state, opened.resume, model, opt, r.logra, r.baseline,
                                          r.mismatch, opened.layout)
        if rank == 0 and (torn := checkpoint.truncate_rows(r.metrics_path, r.start)):  # a torn last row, dropped
            log(torn)
        moved = launch.layout_change(checkpoint.read_manifest(opened.resume)[0], opened.layout)
        log(f"{'resumed' if args.resume else 'continued'} {run_dir} at update {r.start} "
            f"({os.path.basename(opened.resume)}, verified{'; ' + moved if moved else ''})"
            f"{'' if args.resume else ' (another --run-dir starts anew)'}")
    if rank == 0:  # TensorBoard's and W&B's files complete, however the run ends
        r.metrics_log = metrics.Log(run_dir, start=r.start, config=cfg, wandb_project=args.wandb)
        atexit.register(r.metrics_log.close)
    r.synced, r.shadow = start_engine_weights(engine, model, sketch.target_modules(model), cfg, r.start)
    r.stop_if_signalled(r.start)  # a signal during the set-up: stop before the base evaluation
    opened.preemption.setup = False  # from here a signal stops at the next update, saved
    return r


def setup(cfg, opened, run_dir):
    """(task, model, engine). A chat task: its tokenizer and data (each node's own, a refusal
    agreed), the checkpoint loaded once and sharded, vLLM engines. The tiny task: the model
    built and warmed up, the in-process HF engine (or vLLM's CPU build, on a saved copy). The
    directory becomes the run's (opened.commit) once these inputs are read and pass."""
    layout, rank, device, log = opened.layout, opened.rank, opened.device, opened.log

    def start_vllm(**kw):  # on GPUs vLLM gets what the sync's engine state leaves there (the memory plan)
        plan = options.run_plan(cfg, layout.world)
        sent = "" if exact_engine(cfg) else "delta_" if cfg["sync"] == "delta" else "full_"  # factors, elements, weights
        reserve = plan[f"engine_{sent}reserve_bytes"]
        return vllm_engine.start_engine(
            layout=layout, rank=rank, context=cfg["context"], seed=cfg["seed"], sketch_rank=cfg["sketch_rank"],
            device=device, run_dir=run_dir, timeout=cfg["engine_timeout"], restarts=cfg["engine_restarts"], log=log,
            gpu_memory_utilization=cfg.get("gpu_memory_utilization"), reserve_bytes=reserve, exact=exact_engine(cfg),
            residual_on_host=plan["engine_residual_on_host"], progress=lambda: metrics.Progress(
                int(cfg["engine_timeout"]), "engine: seconds of vLLM's start, of at most", enabled=rank == 0,
                interrupt=lambda: opened.preemption.check("the engine's start")), **kw)

    if cfg["task"] in tasks.CHAT_TASKS:
        task = launch.agreed(tasks.chat_task, cfg["task"], cfg["model_path"], seed=cfg["seed"],
                             eval_problems=cfg["eval_problems"], train_data=cfg.get("train_data"),
                             eval_data=cfg.get("eval_data"), gym_tasks=cfg.get("gym_tasks"),
                             gym_level=cfg.get("gym_level"), max_prompt_tokens=cfg["context"] - cfg["max_new_tokens"])
        model = policy.load_pretrained_sharded(cfg["model_path"], cfg["optimizer"], device, layout.world, rank,
                                               sketch_rank=cfg["sketch_rank"], lora_alpha=cfg["lora_alpha"],
                                               seed=cfg["seed"])
        opened.commit()
        return task, model, start_vllm(model_path=cfg["model_path"], stop_ids=task.stop_ids)
    task = tasks.Arithmetic(cfg["seed"], cfg["eval_problems"])
    model = policy.tiny_policy(cfg, task, run_dir, rank=rank, world=layout.world, device=device, log=log,
                               interrupt=lambda: opened.preemption.check("the base policy's warm-up"))
    opened.commit()
    engine = None
    engine_model = os.path.join(run_dir, "engine-model")
    if cfg["engine"] == "vllm":  # vLLM loads a checkpoint folder (its weights are then resynced)
        launch.agreed(lambda: model.save_pretrained(engine_model) if rank == 0 else None)
    else:
        engine = HFEngine(copy.deepcopy(model).to(torch.bfloat16), base_seed=cfg["seed"],
                          sketch_rank=cfg["sketch_rank"], eos=task.eos, pad=task.pad, exact=exact_engine(cfg))
    policy.freeze_for(model, cfg["optimizer"], sketch_rank=cfg["sketch_rank"], lora_alpha=cfg["lora_alpha"],
                      seed=cfg["seed"])
    policy.shard(model, layout.world, cfg["optimizer"], device)
    if engine is None:
        engine = start_vllm(model_path=engine_model, eos=task.eos, pad=task.pad)
    return task, model, engine


if __name__ == "__main__":
    main()
    launch.release()  # the run's objects freed now, not in the interpreter's finalization
