"""ppo.py: hand-derived gradients, micro-batch invariance, the baseline across 2 processes, no
host read in the loss, one in the finite check, and the Use block against a written-out loss."""

import copy
import math
import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

import ppo
import sketch
from distributed import run_gloo
from infra import group_advantages
from tiny import tiny_batch, tiny_qwen2, use_block

F64 = torch.float64


def batch(seed, b=4, t=6):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(b, t, generator=g, dtype=F64) * 3).requires_grad_(True)
    rollout = logp.detach() + 0.3 * torch.randn(b, t, generator=g, dtype=F64)
    adv = torch.randn(b, generator=g, dtype=F64)
    mask = (torch.rand(b, t, generator=g) > 0.3).long()
    mask[:, 0] = 0  # the prompt
    return logp, rollout, adv, mask


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), cap=st.floats(0.5, 3.0))
def test_reinforce_tis_gradient(seed, cap):
    logp, rollout, adv, mask = batch(seed)
    n = int(mask.sum()) + 3  # a global count larger than this micro-batch's
    loss, _ = ppo.policy_loss(logp, adv, mask, rollout_logprobs=rollout, num_tokens=n, tis_cap=cap)
    (grad,) = torch.autograd.grad(loss, logp)
    # d loss / d logp_t = -min(exp(logp_t - rollout_t), cap) A / n on response tokens, 0 elsewhere.
    w = torch.exp(logp.detach() - rollout).clamp(max=cap)
    expect = torch.where(mask.bool(), -w * adv[:, None] / n, torch.zeros((), dtype=F64))
    torch.testing.assert_close(grad, expect, rtol=1e-12, atol=1e-15)


def test_ppo_clip_gradient_vanishes_on_clipped_side():
    logp, _, _, mask = batch(1, b=4, t=5)
    mask[:] = 1
    old = logp.detach() + torch.tensor([0.5, -0.5, 0.05, -0.05], dtype=F64)[:, None]  # ratio e^-0.5, e^0.5, ~1, ~1
    adv = torch.tensor([-1.0, 1.0, 1.0, -1.0], dtype=F64)
    loss, m = ppo.policy_loss(logp, adv, mask, old_logprobs=old, num_tokens=20, clip_eps=0.2)
    (grad,) = torch.autograd.grad(loss, logp)
    ratio = torch.exp(logp.detach() - old)
    # rows 0 and 1: ratio outside [0.8, 1.2] on the side the clip binds -> exactly zero gradient
    assert torch.equal(grad[:2], torch.zeros(2, 5, dtype=F64))
    # rows 2 and 3: inside the clip range -> d/dlogp of -rho A / n = -rho A / n
    torch.testing.assert_close(grad[2:], -ratio[2:] * adv[2:, None] / 20, rtol=1e-12, atol=0)
    assert float(m["clipped"]) == 0.5
    # On the other side of the clip (ratio < 0.8 with A > 0) the objective is not clipped.
    loss, m = ppo.policy_loss(logp, -adv, mask, old_logprobs=old, num_tokens=20, clip_eps=0.2)
    (grad,) = torch.autograd.grad(loss, logp)
    assert (grad[:2] != 0).all() and float(m["clipped"]) == 0.0


def test_micro_batch_invariance():
    logp, rollout, adv, mask = batch(2, b=6, t=7)
    n = ppo.global_token_count(mask)
    whole, _ = ppo.policy_loss(logp, adv, mask, rollout_logprobs=rollout, num_tokens=n)
    (g_whole,) = torch.autograd.grad(whole, logp)
    g_split = torch.zeros_like(logp)
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        part, _ = ppo.policy_loss(logp[rows], adv[rows], mask[rows], rollout_logprobs=rollout[rows], num_tokens=n)
        g_split += torch.autograd.grad(part, logp)[0]
    torch.testing.assert_close(g_split, g_whole, rtol=1e-13, atol=1e-16)


def test_tis_weights():
    logp, rollout, adv, mask = batch(3)
    rollout = logp.detach() - 2.0  # exp(2) = 7.4 > cap: every weight is truncated
    loss, m = ppo.policy_loss(logp, adv, mask, rollout_logprobs=rollout, num_tokens=10, tis_cap=2.0)
    assert float(m["tis_weight"]) == 2.0 and float(m["tis_truncated"]) == 1.0
    (grad,) = torch.autograd.grad(loss, logp)  # the weight is a constant: gradient is -cap A / n
    expect = torch.where(mask.bool(), -2.0 * adv[:, None] / 10, torch.zeros((), dtype=F64))
    torch.testing.assert_close(grad, expect, rtol=1e-12, atol=0)
    _, m = ppo.policy_loss(logp, adv, mask, rollout_logprobs=logp.detach(), num_tokens=10)
    assert float(m["tis_weight"]) == 1.0 and float(m["tis_truncated"]) == 0.0


