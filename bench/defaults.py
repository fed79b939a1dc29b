"""The method files' defaults, untuned, against AdamW at its best learning rate, on a family of
small loops that vary one factor at a time, judged on problems no update saw.

    python bench/defaults.py --jobs 2         # the family: about 10 minutes on 2 CPU cores
    python bench/defaults.py --tune --jobs 2  # LoGRA's settings on seeds 0-4, the check loops left out
    python bench/defaults.py --why --jobs 2   # where the gap comes from (after the family's AdamW sweep)
    python bench/defaults.py --loops base     # some loops only (names below)
    python bench/defaults.py --markdown       # and write bench:defaults into bench/README.md
    python bench/defaults.py --smollm2 DIR    # instead: the one-call defaults on SmolLM2-135M-Instruct
    python bench/defaults.py --smollm2 DIR --start scratch [--uncalibrated]  # the settings for random weights

The family (designed before anything was tuned on it). The base loop is a user's first loop:
a random 2-layer, width-64 Qwen2 (weights at std 0.2, vocabulary 16, its head frozen, as
`attach` leaves it), prompts of 4 uniform tokens, and a ONE-token answer that is right when it
is pi(the token 4 positions before it), pi a fixed permutation of the vocabulary (the first
prompt token, here); REINFORCE with the batch's mean reward as the baseline, 64 responses an
update sampled at temperature 1, 80 updates. With L answer tokens the same rule holds at
every position (token j is pi of token j - 4, prompt or answer), and the reward is the share
of right tokens. The variations, one factor each: answers of 6 and of 64 tokens; the output
head trained (both methods); a Llama of the same shape; batches of 16 (320 updates: the same
5120 rollouts); transformers' std 0.02 init (added after the first measurement of the others,
before any setting was tried: a user's model built from a config has that init). Then the two
loops of the earlier table: examples/minimal_loop.py's toy (reward: the share of its 6 tokens
that are token 7; batch 32, 60 updates) and train.py's tiny preset's base policy on two-digit
additions (batch 32, 60 updates). Two loops, `llama` and `head trained`, are the check: no
default was ever set while looking at them. SmolLM2-135M-Instruct joins the family through
bench/real_model.py's rows (`smollm2_loops`): its two tasks, one-step arithmetic in words (about
20 tokens an answer) and two-step word problems (over 100), graded by tasks.grade_number, run
through train.py by that script's protocol and read back here, not re-run (`--smollm2` runs the
README's loop with the defaults alone, on the earlier sums).

The metric is held out: greedy decoding on 256 prompts that no update drew (the lookback loops: a
fixed set excluded from training; the toy: fresh prompts; the additions: the task's held-out
problems), the share of right answer tokens (the additions: of right answers). AdamW (betas
0.9, 0.95, no weight decay, on the weights LoGRA trains) runs at 1e-4 ... 3e-2 on seeds 0-4,
the sweep widened by a factor of 3 while its best is at an edge; its best rate (the highest
mean on seeds 0-4) is then reported on seeds 5-9. LoGRA runs with every default, the README's
one-call form by start (infra/one_call.py's `LoGRAOptimizer(model, RowAdam(sketch.attach(model,
seed=s)))`), whose start="auto" takes "scratch" for these models, all built from a config:
RowAdam's step scaled per layer and the KL prediction calibrated by the realised KL, kl_control.py's departures 6 and
5; a model loaded with from_pretrained gets the paper's controller instead), on seeds 0-9,
reported on 5-9; `--tune` shows how those defaults were chosen (SEARCH) and each knob around
them (TUNE), "the three calls" among them (THREE_CALLS).
The gap is AdamW's mean minus LoGRA's on seeds 5-9; the target: at most 0.03.
Each run is one line of `--out` (default bench/results/defaults/runs.jsonl, committed), read
back instead of rerun, so the sweep resumes where it stopped.

`--why` takes three loops where the defaults fall short (WHY_LOOPS) and, on seeds 0-4, runs
RowAdam's row-scaled direction of the full gradient (A = I) and the same with LoGRA's sketch,
each at fixed step sizes (a share of ||W||, no KL control; the grid widened while its best is at
an edge), with RowAdam's one scale for all layers and with each layer scaled to its own ||W||,
beside AdamW's best rate, LoGRA's defaults and the README's three calls, and
measures the exact KL of every update: whether the gap is the projection's or the step size's.
"""

import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
import warnings

import torch

import report  # bench/report.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]
import kl_control  # noqa: E402
from infra import one_call  # noqa: E402
from infra.probe_decoder import fast_probe  # noqa: E402
import minimal_loop  # noqa: E402
import ppo  # noqa: E402
import sketch  # noqa: E402
import rowadam  # noqa: E402
from infra import batched  # noqa: E402
from infra.batched import BatchedRowAdam as RowAdam  # noqa: E402  rowadam.RowAdam over stacks: its bits

LRS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)  # AdamW's sweep, widened while its best is at an edge
CHOOSE, REPORT = (0, 1, 2, 3, 4), (5, 6, 7, 8, 9)  # seeds that choose AdamW's rate; seeds reported
BASE_POLICY = os.path.join(ROOT, "tests", "data", "base-tiny-seed0.pt")
HELDOUT = 256  # held-out prompts of every loop
OUT = os.path.join(ROOT, "bench", "results", "defaults", "runs.jsonl")
# --smollm2's runs, one JSON line each (form, seed, held-out before and after), which the family's
# claim reads: the defaults (the paper's controller there) beside the settings for random weights
# (the README's claim their means; bench/README.md's `defaults` block seed by seed)
SMOLLM2_RUNS = os.path.join(ROOT, "bench", "results", "defaults", "smollm2.jsonl")


# -----------------------------------------------------------------------------
# The loops: each an environment with model(seed), targets, sample(model, batch, gen) and
# heldout(model); the update loop is shared (`run`).

class Lookback:
    """The base loop's task: after 4 prompt tokens, answer token j is right when it is
    PERM[token j - 4] (prompt or answer); reward the share of right answer tokens."""

    VOCAB, PROMPT = 16, 4

    def __init__(self, length=1, family="qwen2", head=False, batch=64, updates=80, init_std=0.2):
        self.length, self.family, self.batch, self.updates, self.init_std = length, family, batch, updates, init_std
        self.targets = sketch.TARGETS + (("lm_head",) if head else ())
        self.baseline = "mean"
        self.perm = torch.randperm(self.VOCAB, generator=torch.Generator().manual_seed(1234))
        self.held = torch.randint(0, self.VOCAB, (HELDOUT, self.PROMPT), generator=torch.Generator().manual_seed(99))
        self.held_set = set(map(tuple, self.held.tolist()))

    def model(self, seed):
        from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

        config, model = (Qwen2Config, Qwen2ForCausalLM) if self.family == "qwen2" else (LlamaConfig, LlamaForCausalLM)
        torch.manual_seed(seed)
        return model(config(vocab_size=self.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, initializer_range=self.init_std,
                            max_position_embeddings=self.PROMPT + self.length + 8)).eval()

    def prompts(self, gen, batch):
        rows = []
        while len(rows) < batch:  # a held-out prompt is drawn again
            p = torch.randint(0, self.VOCAB, (self.PROMPT,), generator=gen)
            if tuple(p.tolist()) not in self.held_set:
                rows.append(p)
        return torch.stack(rows)  # (B, P)

    @torch.no_grad()
    def generate(self, model, prompts, gen):
        """Sampled at temperature 1 (`gen`) or greedy (None): (B, P + L)."""
        ids, step, past = prompts, prompts, None
        for _ in range(self.length):
            out = model(input_ids=step, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1].float()  # (B, V)
            step = logits.argmax(-1, keepdim=True) if gen is None else \
                torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
            ids = torch.cat([ids, step], dim=1)
        return ids

    def right(self, ids):
        return (ids[:, self.PROMPT:] == self.perm[ids[:, :self.length]]).float()  # (B, L)

    def sample(self, model, gen):
        ids = self.generate(model, self.prompts(gen, self.batch), gen)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[:, self.PROMPT:] = True
        return ids, mask, self.right(ids).mean(dim=1)

    def heldout(self, model):
        return self.right(self.generate(model, self.held, None)).mean().item()


