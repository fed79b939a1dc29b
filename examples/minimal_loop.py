"""
examples/minimal_loop.py: LoGRA in a plain PyTorch + transformers REINFORCE loop, beside AdamW.

    python examples/minimal_loop.py                # both optimizers, 60 updates, a few seconds each
    python examples/minimal_loop.py --updates 20   # fewer

No train.py, no process group, no engine: one process samples from its own policy, scores
the responses, and takes one policy-gradient step per batch, once with LoGRA (sketch.py,
rowadam.py, kl_control.py) and once with torch.optim.AdamW, from the same initial weights on
the same prompts. It prints both reward curves and the median time of each optimizer's
update (backward to merged weights; the rollout is the same code for both and is left out).

The task is a toy that a few updates can move: a 2-layer Qwen2 built from a config (random
weights drawn at std 0.2, so that its hidden states, not only its output head, decide its
tokens; 32 tokens) is rewarded for the share of its 6 response tokens that are token 7
(chance: 1/32). Both optimizers train the same weights, LoGRA's targets (the attention and
MLP projections; embeddings, norms and the head stay frozen, as in the paper). Copy the
LoGRA lines of `update_logra` into your own loop: the rest is the loop any REINFORCE trainer
already has.

LoGRA runs on the method files' defaults, nothing tuned: the rank from sketch.py's rule (32
here: half the narrowest width of 64), RowAdam's update_ratio, the probe's share of the batch
and kl_control.budget_for's budget (a share of the policy's entropy per token, at most so much
per response). AdamW runs at its best learning rate from bench/defaults.py's sweep (3e-3).
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the method files, flat

import kl_control  # noqa: E402
import ppo  # noqa: E402
import sketch  # noqa: E402
from infra.batched import BatchedRowAdam  # noqa: E402  rowadam.RowAdam over stacks of layers: its bits
from infra.probe_decoder import fast_probe  # noqa: E402  (kl_control.probe's fast path)

VOCAB, PROMPT, RESPONSE, GOOD = 32, 4, 6, 7


def tiny_model(seed: int, *, hidden: int = 64, num_layers: int = 2, init_std: float = 0.2):
    """A Qwen2 from a config (2 layers of width 64 here; bench/defaults_sweep.py also builds
    larger ones, and with the usual init_std 0.02): fp32 weights, random, the same for both
    optimizers; attention heads of 32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=num_layers, num_attention_heads=hidden // 32,
                         num_key_value_heads=max(1, hidden // 64), max_position_embeddings=32,
                         initializer_range=init_std)
    return Qwen2ForCausalLM(config).eval()


@torch.no_grad()
def rollout(model, prompts, generator):
    """Sample RESPONSE tokens after each prompt at temperature 1: (ids (B, P+R), mask (B, P+R))."""
    ids = prompts
    for _ in range(RESPONSE):
        probs = torch.softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)  # (B, V)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, PROMPT:] = True
    return ids, mask


def loss_of(model, ids, mask, advantages):
    """REINFORCE on the global mean per response token (ppo.py); on-policy, so no TIS."""
    logp = ppo.response_logprobs(model(input_ids=ids).logits, ids)  # (B, T)
    loss, _ = ppo.policy_loss(logp, advantages, mask, num_tokens=int(mask.sum()))
    return loss


def update_logra(model, layers, opt, ids, mask, advantages, *, realised=True, **budget):
    """One LoGRA update: backward into the sketches, RowAdam, the KL probe, alpha for the
    default budget, the merge; returns (alpha, predicted KL, realised KL or None). `budget`:
    kl_control.budget_for's settings (bench/defaults.py sweeps them); `realised=False` skips
    the realised KL's extra forward (it only measures)."""
    loss_of(model, ids, mask, advantages).backward()  # into S = G A^T; no weight gradient exists
    opt.prepare()  # RowAdam's directions U (d, r) per layer; nothing changed yet
    try:
        keep = ids.numel() if realised else 0  # the logits "before", for the realised KL
        probe = fast_probe(model, layers, opt.directions, ids, mask, keep_positions=keep)
        alpha = kl_control.solve_alpha(probe.kl1, budget=kl_control.budget_for(probe, **budget))
    except Exception:
        opt.discard()  # weights, moments and counter as they were
        raise
    opt.merge(alpha)  # W -= bf16(alpha U) A_t, then A_t -> A_{t+1}
    return alpha, alpha**2 * probe.kl1, kl_control.realised_kl(probe, model, ids, mask) if realised else None


