"""Sync payload size per update vs a full bf16 weight sync; the engine's merge; a whole sync
through a vLLM CPU engine, factors against full bf16 weights.

1. Payload bytes come from `sync.encode` of zero factors with the target shapes (d, r) of the
   paper presets in `train.PRESETS` (built on the meta device); a full sync's bytes are the
   bf16 target weights (d, k), and the whole model's bf16 parameters for reference.
2. In-process, at SmolLM2-135M's widths (the `smollm2-135m` preset, 106M target weights, its
   rank 64): encode, decode and `EngineWeights.apply` of one update's factors, against
   `EngineWeights.load_full` of the bf16 weights (median of interleaved repetitions).
3. End to end with vLLM's CPU build (the cpu-engine extra), the same widths, random weights
   saved to a temporary folder: infra/engine_sync.py's `factors` (per decoder layer: gather, encode,
   the weight channel, the engine's merge, its re-pack of the changed layers' CPU kernels)
   against `full_sync` in bf16 (AdamW's and `--sync full`'s), each followed by the
   fingerprint check, interleaved, medians.

    python bench/sync_payload.py [--reps 5] [--markdown]
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
        shapes, params = target_shapes(train.PRESETS[name].model)
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


def smollm2_model(dtype):
    """SmolLM2-135M's architecture (the `smollm2-135m` preset's config), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = dict(train.PRESETS["smollm2-135m"].model)
    cfg.pop("model_type")
    return LlamaForCausalLM(LlamaConfig(**cfg)).to(dtype)


def factors_for(slots, rank, g):
    return {n: (torch.randn(s.rows, rank, generator=g) * 1e-4).to(torch.bfloat16) for n, s in slots.items()}


def timings(reps, rank):
    """Prints the in-process table and returns it as Markdown, below its caption."""
    model = smollm2_model(torch.bfloat16)
    engine = sync.EngineWeights(model, base_seed=0, rank=rank)
    full = {n: s.weight.clone() for n, s in engine.slots.items()}
    g = torch.Generator().manual_seed(0)
    t_enc, t_dec, t_apply, t_full = [], [], [], []
    for i in range(reps + 1):
        factors = factors_for(engine.slots, rank, g)
        t0 = time.perf_counter()
        buf = sync.encode(sync.Payload(engine.update, 0, rank, factors))
        t1 = time.perf_counter()
        payload = sync.decode(buf)
        t2 = time.perf_counter()
        engine.apply(payload)
        t3 = time.perf_counter()
        engine.load_full(sync.full_payload(full, update=engine.update, base_seed=0, rank=rank))
        t4 = time.perf_counter()
        if i:
            t_enc.append(t1 - t0), t_dec.append(t2 - t1), t_apply.append(t3 - t2), t_full.append(t4 - t3)
    params = sum(s.residual.numel() for s in engine.slots.values())
    caption = (f"In-process, SmolLM2-135M widths ({params / 1e6:.0f}M target weights), r = {rank}, payload "
               f"{buf.numel() / 2**20:.1f} MiB, this CPU ({torch.get_num_threads()} threads), median of {reps}")
    ms = [statistics.median(t) * 1e3 for t in (t_enc, t_dec, t_apply, t_full)]
    result = report.table(["encode", "decode (checksums)",
                           "apply (regenerate A, rebuild fp32, merge, split to bf16 + int16)",
                           "load_full, bf16 weights", "apply / load_full"],
                          [[f"{m:.0f} ms" for m in ms] + [f"{ms[2] / ms[3]:.2f}x"]])
    print("\n" + caption)
    print(result)
    return caption + "\n\n" + result


def engine_sync(reps, rank):
    """Prints the end-to-end table (a vLLM CPU engine) and returns it as Markdown."""
    import tempfile

    try:
        import vllm  # noqa: F401
    except ImportError:
        line = "End to end through a vLLM CPU engine: not measured (pip install -e \".[cpu-engine]\")"
        print("\n" + line)
        return line
    import rowadam
    from infra.vllm_engine import VLLMEngine

    from infra import engine_sync

    with tempfile.TemporaryDirectory() as folder:
        smollm2_model(torch.bfloat16).save_pretrained(folder)
        model = smollm2_model(torch.float32)  # the trainer's fp32 masters (the same weights)
        modules = sketch.target_modules(model)
        layers = sketch.attach(model, rank=rank, seed=0)
        opt = rowadam.RowAdam(layers, base_seed=0)
        engine = VLLMEngine(model_path=folder, context=256, seed=0, sketch_rank=rank, gpu=None, device="cpu",
                            log_path=os.path.join(folder, "engine.log"), timeout=600, gpu_memory_utilization=0.1,
                            eos=0, pad=0)
        try:
            engine_sync.start(engine, model, modules, optimizer="logra", mode="factors", update=0, seed=0, rank=rank)
            g = torch.Generator().manual_seed(0)
            t_factors, t_full = [], []
            for i in range(reps + 1):
                for layer in layers:  # a stand-in for backward: random sketches, then RowAdam's step
                    layer.sketch.normal_(generator=g)
                    layer.backwards += 1  # what a backward into the sketch counts (RowAdam checks it)
                opt.prepare()
                factors = opt.merge(1.0)
                t0 = time.perf_counter()
                sent_factors = engine_sync.factors(engine, layers, factors, update=opt.update - 1, seed=0, rank=rank)
                sync.check_fingerprints(sync.fingerprint(model), engine.fingerprint())
                t1 = time.perf_counter()
                sent_full = engine_sync.full(engine, modules, update=opt.update, seed=0, rank=rank, dtype=torch.bfloat16)
                sync.check_fingerprints(sync.fingerprint(model), engine.fingerprint())
                t2 = time.perf_counter()
                # back to the exact fp32 master (not timed), for the next factor sync
                engine_sync.full(engine, modules, update=opt.update, seed=0, rank=rank, dtype=torch.float32)
                if i:
                    t_factors.append(t1 - t0), t_full.append(t2 - t1)
        finally:
            engine.close()
    fa, fu = statistics.median(t_factors) * 1e3, statistics.median(t_full) * 1e3
    caption = (f"End to end through a vLLM CPU engine (vLLM {vllm.__version__}), SmolLM2-135M widths, r = {rank}, "
               f"30 payloads (one per decoder layer) per sync, each with the fingerprint check; median of {reps}")
    result = report.table(["sync", "bytes sent", "time", "vs full bf16"],
                          [["LoGRA factors + seed", f"{sent_factors / 2**20:.1f} MiB", f"{fa:.0f} ms", f"{fa / fu:.2f}x"],
                           ["full bf16 weights", f"{sent_full / 2**20:.1f} MiB", f"{fu:.0f} ms", "1.00x"]])
    print("\n" + caption)
    print(result)
    return caption + "\n\n" + result


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rank", type=int, default=train.PRESETS["smollm2-135m"].sketch_rank)
    args = report.parse_args(p, "sync_payload")
    tables = [sizes(), timings(args.reps, args.rank), engine_sync(args.reps, args.rank)]
    if args.markdown:
        report.publish("sync_payload", "\n\n".join(tables))


if __name__ == "__main__":
    main()