class Toy:
    """examples/minimal_loop.py's loop: the share of 6 sampled tokens that are token 7; held out:
    greedy on 256 fresh prompts (the task does not depend on them)."""

    def __init__(self, batch=32, updates=60):
        self.batch, self.updates, self.targets, self.baseline = batch, updates, sketch.TARGETS, "running"
        self.held = torch.randint(0, minimal_loop.VOCAB, (HELDOUT, minimal_loop.PROMPT),
                                  generator=torch.Generator().manual_seed(99))

    def model(self, seed):
        return minimal_loop.tiny_model(seed)

    def sample(self, model, gen):
        prompts = torch.randint(0, minimal_loop.VOCAB, (self.batch, minimal_loop.PROMPT), generator=gen)
        ids, mask = minimal_loop.rollout(model, prompts, gen)
        return ids, mask, (ids[:, minimal_loop.PROMPT:] == minimal_loop.GOOD).float().mean(dim=1)

    @torch.no_grad()
    def heldout(self, model):
        ids = self.held
        for _ in range(minimal_loop.RESPONSE):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return (ids[:, minimal_loop.PROMPT:] == minimal_loop.GOOD).float().mean().item()


class Additions:
    """train.py's tiny preset's task and base policy (its 3000-step warm-up for seed 0), sampled
    in process (no engine): reward 1 for a right boxed answer, -0.01 otherwise; held out:
    greedy on the task's 256 held-out problems, the share answered right."""

    def __init__(self, batch=32, updates=60):
        import train
        from infra import policy, tasks

        self.batch, self.updates, self.targets, self.baseline = batch, updates, sketch.TARGETS, "running"
        self.cfg = train.PRESETS["tiny"]
        self.task = tasks.Arithmetic(0, HELDOUT)
        self.build = lambda: policy.build_model(self.cfg.model, self.task.vocab_size, 0)

    def model(self, seed):
        model = self.build()
        model.load_state_dict(torch.load(BASE_POLICY, weights_only=True))
        return model.eval()

    @torch.no_grad()
    def generate(self, model, problems, gen):
        ids = torch.tensor(self.task.prompt_ids(problems))  # (B, P): one length
        p, ended = ids.shape[1], torch.zeros(len(problems), dtype=torch.bool)
        for _ in range(self.cfg.max_new_tokens):
            logits = model(input_ids=ids).logits[:, -1].float()  # (B, V)
            token = logits.argmax(-1) if gen is None else torch.multinomial(torch.softmax(logits, -1), 1,
                                                                            generator=gen)[:, 0]
            token = torch.where(ended, self.task.pad, token)
            ids = torch.cat([ids, token[:, None]], dim=1)
            ended |= token == self.task.eos
            if ended.all():
                break
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[:, p:] = ids[:, p:] != self.task.pad
        right = torch.tensor([self.task.correct(q, [t for t in row if t != self.task.pad])
                              for q, row in zip(problems, ids[:, p:].tolist())], dtype=torch.float)
        return ids, mask, right

    def sample(self, model, gen):
        problems = [self.task.train_problem(i) for i in torch.randint(0, 10**9, (self.batch,), generator=gen).tolist()]
        ids, mask, right = self.generate(model, problems, gen)
        return ids, mask, torch.where(right > 0, 1.0, -0.01)

    def heldout(self, model):
        return self.generate(model, self.task.heldout, None)[2].mean().item()


LOOPS = {  # name: (environment, role)
    "base": (lambda: Lookback(), "family"),
    "length 6": (lambda: Lookback(length=6), "family"),
    "length 64": (lambda: Lookback(length=64), "family"),
    "batch 16": (lambda: Lookback(batch=16, updates=320), "family"),
    "init 0.02": (lambda: Lookback(init_std=0.02), "family"),
    "head trained": (lambda: Lookback(head=True), "check"),
    "llama": (lambda: Lookback(family="llama"), "check"),
    "toy": (lambda: Toy(), "earlier"),
    "additions": (lambda: Additions(), "earlier"),
}


def backward_batch(env, model, gen, baseline):
    """One batch of `env`'s loop: sampled, its advantages (the batch's mean reward or the running
    `baseline` as the baseline, as `env` says), and the policy loss's backward, into the sketches
    (LoGRA) or the weights' .grad (AdamW). Returns (ids, mask, reward)."""
    ids, mask, reward = env.sample(model, gen)
    advantages = reward - reward.mean() if env.baseline == "mean" else baseline.advantages(reward)
    logp = ppo.response_logprobs(model(input_ids=ids).logits, ids)  # (B, T)
    ppo.policy_loss(logp, advantages, mask, num_tokens=int(mask.sum()))[0].backward()
    return ids, mask, reward


