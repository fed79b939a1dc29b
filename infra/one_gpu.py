"""
infra/one_gpu.py: trainer and rollout engine on one GPU (`train.py --gpus 1`): after every
merge the engine's bf16 weights are cast from the trainer's fp32 master.

What it is
----------
With the trainer and its in-process engine (infra/engine.py's `HFEngine`) on one device, the
engine needs no payload and no master of its own: `refresh(engine, modules)` writes, target by
target, bf16(W) of the trainer's merged fp32 weight into the engine's weight in place (LoRA's
merged weight W + (alpha / r) B A; AdamW's W). The engine then holds what a factor-merging
engine (sync.EngineWeights: bf16 + an int16 residual, 2 bytes a target weight more: 12.2 GiB
at 7B) holds after the same update, bit for bit:

    factors:  master = join(bf16, j);  master -= F A_t;  bf16, j = split(master)    (sync.py)
    cast:     bf16 = round_to_nearest_even(W),  W the trainer's master after W -= F A_t

The factor-merging engine's master is the trainer's own, bit for bit (sync.py, departure 1),
and the trainer keeps that master off bf16 ties (rowadam.py's departure 2: a value halfway
between two bf16 values is moved one fp32 ulp toward zero before any split), so its split's
bf16 part, (bits + 0x7FFF) & ~0xFFFF on the fp32 words, is the nearest bf16: the cast.
Tests: tests/test_one_gpu.py (the two engines after the same updates; a train.py run's rows
against the factor sync's).

Refusals: a sharded weight (FSDP2 over several ranks: one GPU is one rank) or a target the
engine does not hold raise OneGpuError, before anything is written (LoRA's base weights too).
"""

import torch

import rowadam
from infra import lora
from infra.errors import RunError


class OneGpuError(RunError):
    """The one-GPU refresh cannot run as asked (a sharded trainer, another engine's targets)."""


def master_weight(module) -> torch.Tensor:
    """A target's whole fp32 weight as the engine should run it: LoRA's merged weight (formed
    in fp32, one target at a time), else W itself (under one-rank FSDP2: its one shard)."""
    return lora.merged_weight(module) if hasattr(module, "base_layer") else whole(module.weight)


def whole(weight) -> torch.Tensor:
    """`weight` itself, or its one shard under one-rank FSDP2; refused when this rank holds part of it."""
    rows, offset = rowadam.local_rows(weight)
    if offset or tuple(rows.shape) != tuple(weight.shape):
        raise OneGpuError(f"a target weight of shape {tuple(weight.shape)} holds rows {offset}.."
                          f"{offset + rows.shape[0]} here: --gpus 1 trains on one rank, whose shard is the whole "
                          f"weight")
    return rows


@torch.no_grad()
def refresh(engine, modules: dict, *, update: int) -> int:
    """The engine's bf16 target weights cast from the trainer's merged fp32 master, after
    update `update`, in place (the engine's `weights`: infra/engine_weights.py's slots, one per
    target); returns the bytes sent: 0. The engine then expects update `update + 1`."""
    slots = engine.weights.slots
    missing = sorted(set(modules) ^ set(slots))[:3]
    if missing:
        raise OneGpuError(f"the engine and the trainer hold other targets ({', '.join(missing)}): --gpus 1 casts "
                          f"every target of the trainer into the engine's copy of the same model")
    for module in modules.values():  # every refusal before the first write
        whole(getattr(module, "base_layer", module).weight)
    for name, module in modules.items():
        slots[name].weight.copy_(master_weight(module))  # (d, k) fp32 -> bf16, round to nearest even
    engine.weights.update = update + 1
    return 0
