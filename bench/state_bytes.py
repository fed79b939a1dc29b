"""Gradient and optimizer-state bytes of one decoder layer: dense AdamW vs RowAdam + sketch.

Counts the tensors the code actually allocates after one backward and one optimizer step
(not a formula): for AdamW the fp32 `.grad` and `exp_avg`/`exp_avg_sq` of the seven target
weights; for LoGRA the sketches S (d, r), projections A (r, k), row moments v (d,) and the
prepared directions U (d, r).

    python bench/state_bytes.py                # a layer of the 7b preset (Qwen2.5-Math-7B), r = 256
    python bench/state_bytes.py --preset 27b   # another preset of train.py
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import report  # noqa: E402  (bench/report.py)
from infra.batched import BatchedRowAdam  # noqa: E402
import sketch  # noqa: E402


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def one_layer_model(hidden, intermediate, heads, kv_heads):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=128, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg)


def loss_of(model, ids):
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def main():
    import train

    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="7b", choices=[k for k, v in train.PRESETS.items() if v["model"]],
                   help="the widths of this preset of train.py (default: the paper's 7B)")
    p.add_argument("--rank", type=int, default=None, help="default: the preset's rank")
    args = report.parse_args(p, "state_bytes")
    m = train.PRESETS[args.preset].model
    args.hidden, args.intermediate = m["hidden_size"], m["intermediate_size"]
    args.heads, args.kv_heads = m["num_attention_heads"], m["num_key_value_heads"]
    args.rank = args.rank or train.PRESETS[args.preset].sketch_rank
    model = one_layer_model(args.hidden, args.intermediate, args.heads, args.kv_heads)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    targets = [m.weight for m in sketch.target_modules(model).values()]
    weight_bytes = nbytes(targets)

    # Dense AdamW on the same seven weights.
    for prm in model.parameters():
        prm.requires_grad_(False)
    for w in targets:
        w.requires_grad_(True)
    adam = torch.optim.AdamW(targets, lr=1e-6, betas=(0.9, 0.95), weight_decay=0.0)
    loss_of(model, ids).backward()
    adam.step()
    dense_grad = nbytes(w.grad for w in targets)
    dense_state = nbytes(t for st in adam.state.values() for t in st.values() if t.dim() > 0)
    for w in targets:
        w.grad = None
    del adam

    # LoGRA: sketches, projections, moments and directions.
    layers = sketch.attach(model, rank=args.rank, seed=0)
    opt = BatchedRowAdam(layers, seed=0)
    loss_of(model, ids).backward()
    opt.prepare()
    s_bytes = nbytes(l.sketch for l in layers)
    a_bytes = nbytes(l.signs for l in layers)  # int8 signs of A (sketch.py, implementation notes)
    v_bytes = nbytes(opt.moments)
    u_bytes = nbytes(opt.directions)
    logra = s_bytes + a_bytes + v_bytes + u_bytes
    dense = dense_grad + dense_state

    mib = 2**20
    caption = (f"one decoder layer: hidden {args.hidden}, intermediate {args.intermediate}, "
               f"rank {args.rank}; seven target weights = {weight_bytes / mib:.1f} MiB fp32")
    rows = [["AdamW (fp32 grad + exp_avg + exp_avg_sq)", f"{dense_grad / mib:.1f} MiB", f"{dense_state / mib:.1f} MiB",
             f"{dense / mib:.1f} MiB", "1.000x"],
            ["LoGRA (sketch S / A + v + U)", f"{s_bytes / mib:.1f} MiB",
             f"{(a_bytes + v_bytes + u_bytes) / mib:.1f} MiB (A {a_bytes / mib:.1f}, v {v_bytes / 2**10:.1f} KiB, "
             f"U {u_bytes / mib:.1f})", f"{logra / mib:.1f} MiB", f"{logra / dense:.4f}x"]]
    result = report.table(["", "gradient", "optimizer state", "total", "vs AdamW"], rows)
    print(caption)
    print(result)
    if args.markdown:
        report.publish("state_bytes", caption + "\n\n" + result)


if __name__ == "__main__":
    main()