def run(env, method, seed, lr=None, opt=None, schedule=None, rank=None, **logra):
    """One run of the loop: LoGRA with every default (`logra`: RowAdam's settings to change,
    e.g. update_ratio; `opt`: LoGRAOptimizer's, e.g. entropy_share or per_layer, for `--tune`;
    `schedule`: (start, end), the paper's cosine budget over the run's updates instead of
    budget_for; `rank`: attach's, instead of sketch.default_rank's) or AdamW at `lr`, from the
    same start weights; its held-out score."""

    model = env.model(seed)
    if method == "logra":
        start, end = schedule or (None, None)
        layers = sketch.attach(model, rank=rank, seed=seed, targets=env.targets)
        opt = one_call.LoGRAOptimizer(model, RowAdam(layers, **logra),
                                      kl_start=start, kl_end=end, horizon=env.updates if schedule else None,
                                      probe=fast_probe, **(opt or {}))
    else:
        weights = [m.weight for m in sketch.target_modules(model, env.targets).values()]
        for p in model.parameters():
            p.requires_grad_(any(p is w for w in weights))
        opt = torch.optim.AdamW(weights, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen, baseline = torch.Generator().manual_seed(1000 + seed), ppo.RunningBaseline(weight=0.1)
    rewards, alphas, budgets, t0 = [], [], [], time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(env.updates):
            ids, mask, reward = backward_batch(env, model, gen, baseline)
            if method == "logra":
                opt.step(ids, mask)
                alphas.append(opt.last["alpha"])
                budgets.append(opt.last["budget"])
            else:
                opt.step()
                opt.zero_grad(set_to_none=True)
            rewards.append(reward.mean().item())
    warned = [str(w.message) for w in caught if "its cap" in str(w.message)]  # the cap's
    capped = [a >= opt.alpha_max for a in alphas] if method == "logra" else []
    return {"heldout": env.heldout(model), "reward_last5": statistics.mean(rewards[-5:]),
            "capped": sum(capped), "longest_capped": longest(capped), "warned": bool(warned),
            "alpha_median": statistics.median(alphas) if alphas else None,
            "budget_median": statistics.median(budgets) if budgets else None,
            "seconds": round(time.perf_counter() - t0, 1)}


def longest(flags) -> int:
    best = now = 0
    for f in flags:
        now = now + 1 if f else 0
        best = max(best, now)
    return best


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


def sums_run(env, *, seed, updates, batch, form="defaults"):
    """The README's loop on SmolLM2: held-out pass@1 before and after. LoGRAOptimizer's step
    with the settings of SMOLLM2_FORMS[form]: "defaults" every default (start="auto", which
    takes "pretrained" for this model, loaded with from_pretrained: bit for bit the README's
    three calls, tests/test_kl_control.py::test_the_one_call_optimizer_is_the_three_calls_bitwise);
    "scratch" the settings for random weights; "scratch, uncalibrated" those with calibrate=False."""
    model = env.load()
    base = env.evaluate(model)
    opt = one_call.LoGRAOptimizer(model, RowAdam(sketch.attach(model, seed=seed)), probe=fast_probe,
                                  **SMOLLM2_FORMS[form])
    baseline, gen = ppo.RunningBaseline(weight=0.1), torch.Generator().manual_seed(seed)
    lengths = sorted(env.buckets["train"])
    weights = torch.tensor([len(env.buckets["train"][n]) for n in lengths], dtype=torch.float)
    rewards, last = [], []
    for _ in range(updates):
        pool = env.buckets["train"][lengths[torch.multinomial(weights, 1, generator=gen).item()]]
        items = [pool[i] for i in torch.randint(0, len(pool), (batch,), generator=gen).tolist()]
        ids, mask, reward = env.sample(model, items, gen)
        logp = ppo.response_logprobs(model(input_ids=ids).logits, ids)  # (B, T)
        loss, _ = ppo.policy_loss(logp, baseline.advantages(reward), mask, num_tokens=int(mask.sum()))
        loss.backward()
        opt.step(ids, mask)
        rewards.append(reward.mean().item())
        last.append(opt.last)
    return {"base": base, "final": env.evaluate(model), "rewards": rewards, "alphas": [r["alpha"] for r in last],
            "budgets": [r["budget"] for r in last], "scales": [r["kl_scale"] for r in last]}


def sums_work(job):
    """One --smollm2 run in a worker process (one thread): (seed, result)."""
    checkpoint, seed, updates, form = job
    torch.set_num_threads(1)
    return seed, sums_run(Sums(checkpoint), seed=seed, updates=updates, batch=16, form=form)


# LoGRAOptimizer's settings that make it the README's three calls (the paper's controller, with
# budget_for's default budget), bit for bit: kl_control.py's departure 5 and 6 left out.
THREE_CALLS = dict(one_call.STARTS["pretrained"])  # start="pretrained"'s: calibrate, per_layer, alpha_max, share
# --smollm2's forms: LoGRAOptimizer's settings of each, and the block each publishes.
SMOLLM2_FORMS = {"defaults": {}, "scratch": {"start": "scratch"},
                 "scratch, uncalibrated": {"start": "scratch", "calibrate": False}}
SMOLLM2_BLOCKS = {"defaults": "defaults_smollm2", "scratch": "defaults_smollm2_scratch",
                  "scratch, uncalibrated": "defaults_smollm2_scratch_uncalibrated"}


def smollm2_form(args) -> str:
    return ("scratch, uncalibrated" if args.uncalibrated else "scratch") if args.start == "scratch" else "defaults"


def smollm2(args):
    """--smollm2 DIR: one form of LoGRA (SMOLLM2_FORMS) on SmolLM2-135M-Instruct, held-out pass@1
    before and after, seed by seed (`--jobs` seeds at once, one thread each: the same bits)."""
    form = smollm2_form(args)
    settings = SMOLLM2_FORMS[form]
    start = one_call.STARTS[settings.get("start", "pretrained")]  # "auto" takes "pretrained" for this model
    calibrated, cap = settings.get("calibrate", start["calibrate"]), start["alpha_max"]
    rows, t0 = [], time.perf_counter()
    header = ["seed", "held-out pass@1 before", "after", "gain", "train reward, first 5", "last 5",
              "alpha (median)", "budget per token (median)", "alpha at its cap"] + (["rho (median)"] if calibrated
                                                                                    else [])
    jobs = [(args.smollm2, seed, args.smollm2_updates, form) for seed in args.seeds]
    pool = multiprocessing.get_context("fork").Pool(args.jobs) if args.jobs > 1 else None
    outs = dict(pool.imap_unordered(sums_work, jobs) if pool else map(sums_work, jobs))
    if pool:
        pool.close()
    for seed in args.seeds:
        out = outs[seed]
        rows.append([seed, f"{out['base']:.3f}", f"{out['final']:.3f}", f"{out['final'] - out['base']:+.3f}",
                     f"{statistics.mean(out['rewards'][:5]):.3f}", f"{statistics.mean(out['rewards'][-5:]):.3f}",
                     f"{statistics.median(out['alphas']):.2g}", f"{statistics.median(out['budgets']):.2e}",
                     f"{100 * sum(a >= cap for a in out['alphas']) / len(out['alphas']):.0f}%"] +
                    ([f"{statistics.median(out['scales']):.2f}"] if calibrated else []))
        print(report.row(rows[-1]), flush=True)
        if args.markdown:  # a published run: the family's claim reads it back
            with open(SMOLLM2_RUNS, "a") as f:
                f.write(json.dumps({"form": form, "seed": seed, "updates": args.smollm2_updates,
                                    "base": out["base"], "final": out["final"]}) + "\n")
    scratch = f"alpha_max {cap:g}, entropy_share {start['entropy_share']:g}"  # start='scratch''s, where it is run
    what = {"defaults": f"the README's one-call form with every default (rank {sketch.PAPER_RANK}; start='auto', "
                        "which takes 'pretrained' for a model loaded with from_pretrained: the paper's controller, bit "
                        "for bit the README's three calls)",
            "scratch": f"the README's one-call form with start='scratch', the settings for random weights (rank "
                       f"{sketch.PAPER_RANK}; RowAdam scaled per layer, {scratch}, the prediction calibrated; rho "
                       "the scale of KL1 its alpha used)",
            "scratch, uncalibrated": f"the README's one-call form with start='scratch' and calibrate=False (rank "
                                     f"{sketch.PAPER_RANK}; RowAdam scaled per layer, {scratch}, alpha from the "
                                     "predicted KL alone)"}[form]
    note = (f"SmolLM2-135M-Instruct ({args.smollm2}: bench/real_model.py's checkpoint), its 200 training sums, "
            f"{args.smollm2_updates} updates of 16 prompts sampled at temperature 1 (up to 64 new tokens), {what}; "
            "held-out: the 200 other sums, greedy, right when the answer's last number is the sum (one evaluation's "
            f"binomial error about 0.03). {(time.perf_counter() - t0) / 60:.0f} min, {args.jobs} "
            f"run{'s' if args.jobs > 1 else ''} at once, one thread each.")
    print("\n" + note)
    if args.markdown:
        report.publish(SMOLLM2_BLOCKS[form], note + "\n\n" + report.table(header, rows))


def ms(values) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} +- {sd:.3f}"