def test_bad_input():
    logp, rollout, adv, mask = batch(4)
    with pytest.raises(ValueError, match="num_tokens"):
        ppo.policy_loss(logp, adv, mask, num_tokens=0)
    with pytest.raises(ValueError, match="differ in shape"):
        ppo.policy_loss(logp, adv, mask[:, 1:], num_tokens=5)
    with pytest.raises(ValueError, match="advantages must be"):
        ppo.policy_loss(logp, adv[:2], mask, num_tokens=5)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        ppo.policy_loss(logp, adv, mask, rollout_logprobs=rollout[:2], num_tokens=5)
    with pytest.raises(ValueError, match="finite"):
        ppo.RunningBaseline().advantages(torch.tensor([1.0, float("nan")]))
    # A padded position may hold anything: it is masked out.
    padded = logp.detach().clone()
    padded[~mask.bool()] = float("-inf")
    loss, _ = ppo.policy_loss(padded, adv, mask, num_tokens=5)
    assert math.isfinite(loss.item())


def test_policy_loss_reads_nothing_back():
    """On the meta device a tensor has no values, so any host read (.item(), bool(), boolean
    indexing, .cpu()) raises: forward and backward run through, in both objectives."""
    logp, rollout, adv, mask = (t.detach().to("meta") for t in batch(5))
    for kw in (dict(rollout_logprobs=rollout), dict(rollout_logprobs=rollout, old_logprobs=rollout, clip_eps=0.2)):
        lp = logp.clone().requires_grad_(True)
        loss, m = ppo.policy_loss(lp, adv, mask, num_tokens=7, **kw)
        loss.backward()
        assert lp.grad.shape == lp.shape and loss.device.type == "meta"
        assert sorted(m) == ["clipped", "ratio", "tis_truncated", "tis_weight"]
        assert all(v.dim() == 0 and not v.requires_grad for v in m.values())


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


