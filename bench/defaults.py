"""The method files' defaults, untuned, against AdamW at its best learning rate on the same
weights: two small policies, five seeds, in loops of the README's shape.

    python bench/defaults.py                  # both tasks, about 12 minutes on 2 CPU cores
    python bench/defaults.py --seeds 0 1      # fewer seeds
    python bench/defaults.py --markdown       # and write bench:defaults into bench/README.md

The two tasks, each from near chance or a weak start, one process, one thread:
- "toy": examples/minimal_loop.py's own loop (`minimal_loop.train`): a 2-layer width-64 Qwen2 at
  random init (std 0.2), rewarded for the share of its 6 response tokens that are token 7
  (chance 1/32), batch 32, 60 updates.
- "tiny base policy": train.py's tiny preset's base policy (its 3000-step warm-up for seed 0,
  tests/data/base-tiny-seed0.pt) on the preset's two-digit additions, reward 1 for a right
  boxed answer and -0.01 otherwise, sampled at temperature 1 until EOS, batch 32, 60 updates:
  the loop below, the README's three calls with every default.

LoGRA: `sketch.attach(model, seed=s)`, `RowAdam(layers)`, `kl_control.probe(...)` with its
defaults and `kl_control.budget_for(probe)`, then five settings of budget_for around its
defaults (entropy_share x0.5 and x2, per_response x0.5 and x2), to show the default is not at
an edge. AdamW: lr 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, betas (0.9, 0.95), no weight decay, on the
seven target projections LoGRA trains. "final" is the mean reward of the last 5 updates;
mean +- sd and min..max over the seeds. The gap is LoGRA's default against AdamW's best lr.
"""

import argparse
import os
import statistics
import sys
import time

import torch

import report  # bench/report.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]
import kl_control  # noqa: E402
import minimal_loop  # noqa: E402
import ppo  # noqa: E402
import sketch  # noqa: E402
from rowadam import RowAdam  # noqa: E402

LRS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)
E, R = kl_control.ENTROPY_SHARE, kl_control.PER_RESPONSE
BUDGETS = [("default", {}), (f"entropy_share {E / 2:g}", dict(entropy_share=E / 2)),
           (f"entropy_share {2 * E:g}", dict(entropy_share=2 * E)),
           (f"per_response {R / 2:g}", dict(per_response=R / 2)), (f"per_response {2 * R:g}", dict(per_response=2 * R))]
BASE_POLICY = os.path.join(ROOT, "tests", "data", "base-tiny-seed0.pt")


class Additions:
    """train.py's tiny preset's task and base policy, sampled in process (no engine)."""

    def __init__(self):
        import train
        from infra import policy, tasks

        self.cfg = train.PRESETS["tiny"]
        self.task = tasks.Arithmetic(0, self.cfg.eval_problems)
        self.build = lambda: policy.build_model(self.cfg.model, self.task.vocab_size, 0)

    def model(self):
        model = self.build()
        model.load_state_dict(torch.load(BASE_POLICY, weights_only=True))
        return model.eval()

    @torch.no_grad()
    def rollout(self, model, gen, batch):
        """(ids (B, T), mask (B, T): the generated tokens up to and with EOS, rewards (B,))."""
        problems = [self.task.train_problem(i) for i in torch.randint(0, 10**9, (batch,), generator=gen).tolist()]
        ids = torch.tensor(self.task.prompt_ids(problems))  # (B, P): one length
        p, ended = ids.shape[1], torch.zeros(batch, dtype=torch.bool)
        for _ in range(self.cfg.max_new_tokens):
            probs = torch.softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)  # (B, V)
            token = torch.where(ended, self.task.pad, torch.multinomial(probs, 1, generator=gen)[:, 0])
            ids = torch.cat([ids, token[:, None]], dim=1)
            ended |= token == self.task.eos
            if ended.all():
                break
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[:, p:] = ids[:, p:] != self.task.pad
        rewards = torch.tensor([1.0 if self.task.correct(q, r) else -0.01
                                for q, r in zip(problems, [[t for t in row if t != self.task.pad]
                                                           for row in ids[:, p:].tolist()])])
        return ids, mask, rewards