_ENVS = {}


def work(job):
    """One run in a worker process (one thread): (job, result)."""
    loop, method, setting, seed, kwargs = job
    torch.set_num_threads(1)
    if loop not in _ENVS:
        _ENVS[loop] = LOOPS[loop][0]()
    return job, run(_ENVS[loop], method, seed, **kwargs)


class Runs:
    """The runs of `path` (one JSON line each), and `ensure(jobs)`, which runs the missing ones
    (`jobs` processes at once) and appends each as it ends."""

    def __init__(self, path, jobs, worker=None):
        self.path, self.jobs, self.rows, self.worker = path, jobs, {}, worker or work
        if os.path.exists(path):
            for line in open(path):
                r = json.loads(line)
                self.rows[(r["loop"], r["method"], r["setting"], r["seed"])] = r

    def ensure(self, jobs):
        todo = [j for j in jobs if j[:4] not in self.rows]
        if not todo:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        pool = multiprocessing.get_context("fork").Pool(self.jobs) if self.jobs > 1 else None
        results = pool.imap_unordered(self.worker, todo) if pool else map(self.worker, todo)
        with open(self.path, "a") as f:
            for (loop, method, setting, seed, _), res in results:
                r = {"loop": loop, "method": method, "setting": setting, "seed": seed, **res}
                self.rows[(loop, method, setting, seed)] = r
                f.write(json.dumps(r) + "\n")
                f.flush()
                print(f"{loop:14s} {method:5s} {setting:12s} seed {seed}: held-out {res['heldout']:.3f} "
                      f"({res['seconds']:.0f} s)", flush=True)
        if pool:
            pool.close()

    def scores(self, loop, method, setting, seeds):
        return [self.rows[(loop, method, setting, s)]["heldout"] for s in seeds]


def compute(runs, loops, family_only=False) -> float:
    """Seconds of the runs of `loops` in `runs`, summed (read back or run now); `family_only`:
    only the family's (AdamW's and LoGRA's defaults), not --tune's."""
    return sum(r["seconds"] for k, r in runs.rows.items()
               if k[0] in loops and k[1] in ("adamw", "logra") and not (family_only and k[1] == "logra"
                                                                        and k[2] != "default"))


def lr_name(lr) -> str:
    return f"lr {lr:g}"


def family(args):
    runs = Runs(args.out, args.jobs)
    loops = args.loops or list(LOOPS)
    rates = {loop: list(LRS) for loop in loops}
    # 1. AdamW's sweep on the choosing seeds, LoGRA's defaults on all; the sweep widened at an edge
    runs.ensure([(loop, "adamw", lr_name(lr), s, {"lr": lr}) for loop in loops for lr in rates[loop] for s in CHOOSE] +
                [(loop, "logra", "default", s, {}) for loop in loops for s in CHOOSE + REPORT])
    for _ in range(3):
        more = []
        for loop in loops:
            means = [statistics.mean(runs.scores(loop, "adamw", lr_name(lr), CHOOSE)) for lr in rates[loop]]
            best = max(range(len(means)), key=lambda i: means[i])
            if best == 0:
                rates[loop].insert(0, rates[loop][0] / 3)
                more.append(loop)
            elif best == len(means) - 1:
                rates[loop].append(rates[loop][-1] * 3)
                more.append(loop)
        if not more:
            break
        runs.ensure([(loop, "adamw", lr_name(lr), s, {"lr": lr}) for loop in more for lr in rates[loop]
                     for s in CHOOSE])
    # 2. AdamW's best rate, chosen on seeds 0-4, reported on seeds 5-9
    best = {loop: max(rates[loop], key=lambda lr: statistics.mean(runs.scores(loop, "adamw", lr_name(lr), CHOOSE)))
            for loop in loops}
    runs.ensure([(loop, "adamw", lr_name(best[loop]), s, {"lr": best[loop]}) for loop in loops for s in REPORT])

    header = ["loop", "role", "AdamW's best lr (seeds 0-4)", "AdamW, seeds 5-9", "LoGRA's defaults, seeds 5-9",
              "gap (AdamW - LoGRA)", "LoGRA, seeds 0-4", "alpha at its cap (updates, seeds 5-9)", "target"]
    rows, sweep, gaps = [], [], {}
    for loop in loops:
        adam = runs.scores(loop, "adamw", lr_name(best[loop]), REPORT)
        logra = runs.scores(loop, "logra", "default", REPORT)
        gap = gaps[loop] = statistics.mean(adam) - statistics.mean(logra)
        capped = [runs.rows[(loop, "logra", "default", s)] for s in REPORT]
        verdict = "met" if gap <= 0.03 else "named (0.03-0.05)" if gap <= 0.05 else "**short**"
        rows.append([loop, LOOPS[loop][1], f"{best[loop]:g}", ms(adam), ms(logra), f"{gap:+.3f}",
                     ms(runs.scores(loop, "logra", "default", CHOOSE)),
                     ", ".join(str(r["capped"]) for r in capped), verdict])
        for lr in rates[loop]:
            sweep.append([loop, f"{lr:g}", ms(runs.scores(loop, "adamw", lr_name(lr), CHOOSE)),
                          "best" if lr == best[loop] else ""])
    table = report.table(header, rows)
    sweep_table = report.table(["loop", "AdamW lr", "held-out, seeds 0-4", ""], sweep)
    note = ("Held-out score (greedy, 256 prompts no update drew), mean +- sd over the seeds named. LoGRA: every "
            "default of the one-call form (rank by sketch.default_rank, update_ratio "
            f"{RowAdam.__init__.__kwdefaults__['update_ratio']:g}, RowAdam's step scaled per layer, alpha_max "
            f"{one_call.SCRATCH['alpha_max']:g}, the probe's share, budget_for(entropy_share="
            f"{one_call.SCRATCH['entropy_share']:g}, per_response={kl_control.PER_RESPONSE:g}), the prediction "
            "calibrated by the realised KL: start='scratch', which start='auto' takes for these models, all built "
            "from a config). AdamW: betas (0.9, 0.95), no weight "
            "decay, the same weights; its rate chosen on seeds 0-4. Roles: family (the base loop and its "
            "variations), check (never looked at while a default was set), earlier (the two loops of the earlier "
            "table). The alpha column: updates at the cap in each of seeds 5-9's runs. "
            f"Compute: {compute(runs, loops, family_only=True) / 60:.0f} min of runs, one thread each. LoGRA's other "
            "settings on these loops: `defaults_tuning`; where the earlier defaults' gap came from (RowAdam's one step "
            "scale for all layers, the paper's, and the budget; not the sketch): `defaults_why`.")
    smol_rows, smol_gaps = smollm2_loops()
    smol = ("SmolLM2-135M-Instruct, bench/real_model.py's tasks through train.py's smollm2-cpu preset (rank 64, "
            "batch 8, 40 updates; graded by tasks.grade_number), read from its committed rows: its protocol, so "
            "AdamW's rate is chosen at one seed on the validation split and both methods are reported at seeds 1-3 on "
            "the test split (held-out sampled pass@1, mean +- sd; the seed-0 columns: pass@1 +- its binomial "
            "error). LoGRA's defaults here are the budget rule's and RowAdam's (x1 in real_model.py's sweep), through "
            "train.py, which runs the three calls (RowAdam's one scale, no calibration, budget_for's entropy_share "
            f"{kl_control.ENTROPY_SHARE:g}, alpha_max 3): the controller the one-call form gives a model loaded "
            "with from_pretrained (start='pretrained'), not its settings for random weights measured above; the "
            "one-call form on SmolLM2: `defaults_smollm2`.\n\n"
            + report.table(SMOLLM2_HEADER, smol_rows))
    forms = smollm2_forms()
    if forms[1]:  # the --smollm2 runs seed by seed: here; the README's claim has their means
        smol += "\n\n" + forms[1]
    claim = claim_table(runs, loops, best, gaps, smol_rows, smol_gaps, forms[0])
    print("\n" + note + "\n\n" + table + "\n\n" + sweep_table + "\n\n" + smol + "\n\n" + claim)
    if args.markdown:
        # what the block cost: its runs' seconds at --jobs at once (read back, they cost nothing now)
        seconds = compute(runs, loops, family_only=True) / max(args.jobs, 1)
        report.publish("defaults", note + "\n\n" + table + "\n\nAdamW's sweep:\n\n" + sweep_table + "\n\n" + smol,
                       seconds)
        if loops == list(LOOPS):  # the README's sentence, from the whole family only
            report.publish("defaults_claim", claim, seconds)


