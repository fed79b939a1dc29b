"""The KL probe: its cost next to a plain forward, and its prediction next to the realised KL.

1. Time of one `predict_kl` (the probe over 2 responses: for Qwen2, infra/probe_decoder.py's written-out
   decoder and tangent), and of the same probe by forward-mode AD (the other families' path),
   relative to one plain no-grad forward of the same 2 sequences, median of interleaved
   repetitions.
2. On a float64 model: choose alpha for a budget, merge, and compare the exact mean
   per-token KL(pi_old || pi_new) at the response positions with the predicted alpha^2 KL1.
3. On a trained policy, as train.py runs it: the tiny preset's base policy (its supervised
   warm-up, cached in runs/ as train.py caches it), real rollouts from its engine, REINFORCE
   into the sketches, RowAdam, the probe on the preset's probe tokens; for every budget from
   1e-6 to 1e-2 alpha is solved without the cap, the step is merged, and the realised KL
   (train.py's `kl_real`: exact, float64) is divided by the prediction. Seeds 0-2, three
   rollout batches each: median and range of realised / predicted.

    python bench/kl_probe.py            # all three
    python bench/kl_probe.py --trained  # only the third
    python bench/kl_probe.py --markdown # and write the tables into the READMEs
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kl_control  # noqa: E402
from infra import probe_decoder  # noqa: E402
import report  # noqa: E402  (bench/report.py)
from infra.batched import BatchedRowAdam  # noqa: E402
import sketch  # noqa: E402


def build(dtype, hidden=256, layers=4, vocab=4096, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).to(dtype).eval()


def prepared(dtype, batch, length, update_ratio, rank=32, seed=0):
    model = build(dtype)
    layers = sketch.attach(model, rank=rank, seed=seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=g)
    logits = model(input_ids=ids).logits
    F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    opt = BatchedRowAdam(layers, seed=seed, update_ratio=update_ratio, factor_dtype=dtype)
    opt.prepare()
    mask = torch.zeros_like(ids)
    mask[:, length // 4:] = 1
    return model, layers, opt, ids, mask


def timing(reps=5):
    """Prints the cost table and returns it as Markdown, below its caption."""
    model, layers, opt, ids, mask = prepared(torch.float32, batch=2, length=512, update_ratio=6e-5)
    def by_forward_ad():  # the probe as it runs for the families it does not write out
        written, probe_decoder.WRITTEN_OUT = probe_decoder.WRITTEN_OUT, ()
        try:
            return probe_decoder.fast_probe(model, layers, opt.directions, ids, mask).kl1
        finally:
            probe_decoder.WRITTEN_OUT = written

    runs = {
        "plain forward": lambda: model(input_ids=ids),
        "predict_kl probe (written out)": lambda: probe_decoder.fast_probe(model, layers, opt.directions, ids, mask),
        "predict_kl probe (forward-mode AD)": by_forward_ad,
    }
    times = {k: [] for k in runs}
    for rep in range(reps + 1):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            with torch.no_grad():
                fn()
            if rep:
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["plain forward"])
    caption = f"probe cost: 2 x 512 tokens, hidden 256, 4 layers, vocab 4096, fp32, median of {reps}"
    result = report.table(["", "time", "vs forward"],
                          [[name, f"{statistics.median(ts) * 1e3:.0f} ms", f"{statistics.median(ts) / base:.2f}x"]
                           for name, ts in times.items()])
    print(caption)
    print(result)
    return caption + "\n\n" + result


def accuracy(temperature=1.0):
    """Prints the accuracy table as it goes and returns it as Markdown, below its caption."""
    caption = f"prediction vs reality: float64 model, 3 x 64 tokens, temperature {temperature}"
    header = ["budget", "alpha", "predicted alpha^2 KL1", "exact KL", "exact / predicted"]
    print("\n" + caption)
    print(report.table(header, []))
    rows = []
    for budget in (1e-5, 1e-4, 1e-3):
        model, layers, opt, ids, mask = prepared(torch.float64, batch=3, length=64, update_ratio=3e-2)
        kl1 = probe_decoder.fast_probe(model, layers, opt.directions, ids, mask,
                                       temperature=temperature, max_responses=3).kl1
        alpha = kl_control.solve_alpha(kl1, budget=budget)
        with torch.no_grad():
            old = model(input_ids=ids).logits
            opt.merge(alpha)
            new = model(input_ids=ids).logits
        sel = mask[:, 1:].bool()
        lp = torch.log_softmax(old[:, :-1][sel] / temperature, -1)
        lq = torch.log_softmax(new[:, :-1][sel] / temperature, -1)
        exact = (lp.exp() * (lp - lq)).sum(-1).mean().item()
        pred = alpha**2 * kl1
        rows.append([f"{budget:.0e}", f"{alpha:.3f}", f"{pred:.3e}", f"{exact:.3e}", f"{exact / pred:.4f}"])
        print(report.row(rows[-1]), flush=True)
    return caption + "\n\n" + report.table(header, rows)


def trained(seeds=(0, 1, 2), batches=3, budgets=(1e-6, 1e-5, 1e-4, 1e-3, 1e-2)):
    """Prints the table on the trained policy and returns it as Markdown, below its caption."""
    import copy
    import dataclasses

    import ppo
    from infra import tasks
    from infra import policy
    import train
    from infra.engine import HFEngine, stable_seed

    ratios, alphas, preds = ({b: [] for b in budgets} for _ in range(3))
    for seed in seeds:
        cfg = dataclasses.replace(train.PRESETS["tiny"], preset="tiny", seed=seed)
        task = tasks.Arithmetic(seed, cfg.eval_problems)
        base = policy.build_model(cfg.model, task.vocab_size, cfg.seed)
        warmup = dict(steps=cfg.warmup_steps, batch=cfg.warmup_batch, lr=cfg.warmup_lr, unboxed=cfg.warmup_unboxed)
        path = policy.base_policy_path(cfg.model, task, os.path.join("runs", "tiny-logra"), preset=cfg.preset,
                                       seed=cfg.seed, warmup=warmup)
        os.makedirs(os.path.dirname(path), exist_ok=True)  # runs/, where train.py's tiny runs cache it too
        policy.base_policy(base, task, path, **warmup, seed=cfg.seed, log=print)
        base.eval()
        engine = HFEngine(copy.deepcopy(base).to(torch.bfloat16), base_seed=seed, sketch_rank=cfg.sketch_rank,
                          eos=task.eos, pad=task.pad)
        for b in range(batches):
            problems = [task.train_problem(b * cfg.batch + i) for i in range(cfg.batch)]
            ro = engine.generate(task.prompt_ids(problems),
                                 [stable_seed("rollout", seed, b, b * cfg.batch + i) for i in range(len(problems))],
                                 temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)
            rewards = ppo.outcome_reward(torch.tensor([task.correct(p, r) for p, r in zip(problems, ro.responses)]))
            advantages = rewards - rewards.mean()
            probed = kl_control.probe_count(ro.mask, cfg.probe_responses, cfg.probe_tokens)
            for budget in budgets:
                model = copy.deepcopy(base)  # every budget from the same policy and the same sketches
                layers = sketch.attach(model, rank=cfg.sketch_rank, seed=seed)
                opt = BatchedRowAdam(layers, seed=seed, update_ratio=cfg.update_ratio)
                logp = ppo.response_logprobs(model(input_ids=ro.ids).logits, ro.ids, cfg.temperature)
                loss, _ = ppo.policy_loss(logp, advantages, ro.mask, rollout_logprobs=ro.logprobs,
                                          num_tokens=ppo.global_token_count(ro.mask))
                loss.backward()
                opt.prepare()
                probe = probe_decoder.fast_probe(model, layers, opt.directions, ro.ids, ro.mask,
                                                 temperature=cfg.temperature, max_responses=probed,
                                                 keep_positions=cfg.kl_real_positions)
                kl1 = probe.kl1
                alpha = kl_control.solve_alpha(kl1, budget=budget, alpha_max=float("inf"))
                opt.merge(alpha)
                real = kl_control.realised_kl(probe, model, ro.ids, ro.mask)
                ratios[budget].append(real / (alpha**2 * kl1))
                alphas[budget].append(alpha)
                preds[budget].append(alpha**2 * kl1)
    n = len(seeds) * batches
    caption = (f"prediction vs reality on the tiny preset's base policy: seeds {list(seeds)}, {batches} rollout "
               f"batches of {train.PRESETS['tiny'].batch} each ({n} steps per budget), alpha uncapped")
    rows = [[f"{b:.0e}", f"{statistics.median(alphas[b]):.3g}", f"{statistics.median(preds[b]):.2e}",
             f"{statistics.median(ratios[b]):.3f}", f"{min(ratios[b]):.3f}", f"{max(ratios[b]):.3f}"]
            for b in budgets]
    result = report.table(["budget", "median alpha", "median predicted", "realised / predicted: median", "min", "max"],
                          rows)
    print("\n" + caption)
    print(result)
    return caption + "\n\n" + result


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trained", action="store_true", help="only the third part, on the trained policy")
    args = report.parse_args(p, "kl_probe", "kl_probe_trained",
                             which=lambda a: ["kl_probe_trained"] if a.trained else ["kl_probe", "kl_probe_trained"])
    if not args.trained:
        cost_and_accuracy = timing() + "\n\n" + accuracy()
        if args.markdown:  # published at once: the third part takes minutes
            report.publish("kl_probe", cost_and_accuracy)
    on_trained = trained()
    if args.markdown:
        report.publish("kl_probe_trained", on_trained)


if __name__ == "__main__":
    main()