def additions_run(env, method, *, seed, updates, batch, lr=None, **budget):
    """One run on the tiny base policy: the README's loop, LoGRA's three calls at their defaults."""
    model = env.model()
    if method == "logra":
        layers = sketch.attach(model, seed=seed)
        opt = RowAdam(layers)
    else:
        targets = [m.weight for m in sketch.target_modules(model).values()]
        for p in model.parameters():
            p.requires_grad_(any(p is t for t in targets))
        opt = torch.optim.AdamW(targets, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    baseline, gen = ppo.RunningBaseline(weight=0.1), torch.Generator().manual_seed(seed)
    rewards, alphas = [], []
    for _ in range(updates):
        ids, mask, reward = env.rollout(model, gen, batch)
        logp = ppo.response_logprobs(model(input_ids=ids).logits, ids)  # (B, T)
        loss, _ = ppo.policy_loss(logp, baseline.advantages(reward), mask, num_tokens=int(mask.sum()))
        loss.backward()
        if method == "logra":
            opt.prepare()
            try:
                probe = kl_control.probe(model, layers, opt.directions, ids, mask)
                alpha = kl_control.solve_alpha(probe.kl1, budget=kl_control.budget_for(probe, **budget))
            except Exception:
                opt.discard()
                raise
            opt.merge(alpha)
            alphas.append(alpha)
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
        rewards.append(reward.mean().item())
    return {"rewards": rewards, "alphas": alphas}


def sums_split():
    """(train, heldout): the 400 pairs (a, b), 0 <= a, b < 20, shuffled with a fixed seed, halved
    (the task bench/real_model.py ran before it took a harder one)."""
    import random

    pairs = [(a, b) for a in range(20) for b in range(20)]
    random.Random("real-model-sums").shuffle(pairs)
    return pairs[:200], pairs[200:]


class Sums:
    """bench/real_model.py's checkpoint (SmolLM2-135M-Instruct, dequantised to fp32) and one-step
    sums "What is $a+b$?" (`sums_split`: 200 to train on, 200 held out), sampled in process at
    temperature 1 with the chat template; right when the last number of the answer is the sum
    (real_model.py grades with math-verify, which reads the same number here). Prompts of one
    token length per batch (a length drawn, then its problems), so that no batch is padded."""

    def __init__(self, checkpoint):
        import re

        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.re = re
        self.tok = AutoTokenizer.from_pretrained(checkpoint)
        self.load = lambda: AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        train, heldout = sums_split()
        self.buckets = {"train": self.bucket(train), "heldout": self.bucket(heldout)}

    def prompt(self, a, b):
        return self.tok.apply_chat_template([{"role": "user", "content": f"What is ${a}+{b}$?"}],
                                            tokenize=True, add_generation_prompt=True, return_dict=False)

    def bucket(self, pairs):
        out = {}
        for a, b in pairs:
            ids = self.prompt(a, b)
            out.setdefault(len(ids), []).append((ids, a + b))
        return out

    def right(self, text, answer):
        numbers = self.re.findall(r"-?\d+", text.replace(",", ""))
        return bool(numbers) and int(numbers[-1]) == answer

    @torch.no_grad()
    def sample(self, model, items, gen, temperature=1.0):
        """(ids (B, T), mask (B, T): generated tokens through EOS, rewards (B,) 1 or 0)."""
        ids = torch.tensor([i for i, _ in items])
        p, eos, ended = ids.shape[1], self.tok.eos_token_id, torch.zeros(len(items), dtype=torch.bool)
        past, step_ids = None, ids
        for _ in range(64):
            out = model(input_ids=step_ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[:, -1].float()  # (B, V)
            if temperature == 0:
                token = logits.argmax(-1)
            else:
                token = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)[:, 0]
            token = torch.where(ended, eos, token)
            ids = torch.cat([ids, token[:, None]], dim=1)
            step_ids = token[:, None]
            ended |= token == eos
            if ended.all():
                break
        gen_part = ids[:, p:]
        after_eos = (gen_part == eos).int().cumsum(1) - (gen_part == eos).int() > 0
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[:, p:] = ~after_eos
        texts = self.tok.batch_decode(gen_part, skip_special_tokens=True)
        return ids, mask, torch.tensor([1.0 if self.right(t, a) else 0.0 for t, (_, a) in zip(texts, items)])

    def evaluate(self, model):
        """Held-out pass@1, greedy: the share of the 200 held-out sums answered right."""
        right = total = 0
        for items in self.buckets["heldout"].values():
            for start in range(0, len(items), 50):
                _, _, r = self.sample(model, items[start:start + 50], None, temperature=0)
                right, total = right + r.sum().item(), total + len(r)
        return right / total


def sums_run(env, *, seed, updates, batch):
    """The README's loop with every LoGRA default on SmolLM2: held-out pass@1 before and after."""
    model = env.load()
    base = env.evaluate(model)
    layers = sketch.attach(model, seed=seed)
    opt = RowAdam(layers)
    baseline, gen = ppo.RunningBaseline(weight=0.1), torch.Generator().manual_seed(seed)
    lengths = sorted(env.buckets["train"])
    weights = torch.tensor([len(env.buckets["train"][n]) for n in lengths], dtype=torch.float)
    rewards, alphas, budgets = [], [], []
    for _ in range(updates):
        pool = env.buckets["train"][lengths[torch.multinomial(weights, 1, generator=gen).item()]]
        items = [pool[i] for i in torch.randint(0, len(pool), (batch,), generator=gen).tolist()]
        ids, mask, reward = env.sample(model, items, gen)
        logp = ppo.response_logprobs(model(input_ids=ids).logits, ids)  # (B, T)
        loss, _ = ppo.policy_loss(logp, baseline.advantages(reward), mask, num_tokens=int(mask.sum()))
        loss.backward()
        try:
            opt.prepare()
            probe = kl_control.probe(model, layers, opt.directions, ids, mask)
            budget = kl_control.budget_for(probe)
            alpha = kl_control.solve_alpha(probe.kl1, budget=budget)
        except Exception:
            opt.discard()
            raise
        opt.merge(alpha)
        rewards.append(reward.mean().item())
        alphas.append(alpha)
        budgets.append(budget)
    return {"base": base, "final": env.evaluate(model), "rewards": rewards, "alphas": alphas, "budgets": budgets}


def smollm2(args):
    """--smollm2 DIR: LoGRA's defaults on SmolLM2-135M-Instruct, held-out pass@1 before and after."""
    env = Sums(args.smollm2)
    rows, t0 = [], time.perf_counter()
    header = ["seed", "held-out pass@1 before", "after", "gain", "train reward, first 5", "last 5",
              "alpha (median)", "budget per token (median)", "alpha at its cap"]
    for seed in args.seeds:
        out = sums_run(env, seed=seed, updates=args.smollm2_updates, batch=16)
        rows.append([seed, f"{out['base']:.3f}", f"{out['final']:.3f}", f"{out['final'] - out['base']:+.3f}",
                     f"{statistics.mean(out['rewards'][:5]):.3f}", f"{statistics.mean(out['rewards'][-5:]):.3f}",
                     f"{statistics.median(out['alphas']):.2g}", f"{statistics.median(out['budgets']):.2e}",
                     f"{100 * sum(a >= 3.0 for a in out['alphas']) / len(out['alphas']):.0f}%"])
        print(report.row(rows[-1]), flush=True)
    note = (f"SmolLM2-135M-Instruct ({args.smollm2}: bench/real_model.py's checkpoint), its 200 training sums, "
            f"{args.smollm2_updates} updates of 16 prompts sampled at temperature 1 (up to 64 new tokens), "
            f"the README's loop with every LoGRA default (rank {sketch.PAPER_RANK}, update_ratio, probe, budget_for); held-out: the "
            f"200 other sums, greedy, right when the answer's last number is the sum (one evaluation's binomial "
            f"error about 0.03). {(time.perf_counter() - t0) / 60:.0f} min, one thread.")
    print("\n" + note)
    if args.markdown:
        report.publish("defaults_smollm2", note + "\n\n" + report.table(header, rows))


def summary(values) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} +- {sd:.3f} ({min(values):.3f}..{max(values):.3f})"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--updates", type=int, default=60)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--smollm2", metavar="DIR", help="instead: LoGRA's defaults on bench/real_model.py's checkpoint")
    p.add_argument("--smollm2-updates", type=int, default=30)
    args = report.parse_args(p, "defaults", "defaults_smollm2",
                             which=lambda a: ["defaults_smollm2" if a.smollm2 else "defaults"])
    torch.set_num_threads(1)
    if args.smollm2:
        return smollm2(args)
    additions = Additions()
    tasks = {
        "toy (examples/minimal_loop.py)": lambda method, seed, lr=None, **kw: minimal_loop.train(
            method, updates=args.updates, batch=args.batch, seed=seed, log=lambda line: None, realised=False,
            **({"lr": lr} if lr else {}), **kw),
        "tiny base policy (additions)": lambda method, seed, lr=None, **kw: additions_run(
            additions, method, seed=seed, updates=args.updates, batch=args.batch, lr=lr, **kw),
    }
    header = ["task", "optimizer", "setting", "reward, first 5", "final reward (last 5)", "alpha at its cap"]
    rows, gaps, t_all = [], [], time.perf_counter()
    print(report.table(header, []), flush=True)
    for task, run in tasks.items():
        finals = {}
        settings = [("adamw", f"lr {lr:g}", dict(lr=lr)) for lr in LRS] + \
                   [("logra", name, kw) for name, kw in BUDGETS]
        for method, name, kw in settings:
            first, last, capped = [], [], []
            for seed in args.seeds:
                out = run(method, seed, **kw)
                first.append(statistics.mean(out["rewards"][:5]))
                last.append(statistics.mean(out["rewards"][-5:]))
                capped += [a >= 3.0 for a in out["alphas"]]
            finals[(method, name)] = last
            rows.append([task, "LoGRA" if method == "logra" else "AdamW", name, summary(first), summary(last),
                         f"{100 * sum(capped) / len(capped):.0f}%" if capped else ""])
            print(report.row(rows[-1]), flush=True)
        best = max((k for k in finals if k[0] == "adamw"), key=lambda k: statistics.mean(finals[k]))
        gap = statistics.mean(finals[("logra", "default")]) - statistics.mean(finals[best])
        gaps.append(f"{task}: LoGRA's defaults {statistics.mean(finals[('logra', 'default')]):.3f}, AdamW's best "
                    f"({best[1]}) {statistics.mean(finals[best]):.3f}: {gap:+.3f}")
    minutes = (time.perf_counter() - t_all) / 60
    note = (f"{args.updates} updates of batch {args.batch}, seeds {', '.join(map(str, args.seeds))} (mean +- sd, "
            f"min..max over seeds); LoGRA's defaults: rank {sketch.PAPER_RANK} capped by sketch.default_rank "
            f"(32 here), "
            f"update_ratio {RowAdam.__init__.__kwdefaults__['update_ratio']:g}, the probe on an eighth of the "
            f"batch and at least {kl_control.PROBE_FLOOR} tokens, "
            f"budget_for(entropy_share={E:g}, per_response={R:g}). One thread; whole sweep {minutes:.1f} min.")
    print("\n" + note + "\n" + "\n".join(gaps))
    if args.markdown:
        report.publish("defaults", note + "\n\n" + "\n".join(f"- {g}" for g in gaps) + "\n\n" +
                       report.table(header, rows))


if __name__ == "__main__":
    main()
