"""
infra/engine_sync.py: the trainer's side of the weight syncs that keep a rollout engine equal to
the trainer (sync.py is the method's half that any engine needs: payloads, the exact merge,
fingerprints).

What it is
----------
- `start(engine, model, modules, ...)`: the engine's weights made the trainer's before the
  first rollout (and, through heal.py's `attach`, after every engine restart).
- `factors(...)`: LoGRA's sync, the paper's: the bf16 factors F the merge used, and the seed.
- `delta(...)`: `--sync delta`, any optimizer: the bf16 elements the update changed
  (sync.sparse_delta: the dense weight where that is no larger).
- `full(...)`: full target weights: AdamW's and LoRA's sync, the paper's control for LoGRA
  (`--sync full`), and every start and resync.
Each is streamed one decoder layer per payload (sync.layer_groups; LoGRA's factors, as many
layers as fit in sync.FACTOR_PAYLOAD_BYTES), so neither side holds more than one layer's
targets beyond its state; under FSDP2 every rank takes part (row shards are
gathered for each payload only) and returns the bytes sent. `fingerprint` is the trainer's
fingerprint of what the engines should hold: W, or LoRA's merged weight.
"""

import torch

import rowadam
import sync
from infra import lora


def exact(optimizer: str, mode: str) -> bool:
    """Whether the engines merge LoGRA's factors, and so keep the trainer's fp32 master (sync.py)."""
    return optimizer == "logra" and mode == "factors"


def start(engine, model, modules: dict, *, optimizer: str, mode: str, update: int, seed: int, rank: int):
    """The engine's weights made the trainer's before the first rollout. LoGRA's engines merge
    the factors themselves: they start from the trainer's exact fp32 master, with no bf16 ties,
    so that bf16 + an int16 residual holds it (rowadam.py, on bf16 ties). AdamW's, --sync
    full's and --sync delta's engines only ever receive bf16 weights or elements; their
    policy's start (update 0) is made tie-free too, so that every method's engine starts from
    the same bf16 weights (a tie rounds to even in a plain cast, one ulp apart from LoGRA's).
    Fingerprints confirm. Returns the trainer's fingerprint and --sync delta's shadow (`delta`)."""
    if exact(optimizer, mode) or update == 0:
        with torch.no_grad():
            for module in modules.values():
                rowadam.avoid_bf16_ties_(rowadam.local_rows(own_weight(module))[0])
    dtype = torch.float32 if exact(optimizer, mode) else torch.bfloat16
    if hasattr(engine, "attach"):  # a supervised engine is rebuilt the same way after a restart (infra/heal.py)
        engine.attach(resync=lambda target, at: full(target, modules, update=at, seed=seed, rank=rank, dtype=dtype),
                      fingerprint=lambda: fingerprint(model, optimizer))
    full(engine, modules, update=update, seed=seed, rank=rank, dtype=dtype)
    shadow = {n: engine_rows(m)[0].clone() for n, m in modules.items()} if mode == "delta" else None
    synced = fingerprint(model, optimizer)
    sync.check_fingerprints(synced, engine.fingerprint())
    return synced, shadow


def factors(engine, layers, merged, *, update: int, seed: int, rank: int) -> int:
    """The merged factors F (`merged`, one per sketched layer) to the engine, as many decoder
    layers per payload as fit in sync.FACTOR_PAYLOAD_BYTES (one at the paper's scale): each
    layer's rows are gathered across ranks (row-sharded F) for its payload only. Returns the
    bytes sent."""
    by_name = {layer.name: (layer, f) for layer, f in zip(layers, merged)}
    sent = 0
    nbytes = lambda n: 2 * rank * by_name[n][0].module.weight.shape[0]  # noqa: E731  (bf16 F, all rows)
    for names in sync.payload_groups(sync.layer_groups(by_name), nbytes, sync.FACTOR_PAYLOAD_BYTES):
        part = {n: by_name[n][0].all_rows(by_name[n][1]) for n in names}  # (d, r) each
        sent += engine.apply(sync.Payload(update, seed, rank, part))
    return sent


def delta(engine, modules: dict, shadow: dict, base: dict, *, update: int, seed: int, rank: int) -> tuple[int, float]:
    """The bf16 elements this update changed, to the engine, one decoder layer per payload: each
    rank compares its rows of what the engines run with `shadow` (those rows at the last sync),
    and the changes are gathered across ranks. `base`: the trainer's fingerprint at the last
    sync, which the engine checks its weights against before it writes. Returns the bytes sent
    and the share of target elements that changed."""
    sent = changed = total = 0
    for names in sync.layer_groups(modules):
        part = {}
        for n in names:
            rows, offset, shape = engine_rows(modules[n])  # (n, k) bf16
            changes = sync.gather_changes(*sync.changed_elements(shadow[n], rows, offset))  # (c,), (c,)
            shadow[n].copy_(rows)
            part[n] = sync.sparse_delta(shape, *changes, base[n], whole=lambda n=n: target_weight(modules[n]))
            changed, total = changed + changes[0].numel(), total + shape[0] * shape[1]
        sent += engine.apply(sync.Payload(update, seed, rank, part, kind="sparse"))
    return sent, changed / total


def full(engine, modules: dict, *, update: int, seed: int, rank: int, dtype) -> int:
    """Full target weights to the engine, streamed one decoder layer per payload: the trainer
    gathers (FSDP2) one weight at a time and neither side holds more than one layer's targets
    beyond its state. Returns the bytes sent."""
    sent = 0
    for names in sync.layer_groups(modules):
        weights = {n: target_weight(modules[n]) for n in names}
        sent += engine.load_full(sync.full_payload(weights, update=update, base_seed=seed, rank=rank, dtype=dtype))
    return sent


def target_weight(module):
    """A target's whole weight as the engines run it: W (gathered under FSDP2), or LoRA's merged one."""
    if hasattr(module, "base_layer"):
        return lora.merged_weight(module)
    return module.weight.full_tensor() if hasattr(module.weight, "full_tensor") else module.weight


def own_weight(module):
    """A target's own weight parameter: W, or the frozen W under LoRA's adapters."""
    return module.base_layer.weight if hasattr(module, "base_layer") else module.weight


def engine_rows(module):
    """(this rank's rows of a target as the engines run it, in bf16; their first row; the whole
    weight's shape): W's own shard, or the rows of LoRA's merged weight (formed whole: collective)."""
    weight = own_weight(module)
    rows, offset = rowadam.local_rows(weight)
    if hasattr(module, "base_layer"):
        rows = lora.merged_weight(module)[offset:offset + rows.shape[0]]
    return rows.detach().to(torch.bfloat16), offset, tuple(weight.shape)


def fingerprint(model, optimizer: str):
    """The trainer's fingerprint of what the engines should hold (sync.fingerprint)."""
    return sync.fingerprint(model, weight=lora.merged_weight if optimizer == "lora" else None)