def verdict(gap: float) -> str:
    """The target's word for a gap (AdamW's mean minus LoGRA's): at most 0.03, named up to 0.05."""
    return "within 0.03" if gap <= 0.03 else "within 0.05" if gap <= 0.05 else f"**short** by {gap:.2f}"


def claim_table(runs, loops, best, gaps, smol_rows, smol_gaps, sums) -> str:
    """The README's claim: a row per loop (AdamW at its best rate and LoGRA's defaults, mean +- sd
    over seeds 5-9, the gap, its verdict), SmolLM2's tasks as rows of their own (their protocol:
    test, seeds 1-3), and two lines: what is compared, and the pretrained model's (`sums`: the
    --smollm2 runs' means)."""
    rows = [[loop, ms(runs.scores(loop, "adamw", lr_name(best[loop]), REPORT)),
             ms(runs.scores(loop, "logra", "default", REPORT)), f"{gaps[loop]:+.3f}", verdict(gaps[loop])]
            for loop in loops]
    for cells, phrase in zip(smol_rows, smol_gaps):
        c = dict(zip(SMOLLM2_HEADER, cells))
        gap = c["gap (AdamW - LoGRA)"]
        rows.append([c["loop"] + " (pretrained)", c["AdamW, test, seeds 1-3"], c["LoGRA's defaults, test, seeds 1-3"],
                     gap, verdict(float(gap)) if gap != "-" else phrase.split(": ", 1)[1]])
    head = (f"LoGRAOptimizer's defaults, untuned, against AdamW at its best learning rate (chosen on seeds 0-4) on "
            f"bench/defaults.py's {len(loops)} small loops, held out, mean +- sd over seeds 5-9; built from a config, "
            "so start='scratch' (RowAdam's step per layer, the KL prediction calibrated):")
    tail = ("SmolLM2-135M-Instruct: loaded, so the paper's controller (start='pretrained', through train.py; "
            "bench/real_model.py's test, seeds 1-3)" + (f"; {sums}" if sums else "") +
            ". Other settings: bench/README.md's `defaults_tuning`; the earlier gap's source: `defaults_why`.")
    return head + "\n\n" + report.table(["loop", "AdamW's best", "LoGRA's defaults", "gap", "verdict"], rows) + \
        "\n\n" + tail


def smollm2_forms() -> tuple[str, str]:
    """`--smollm2`'s runs (SMOLLM2_RUNS, the latest run of each form and seed), the defaults (the
    paper's controller there) beside the settings for random weights, at the seeds every form
    ran: (the claim's phrase, their means; bench/README's sentence, seed by seed); ("", "") when
    none was run."""
    if not os.path.exists(SMOLLM2_RUNS):
        return "", ""
    latest = {}
    for line in open(SMOLLM2_RUNS):
        r = json.loads(line)
        latest[(r["form"], r["seed"])] = r
    forms = [f for f in SMOLLM2_FORMS if any(form == f for form, _ in latest)]
    seeds = sorted({seed for _, seed in latest if all((f, seed) in latest for f in forms)})
    if "defaults" not in forms or not seeds:
        return "", ""
    said = {"defaults": "the defaults (start='auto' takes 'pretrained' there: the paper's controller)",
            "scratch": "the settings for random weights (start='scratch')",
            "scratch, uncalibrated": "those without calibration"}
    brief = {"defaults": "the defaults", "scratch": "for random weights", "scratch, uncalibrated": "uncalibrated"}
    finals = {f: [latest[(f, s)]["final"] for s in seeds] for f in forms}
    parts = [f"{said[f]}{' reached' if i == 0 else ''} {', '.join(f'{x:.3f}' for x in finals[f])} (mean "
             f"{statistics.mean(finals[f]):.3f})" for i, f in enumerate(forms)]
    where = (f"its one-step sums (`defaults.py --smollm2`, seeds {', '.join(map(str, seeds))}, held-out pass@1 "
             f"from {latest[('defaults', seeds[0])]['base']:.3f})")
    short = (f"on {where.replace('held-out pass@1 ', '')}, means: "
             + ", ".join(f"{brief[f]} {statistics.mean(finals[f]):.3f}" for f in forms))
    long = (f"On SmolLM2-135M-Instruct's {where[4:]}, the one pretrained model tried, " + "; ".join(parts)
            + " (the rule that gives a loaded model the paper's controller was set after these runs: they are its "
            "reason, not its check).")
    return short, long


