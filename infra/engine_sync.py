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
  (infra/sparse_delta.py; the dense weight where that is no larger).
- `full(...)`: full target weights: AdamW's and LoRA's sync, the paper's control for LoGRA
  (`--sync full`), and every start and resync.
Each is streamed one decoder layer per payload (`layer_groups`; LoGRA's factors, as many
layers as fit in FACTOR_PAYLOAD_BYTES), so neither side holds more than one layer's
targets beyond its state; under FSDP2 every rank takes part (row shards are
gathered for each payload only) and returns the bytes sent. `fingerprint` is the trainer's
fingerprint of what the engines should hold: W, or LoRA's merged weight.

The engine's outputs, not only its weights
------------------------------------------
Fingerprints compare the weights a sync wrote, not those the engine's kernels read: a payload
that reaches `.weight` but not vLLM's repacked CPU GEMMs, a compiled copy or a CUDA graph's
buffers leaves them agreeing while the engine samples from stale weights. `check_outputs`
(train.py's --check-outputs N: every N syncs; by default every sync on GPUs, none on CPUs) has
the engine sample up to 16 tokens for each of the first 4 held-out prompts and the trainer
score them: the mean |log-prob gap| per token must stay within OUTPUT_TOLERANCE, 0.2 nats.
That is twice the largest honest gap measured on CPUs (bf16 engine, fp32 trainer): at most
0.003 through vLLM's CPU build and 0.025 with the HF engine on the tiny presets, 0.107 over
SmolLM2-135M's rollouts through vLLM (529 updates, p99 0.076). A stale engine exceeds it once
its weights are some 0.05 nats of KL per token behind the trainer's (at SmolLM2's widths 0.13
at 0.024, 0.27 at 0.086), at the third update of the tests' tenfold steps (1.38 through vLLM
with stale kernels): it stops a run whose engine has drifted, not one small step hidden in
bf16's own gap. Its cost, in the sync's time: one generate of 4 short responses and one
forward of them (10-60 ms on the tiny presets). Tests: tests/test_train.py (a run bitwise
unchanged by it, a stale HF engine), tests/test_vllm_engine.py (through vLLM; stale CPU
kernels, slow tier).
"""

import math

import torch
import torch.distributed as dist

import ppo
import rowadam
import sketch
import sync
from infra import lora
from infra.checksum import checksum_rows, checksums
from infra.engine import EngineError, stable_seed
from infra.sparse_delta import changed_elements, gather_changes
from infra.wire import sparse_delta

FACTOR_PAYLOAD_BYTES = 32 * 2**20  # bf16 factors per payload at most (one decoder layer's if larger)


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
    layers per payload as fit in FACTOR_PAYLOAD_BYTES (one at the paper's scale): each
    layer's rows are gathered across ranks (row-sharded F) for its payload only. Returns the
    bytes sent."""
    by_name = {layer.name: (layer, f) for layer, f in zip(layers, merged)}
    sent = 0
    nbytes = lambda n: 2 * rank * by_name[n][0].module.weight.shape[0]  # noqa: E731  (bf16 F, all rows)
    for names in payload_groups(layer_groups(by_name), nbytes, FACTOR_PAYLOAD_BYTES):
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
    for names in layer_groups(modules):
        part = {}
        for n in names:
            rows, offset, shape = engine_rows(modules[n])  # (n, k) bf16
            changes = gather_changes(*changed_elements(shadow[n], rows, offset))  # (c,), (c,)
            shadow[n].copy_(rows)
            part[n] = sparse_delta(shape, *changes, base[n], whole=lambda n=n: target_weight(modules[n]))
            changed, total = changed + changes[0].numel(), total + shape[0] * shape[1]
        sent += engine.apply(sync.Payload(update, seed, rank, part, kind="sparse"))
    return sent, changed / total


def full(engine, modules: dict, *, update: int, seed: int, rank: int, dtype) -> int:
    """Full target weights to the engine, streamed one decoder layer per payload: the trainer
    gathers (FSDP2) one weight at a time and neither side holds more than one layer's targets
    beyond its state. Returns the bytes sent."""
    sent = 0
    for names in layer_groups(modules):
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
    return fingerprint_of(model, weight=lora.merged_weight if optimizer == "lora" else None)


