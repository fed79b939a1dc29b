"""
ppo.py: the paper's deliberately simple RL objective.

What it is
----------
One response per prompt, a binary outcome reward, a running reward baseline shared by all
data-parallel trainer processes, REINFORCE with truncated importance sampling (TIS), and an
optional PPO clip for several optimiser steps per batch. The paper (arXiv:2610.06647) chose
this simple setup for Table 1's runs (one response per prompt, a global running reward
baseline) on purpose: it isolates the memory method from gains that a more elaborate RL
algorithm would add. Beside it, for trainers that sample G responses of each prompt: the GRPO,
Dr. GRPO and RLOO advantages of a response against its group (`grpo_advantages`,
`drgrpo_advantages`, `rloo_advantages`; not the paper's), in place of the running baseline (the Use block's comment).

Use
---
    import ppo

    rewards = ppo.outcome_reward(correct)                  # (B,) 1 if correct, else -0.01
    baseline = ppo.RunningBaseline()                       # b: kept from batch to batch (and checkpointed)
    advantages = baseline.advantages(rewards)              # (B,) A = r - b; then b moves toward the mean
    # or, a prompt's G responses in contiguous rows: advantages = ppo.rloo_advantages(rewards, G)
    num_tokens = ppo.global_token_count(mask)              # response tokens of the global batch
    logprobs = ppo.response_logprobs(model(input_ids=ids).logits, ids)  # (B, T) log pi(y_t), with grad
    loss, metrics = ppo.policy_loss(logprobs, advantages, mask, rollout_logprobs=rollout_logprobs,
                                    num_tokens=num_tokens)  # REINFORCE with TIS
    loss.backward()

`model` is the policy (a Hugging Face causal LM, its target layers sketched by sketch.attach in
LoGRA), `ids` (B, T) the rollout's prompt and response tokens, `mask` (B, T) True on the response
tokens, `correct` (B,) the outcomes (1 or 0, or a verifier's score) and `rollout_logprobs` (B, T)
the rollout engine's log-probs of `ids`; tests/test_ppo.py runs this block on a tiny Qwen2. With
micro-batches, the last three statements run once per micro-batch, on its rows of `ids`,
`advantages`, `mask` and `rollout_logprobs`, with the one `num_tokens` (as train.py does).
`metrics` are 0-dim tensors; `check_finite` checks the inputs once per update.

The math
--------
    reward     r = 1 if the final answer is correct else failure_reward (-0.01)
               (a verifier's partial score s in (0, 1), Reasoning Gym's: r = s)
    baseline   b <- (1 - w) b + w mean(global batch rewards)       w = 0.1
    advantage  A = r - b       b from before this batch (first batch: its own mean)
               (with groups of G responses per prompt: GRPO, Dr. GRPO or RLOO's, below)
    TIS        w_t = min(exp(logp_old_t - logp_rollout_t), tis_cap)  detached, tis_cap = 2
    REINFORCE  loss_t = -w_t A logp_t
    PPO        loss_t = -w_t min(rho_t A, clip(rho_t, 1 - eps, 1 + eps) A),  rho_t = exp(logp_t - logp_old_t)
    loss       = sum over response tokens of loss_t / num_tokens

`num_tokens` is the number of response tokens of the whole global batch (all micro-batches,
all trainer processes), so splitting the batch into micro-batches or across processes sums to
the same gradient: each process's loss is already a share of the global mean, and the
processes' sketches are summed (in backward under FSDP2, sketch.py departure 1, else by
`RowAdam.prepare`). `global_token_count` computes `num_tokens` with one all_reduce.
The same advantage is used on every token of a response. The paper runs one step per batch,
where `logp_old = logp.detach()` and the PPO ratio is 1 (clip disabled).

TIS corrects for the engine/trainer mismatch: the rollout engine samples with slightly
different numerics (bf16 kernels), so its log-probs differ from the trainer's; the weight
`exp(logp_old - logp_rollout)` reweights to the trainer's distribution, truncated at `tis_cap`.

Shape legend: B batch (responses), T time (tokens).

Departures from the paper
-------------------------
1. The paper's reward is binary: 1 for a correct final answer, -0.01 otherwise. A verifier
   that grades with a score s in [0, 1] (Reasoning Gym's, infra/tasks.py) gives s > 0 as the
   reward and a score of 0 the failure reward: its partial credit and format scores are its
   own grading, which a binary cut would discard, and a verifier that says only right or
   wrong (math-verify) gives the paper's rewards exactly. Test: tests/test_ppo.py,
   test_outcome_reward.

Implementation notes
--------------------
- The baseline's global mean is a reduced (sum, count) in float64, so processes with
  different numbers of responses still agree on it (the mean of per-process means would
  not). Test: tests/test_ppo.py, test_two_process_baseline_matches_concatenation.
- `policy_loss` reads nothing back to the host (no `.item()`, no boolean indexing, no test of
  a tensor's value), so a micro-batch never waits for the GPU: its watch metrics are 0-dim
  tensors, means over this process's response tokens, and its inputs are checked for
  non-finite values once per update by `check_finite`, which reads one flag vector. Tests:
  tests/test_ppo.py, test_policy_loss_reads_nothing_back (on the meta device, where any read
  raises) and test_check_finite_names_the_first_bad_input_with_one_read.
"""