def update_adamw(model, opt, ids, mask, advantages):
    loss_of(model, ids, mask, advantages).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


LR = 3e-3  # AdamW's best on this toy (bench/defaults.py: 1e-3, 3e-3, 1e-2, 3e-2 swept)


def train(method: str, *, updates: int, batch: int, seed: int, log=print, lr: float = LR, realised: bool = True,
          hidden: int = 64, num_layers: int = 2, init_std: float = 0.2, **budget) -> dict:
    """One run of `method` ("logra" or "adamw"): its reward per update and update times (and,
    for LoGRA, alpha and the predicted and realised KL per update). `lr` is AdamW's, `budget`
    LoGRA's budget_for settings (their defaults unless given); the model's size and
    initialisation are the example's unless given."""
    model = tiny_model(seed, hidden=hidden, num_layers=num_layers, init_std=init_std)
    if method == "logra":
        layers = sketch.attach(model, seed=seed)  # every weight frozen; the targets sketched
        opt = BatchedRowAdam(layers)
    else:
        targets = [m.weight for m in sketch.target_modules(model).values()]  # what LoGRA trains, no more
        for p in model.parameters():
            p.requires_grad_(any(p is t for t in targets))
        opt = torch.optim.AdamW(targets, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    baseline = ppo.RunningBaseline(weight=0.1)
    prompts_gen, sample_gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    rewards, times, alphas, kls = [], [], [], []
    for update in range(updates):
        prompts = torch.randint(0, VOCAB, (batch, PROMPT), generator=prompts_gen)
        ids, mask = rollout(model, prompts, sample_gen)
        reward = (ids[:, PROMPT:] == GOOD).float().mean(dim=1)  # (B,) the share of good tokens
        advantages = baseline.advantages(reward)
        t0 = time.perf_counter()
        if method == "logra":
            alpha, kl_pred, kl_real = update_logra(model, layers, opt, ids, mask, advantages, realised=realised,
                                                   **budget)
            alphas.append(alpha)
            kls.append((kl_pred, kl_real))
            info = f"alpha {alpha:.2f} | kl {kl_pred:.1e}" + (f" (real {kl_real:.1e})" if realised else "")
        else:
            update_adamw(model, opt, ids, mask, advantages)
            info = f"lr {opt.param_groups[0]['lr']:.0e}"
        times.append(time.perf_counter() - t0)
        rewards.append(reward.mean().item())
        if update % 10 == 0 or update == updates - 1:
            log(f"{method:5s} update {update:3d} | reward {rewards[-1]:.3f} | {info} | {1e3 * times[-1]:.0f} ms")
    return {"rewards": rewards, "times": times, "model": model, "alphas": alphas, "kls": kls}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--updates", type=int, default=60)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # small matmuls: threads only add overhead, and the timing is steadier
    runs = {m: train(m, updates=args.updates, batch=args.batch, seed=args.seed, realised=False)
            for m in ("logra", "adamw")}
    for method, run in runs.items():
        first, last = run["rewards"][:5], run["rewards"][-5:]
        print(f"{method}: reward {statistics.mean(first):.3f} (first 5) -> {statistics.mean(last):.3f} (last 5); "
              f"update {1e3 * statistics.median(run['times']):.1f} ms (median)")
    ratio = statistics.median(runs["logra"]["times"]) / statistics.median(runs["adamw"]["times"])
    print(f"LoGRA's update takes {ratio:.2f}x AdamW's (median, rollout excluded)")
    return runs


if __name__ == "__main__":
    main()
