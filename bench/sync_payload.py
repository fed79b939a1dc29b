"""Sync payload size per update vs a full bf16 weight sync, and encode/apply time.

Payload bytes come from `sync.encode` of zero factors with each preset's real target shapes
(d, r); a full sync's bytes are the bf16 target weights (d, k), and the whole model's bf16
parameters for reference. Timings: encode, decode and EngineWeights.apply for a small model
on this CPU (median of interleaved repetitions).

    python bench/sync_payload.py
"""

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sync  # noqa: E402

PRESETS = {  # Hugging Face config values of the two public checkpoints
    "Qwen2.5-Math-1.5B": dict(hidden=1536, inter=8960, heads=12, kv=2, layers=28, vocab=151936, tied=True),
    "Qwen2.5-Math-7B": dict(hidden=3584, inter=18944, heads=28, kv=4, layers=28, vocab=152064, tied=False),
}


def target_shapes(c):
    hd = c["hidden"] // c["heads"]
    q, kv, h, i = c["heads"] * hd, c["kv"] * hd, c["hidden"], c["inter"]
    per_layer = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                 "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    return {f"model.layers.{n}.{k}": s for n in range(c["layers"]) for k, s in per_layer.items()}


def whole_model_params(c):
    shapes = target_shapes(c)
    hd = c["hidden"] // c["heads"]
    biases = c["layers"] * (c["heads"] + 2 * c["kv"]) * hd
    norms = (2 * c["layers"] + 1) * c["hidden"]
    emb = c["vocab"] * c["hidden"] * (1 if c["tied"] else 2)
    return sum(d * k for d, k in shapes.values()) + biases + norms + emb


def sizes():
    print("| model | r | payload per update | full sync, targets | ratio | full sync, whole model | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, c in PRESETS.items():
        shapes = target_shapes(c)
        full_targets = sum(d * k * 2 for d, k in shapes.values())
        whole = whole_model_params(c) * 2
        for r in (64, 256):
            payload = sync.Payload(0, 0, r, {n: torch.zeros(d, r, dtype=torch.bfloat16) for n, (d, k) in shapes.items()})
            size = sync.encode(payload).numel()
            print(f"| {name} | {r} | {size / 2**20:.1f} MiB | {full_targets / 2**30:.2f} GiB | 1/{full_targets / size:.1f} "
                  f"| {whole / 2**30:.2f} GiB | 1/{whole / size:.1f} |")


def timings(reps=7, rank=64):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    engine = sync.EngineWeights(model, base_seed=0, rank=rank)
    g = torch.Generator().manual_seed(0)
    t_enc, t_dec, t_apply = [], [], []
    for i in range(reps + 1):
        factors = {n: (torch.randn(s.rows, rank, generator=g) * 1e-6).to(torch.bfloat16) for n, s in engine.slots.items()}
        t0 = time.perf_counter()
        buf = sync.encode(sync.Payload(i, 0, rank, factors))
        t1 = time.perf_counter()
        payload = sync.decode(buf)
        t2 = time.perf_counter()
        engine.apply(payload)
        t3 = time.perf_counter()
        if i:
            t_enc.append(t1 - t0), t_dec.append(t2 - t1), t_apply.append(t3 - t2)
    params = sum(s.residual.numel() for s in engine.slots.values())
    print(f"\nCPU timings, hidden 512, 4 layers ({params / 1e6:.1f}M target weights), r = {rank}, "
          f"payload {buf.numel() / 2**20:.2f} MiB, median of {reps}")
    print("| encode | decode (checksums) | apply (regenerate A, rebuild fp32, merge, split to bf16 + int16) |\n|---|---|---|")
    print(f"| {statistics.median(t_enc) * 1e3:.1f} ms | {statistics.median(t_dec) * 1e3:.1f} ms "
          f"| {statistics.median(t_apply) * 1e3:.1f} ms |")


if __name__ == "__main__":
    sizes()
    timings()