import torch
import torch.distributed as dist


def _distributed():
    return dist.is_available() and dist.is_initialized()


# -----------------------------------------------------------------------------
# Reward and baseline

def outcome_reward(score, *, failure_reward=-0.01):
    """1.0 for a correct final answer, `failure_reward` otherwise: `score` a bool, or a
    verifier's score in [0, 1] (Reasoning Gym's, tasks.GymTask: partial credit is its own
    reward, a score of 0 the failure reward); a number or a tensor."""
    if isinstance(score, torch.Tensor):
        score = score.to(torch.float32)
        return torch.where(score > 0, score, failure_reward)  # same device
    return float(score) if score > 0 else float(failure_reward)


class RunningBaseline:
    """b <- (1 - w) b + w mean(global batch rewards); advantages use b from before the batch."""

    def __init__(self, weight=0.1):
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"baseline weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.value = None  # b; None before the first batch

    @torch.no_grad()
    def advantages(self, rewards, group=None):
        """A = r - b for this process's rewards (B,); then update b with the global batch mean."""
        if rewards.dim() != 1:
            raise ValueError(f"rewards must be (B,), got {tuple(rewards.shape)}")
        if not torch.isfinite(rewards).all():
            raise ValueError("rewards must be finite")
        # Global mean as a reduced (sum, count): a mean of per-process means would weight
        # a process with few responses as much as one with many.
        totals = torch.tensor([rewards.double().sum().item(), float(rewards.numel())], dtype=torch.float64,
                              device=rewards.device)
        if _distributed():
            dist.all_reduce(totals, group=group)
        total, count = totals.tolist()
        if count == 0:
            raise ValueError("the global batch has no rewards")
        mean = total / count
        b = mean if self.value is None else self.value
        adv = (rewards.double() - b).to(rewards.dtype)  # (B,)
        # b <- (1 - w) b + w mean, written as b + w (mean - b): when every reward equals b the
        # baseline stays exactly b, so equal rewards keep giving advantages of exactly 0
        # (otherwise round-off noise becomes a "direction" that RowAdam scales to full size).
        self.value = b + self.weight * (mean - b)
        return adv

    def state_dict(self):
        return {"value": self.value, "weight": self.weight}

    def load_state_dict(self, state):
        self.value, self.weight = state["value"], state["weight"]


# -----------------------------------------------------------------------------
# Several responses per prompt: group advantages (not the paper's; train.py --group-size)
#
# The paper samples one response per prompt and subtracts the running baseline above. The
# recipes most trainers run today (TRL's GRPOTrainer, verl, NeMo-RL) sample G responses of
# each prompt and compare a response with the others of its group instead. Each estimator
# takes this process's rewards (B,) with a prompt's G responses contiguous (rows g G ..
# g G + G - 1 are group g) and returns the advantages (B,), with no state and no
# communication: a group lives on one process. With mean_g and std_g the group's mean and
# standard deviation,
#
#     grpo    A_i = (r_i - mean_g) / (std_g + eps)      std with G - 1 in its denominator, eps 1e-4
#     drgrpo  A_i =  r_i - mean_g
#     rloo    A_i =  r_i - (sum_g r - r_i) / (G - 1)  =  G / (G - 1) (r_i - mean_g)
#
# A group whose G rewards are all equal carries no signal: its advantages are exactly 0 (set,
# not left to round-off, which would otherwise hand RowAdam a direction of noise), so its
# responses add nothing to the gradient; their tokens still count in `num_tokens`, so such
# groups shrink the step of the others as the token normalisation of TRL and DAPO does (DAPO's
# dynamic sampling, which resamples them, is not done here). `zero_variance_groups` counts
# them (the standard diagnostic). Tests: tests/test_ppo.py, against numpy.