def smollm2_loops(results=None) -> tuple[list[list[str]], list[str]]:
    """The family's SmolLM2-135M-Instruct loops, one per task of bench/real_model.py, read from
    its committed rows (its protocol, not re-run here): (table rows, the claim's phrases). Its
    runs are train.py's smollm2-cpu preset, graded by tasks.grade_number; AdamW's rate is its
    best of five on validation at seed 0, and AdamW at that rate and LoGRA at the budget rule's
    defaults (x1: budget_for's entropy share and per-response cap, update_ratio 1e-2) are
    reported on the test split at seeds 1-3. Beside them the paper's 2e-4 -> 2e-5 schedule and
    the defaults on validation at seed 0 (the long responses' question: item 2 of the issue
    that added this). A loop whose runs are not all done says how many are."""
    import real_model  # bench/real_model.py: its rows, methods and protocol
    import train  # its runs' preset: alpha's cap

    results = results or real_model.RESULTS
    logra, adam = real_model.LOGRA, real_model.ADAMW
    alpha_max = train.PRESETS[real_model.PRESET].alpha_max
    table, phrases = [], []
    for key, task in real_model.TASKS.items():
        rows = real_model.read_rows(os.path.join(results, key))
        score = lambda m, v, s: rows[real_model.run_key(m, v, s)]["final"]["pass1"]  # noqa: E731
        have = lambda m, v, s: real_model.run_key(m, v, s) in rows  # noqa: E731
        best = real_model.best_value(adam, rows)
        logra_seeds = [s for s in real_model.REPORT if have(logra, logra.defaults, s)]
        adam_seeds = [] if best is None else [s for s in real_model.REPORT if have(adam, best[0], s)]
        on_val = []  # the defaults and the paper's schedule at the selection seed: pass@1 +- its error
        for v in (logra.defaults, real_model.PAPER):
            key = real_model.run_key(logra, v, real_model.SELECT)
            final = rows[key]["final"] if key in rows else None
            on_val.append(f"{final['pass1']:.3f} +- {final['pass1_se']:.3f}" if final else "(not run yet)")
        mine = {s: rows[real_model.run_key(logra, logra.defaults, s)]  # LoGRA's defaults' rows, by seed
                for s in (real_model.SELECT, *real_model.REPORT) if have(logra, logra.defaults, s)}
        tokens = [r["response_tokens_mean"] for r in mine.values()]
        capped = [sum(a >= alpha_max for a in mine[s].get("alphas") or []) for s in logra_seeds]
        done = len(logra_seeds) == len(adam_seeds) == len(real_model.REPORT)
        if done:
            a, g = [score(adam, best[0], s) for s in adam_seeds], [score(logra, logra.defaults, s) for s in logra_seeds]
            gap = statistics.mean(a) - statistics.mean(g)
            verdict = "met" if gap <= 0.03 else "named (0.03-0.05)" if gap <= 0.05 else "**short**"
            phrases.append(f"{task.name}: {gap:+.3f}")
        else:
            left = 2 * len(real_model.REPORT) - len(logra_seeds) - len(adam_seeds)
            if best is None:  # nothing to report at: bench/README's real_model section says why a sweep stopped
                verdict = (f"not measured: AdamW's sweep not run, and {left} reporting runs (adam, LoGRA's "
                           "defaults); bench/README's real_model section says why")
                phrases.append(f"{task.name}: not measured (AdamW's sweep not run; {left} reporting runs to go)")
            else:
                verdict = f"waiting: {left} of real_model.py's reporting runs (adam, LoGRA's defaults) to go"
                phrases.append(f"{task.name}: not yet measured ({left} runs to go)")
        table.append([f"SmolLM2, {task.key}", f"{statistics.mean(tokens):.0f}" if tokens else "-",
                      f"{best[0]:g}" + (" (at an edge)" if best[1] else "") if best else "(sweep not done)",
                      ms([score(adam, best[0], s) for s in adam_seeds]) if adam_seeds else "-",
                      ms([score(logra, logra.defaults, s) for s in logra_seeds]) if logra_seeds else "-",
                      f"{gap:+.3f}" if done else "-", *on_val,
                      ", ".join(map(str, capped)) or "-", verdict])
    return table, phrases


SMOLLM2_HEADER = ["loop", "response tokens (LoGRA's defaults)", "AdamW's best lr (validation, seed 0)",
                  "AdamW, test, seeds 1-3", "LoGRA's defaults, test, seeds 1-3", "gap (AdamW - LoGRA)",
                  "LoGRA's defaults, validation, seed 0", "the paper's schedule, validation, seed 0",
                  "updates at alpha's cap (seeds 1-3)", "target"]


TUNE = [  # LoGRA's settings tried on the choosing seeds of the loops that are not the check, one knob at a time
    ("default", {}),  # start="scratch" here: every loop's model is built from a config
    ("uncalibrated", {"opt": {"calibrate": False}}),  # alpha from the prediction alone, as the paper has it
    ("one scale", {"opt": {"per_layer": False}}),  # RowAdam's one c for all layers, the paper's
    ("alpha_max 3", {"opt": {"alpha_max": 3.0}}),  # the three calls' cap: 3% of ||W|| a step
    ("alpha_max 27", {"opt": {"alpha_max": 27.0}}),
    ("entropy_share 0.2", {"opt": {"entropy_share": 0.2}}),  # budget_for's default, the three calls'
    ("entropy_share 0.8", {"opt": {"entropy_share": 0.8}}),
    ("the paper's schedule", {"schedule": (2e-4, 2e-5)}),  # its budget, 2e-4 -> 2e-5 per token, over the run
    ("rank 64", {"rank": 64}),  # the models' width: A A^T's noise at its least (the default rank is 32 here)
    ("the three calls", {"opt": THREE_CALLS}),  # the paper's controller with budget_for's rule
]
# The search that chose LoGRAOptimizer's defaults for random weights (bench/README.md,
# `defaults_tuning`), every setting spelt out: it started from the earlier defaults (calibrated, one
# scale, alpha_max 3, entropy_share 0.2), which are its first row, and tried RowAdam's step scaled per
# layer (departure 6 of kl_control.py) with the cap (update_ratio, the same as alpha_max here) and the
# budget's share.
EARLIER = {"per_layer": False, "alpha_max": 3.0, "entropy_share": 0.2, "calibrate": True}
SEARCH = [
    ("earlier defaults", {"opt": EARLIER}),
    ("per layer", {"opt": {**EARLIER, "per_layer": True}}),
    ("per layer, update_ratio 0.03", {"opt": {**EARLIER, "per_layer": True}, "update_ratio": 0.03}),
    ("per layer, update_ratio 0.1", {"opt": {**EARLIER, "per_layer": True}, "update_ratio": 0.1}),
    ("per layer, entropy_share 0.1", {"opt": {**EARLIER, "per_layer": True, "entropy_share": 0.1}}),
    ("per layer, entropy_share 0.4", {"opt": {**EARLIER, "per_layer": True, "entropy_share": 0.4}}),
    ("per layer, update_ratio 0.03, entropy_share 0.1", {"opt": {**EARLIER, "per_layer": True, "entropy_share": 0.1},
                                                         "update_ratio": 0.03}),
    ("per layer, update_ratio 0.03, entropy_share 0.4", {"opt": {**EARLIER, "per_layer": True, "entropy_share": 0.4},
                                                         "update_ratio": 0.03}),
]


# -----------------------------------------------------------------------------
# --why: where the gap comes from, on three loops where the defaults fall short

WHY_LOOPS = ("base", "batch 16", "init 0.02")
WHY_RATIOS = (0.0025, 0.005, 0.01, 0.02, 0.04)  # fixed steps, ||step|| / ||W||, widened while the best is at an edge
FIXED = ("dense", "sketch", "dense per layer", "sketch per layer")  # why_run's kinds at fixed steps


