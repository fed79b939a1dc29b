"""ppo.py: the paper's deliberately simple RL objective.

One response per prompt, a binary outcome reward, a running baseline shared by all processes, REINFORCE with truncated
importance sampling (TIS: the engine's bf16 samples reweighted to the trainer's distribution) and an optional PPO clip:
the paper's setup for Table 1 (arXiv:2610.06647), to isolate the memory method (group advantages, not its: infra/).

Use
---
    import ppo
    rewards = ppo.outcome_reward(correct)                  # (B,) 1 if correct, else -0.01
    baseline = ppo.RunningBaseline()                       # b: kept from batch to batch (and checkpointed)
    advantages = baseline.advantages(rewards)              # (B,) A = r - b; then b moves toward the mean
    num_tokens = ppo.global_token_count(mask)              # global batch's response tokens; the rest per micro-batch
    logprobs = ppo.response_logprobs(model(input_ids=ids).logits, ids)  # (B, T) log pi(y_t), with grad
    loss, metrics = ppo.policy_loss(logprobs, advantages, mask, rollout_logprobs=rollout_logprobs,
                                    num_tokens=num_tokens)  # REINFORCE with TIS
    loss.backward()
Inputs (B, T): `ids`, `mask` (True on the response), `rollout_logprobs` (the engine's); `correct` (B,): bools or scores.

The math (the paper's RL setup; B batch, T time)
------------------------------------------------
    reward     r = 1 if the final answer is correct else failure_reward
    baseline   b <- (1 - w) b + w mean(global batch rewards);  A = r - b, b from before the batch
    TIS        w_t = min(exp(logp_old_t - logp_rollout_t), tis_cap)       detached
    REINFORCE  loss_t = -w_t A logp_t
    PPO        loss_t = -w_t min(rho_t A, clip(rho_t, 1 - eps, 1 + eps) A),  rho_t = exp(logp_t - logp_old_t)
    loss       = sum over response tokens of loss_t / num_tokens     (the global batch's count)
Defaults: the paper's failure_reward -0.01, clip_eps None (one step a batch: rho = 1); w 0.1, tis_cap 2: departures 2-3.

Departures from the paper
-------------------------
1. A verifier's score s in [0, 1] is the reward if s > 0, keeping partial credit (Reasoning Gym; test_outcome_reward).
2. The baseline's weight w = 0.1: no source in the paper's text at hand (test_baseline_worked_example).
3. The TIS cap 2: no source in the paper's text at hand (test_tis_weights).

Implementation notes: the baseline reduces a float64 (sum, count) over processes, so unequal batches agree
(test_two_process_baseline_matches_concatenation); no host read in `policy_loss` (test_policy_loss_reads_nothing_back).
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
# The loss


def global_token_count(mask, group=None) -> int:
    """Response tokens of this process's part of the batch, summed over processes (one all_reduce)."""
    n = torch.tensor([float(mask.sum().item())], dtype=torch.float64, device=mask.device)
    if _distributed():
        dist.all_reduce(n, group=group)
    return int(n.item())


def policy_loss(logprobs, advantages, mask, *, rollout_logprobs=None, old_logprobs=None,
                num_tokens, clip_eps=None, tis_cap=2.0):
    """REINFORCE (or PPO-clip) with TIS; returns (loss, metrics). logprobs (B, T) carry the gradient;
    advantages (B,) or (B, T); mask (B, T) True on the response (padding may hold anything, -inf too);
    rollout/old log-probs (B, T) are constants; num_tokens a Python number (global_token_count).
    Nothing is read back to the host: the metrics are 0-dim tensors, and non-finite inputs are
    caught by one `check_finite` call per update."""
    for name, t in (("mask", mask), ("rollout_logprobs", rollout_logprobs), ("old_logprobs", old_logprobs)):
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} {tuple(t.shape)} and logprobs {tuple(logprobs.shape)} differ in shape")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(f"advantages must be (B,) or (B, T), got {tuple(advantages.shape)}")
    if not (num_tokens > 0 and (clip_eps is None or clip_eps > 0) and tis_cap > 0):
        raise ValueError(f"num_tokens, clip_eps (or None) and tis_cap must be positive: got num_tokens={num_tokens}, "
                         f"clip_eps={clip_eps}, tis_cap={tis_cap}")

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
        ratio, clipped = torch.ones_like(old), torch.zeros_like(valid)
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
        metrics = {"ratio": torch.where(valid, ratio.detach(), zero).sum() / n, "clipped": clipped.sum() / n,
                   "tis_weight": torch.where(valid, w, zero).sum() / n, "tis_truncated": truncated}
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
    In fp32 over chunks of positions, each recomputed in backward (torch.utils.checkpoint): only the
    (B, T) result is kept, not an fp32 copy of the (B, T, V) logits (2.5 GB per 4096 tokens at V = 152k)."""
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