def count_host_reads(monkeypatch):
    """Count the calls of every Tensor method that reads values back to the host."""
    calls = []
    for name in HOST_READS:
        def counted(self, *args, _original=getattr(torch.Tensor, name), _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


def test_check_finite_names_the_first_bad_input_with_one_read(monkeypatch):
    logp, rollout, adv, mask = batch(6)
    padded = torch.where(mask.bool(), logp.detach(), float("-inf"))  # -inf off the response
    nan_adv = adv.clone()
    nan_adv[2] = float("nan")
    inf_rollout = rollout.clone()
    inf_rollout[1, 3] = float("inf")
    calls = count_host_reads(monkeypatch)
    ppo.check_finite(logprobs=torch.where(mask.bool(), padded, 0), advantages=adv, rollout_logprobs=rollout)
    assert len(calls) == 1, calls
    for kwargs, first in [(dict(advantages=nan_adv, rollout_logprobs=inf_rollout), "advantages"),
                          (dict(rollout_logprobs=inf_rollout, advantages=nan_adv), "rollout_logprobs"),
                          (dict(advantages=adv, logprobs=padded), "logprobs")]:
        calls.clear()
        with pytest.raises(ValueError, match=f"^{first} holds non-finite"):
            ppo.check_finite(**kwargs)
        assert len(calls) == 1, calls
    calls.clear()
    ppo.check_finite()
    assert calls == []


def test_outcome_reward():
    assert ppo.outcome_reward(True) == 1.0 and ppo.outcome_reward(False) == -0.01
    assert ppo.outcome_reward(False, failure_reward=0.0) == 0.0
    assert torch.equal(ppo.outcome_reward(torch.tensor([True, False])), torch.tensor([1.0, -0.01]))
    # A verifier's partial score (Reasoning Gym's) is its own reward; 0 is a failure.
    assert torch.equal(ppo.outcome_reward(torch.tensor([1.0, 0.25, 0.0])), torch.tensor([1.0, 0.25, -0.01]))
    assert ppo.outcome_reward(0.5) == 0.5 and ppo.outcome_reward(0.0) == -0.01


def test_baseline_worked_example():
    bl = ppo.RunningBaseline(weight=0.1)
    # Batch 1: mean 0.5, used as its own baseline; then b = 0.5.
    assert torch.allclose(bl.advantages(torch.tensor([1.0, 0.0, 1.0, 0.0])), torch.tensor([0.5, -0.5, 0.5, -0.5]))
    assert bl.value == 0.5
    # Batch 2: mean 1.0; advantages against 0.5; then b = 0.9 * 0.5 + 0.1 * 1.0 = 0.55.
    assert torch.allclose(bl.advantages(torch.tensor([1.0, 1.0])), torch.tensor([0.5, 0.5]))
    assert math.isclose(bl.value, 0.55)
    # Batch 3: mean -0.01; advantages against 0.55; b = 0.9 * 0.55 + 0.1 * (-0.01) = 0.494.
    assert torch.allclose(bl.advantages(torch.tensor([-0.01])), torch.tensor([-0.56]))
    assert math.isclose(bl.value, 0.494)
    restored = ppo.RunningBaseline()
    restored.load_state_dict(bl.state_dict())
    assert restored.value == bl.value


BATCHES = [[1.0, -0.01, 1.0, 1.0, -0.01], [-0.01, -0.01, 1.0], [1.0, 1.0, 1.0, -0.01, -0.01, -0.01]]
SPLIT = [3, 2, 4]  # rank 0 gets the first SPLIT[i] rewards of batch i: uneven sizes per rank


def _two_rank_baseline(rank, world, out_dir):
    bl = ppo.RunningBaseline()
    advs = []
    for rewards, k in zip(BATCHES, SPLIT):
        part = rewards[:k] if rank == 0 else rewards[k:]
        advs.append(bl.advantages(torch.tensor(part, dtype=F64)))
    torch.save({"advs": advs, "b": bl.value}, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_two_process_baseline_matches_concatenation(tmp_path):
    run_gloo(_two_rank_baseline, 2, str(tmp_path))
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    bl = ppo.RunningBaseline()
    for i, (rewards, k) in enumerate(zip(BATCHES, SPLIT)):
        whole = bl.advantages(torch.tensor(rewards, dtype=F64))
        torch.testing.assert_close(torch.cat([got[0]["advs"][i], got[1]["advs"][i]]), whole, rtol=1e-14, atol=1e-15)
    assert got[0]["b"] == got[1]["b"] and math.isclose(got[0]["b"], bl.value, rel_tol=1e-14)


def test_response_logprobs_against_direct_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    out = ppo.response_logprobs(logits, ids, temperature=0.7)
    p = torch.softmax(logits.double() / 0.7, -1)
    for b in range(2):
        assert out[b, 0] == 0
        for t in range(1, 5):
            assert math.isclose(out[b, t].item(), math.log(p[b, t - 1, ids[b, t]].item()), rel_tol=1e-5)


def test_response_logprobs_chunks_and_gradient():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(2, 9, 30, generator=g, dtype=F64, requires_grad=True)
    y = torch.randint(0, 30, (2, 9), generator=g)
    direct = torch.log_softmax(z[:, :-1] / 0.7, -1).gather(-1, y[:, 1:, None]).squeeze(-1)  # (B, T-1)
    (g_direct,) = torch.autograd.grad(direct.sum(), z)
    for chunk in (1, 3, 100):  # chunked and recomputed in backward: same values and gradient
        out = ppo.response_logprobs(z, y, 0.7, chunk=chunk)
        torch.testing.assert_close(out[:, 1:], direct, rtol=1e-12, atol=1e-12)
        (g_out,) = torch.autograd.grad(out.sum(), z)
        torch.testing.assert_close(g_out, g_direct, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------
# The Use block, on the tiny Qwen2 with sketched targets

def test_the_use_block_runs():
    """ppo.py's Use block on the tiny Qwen2 (fp32, targets sketched): its advantages, loss and
    every target's sketch are those of the objective written out here, in float64 on a copy
    of the model, with dense autograd's gradient G (sketch S = G A_0^T)."""
    model = tiny_qwen2()
    reference = copy.deepcopy(model).double()
    layers = sketch.attach(model, rank=8, seed=0)
    ids = tiny_batch(batch=4, length=9)
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    mask[:, 5:] = True  # 5 prompt tokens, then 4 response tokens
    mask[3, 7:] = False  # one shorter response (padding after it)
    correct = torch.tensor([1.0, 0.0, 1.0, 0.0])
    with torch.no_grad():
        trainer = ppo.response_logprobs(model(input_ids=ids).logits, ids)  # (B, T)
    noise = 0.5 * torch.randn(ids.shape, generator=torch.Generator().manual_seed(2))
    rollout_logprobs = torch.where(mask, trainer + noise, 0.0)  # an engine that differs a little
    run = dict(torch=torch, model=model, ids=ids, mask=mask, correct=correct, rollout_logprobs=rollout_logprobs)
    exec(use_block(ppo.__doc__), run)

    # The objective, written out: r = 1 or -0.01; A = r - mean(r) (a first batch is its own
    # baseline); w = min(exp(logp - rollout), 2); loss = -sum over responses of w A logp / N.
    logits = reference(input_ids=ids).logits  # (B, T, V) float64
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T - 1)
    logp = torch.cat([torch.zeros(4, 1, dtype=F64), logp], 1)  # (B, T)
    r = torch.tensor([1.0, -0.01, 1.0, -0.01], dtype=F64)
    adv = r - r.mean()  # (B,)
    w = torch.exp(logp.detach() - rollout_logprobs.double()).clamp(max=2.0)  # (B, T)
    loss = -torch.where(mask, w * adv[:, None] * logp, 0.0).sum() / mask.sum()
    loss.backward()

    assert run["num_tokens"] == int(mask.sum()) == 14
    torch.testing.assert_close(run["advantages"].double(), adv, rtol=1e-6, atol=1e-7)
    assert math.isclose(run["baseline"].value, r.mean().item(), rel_tol=1e-6)
    assert math.isfinite(run["loss"].item()) and math.isclose(run["loss"].item(), loss.item(), rel_tol=1e-5)
    assert 0 < float(run["metrics"]["tis_weight"]) <= 2.0
    modules = dict(reference.named_modules())
    for layer in layers:
        ref = modules[layer.name].weight.grad @ layer.projection.double().t()  # (d, r)
        assert layer.backwards == 1 and ref.abs().max() > 0, layer.name
        torch.testing.assert_close(layer.sketch.double(), ref, rtol=0, atol=2e-5 * ref.abs().max().item())
    assert all(p.grad is None for p in model.parameters())


# --- group advantages, against numpy ---------------------------------------------------------

def numpy_group_advantages(kind, rewards, G):
    """The estimators written out per response with numpy, one group and one response at a time."""
    import numpy as np

    r = np.asarray(rewards, dtype=np.float64).reshape(-1, G)
    out = np.zeros_like(r)
    for g in range(r.shape[0]):
        row = r[g]
        if np.all(row == row[0]):
            continue  # no signal: 0
        for i in range(G):
            if kind == "grpo":
                out[g, i] = (row[i] - row.mean()) / (np.std(row, ddof=1) + 1e-4)
            elif kind == "drgrpo":
                out[g, i] = row[i] - row.mean()
            else:  # rloo: the mean of the others
                out[g, i] = row[i] - np.mean(np.delete(row, i))
    return out.reshape(-1)


@pytest.mark.parametrize("kind", ["grpo", "drgrpo", "rloo"])
@pytest.mark.parametrize("G, rewards", [
    (2, [1.0, -0.01, -0.01, 1.0, 1.0, 1.0, -0.01, -0.01]),           # G = 2: one split, two equal groups
    (4, [1.0, 1.0, -0.01, -0.01, 0.25, 0.25, 0.25, 1.0, 0.5, 0.5, 0.5, 0.5]),  # ties; an all-equal group
    (8, torch.rand(32, generator=torch.Generator().manual_seed(3)).tolist()),
])
def test_group_advantages_against_numpy(kind, G, rewards):
    import numpy as np

    r = torch.tensor(rewards, dtype=torch.float32)
    got = group_advantages.GROUP_ADVANTAGES[kind](r, G)
    assert got.dtype == torch.float32 and got.shape == r.shape
    expect = numpy_group_advantages(kind, r.double().numpy(), G)
    np.testing.assert_allclose(got.double().numpy(), expect, rtol=1e-6, atol=1e-7)
    equal = (r.view(-1, G) == r.view(-1, G)[:, :1]).all(dim=1)
    assert torch.equal(got.view(-1, G)[equal], torch.zeros_like(got.view(-1, G)[equal]))  # exactly 0, no noise
    assert int(group_advantages.zero_variance_groups(r, G)) == int(equal.sum())
    if kind != "grpo":  # the mean of a group's advantages is 0 (grpo's too; drgrpo and rloo exactly scaled)
        np.testing.assert_allclose(got.double().view(-1, G).sum(dim=1).numpy(), 0.0, atol=1e-6)


def test_rloo_is_a_scaled_drgrpo_and_grpo_unit_variance():
    r = torch.rand(40, generator=torch.Generator().manual_seed(0), dtype=F64)
    G = 5
    torch.testing.assert_close(group_advantages.rloo_advantages(r, G), G / (G - 1) * group_advantages.drgrpo_advantages(r, G))
    std = group_advantages.grpo_advantages(r, G).view(-1, G).std(dim=1)
    torch.testing.assert_close(std, torch.full_like(std, 1.0), rtol=1e-3, atol=0)  # eps 1e-4 against std ~0.3


@pytest.mark.parametrize("kind", ["grpo", "drgrpo", "rloo"])
def test_group_advantages_refuse_what_is_not_whole_groups(kind):
    with pytest.raises(ValueError, match="B a multiple of G: got B = 6, G = 4"):
        group_advantages.GROUP_ADVANTAGES[kind](torch.ones(6), 4)
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages.GROUP_ADVANTAGES[kind](torch.ones(6), 1)
    with pytest.raises(ValueError, match=r"must be \(B,\)"):
        group_advantages.GROUP_ADVANTAGES[kind](torch.ones(2, 4), 2)