def why_run(env, kind, seed, value=None):
    """One run of `env` by `kind`, with the exact KL of every update measured on its batch (all
    response positions, before against after): "adamw" at lr `value`; "logra" with every default
    (`value` False: THREE_CALLS, the README's three calls); "dense", RowAdam's direction (`rowadam.row_adam_direction`)
    of the full gradient, A = I, scaled to ||step|| = `value` ||W|| with alpha 1, no KL control;
    "sketch", LoGRA's own sketch and RowAdam (`update_ratio=value`) at alpha 1, no KL control.
    "dense" and "sketch" differ only by the projection. "dense per layer" and "sketch per layer":
    the same, but each layer's step scaled to `value` times its own ||W|| (RowAdam's c is one
    scale for all layers, so a layer's step is proportional to its sketch's norm). Returns the
    held-out score, the median KL per token of an update and its median share of the policy's
    entropy."""
    model = env.model(seed)
    weights = [m.weight for m in sketch.target_modules(model, env.targets).values()]
    kind, per_layer = kind.removesuffix(" per layer"), kind.endswith(" per layer")
    if kind in ("logra", "sketch"):
        layers = sketch.attach(model, seed=seed, targets=env.targets)
        ra = RowAdam(layers, **({"update_ratio": value} if kind == "sketch" else {}))
        opt = one_call.LoGRAOptimizer(model, ra, probe=fast_probe, **({} if value else THREE_CALLS)) \
            if kind == "logra" else None
    elif kind in ("adamw", "dense"):
        for p in model.parameters():
            p.requires_grad_(any(p is w for w in weights))
        opt = torch.optim.AdamW(weights, lr=value, betas=(0.9, 0.95), weight_decay=0.0) if kind == "adamw" else None
        moments = [torch.zeros(w.shape[0]) for w in weights]
    else:
        raise ValueError(f"kind must be adamw, logra, dense or sketch, got {kind!r}")
    gen, baseline = torch.Generator().manual_seed(1000 + seed), ppo.RunningBaseline(weight=0.1)
    kls, shares = [], []
    for t in range(env.updates):
        ids, mask, _ = backward_batch(env, model, gen, baseline)
        with torch.no_grad():  # the weights as the backward saw them: the update's "before"
            before = model(input_ids=ids).logits[:, :-1].double().log_softmax(-1)[mask[:, 1:]]  # (N, V)
        if kind == "logra":
            opt.step(ids, mask)
        elif kind == "sketch":
            ra.prepare()
            for layer, u in zip(ra.layers, ra.directions) if per_layer else ():
                ua = batched._da_squared([layer], u[None]).item()  # ||U A||^2 of this layer
                u.mul_(value * layer.module.weight.norm().item() / math.sqrt(ua) if ua else 0.0)
            ra.merge(1.0)
        elif kind == "adamw":
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                directions = []
                for i, w in enumerate(weights):
                    d, moments[i] = rowadam.row_adam_direction(w.grad, moments[i], step=t + 1)
                    directions.append(d)
                norm = sum(d.square().sum().item() for d in directions)  # 0 when every advantage is
                c = value * math.sqrt(sum(w.square().sum().item() for w in weights) / norm) if norm else 0.0
                for w, d in zip(weights, directions):
                    layer_norm = d.norm().item()
                    w.sub_((value * w.norm().item() / layer_norm if layer_norm else 0.0) * d if per_layer else c * d)
                    w.grad = None
        with torch.no_grad():
            after = model(input_ids=ids).logits[:, :-1].double().log_softmax(-1)[mask[:, 1:]]
        kl = (before.exp() * (before - after)).sum(-1).mean().item()
        kls.append(kl)
        shares.append(kl / -(before.exp() * before).sum(-1).mean().item())
    return {"heldout": env.heldout(model), "kl_median": statistics.median(kls),
            "kl_share_median": statistics.median(shares)}


def why_work(job):
    loop, kind, setting, seed, value = job
    torch.set_num_threads(1)
    if loop not in _ENVS:
        _ENVS[loop] = LOOPS[loop][0]()
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # LoGRAOptimizer's once-a-run notes: known on these loops
        out = why_run(_ENVS[loop], kind.removeprefix("why "), seed, value)
    return job, {**out, "seconds": round(time.perf_counter() - t0, 1)}


def why(args):
    """--why: on WHY_LOOPS' choosing seeds 0-4, the same row-scaled step without the sketch and
    with it, each at its best fixed size, beside AdamW's best, LoGRA's defaults and the three
    calls, and how much KL an update of each spends."""
    runs = Runs(args.out, args.jobs, worker=why_work)
    loops = list(args.loops or WHY_LOOPS)
    best = {}
    for loop in loops:
        adam = adamw_best(runs, loop)
        if adam is None:
            raise SystemExit(f"--why needs AdamW's sweep of {loop!r} on seeds 0-4 first: run defaults.py without --why")
        best[loop] = float(adam[1].split()[1])
    ratios = {loop: {kind: list(WHY_RATIOS) for kind in FIXED} for loop in loops}

    def jobs(loop):
        out = [(loop, "why adamw", lr_name(best[loop]), s, best[loop]) for s in CHOOSE]
        out += [(loop, "why logra", name, s, one) for name, one in (("default", True), ("the three calls", False))
                for s in CHOOSE]
        out += [(loop, f"why {kind}", f"ratio {r:g}", s, r) for kind in FIXED for r in ratios[loop][kind]
                for s in CHOOSE]
        return out

    runs.ensure([j for loop in loops for j in jobs(loop)])
    for _ in range(3):  # widen each fixed-step grid while its best is at an edge
        more = False
        for loop in loops:
            for kind in FIXED:
                grid = ratios[loop][kind]
                means = [statistics.mean(runs.scores(loop, f"why {kind}", f"ratio {r:g}", CHOOSE)) for r in grid]
                top = max(range(len(means)), key=means.__getitem__)
                if top in (0, len(means) - 1):
                    ratios[loop][kind] = sorted(grid + [grid[0] / 2 if top == 0 else grid[-1] * 2])
                    more = True
        if not more:
            break
        runs.ensure([j for loop in loops for j in jobs(loop)])
    header = ["loop", "AdamW, its best lr", "RowAdam's step without the sketch (A = I)", "with LoGRA's sketch",
              "without the sketch, per layer", "with the sketch, per layer", "LoGRA's defaults",
              "the three calls (the paper's controller)"]
    kl_header = ["loop", "AdamW, its best lr", "without the sketch", "with the sketch", "without, per layer",
                 "with, per layer", "LoGRA's defaults", "the three calls"]
    rows, kl_rows = [], []
    for loop in loops:
        cells = [("why adamw", lr_name(best[loop]))]
        for kind in FIXED:
            top = max(ratios[loop][kind], key=lambda r: statistics.mean(runs.scores(loop, f"why {kind}",
                                                                                     f"ratio {r:g}", CHOOSE)))
            cells.append((f"why {kind}", f"ratio {top:g}"))
        cells += [("why logra", "default"), ("why logra", "the three calls")]
        rows.append([loop] + [f"{ms(runs.scores(loop, m, st, CHOOSE))} ({st.replace('ratio ', '')})"
                              if m != "why logra" else ms(runs.scores(loop, m, st, CHOOSE)) for m, st in cells])
        kl_rows.append([loop] + [
            "{:.2g} ({:.1%} of H)".format(statistics.median(runs.rows[(loop, m, st, s)]["kl_median"] for s in CHOOSE),
                                          statistics.median(runs.rows[(loop, m, st, s)]["kl_share_median"]
                                                            for s in CHOOSE)) for m, st in cells])
    grids = "; ".join(f"{loop} {kind}: {', '.join(f'{r:g}' for r in ratios[loop][kind])}"
                      for loop in loops for kind in FIXED if ratios[loop][kind] != list(WHY_RATIOS))
    seconds = sum(r["seconds"] for k, r in runs.rows.items() if k[1].startswith("why") and k[0] in loops)
    note = ("Seeds 0-4 of three loops where the defaults fall short (held-out, mean +- sd; in brackets the setting). "
            "Without the sketch: RowAdam's row-scaled direction of the full gradient (A = I), one fixed step a "
            "share of ||W|| each update, no KL control. With the sketch: LoGRA's own sketch and RowAdam at the same "
            "fixed steps (alpha 1); the two differ only by the random projection. Per layer: each layer's step "
            "scaled to the share of its own ||W|| (RowAdam's c, the paper's, is one scale for all layers, so a "
            "layer's step is in proportion to its sketch's norm). The step sizes tried (||step|| / ||W||): "
            f"{', '.join(f'{r:g}' for r in WHY_RATIOS)}" + (f", widened at an edge for {grids}" if grids else "") +
            ". Compute: "
            f"{seconds / 60:.0f} min of runs, one thread each.")
    kl_note = ("The KL of one update (exact, per token, on its own batch, before against after), the median over "
               "a run's updates and over seeds 0-4, and its share of the policy's entropy H there:")
    text = note + "\n\n" + report.table(header, rows) + "\n\n" + kl_note + "\n\n" + report.table(kl_header, kl_rows)
    print("\n" + text)
    if args.markdown:
        report.publish("defaults_why", text, seconds / max(args.jobs, 1))  # its runs' cost, at --jobs at once


