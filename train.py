"""
train.py: the whole LoGRA RL loop, top to bottom (arXiv:2610.06647).

    python train.py                                   # the tiny preset on this CPU, end to end
    torchrun --nproc_per_node 4 train.py --model 7b   # the paper's run: 4 GPUs + 4 vLLM engines
    python train.py --model 7b-random --gpus 1        # a 7B's shape: trainer and engine on one GPU

One update, in the order the paper runs it (the loop in `run`):

    rollout   the engine (a bf16 copy of the policy, changed only by sync payloads) samples
              one response per prompt (--group-size G: G per prompt), with log-probs (infra/engine.py)
    reward    1 for a correct boxed answer, -0.01 otherwise                      (ppo.py)
    baseline  A = r - b, b a running mean over the global batch  (ppo.py; groups: infra/group_advantages.py)
    loss      REINFORCE with truncated importance sampling, / global response tokens
    backward  into the sketches S = G A^T; no weight gradient exists             (sketch.py)
    RowAdam   per-row scaling of the sketches, one global scale -> U             (rowadam.py)
    KL probe  the step's tangent through the model predicts KL(alpha) = alpha^2 KL1; alpha
              spends the budget (its schedule, minus the engine/trainer mismatch) (kl_control.py)
    merge     W -= bf16(alpha U) A_t in the fp32 master weights; A_t -> A_{t+1}  (rowadam.py)
    sync      the same bf16 factors go to the engine, which merges them itself; fingerprints
              and a short sample's log-probs confirm both run the same weights (infra/engine_sync.py)

The dense baseline (--optimizer adam) runs the loop with backward into .grad and one AdamW step in
place of RowAdam, the probe and the merge, and syncs full bf16 weights; LoRA (--optimizer lora, Table 2)
the same with adapters. What runs the loop but is not the method is in infra/ (its README).

Shape legend: B responses of this rank (b of a micro-batch), T prompt + padded response tokens, V vocab.

Departures from the paper
-------------------------
1. The paper's baseline is "Adam with learning-rate annealing" with no schedule: lr_t = adam_lr sqrt(budget_t /
   budget_0), the KL budget's cosine, as LoGRA's step goes as sqrt(KL). Test: tests/test_train.py, test_smoke_run[adam].
2. The KL probe scores the first `probe_responses` (2) responses of each rank, as the paper does, and more
   until they hold `probe_tokens` generated tokens: the paper's responses run to thousands of tokens, the
   tiny task's to a few, and KL1 from 16 tokens is noise (the tiny preset scores 512: all its responses).
   With groups (not the paper's) the first response of each group comes first, then the second of each
   (`logra_step`). Test: tests/test_train_paper_path.py, test_probe_count_sizes_the_probe_in_tokens.
"""

import atexit
import dataclasses
import math
import os
import sys

import torch
import torch.distributed as dist

import kl_control
import ppo
import sketch
import sync
from infra import engine_sync, group_advantages, launch, lifecycle, metrics, one_gpu, planning, policy, task_data, tasks
from infra import vllm_engine
from infra.probe_decoder import fast_probe
from infra.engine import HFEngine, evaluate, rollout_slots
from infra.errors import RunError
from infra.options import Config


# -----------------------------------------------------------------------------
# Presets: every model size in one table, picked by name (--model); each a Config (infra/options.py)

# The setup of the paper's Table 1 (arXiv:2610.06647): one node, 4 training GPUs with FSDP + 4 vLLM
# engines, DAPO-Math-17k for training and MATH-500 for evaluation; its hyperparameters as the
# paper states them (rank 256, KL budget 2e-4 -> 2e-5, 128 prompts per update, AdamW at 1e-6).
PAPER = Config(
    task="math", train_data="BytedTsinghua-SIA/DAPO-Math-17k", eval_data="HuggingFaceH4/MATH-500",
    sketch_rank=256, batch=128, micro_batch=2, updates=200, temperature=1.0, max_new_tokens=3072, context=4096,
    update_ratio=6e-5, kl_start=2e-4, kl_end=2e-5, kl_horizon=300, alpha_max=3.0, probe_responses=2,
    kl_real_positions=256, adam_lr=1e-6, lora_lr=1e-5, lora_alpha=32.0, eval_every=10, eval_problems=500,
    eval_samples=4, eval_temperature=0.7, eval_top_p=0.7, gym_tasks="hard", gym_level=2, save_every=20,
    device="cuda", engine="vllm", engine_gpus="4,5,6,7", engine_timeout=1800, dist_timeout=3600)