def _grouped(rewards, group_size):
    """rewards (B,) as float64 (B / G, G), after the checks every estimator shares."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be (B,), got {tuple(rewards.shape)}")
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"group advantages need groups of G >= 2 responses and B a multiple of G: got B = "
                         f"{rewards.numel()}, G = {group_size}")
    return rewards.double().view(-1, group_size)


def _flat(r):
    """(B / G,) True for each group (a row of r) whose rewards are all equal."""
    return (r == r[:, :1]).all(dim=1)


def _zero_where_equal(adv, r, dtype):
    """A group's advantages, exactly 0 where all of its rewards are equal; (B,) in `dtype`."""
    return torch.where(_flat(r)[:, None], 0.0, adv).view(-1).to(dtype)


@torch.no_grad()
def grpo_advantages(rewards, group_size, *, eps=1e-4):
    """GRPO's outcome advantage, A_i = (r_i - mean_g) / (std_g + eps): Shao et al. 2024,
    DeepSeekMath (arXiv:2402.03300), section 4.1.2. The standard deviation is the sample one
    (G - 1 in its denominator) and eps = 1e-4, as TRL's GRPOTrainer computes it."""
    r = _grouped(rewards, group_size)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)
    return _zero_where_equal(adv, r, rewards.dtype)


@torch.no_grad()
def drgrpo_advantages(rewards, group_size):
    """Dr. GRPO's advantage, A_i = r_i - mean_g, no division by the group's standard deviation
    (which weights a prompt by how evenly it splits its group): Liu et al. 2025, "Understanding
    R1-Zero-Like Training" (arXiv:2503.20783). Their other change, no division by each
    response's own length, holds here already: `policy_loss` divides by the global batch's
    token count."""
    r = _grouped(rewards, group_size)
    return _zero_where_equal(r - r.mean(dim=1, keepdim=True), r, rewards.dtype)


@torch.no_grad()
def rloo_advantages(rewards, group_size):
    """REINFORCE leave-one-out, A_i = r_i - (sum of the group's other rewards) / (G - 1): Kool
    et al. 2019 ("Buy 4 REINFORCE samples, get a baseline for free!"), as RLOO in Ahmadian et
    al. 2024 (arXiv:2402.14740). The baseline of a response does not depend on it, so the
    estimate stays unbiased."""
    r = _grouped(rewards, group_size)
    others = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    return _zero_where_equal(r - others, r, rewards.dtype)


GROUP_ADVANTAGES = {"grpo": grpo_advantages, "drgrpo": drgrpo_advantages, "rloo": rloo_advantages}


def zero_variance_groups(rewards, group_size):
    """The number of groups of G contiguous rewards that are all equal, a 0-dim tensor (no read)."""
    return _flat(_grouped(rewards, group_size)).sum()


# -----------------------------------------------------------------------------
# The loss

def global_token_count(mask, group=None) -> int:
    """Response tokens of this process's part of the batch, summed over processes (one all_reduce)."""
    n = torch.tensor([float(mask.sum().item())], dtype=torch.float64, device=mask.device)
    if _distributed():
        dist.all_reduce(n, group=group)
    return int(n.item())