def adamw_best(runs, loop):
    """(mean held-out score on seeds 0-4, setting) of AdamW's best rate among those run on all of
    seeds 0-4 of `loop`, or None when none was."""
    rates = sorted({k[2] for k in runs.rows if k[0] == loop and k[1] == "adamw"
                    and all((loop, "adamw", k[2], s) in runs.rows for s in CHOOSE)})
    return max(((statistics.mean(runs.scores(loop, "adamw", lr, CHOOSE)), lr) for lr in rates), default=None)


def tune(args):
    """--tune: on seeds 0-4 of every loop but the check, beside AdamW's best there, the search that
    chose LoGRAOptimizer's defaults (SEARCH) and LoGRA's settings around them (TUNE): how the
    defaults were chosen, never looking at the check loops."""
    runs = Runs(args.out, args.jobs)
    loops = [loop for loop in (args.loops or list(LOOPS)) if LOOPS[loop][1] != "check"]
    tables = []
    for title, table_settings, reference in (("search", SEARCH, "earlier defaults"), ("tune", TUNE, "default")):
        settings = [t for t in table_settings if not args.settings or t[0] in args.settings]
        runs.ensure([(loop, "logra", name, s, kw) for loop in loops for name, kw in settings for s in CHOOSE])
        tables.append(settings_table(runs, loops, settings, reference))
    note = ("LoGRA's settings on the choosing seeds 0-4 (held-out, mean +- sd; in brackets the updates at alpha's "
            "cap over the 5 runs); the check loops are left out. First the search that chose LoGRAOptimizer's "
            "defaults, from the earlier ones (calibrated, RowAdam's one scale, alpha_max 3 x update_ratio 0.01 = 3% "
            "of ||W||, budget_for's entropy_share 0.2); per layer: RowAdam's step scaled per layer (kl_control.py's "
            "departure 6); update_ratio 0.03 there is the same cap as today's alpha_max 9. Then today's defaults "
            "(per layer, alpha_max 9, entropy_share 0.4, calibrated) with one knob changed at a time; the three "
            "calls: the paper's controller with budget_for's default budget. The paper's schedule: kl_budget from "
            "2e-4 to 2e-5 per token over the run's updates. "
            f"Compute: {compute(runs, loops) / 60:.0f} min of runs of these loops (the family's included).")
    text = note + "\n\nThe search:\n\n" + tables[0] + "\n\nAround the defaults chosen:\n\n" + tables[1]
    print("\n" + text)
    if args.markdown:
        report.publish("defaults_tuning", text, compute(runs, loops) / max(args.jobs, 1))


def settings_table(runs, loops, settings, reference) -> str:
    """The table of `settings` on `loops`' seeds 0-4 and, per loop, AdamW's best minus the
    `reference` setting and minus the best of them."""
    header = ["loop", "AdamW's best, seeds 0-4"] + [name for name, _ in settings]
    rows, lines = [], []
    for loop in loops:
        adam = adamw_best(runs, loop)  # (mean, its rate's setting) on seeds 0-4, or None
        means = {name: statistics.mean(runs.scores(loop, "logra", name, CHOOSE)) for name, _ in settings}
        capped = {name: sum(runs.rows[(loop, "logra", name, s)]["capped"] for s in CHOOSE) for name, _ in settings}
        rows.append([loop, f"{adam[0]:.3f} ({adam[1]})" if adam else ""] +
                    [ms(runs.scores(loop, "logra", name, CHOOSE)) + f" ({capped[name]})" for name, _ in settings])
        if adam is None:
            continue
        top = max(means, key=means.get)
        gap, ref = adam[0] - means[top], means.get(reference, float("nan"))
        lines.append(f"- {loop}: AdamW's best {adam[0]:.3f}; {reference} {ref:.3f} ({adam[0] - ref:+.3f}); "
                     f"LoGRA's best setting here, {top}, {means[top]:.3f} ({gap:+.3f}: "
                     + ("within 0.03" if gap <= 0.03 else "short") + ")")
    return report.table(header, rows) + "\n\nAdamW's best minus LoGRA's, seeds 0-4:\n\n" + "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loops", nargs="+", choices=list(LOOPS), help="some loops only (default: all)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, one thread each")
    p.add_argument("--out", default=OUT, help="the runs, one JSON line each (read back, not rerun)")
    p.add_argument("--tune", action="store_true", help="instead: LoGRA's settings (TUNE) on seeds 0-4, no check loop")
    p.add_argument("--settings", nargs="+", help="with --tune: some settings only")
    p.add_argument("--why", action="store_true", help="instead: where the gap comes from, on WHY_LOOPS' seeds 0-4")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="with --smollm2")
    p.add_argument("--smollm2", metavar="DIR", help="instead: LoGRA's defaults on bench/real_model.py's checkpoint")
    p.add_argument("--smollm2-updates", type=int, default=30)
    p.add_argument("--start", choices=["scratch"], help="with --smollm2: LoGRAOptimizer's start (default: auto)")
    p.add_argument("--uncalibrated", action="store_true", help="with --smollm2 --start scratch: calibrate=False")
    args = report.parse_args(p, "defaults", "defaults_claim", *SMOLLM2_BLOCKS.values(), "defaults_tuning",
                             "defaults_why",
                             which=lambda a: [SMOLLM2_BLOCKS[smollm2_form(a)]]
                             if a.smollm2 else ["defaults_tuning"] if a.tune
                             else ["defaults_why"] if a.why else ["defaults", "defaults_claim"])
    if args.start and not args.smollm2:
        p.error("--start goes with --smollm2 DIR (the family's models all take start='scratch')")
    if args.uncalibrated and args.start != "scratch":
        p.error("--uncalibrated goes with --smollm2 DIR --start scratch (the defaults there are the paper's, uncalibrated)")
    torch.set_num_threads(1)
    if args.smollm2:
        return smollm2(args)
    why(args) if args.why else tune(args) if args.tune else family(args)


if __name__ == "__main__":
    main()