QWEN25_7B = dict(  # Qwen2.5(-Math)-7B's widths
    hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    vocab_size=152064, max_position_embeddings=4096, tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6)
SMOLLM2_135M = dict(  # SmolLM2-135M(-Instruct)'s widths, a Llama
    model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
    rope_theta=100000.0, rms_norm_eps=1e-5)
PRESETS = {
    # A CPU run of a minute or two. head_dim 32: vLLM's CPU attention refuses 16. 3000 warm-up steps
    # make every seed's base policy add reliably: the box is what RL has to learn (infra/tasks.py).
    "tiny": Config(
        task="arithmetic", model=dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False),
        sketch_rank=32, batch=64, micro_batch=64, updates=150, max_new_tokens=8, context=32, update_ratio=2e-3,
        kl_start=2e-2, kl_end=5e-3, kl_horizon=150, probe_tokens=512, kl_real_positions=1024, adam_lr=1e-4,
        lora_lr=1e-3, warmup_steps=3000, warmup_batch=128, warmup_lr=3e-3, warmup_unboxed=0.7, eval_every=25,
        eval_problems=256, eval_samples=2, eval_temperature=1.0, eval_top_p=1.0, checkpointing=False, save_every=10,
        device="cpu", engine="hf", gpu_memory_utilization=0.1, engine_timeout=300, dist_timeout=1800),
    # bench/gpu_smoke.py: the tiny task on a Qwen2.5-0.5B shape, warmed up so that updates are real.
    "smoke-0.5b": Config(
        task="arithmetic", model=dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=512,
                                      tie_word_embeddings=True, vocab_size=151936),
        sketch_rank=256, batch=32, micro_batch=8, updates=4, max_new_tokens=8, context=32, update_ratio=6e-5,
        kl_start=2e-4, kl_end=2e-5, kl_horizon=300, adam_lr=1e-6, lora_lr=1e-5, warmup_steps=300, warmup_batch=128,
        warmup_lr=3e-4, warmup_unboxed=0.0, eval_every=0, eval_problems=32, eval_samples=1, eval_temperature=1.0,
        eval_top_p=1.0, save_every=0, device="cuda", engine="hf", engine_timeout=600, dist_timeout=1800),
    # The tiny task on Qwen2.5-7B's shape, random weights (no download), trainer and engine on one GPU.
    "7b-random": Config(
        task="arithmetic", model=QWEN25_7B, sketch_rank=256, batch=32, micro_batch=8, updates=3, max_new_tokens=256,
        context=264, update_ratio=6e-5, kl_start=2e-4, kl_end=2e-5, kl_horizon=300, adam_lr=1e-6, lora_lr=1e-5,
        eval_every=0, eval_problems=32, eval_samples=1, eval_temperature=1.0, eval_top_p=1.0, save_every=0,
        device="cuda", engine="hf", gpus=1, engine_timeout=600, dist_timeout=1800),
    "1.5b": dataclasses.replace(PAPER, model_path="Qwen/Qwen2.5-Math-1.5B", model=dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e4, rms_norm_eps=1e-6)),
    "7b": dataclasses.replace(PAPER, model_path="Qwen/Qwen2.5-Math-7B", model=QWEN25_7B),
    # Not public (--model-path required); --dry-run assumes Qwen2.5-32B's widths cut to 52 layers (26.9B).
    "27b": dataclasses.replace(PAPER, model=dict(
        hidden_size=5120, intermediate_size=27648, num_hidden_layers=52, num_attention_heads=40, num_key_value_heads=8,
        vocab_size=152064, max_position_embeddings=4096, tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6)),
    # SmolLM2-135M-Instruct: the paper's KL budget and update ratio (not tied to size), rank 64 (11%
    # of its 576-wide inputs; the paper's 256 is 7% of 3584), 32 prompts an update, 512-token answers.
    "smollm2-135m": dataclasses.replace(
        PAPER, model_path="HuggingFaceTB/SmolLM2-135M-Instruct", model=SMOLLM2_135M, sketch_rank=64, batch=32,
        micro_batch=4, updates=100, max_new_tokens=512, context=1024, eval_problems=100, device="cpu",
        engine_gpus="1", gpu_memory_utilization=0.3, checkpointing=False),
    # The same model at a CPU's settings, every LoGRA default of the modules (the budget from the probe:
    # --kl-entropy-share): bench/real_model.py's comparison, which adds each method's setting (bench/README.md).
    "smollm2-cpu": dataclasses.replace(
        PAPER, train_data=None, eval_data=None, model=SMOLLM2_135M, sketch_rank=64, batch=8, micro_batch=4,
        updates=40, max_new_tokens=64, context=512, update_ratio=1e-2, kl_entropy_share=0.2, kl_per_response=2.0,
        probe_tokens=128, kl_start=1e-2, kl_end=2e-3, kl_horizon=40, adam_lr=1e-5, lora_lr=1e-4, eval_problems=200,
        eval_samples=4, curve_problems=50, curve_samples=1, save_every=10, checkpointing=False, device="cpu",
        gpu_memory_utilization=0.1, engine_timeout=600),
    # The paper's task path at toy scale on a CPU, vLLM's CPU build as the engines: --model-path,
    # --train-data and --eval-data in the paper's formats required (python tests/tiny_math.py DIR).
    "tiny-math": dataclasses.replace(
        PAPER, train_data=None, eval_data=None, sketch_rank=16, batch=16, micro_batch=8, updates=4, max_new_tokens=12,
        context=128, update_ratio=2e-3, kl_start=2e-2, kl_end=5e-3, kl_horizon=150, eval_every=0, probe_tokens=64,
        eval_problems=20, eval_samples=2, save_every=0, device="cpu", gpu_memory_utilization=0.1, engine_timeout=300),
}


