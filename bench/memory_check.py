"""The memory estimate of `train.py --dry-run`, checked by measurement on this CPU.

A Qwen2 with the 7B preset's widths (hidden 3584, intermediate 18944, 28 heads, 4 KV heads)
but 2 decoder layers and a 1024-word vocabulary, fp32, on 2 gloo ranks with FSDP2 (one unit
per decoder layer, then the root), r = 256:

- LoGRA: backward into the row-sharded sketches, then the optimizer step as train.py runs it
  (RowAdam.prepare, the KL probe, merge, and the factor sync: each decoder layer's factors
  gathered and encoded as the engine payload).
- AdamW (foreach, as on GPUs): backward, a first step (its moments appear), then the
  measured step and the streamed full bf16 sync.

Persistent state is counted from the tensors themselves on each rank. The step's transient
is measured with a TorchDispatchMode that adds the bytes of every storage an op allocates
and subtracts them when the storage dies: the peak of live bytes above the step's start.
Both are compared with `memory_plan.estimate` for the same shapes and world size.

    python bench/memory_check.py            # about a minute; prints the table and the ratios
    python bench/memory_check.py --markdown # and writes them into the READMEs
"""

import argparse
import json
import os
import sys
import tempfile
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import kl_control  # noqa: E402
import report  # noqa: E402  (bench/report.py)
import sketch  # noqa: E402
from infra import engine_sync  # noqa: E402
from infra.batched import BatchedRowAdam  # noqa: E402
from infra.row_shard import RowShard  # noqa: E402
from infra import memory_plan  # noqa: E402
from infra import policy  # noqa: E402
from infra import probe_decoder  # noqa: E402
import sync  # noqa: E402
from infra import wire  # noqa: E402
import train  # noqa: E402

WORLD, MICRO, TOKENS = 2, 2, 64
SEVEN_B = dict(train.PRESETS["7b"].model, num_hidden_layers=2, vocab_size=1024)


class LiveBytes(TorchDispatchMode):
    """Bytes held by the storages that ops return inside the mode, except those that existed
    before (`existing`), and their peak. Sizes are read again after every op, so memory
    freed by resizing a storage to 0 (FSDP2's unsharded parameters) is seen as freed."""

    def __init__(self, existing=()):
        super().__init__()
        self.tracked, self.now, self.peak = {}, 0, 0
        self.ignore = {id((t.to_local() if hasattr(t, "to_local") else t).untyped_storage()) for t in existing}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                try:
                    st = t.untyped_storage()
                except RuntimeError:  # a wrapper subclass (DTensor): its local tensor is counted itself
                    continue
                key = id(st)
                if key not in self.ignore and key not in self.tracked:
                    self.tracked[key] = weakref.ref(st, lambda _, key=key: self.tracked.pop(key, None))
        self.peak = max(self.peak, self.live())
        return out

    def live(self) -> int:
        self.now = sum(st.nbytes() for st in (r() for r in list(self.tracked.values())) if st is not None)
        return self.now


def nbytes(tensors):
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)


def build(model_cfg, optimizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**model_cfg))
    policy.freeze_for(model, optimizer, sketch_rank=None, lora_alpha=None, seed=0)
    policy.shard(model, WORLD, optimizer, torch.device("cpu"))
    return model


def batch(model_cfg, rank):
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, model_cfg["vocab_size"], (MICRO, TOKENS), generator=g)  # (B, T)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, TOKENS // 2:] = True  # the second half is the "response"
    return ids, mask


def loss_of(model, ids):
    logits = model(input_ids=ids).logits  # (B, T, V)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def logra_step(model_cfg, r, rank):
    model = build(model_cfg, "logra")
    layers = sketch.attach(model, rank=r, seed=0, shard=RowShard(dist.group.WORLD))
    opt = BatchedRowAdam(layers, seed=0, update_ratio=6e-5)
    ids, mask = batch(model_cfg, rank)
    loss_of(model, ids).backward()
    persistent = nbytes(p for p in model.parameters()) + nbytes(l.sketch for l in layers) + nbytes(opt._u) \
        + nbytes(opt.moments) + nbytes(l.signs for l in layers)
    phases, left = {}, {}
    existing = [*model.parameters(), *model.buffers(), *(l.sketch for l in layers), *opt._u, *opt.moments,
                *(l.signs for l in layers)]
    with LiveBytes(existing) as live:
        def mark(phase):  # the phase's peak above what was live when it began
            phases[phase] = live.peak - mark.start
            left[phase] = live.live()
            live.peak = mark.start = live.now
        mark.start = 0
        opt.prepare()
        mark("prepare")
        kl1 = probe_decoder.fast_probe(model, layers, opt.directions, ids, mask, max_responses=MICRO).kl1
        mark("probe")
        factors = opt.merge(kl_control.solve_alpha(kl1, budget=2e-4))
        mark("merge")
        by_name = {l.name: (l, f) for l, f in zip(layers, factors)}
        sizes = {n: 2 * r * layer.module.weight.shape[0] for n, (layer, _) in by_name.items()}
        for names in engine_sync.payload_groups(engine_sync.layer_groups(by_name), sizes.get, engine_sync.FACTOR_PAYLOAD_BYTES):
            # what engine_sync.factors sends, without an engine
            part = {n: by_name[n][0].all_rows(by_name[n][1]) for n in names}
            wire.encode(sync.Payload(0, 0, r, part))
        mark("sync")
        del factors, by_name, part
    return persistent, max(phases.values()), phases