def fingerprint_of(layers_or_model, dtype=torch.bfloat16, group=None, weight=None) -> dict:
    """sync.fingerprint's checksums of bf16(W) per target, from a model or from sketch.attach's layers.

    Under FSDP2 each trainer process sums its row shard (at its global row offset) and one
    all_reduce adds the shards, so every process returns the whole model's fingerprint.
    `weight(module)`: the whole weight the engines should hold instead (LoRA's merged one,
    formed on every process, one target at a time).
    """
    if isinstance(layers_or_model, torch.nn.Module):
        mods = sketch.target_modules(layers_or_model)
    else:
        mods = {l.name: l.module for l in layers_or_model}
    names = sorted(mods)
    if weight is not None:
        return dict(zip(names, checksums(weight(mods[n]).detach().to(dtype) for n in names)))
    device = rowadam.local_rows(mods[names[0]].weight)[0].device
    sums = torch.zeros(len(names), 2, dtype=torch.int64, device=device)  # on the device: NCCL reduces it
    for i, name in enumerate(names):
        rows, offset = rowadam.local_rows(mods[name].weight)
        sums[i] = checksum_rows(rows.detach().to(dtype), offset)
    if dist.is_available() and dist.is_initialized() and any(hasattr(mods[n].weight, "to_local") for n in names):
        dist.all_reduce(sums, group=group)
    return {n: tuple(s.tolist()) for n, s in zip(names, sums)}


def layer_groups(names) -> list[list[str]]:
    """Target names grouped by decoder layer (`model.layers.<i>.`), in layer order: the units
    of a streamed full sync, so that neither side holds more than one layer's targets."""
    groups = {}
    for name in names:
        parts = name.split(".")
        key = int(parts[parts.index("layers") + 1]) if "layers" in parts else -1
        groups.setdefault(key, []).append(name)
    return [groups[k] for k in sorted(groups)]


def payload_groups(groups: list[list[str]], nbytes, cap: int) -> list[list[str]]:
    """Consecutive `groups` (layer_groups') joined while their `nbytes(name)` add up to at most
    `cap`, at least one group each: a sync whose payloads are small (LoGRA's factors on a small
    model) goes in fewer round trips, and one at the paper's scale stays one layer a payload."""
    joined, size = [], cap + 1
    for names in groups:
        n = sum(nbytes(name) for name in names)
        if size + n > cap:
            joined.append([])
            size = 0
        joined[-1] += names
        size += n
    return joined


# -----------------------------------------------------------------------------
# The engine's outputs, not only its weights

OUTPUT_TOKENS = 16  # the longest response of the check
OUTPUT_TOLERANCE = 0.2  # nats: the mean gap a check allows (the module docstring: where it comes from)


class EngineOutputsDiffer(EngineError):
    """The engine's log-probs are not the trainer's, although their weights' fingerprints agree."""


def check_outputs(engine, model, prompts: list, *, after: int, seed: int, temperature: float, max_new_tokens: int,
                  device, tolerance: float = OUTPUT_TOLERANCE) -> float:
    """The engine's outputs after the sync of update `after`: it samples a response of at most
    OUTPUT_TOKENS (and `max_new_tokens`) to each of `prompts` through its ordinary `generate`,
    each from its own seed (from `seed`); the trainer scores the same tokens as the loss does;
    the mean |log-prob gap| over the responses' tokens must be within `tolerance` on every
    rank's engine, or every rank raises EngineOutputsDiffer naming the worst. Changes nothing:
    the engine samples every request from its own seed (vLLM's prefix cache is reset before
    each generate), the trainer's forward takes no gradient and draws nothing. Collective under
    FSDP2 (every rank's forward, one all_reduce). Returns the worst rank's mean gap."""
    seeds = [stable_seed("outputs", seed, i) for i in range(len(prompts))]
    rollout = engine.generate(prompts, seeds, temperature=temperature,
                              max_new_tokens=min(max_new_tokens, OUTPUT_TOKENS))
    ids, mask = rollout.ids.to(device), rollout.mask.to(device)  # (B, T)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits  # (B, T, V)
        logp = ppo.response_logprobs(logits, ids, temperature)  # (B, T)
    # gap_t = |log pi_engine(y_t) - log pi_trainer(y_t)| over the N response tokens of this rank's engine
    gap = (rollout.logprobs.to(device).double() - logp.double()).abs()[mask]  # (N,)
    # Each rank's sum, N and largest gap, in its own row; the check: sum / N <= tolerance for every rank
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    each = torch.zeros(world, 3, dtype=torch.float64, device=device)  # (world, 3)
    each[rank] = torch.stack([gap.sum(), gap.new_tensor(gap.numel()), gap.max()])
    if dist.is_initialized():
        dist.all_reduce(each)
    means = torch.nan_to_num(each[:, 0] / each[:, 1], nan=math.inf)  # (world,); a NaN gap fails too
    worst = int(means.argmax())
    mean, largest = means[worst].item(), each[worst, 2].item()
    if not mean <= tolerance:
        who = f"rank {worst}'s engine" if world > 1 else "the engine"
        error = EngineOutputsDiffer(
            f"after update {after} {who} samples tokens whose log-probs are {mean:.3g} nats from the trainer's on "
            f"average (at most {largest:.3g}; tolerance {tolerance:g}) while their weights' fingerprints agree: the "
            f"sync did not reach the weights its kernels read (a repacked or compiled copy, a CUDA graph's buffers), "
            f"or the policy is so peaked that bf16 moves it this much; --check-outputs 0 runs without this check")
        error.agreed = world > 1  # every rank raises it: one line per node
        raise error
    return mean
