"""Sync payload size per update vs a full bf16 weight sync, and encode/apply time.

Payload bytes come from `sync.encode` of zero factors with the target shapes (d, r) of the
paper presets in `train.PRESETS` (built on the meta device); a full sync's bytes are the bf16 target weights (d, k), and the whole model's bf16
parameters for reference. Timings: encode, decode and EngineWeights.apply for a small model
on this CPU (median of interleaved repetitions).

    python bench/sync_payload.py [--markdown]
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import report  # noqa: E402  (bench/report.py)
import sketch  # noqa: E402
import sync  # noqa: E402
import train  # noqa: E402


def target_shapes(model_cfg):
    """{clean name: (d, k)} of the seven target projections and the whole model's parameter
    count, from a preset's config built on the meta device (no memory, no download)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**model_cfg))
    shapes = {name: tuple(m.weight.shape) for name, m in sketch.target_modules(model).items()}
    return shapes, sum(p.numel() for p in model.parameters())


def sizes():
    """Prints the table of payload sizes and returns it as Markdown."""
    rows = []
    for name in ("1.5b", "7b", "27b"):
        shapes, params = target_shapes(train.PRESETS[name]["model"])
        full_targets = sum(d * k * 2 for d, k in shapes.values())
        whole = params * 2
        for r in (64, 256):
            payload = sync.Payload(0, 0, r, {n: torch.zeros(d, r, dtype=torch.bfloat16) for n, (d, k) in shapes.items()})
            size = sync.encode(payload).numel()
            rows.append([name, r, f"{size / 2**20:.1f} MiB", f"{full_targets / 2**30:.2f} GiB",
                         f"1/{full_targets / size:.1f}", f"{whole / 2**30:.2f} GiB", f"1/{whole / size:.1f}"])
    result = report.table(["preset", "r", "payload per update", "full sync, targets", "ratio",
                           "full sync, whole model", "ratio"], rows)
    print(result)
    return result


def timings(reps=7, rank=64):
    """Prints the table of timings and returns it as Markdown, below its caption."""
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
    caption = (f"CPU timings, hidden 512, 4 layers ({params / 1e6:.1f}M target weights), r = {rank}, "
               f"payload {buf.numel() / 2**20:.2f} MiB, median of {reps}")
    result = report.table(["encode", "decode (checksums)",
                           "apply (regenerate A, rebuild fp32, merge, split to bf16 + int16)"],
                          [[f"{statistics.median(t) * 1e3:.1f} ms" for t in (t_enc, t_dec, t_apply)]])
    print("\n" + caption)
    print(result)
    return caption + "\n\n" + result


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = report.parse_args(p, "sync_payload")
    tables = [sizes(), timings()]
    if args.markdown:
        report.publish("sync_payload", "\n\n".join(tables))


if __name__ == "__main__":
    main()