# -----------------------------------------------------------------------------
# The run

def main(argv=None):
    """train.py's one exit for a stop that a module raised (infra/errors.py): a refusal (exit 2), an
    engine lost beyond healing (exit 1) or a stop on a signal (exit 75), as one line on stderr; once per
    node when every rank raised it; a second Ctrl-C and an OSError no module words too (launch.stop_of)."""
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
    flags, cfg, world, run_dir = planning.configure(argv, PRESETS)
    if flags.dry_run:
        return planning.dry_run(cfg, flags.nodes, PRESETS[cfg.preset].engine_gpus, as_json=flags.json)
    r = start_run(flags, cfg, world, run_dir)  # processes, task, policy, engine, optimizer, resume
    cfg, model, engine, task, opt, device = r.cfg, r.model, r.engine, r.task, r.opt, r.device
    modules = sketch.target_modules(model)  # the seven projections of every decoder layer, by name
    held_out = dict(samples=cfg.eval_samples, temperature=cfg.eval_temperature, top_p=cfg.eval_top_p,
                    max_new_tokens=cfg.max_new_tokens, seed=cfg.seed, world=world, rank=r.rank, device=device)
    curve = dict(held_out, problems=cfg.curve_problems or None, samples=cfg.curve_samples or cfg.eval_samples)
    if r.start == 0:  # the start's fingerprint, and (unless --no-eval-base) the base policy's evaluation
        r.record_base(evaluate(engine, task, **held_out) if cfg.eval_base else None)

    for update in range(r.start, cfg.updates):
        timer = metrics.Laps(device)  # wall time per phase, and the update's peak memory
        # --- rollout ---------------------------------------------------------------------
        prompts, seeds = rollout_slots(update, batch=cfg.batch, group_size=cfg.group_size, seed=cfg.seed,
                                       world=world, rank=r.rank)
        problems = [task.train_problem(i) for i in prompts]
        rollout = engine.generate(task.prompt_ids(problems), seeds, temperature=cfg.temperature,
                                  max_new_tokens=cfg.max_new_tokens)
        # Padded to the global batch's longest sequence (one all_reduce): shapes and sum orders as one process's
        _, (longest,) = metrics.global_sums([], [rollout.ids.shape[1]], device=device)
        rollout = rollout.padded(int(longest), task.eos)
        timer("rollout")
        r.stop_if_signalled(update)  # nothing of this update has changed the trainer yet: abandon it

        # --- reward ----------------------------------------------------------------------
        correct = torch.tensor([task.correct(p, y) for p, y in zip(problems, rollout.responses)], device=device)
        rewards = ppo.outcome_reward(correct)  # (B,)

        # --- baseline: the paper's running one, or each response against its group ----------
        if cfg.advantage == "running":
            advantages = r.baseline.advantages(rewards)  # (B,)
        else:  # a group's responses are contiguous rows of one rank (rollout_slots)
            advantages = group_advantages.GROUP_ADVANTAGES[cfg.advantage](rewards, cfg.group_size)
        flat = group_advantages.zero_variance_groups(rewards, cfg.group_size) if cfg.group_size > 1 else None

        # --- loss, backward into the sketches (LoGRA) or into .grad (AdamW, LoRA) ------------
        num_tokens = ppo.global_token_count(rollout.mask)
        trainer_logp = torch.zeros_like(rollout.logprobs)  # (B, T), for the mismatch estimate
        loss_stats = {}
        for s in range(0, cfg.batch // world, cfg.micro_batch):
            rows = slice(s, s + cfg.micro_batch)
            logits = model(input_ids=rollout.ids[rows], use_cache=False).logits  # (b, T, V)
            logp = ppo.response_logprobs(logits, rollout.ids[rows], cfg.temperature)  # (b, T)
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
        budget = kl_control.kl_budget(update, start=cfg.kl_start, end=cfg.kl_end, horizon=cfg.kl_horizon)
        if r.logra:
            kl_step = logra_step(model, opt, r.layers, rollout, budget_rule(cfg, r.mismatch, budget), cfg, timer)
            r.watch_alpha(kl_step["alpha"])  # says so once a run when alpha sits at its cap
        else:
            kl_step = adam_step(opt, budget, cfg, timer)

        # --- sync: LoGRA's factors and the seed, the changed bf16 elements, or full weights ---
        changed = None  # --sync delta: the share of target elements whose bf16 value changed
        sent = dict(update=update, seed=cfg.seed, rank=cfg.sketch_rank)
        if cfg.gpus == 1:  # one GPU: the engine's bf16 weights cast from the fp32 master, no payload (infra/one_gpu.py)
            sync_bytes = one_gpu.refresh(engine, modules, update=update)
        elif r.logra and cfg.sync == "factors":
            sync_bytes = engine_sync.factors(engine, r.layers, kl_step["factors"], **sent)
        elif cfg.sync == "delta":  # any optimizer
            sync_bytes, changed = engine_sync.delta(engine, modules, r.shadow, r.synced, **sent)
        else:  # AdamW, LoRA (merged), or the paper's control: full bf16 target weights, one layer at a time
            sync_bytes = engine_sync.full(engine, modules, **dict(sent, update=update + 1), dtype=torch.bfloat16)
        r.synced = engine_sync.fingerprint(model, cfg.optimizer)
        sync.check_fingerprints(r.synced, engine.fingerprint())
        if cfg.check_outputs and (update + 1) % cfg.check_outputs == 0:  # its outputs too, not only its weights
            engine_sync.check_outputs(engine, model, task.prompt_ids(task.heldout[:4]), after=update + 1, seed=cfg.seed,
                                      temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, device=device)
        timer("sync")

        # --- log, evaluate, checkpoint ------------------------------------------------------
        completed = update + 1  # updates completed
        row = metrics.update_row(completed, rewards, correct, rollout, trainer_logp, kl_step, loss_stats,
                                 mismatch=r.mismatch.m, sync_bytes=sync_bytes, sync_changed=changed,
                                 num_tokens=num_tokens, seconds=sum(timer.times.values()), device=device,
                                 group_size=cfg.group_size, flat_groups=flat)
        if cfg.eval_every and (completed % cfg.eval_every == 0 or completed == cfg.updates):
            row.update(evaluate(engine, task, **(held_out if completed == cfg.updates else curve)))
            timer("eval")
        r.record(completed, row, timer.times)  # the log line and row, a checkpoint when due, a signal's stop

    # --- summary ---------------------------------------------------------------------------
    r.close(summary=os.path.join(run_dir, "curves.png"))


def budget_rule(cfg: Config, mismatch, scheduled: float):
    """The update's KL budget as a function of its probe: the --kl-start schedule's `scheduled`, or with
    --kl-entropy-share kl_control.budget_for's rule (the probe's entropy and response length); less the
    engine/trainer mismatch either way."""
    def budget_of(probe):
        if not cfg.kl_entropy_share:
            return mismatch.adjust(scheduled)
        return mismatch.adjust(kl_control.budget_for(probe, entropy_share=cfg.kl_entropy_share,
                                                     per_response=cfg.kl_per_response))
    return budget_of


def logra_step(model, opt, layers, rollout, budget_of, cfg: Config, timer) -> dict:
    """RowAdam, the KL probe, alpha for the budget `budget_of(probe)`, the merge and the realised KL of the
    merged step: the step's KL control (kl1, alpha, budget, sketch_norm, kl_real, probed; no lr), the
    method's state bytes and the merged `factors` the sync sends. A failure before the merge discards the
    prepared update, so weights and optimizer state stay as they were."""
    ids, mask = rollout.ids, rollout.mask
    # --- RowAdam ---------------------------------------------------------------------------
    sketch_norm = opt.prepare()
    # --- KL probe --------------------------------------------------------------------------
    if cfg.group_size > 1:  # the probe scores the first responses: the first of each group, then the second...
        order = torch.arange(len(ids), device=ids.device).view(-1, cfg.group_size).t().reshape(-1)
        ids, mask = ids[order], mask[order]
    probed = kl_control.probe_count(mask, cfg.probe_responses, cfg.probe_tokens)  # departure 2
    try:  # KL1, and the policy's logits at the first scored positions (the realised KL's "before")
        probe = fast_probe(model, layers, opt.directions, ids, mask, temperature=cfg.temperature,
                           max_responses=probed, keep_positions=cfg.kl_real_positions)
        budget = budget_of(probe)
        alpha = kl_control.solve_alpha(probe.kl1, budget=budget, alpha_max=cfg.alpha_max)
    except Exception:
        opt.discard()  # nothing is merged: weights and optimizer state stay as they were
        raise
    timer("probe")
    # --- merge -----------------------------------------------------------------------------
    factors = opt.merge(alpha)
    state = policy.state_bytes(opt, layers, "logra")
    timer("merge")
    # The realised KL of the merged step on the same tokens: the paper calls the prediction
    # "an estimate used for control, not a guarantee", so every step's is measured and logged.
    kl_real = math.nan
    if probe.logits is not None:
        kl_real = kl_control.realised_kl(probe, model, ids, mask)  # the probe's own positions
        timer("kl_real")
    return dict(kl1=probe.kl1, alpha=alpha, budget=budget, sketch_norm=sketch_norm, kl_real=kl_real, probed=probed,
                factors=factors, state=state, lr=None)


def adam_step(opt, budget: float, cfg: Config, timer) -> dict:
    """AdamW's step (the dense baseline, or LoRA's adapters: infra/lora.py) at lr_t = lr sqrt(budget_t /
    budget_0) (departure 1); the state it holds (gradients and moments, before the gradients are dropped)."""
    for group in opt.param_groups:
        group["lr"] = opt.defaults["lr"] * math.sqrt(budget / cfg.kl_start)
    opt.step()
    state = policy.state_bytes(opt, None, cfg.optimizer)
    opt.zero_grad(set_to_none=True)
    timer("merge")
    return dict(kl1=math.nan, alpha=math.nan, budget=math.nan, sketch_norm=math.nan, kl_real=math.nan, probed=0,
                factors=None, state=state, lr=opt.param_groups[0]["lr"])


# -----------------------------------------------------------------------------
# Set-up: processes, the task, the policy and its engine, the optimizer, a resume

def start_run(flags, cfg: Config, world: int, run_dir: str) -> lifecycle.Run:
    """The process group and the run directory (lifecycle.open_run), the task, the policy and its engine,
    the optimizer, the baseline and mismatch estimate, a resume, the engine's weights made the trainer's."""
    opened = lifecycle.open_run(cfg, world, run_dir, flags.resume, flags.resume_from)
    try:
        return _start_run(flags, opened.cfg, world, run_dir, opened)
    except BaseException:
        opened.release()  # the directory let go now (a refusal before commit: as it was found)
        raise


def _start_run(flags, cfg: Config, world: int, run_dir: str, opened) -> lifecycle.Run:
    # --- the task, the policy (fp32 master weights, FSDP2-sharded), its rollout engine -------
    task, model, engine = setup(cfg, opened, run_dir)
    atexit.register(engine.close)  # also when the run stops on an error: no engine process is left
    opt, layers = policy.make_optimizer(model, cfg.optimizer, sketch_rank=cfg.sketch_rank, seed=cfg.seed,
                                        update_ratio=cfg.update_ratio, adam_lr=cfg.adam_lr, lora_lr=cfg.lora_lr,
                                        checkpointing=cfg.checkpointing)
    r = lifecycle.Run(cfg, opened, world, run_dir, flags.keep, task, model, engine, opt, layers,
                      baseline=ppo.RunningBaseline(weight=0.1), mismatch=kl_control.Mismatch(momentum=0.7))
    r.resume(explicit=bool(flags.resume), wandb=flags.wandb)  # a checkpoint's state, the metrics log
    r.synced, r.shadow = engine_sync.start(engine, model, sketch.target_modules(model), optimizer=cfg.optimizer,
                                           mode=cfg.sync, update=r.start, seed=cfg.seed, rank=cfg.sketch_rank)
    r.stop_if_signalled(r.start)  # a signal during the set-up: stop before the base evaluation
    opened.preemption.setup = False  # from here a signal stops at the next update, saved
    return r


def setup(cfg: Config, opened, run_dir: str):
    """(task, model, engine). A chat task: its tokenizer and data (each node's own), the checkpoint loaded
    once and sharded, vLLM engines. The tiny task: the model built and warmed up, the in-process HF engine
    (or vLLM's CPU build, on a saved copy). The directory becomes the run's once these pass (opened.commit)."""
    layout, rank, device, log = opened.layout, opened.rank, opened.device, opened.log
    exact = engine_sync.exact(cfg.optimizer, cfg.sync) and cfg.gpus != 1  # --gpus 1: the engine keeps no master

    def start_vllm(**kw):  # on GPUs vLLM gets what the sync's engine state leaves there (the memory plan)
        plan = planning.run_plan(cfg, layout.world)
        sent = "" if exact else "delta_" if cfg.sync == "delta" else "full_"  # factors, elements, weights
        return vllm_engine.start_engine(
            layout=layout, rank=rank, context=cfg.context, seed=cfg.seed, sketch_rank=cfg.sketch_rank,
            device=device, run_dir=run_dir, timeout=cfg.engine_timeout, restarts=cfg.engine_restarts, log=log,
            gpu_memory_utilization=cfg.gpu_memory_utilization, reserve_bytes=plan[f"engine_{sent}reserve_bytes"],
            exact=exact, residual_on_host=plan["engine_residual_on_host"], progress=lambda: metrics.Progress(
                int(cfg.engine_timeout), "engine: seconds of vLLM's start, of at most", enabled=rank == 0,
                interrupt=lambda: opened.preemption.check("the engine's start")), **kw)

    if cfg.task in tasks.CHAT_TASKS:
        task = launch.agreed(task_data.chat_task, cfg.task, cfg.model_path, seed=cfg.seed,
                             eval_problems=cfg.eval_problems, train_data=cfg.train_data, eval_data=cfg.eval_data,
                             gym_tasks=cfg.gym_tasks, gym_level=cfg.gym_level, grader=cfg.grader, shots=cfg.shots,
                             max_prompt_tokens=cfg.context - cfg.max_new_tokens)
        model = policy.load_pretrained_sharded(cfg.model_path, cfg.optimizer, device, layout.world, rank,
                                               sketch_rank=cfg.sketch_rank, lora_alpha=cfg.lora_alpha, seed=cfg.seed)
        opened.commit()
        return task, model, start_vllm(model_path=cfg.model_path, stop_ids=task.stop_ids)
    task = tasks.Arithmetic(cfg.seed, cfg.eval_problems)
    model = policy.tiny_policy(cfg.model, task, run_dir, preset=cfg.preset, seed=cfg.seed, warmup=dict(
        steps=cfg.warmup_steps, batch=cfg.warmup_batch, lr=cfg.warmup_lr, unboxed=cfg.warmup_unboxed),
        rank=rank, world=layout.world, device=device, log=log,
        interrupt=lambda: opened.preemption.check("the base policy's warm-up"))
    opened.commit()
    engine_model = os.path.join(run_dir, "engine-model")
    if cfg.engine == "vllm":  # vLLM loads a checkpoint folder (its weights are then resynced)
        launch.agreed(lambda: model.save_pretrained(engine_model) if rank == 0 else None)
    engine = None if cfg.engine == "vllm" else HFEngine(  # a bf16 copy, generating with a KV cache on GPUs
        policy.engine_copy(model), base_seed=cfg.seed, sketch_rank=cfg.sketch_rank, eos=task.eos, pad=task.pad,
        exact=exact, kv_cache=device.type == "cuda")
    policy.freeze_for(model, cfg.optimizer, sketch_rank=cfg.sketch_rank, lora_alpha=cfg.lora_alpha, seed=cfg.seed)
    policy.shard(model, layout.world, cfg.optimizer, device)
    if engine is None:
        engine = start_vllm(model_path=engine_model, eos=task.eos, pad=task.pad)
    return task, model, engine


if __name__ == "__main__":
    main()
    launch.release()  # the run's objects freed now, not in the interpreter's finalization