def adam_step(model_cfg, r, rank):
    model = build(model_cfg, "adam")
    modules = sketch.target_modules(model)
    opt = torch.optim.AdamW([m.weight for m in modules.values()], lr=1e-6, betas=(0.9, 0.95), weight_decay=0.0,
                            foreach=True)
    ids, _ = batch(model_cfg, rank)
    for step in range(2):
        loss_of(model, ids).backward()
        if step == 0:
            opt.step()  # the moments now exist
            opt.zero_grad(set_to_none=True)
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    persistent = nbytes(p for p in model.parameters()) + nbytes(m.weight.grad for m in modules.values()) + nbytes(state)
    existing = [*model.parameters(), *model.buffers(), *(m.weight.grad for m in modules.values()), *state]
    with LiveBytes(existing) as live:
        opt.step()
        for names in engine_sync.layer_groups(modules):  # engine_sync.full, without an engine
            weights = {n: engine_sync.target_weight(modules[n]) for n in names}
            wire.encode(sync.full_payload(weights, update=1, base_seed=0, rank=r))
        del weights
    return persistent, live.peak


def worker(rank, world, model_cfg, r, out_dir):
    torch.set_num_threads(1)
    result = {"logra": logra_step(model_cfg, r, rank), "adam": adam_step(model_cfg, r, rank)}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def measure(model_cfg, r):
    """[(label, rank 0 measured, rank 1 measured, estimate)] for `model_cfg` at rank `r`; the probe's peak."""
    from distributed import run_gloo

    with tempfile.TemporaryDirectory() as tmp:
        run_gloo(worker, WORLD, model_cfg, r, tmp)
        measured = [json.load(open(os.path.join(tmp, f"rank{k}.json"))) for k in range(WORLD)]
    # fp32 compute here (bf16 on GPUs)
    est = memory_plan.estimate(model_cfg, WORLD, r, micro_batch=MICRO, context=TOKENS,
                               probe_forward_tokens=MICRO * TOKENS, kl_real_positions=0, compute_bytes=4)
    rows = [("LoGRA persistent (weights shard, S, U, v, signs)", measured[0]["logra"][0], measured[1]["logra"][0],
             est["trainer_logra_persistent_bytes"])]
    for phase in ("prepare", "merge", "sync"):
        rows.append((f"LoGRA step: {phase}", measured[0]["logra"][2][phase], measured[1]["logra"][2][phase],
                     est["trainer_logra_phases"][phase]))
    rows += [("LoGRA step transient (prepare, merge, sync; the largest)",
              max(v for k, v in measured[0]["logra"][2].items() if k != "probe"),
              max(v for k, v in measured[1]["logra"][2].items() if k != "probe"),
              max(v for k, v in est["trainer_logra_phases"].items() if k != "probe")),
             ("AdamW persistent (weights shard, grads, moments)", measured[0]["adam"][0], measured[1]["adam"][0],
              est["trainer_adam_persistent_bytes"]),
             ("AdamW step transient (step, streamed full sync)", measured[0]["adam"][1], measured[1]["adam"][1],
              est["trainer_adam_transient_bytes"])]
    return rows, (measured[0]["logra"][2]["probe"], measured[1]["logra"][2]["probe"])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = report.parse_args(p, "memory_check")
    rows, probe = measure(SEVEN_B, 256)
    mib = 2**20
    caption = (f"Qwen2 with 7B widths, 2 layers, vocab 1024; {WORLD} gloo ranks, FSDP2, r = 256; "
               f"rank 0 (rank 1 in brackets)")
    worst = max(abs(got / want - 1) for _, got, _, want in rows)
    result = [caption,
              report.table(["", "measured", "estimate", "measured / estimate"],
                           [[label, f"{got / mib:.1f} MiB ({other / mib:.1f})", f"{want / mib:.1f} MiB",
                             f"{got / want:.3f}"] for label, got, other, want in rows]),
              f"largest deviation: {100 * worst:.1f}%",
              f"the KL probe, a forward pass with tangents under FSDP2: {probe[0] / mib:.1f} MiB "
              f"({probe[1] / mib:.1f}) at its peak, the unsharded layers in flight included (not compared: FSDP2's "
              f"own buffers)"]
    print("\n".join(result))
    if args.markdown:
        report.publish("memory_check", "\n\n".join(result))


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    main()
