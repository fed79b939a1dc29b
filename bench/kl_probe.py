"""The KL probe: its cost next to a plain forward, and its prediction next to the realised KL.

1. Time of one `predict_kl` (forward-mode AD over 2 responses) relative to one plain no-grad
   forward of the same 2 sequences, median of interleaved repetitions.
2. On a float64 model: choose alpha for a budget, merge, and compare the exact mean
   per-token KL(pi_old || pi_new) at the response positions with the predicted alpha^2 KL1.

    python bench/kl_probe.py
"""

import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kl_control  # noqa: E402
import rowadam  # noqa: E402
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
    opt = rowadam.RowAdam(layers, base_seed=seed, update_ratio=update_ratio, factor_dtype=dtype)
    opt.prepare()
    mask = torch.zeros_like(ids)
    mask[:, length // 4:] = 1
    return model, layers, opt, ids, mask


def timing(reps=5):
    model, layers, opt, ids, mask = prepared(torch.float32, batch=2, length=512, update_ratio=6e-5)
    runs = {
        "plain forward": lambda: model(input_ids=ids),
        "predict_kl probe": lambda: kl_control.predict_kl(model, layers, opt.directions, ids, mask),
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
    print(f"probe cost: 2 x 512 tokens, hidden 256, 4 layers, vocab 4096, fp32, median of {reps}")
    print("| | time | vs forward |\n|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts) * 1e3:.0f} ms | {statistics.median(ts) / base:.2f}x |")


def accuracy(temperature=1.0):
    print(f"\nprediction vs reality: float64 model, 3 x 64 tokens, temperature {temperature}")
    print("| budget | alpha | predicted alpha^2 KL1 | exact KL | exact / predicted |\n|---|---|---|---|---|")
    for budget in (1e-5, 1e-4, 1e-3):
        model, layers, opt, ids, mask = prepared(torch.float64, batch=3, length=64, update_ratio=3e-2)
        kl1 = kl_control.predict_kl(model, layers, opt.directions, ids, mask,
                                    temperature=temperature, max_responses=3)
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
        print(f"| {budget:.0e} | {alpha:.3f} | {pred:.3e} | {exact:.3e} | {exact / pred:.4f} |")


if __name__ == "__main__":
    timing()
    accuracy()
