"""
infra/group_advantages.py: several responses per prompt (train.py --group-size, --advantage),
not the paper's.

The paper samples one response per prompt and subtracts ppo.py's running baseline. The
recipes most trainers run today (TRL's GRPOTrainer, verl, NeMo-RL) sample G responses of
each prompt and compare a response with the others of its group instead. Each estimator
takes this process's rewards (B,) with a prompt's G responses contiguous (rows g G ..
g G + G - 1 are group g) and returns the advantages (B,), with no state and no
communication: a group lives on one process. With mean_g and std_g the group's mean and
standard deviation,

    grpo    A_i = (r_i - mean_g) / (std_g + eps)      std with G - 1 in its denominator, eps 1e-4
    drgrpo  A_i =  r_i - mean_g
    rloo    A_i =  r_i - (sum_g r - r_i) / (G - 1)  =  G / (G - 1) (r_i - mean_g)

A group whose G rewards are all equal carries no signal: its advantages are exactly 0 (set,
not left to round-off, which would otherwise hand RowAdam a direction of noise), so its
responses add nothing to the gradient; their tokens still count in `num_tokens`, so such
groups shrink the step of the others as the token normalisation of TRL and DAPO does (DAPO's
dynamic sampling, which resamples them, is not done here). `zero_variance_groups` counts
them (the standard diagnostic). Tests: tests/test_ppo.py, against numpy. Measured beside the
paper's baseline: bench/README.md, `tiny_sweep.py --groups`.
"""

import torch


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