def policy_loss(logprobs, advantages, mask, *, rollout_logprobs=None, old_logprobs=None,
                num_tokens, clip_eps=None, tis_cap=2.0):
    """REINFORCE (or PPO-clip) with truncated importance sampling; returns (loss, metrics).

    logprobs (B, T) carry the gradient; advantages (B,) or (B, T); mask (B, T) marks the
    response tokens; rollout/old log-probs (B, T) are treated as constants; `num_tokens` is a
    Python number (`global_token_count`). Padded positions may hold anything, -inf included.

    Nothing is read back to the host, so a micro-batch never waits for the device: the
    metrics are 0-dim tensors (float() them once per update), and non-finite inputs are not
    detected here but by one `check_finite` call per update.
    """
    if mask.shape != logprobs.shape:
        raise ValueError(f"mask {tuple(mask.shape)} and logprobs {tuple(logprobs.shape)} differ in shape")
    for name, t in (("rollout_logprobs", rollout_logprobs), ("old_logprobs", old_logprobs)):
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} {tuple(t.shape)} must match logprobs {tuple(logprobs.shape)}")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(f"advantages must be (B,) or (B, T), got {tuple(advantages.shape)}")
    if not num_tokens > 0:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    if clip_eps is not None and not clip_eps > 0:
        raise ValueError(f"clip_eps must be positive, got {clip_eps}")
    if not tis_cap > 0:
        raise ValueError(f"tis_cap must be positive, got {tis_cap}")

    valid = mask.bool()  # (B, T)
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(logprobs)  # (B, T)
    adv = adv.to(logprobs.dtype)
    old = logprobs.detach() if old_logprobs is None else old_logprobs.to(logprobs.dtype)  # (B, T)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)

    # TIS: w_t = min(exp(logp_old - logp_rollout), tis_cap), no gradient.
    if rollout_logprobs is None:
        w = torch.ones_like(old)
    else:
        raw = torch.exp(torch.where(valid, old - rollout_logprobs.to(old.dtype), zero))  # (B, T)
        w = raw.clamp(max=tis_cap)

    if clip_eps is None:
        # REINFORCE: loss_t = -w A logp
        per_token = -w * adv * logprobs  # (B, T)
        ratio = torch.ones_like(old)
        clipped = torch.zeros_like(valid)
    else:
        # PPO: loss_t = -w min(rho A, clip(rho) A), rho = exp(logp - logp_old)
        ratio = torch.exp(torch.where(valid, logprobs - old, zero))  # (B, T)
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
        per_token = -w * surrogate
        clipped = (ratio.detach() * adv != surrogate.detach()) & valid
    loss = torch.where(valid, per_token, zero).sum() / num_tokens

    # Means over response tokens as masked sums: indexing by `valid` would read its count back.
    with torch.no_grad():
        n = valid.sum().clamp(min=1)
        truncated = zero if rollout_logprobs is None else ((raw > tis_cap) & valid).sum() / n
        metrics = {
            "ratio": torch.where(valid, ratio.detach(), zero).sum() / n,
            "clipped": clipped.sum() / n,
            "tis_weight": torch.where(valid, w, zero).sum() / n,
            "tis_truncated": truncated,
        }
    return loss, metrics


def check_finite(**tensors: torch.Tensor) -> None:
    """Raise ValueError naming the first of `tensors` (in the order given) that holds a nan or
    an inf; one device-to-host read in all. Call it once per update with the loss inputs,
    padded positions masked out (`torch.where(mask, t, 0)`; `t[mask]` would read the count):

        check_finite(logprobs=torch.where(mask, logp, 0), advantages=adv)
    """
    if not tensors:
        return
    # The flags gather on an accelerator if any tensor is on one: moving them there reads nothing.
    device = next((t.device for t in tensors.values() if t.device.type != "cpu"), torch.device("cpu"))
    flags = torch.stack([torch.isfinite(t).all().to(device) for t in tensors.values()])  # (n,) bool
    for name, finite in zip(tensors, flags.tolist()):  # the one read
        if not finite:
            raise ValueError(f"{name} holds non-finite values (nan or inf)")


def response_logprobs(logits, input_ids, temperature=1.0, chunk=1024):
    """log pi(y_t) of each token under the logits at t - 1, temperature applied: (B, T), 0 at t = 0.

    Computed in fp32 over chunks of positions, each recomputed in backward
    (`torch.utils.checkpoint`), so only the (B, T) result is kept rather than an fp32 copy of
    the (B, T, V) logits: about 2.5 GB per 4096-token sequence at a vocabulary of 152k.
    """
    from torch.utils.checkpoint import checkpoint

    def picked_logprob(z, y):  # z (B, c, V), y (B, c)
        z = z.to(torch.promote_types(z.dtype, torch.float32)) / temperature  # fp32 at least
        return z.gather(-1, y[..., None]).squeeze(-1) - torch.logsumexp(z, dim=-1)

    z, y = logits[:, :-1], input_ids[:, 1:]  # the logits at t - 1 score the token at t
    parts = []
    for start in range(0, y.shape[1], chunk):
        zc, yc = z[:, start:start + chunk], y[:, start:start + chunk]
        parts.append(checkpoint(picked_logprob, zc, yc, use_reentrant=False) if zc.requires_grad
                     else picked_logprob(zc, yc))
    picked = torch.cat(parts, dim=1) if parts else z.new_zeros(y.shape, dtype=torch.float32)  # (B, T-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)  # (B, T)
