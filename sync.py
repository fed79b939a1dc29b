"""
sync.py: seed-based weight sync from the trainer to the rollout engines.

What it is
----------
After update t is merged, the trainer sends each rollout engine, per target layer, only the
bf16 factor `F = alpha U` (d, r) that RowAdam merged, plus the update number. The engine
regenerates `A_t` from the seed rule of sketch.py and merges `W -= F @ A_t` itself, exactly
as the trainer did, so that its bf16 weights stay bf16 of the trainer's fp32 master. The
payload is `sum_layers d * r * 2` bytes, about r/k of a full bf16 weight sync.

Use
---
    import sketch
    import sync
    from rowadam import RowAdam, avoid_bf16_ties_
    engine = sync.EngineWeights(engine_model, base_seed=0, rank=8)  # a bf16 copy + an int16 residual per target
    layers = sketch.attach(model, rank=8, seed=0)                    # the trainer: S and A_0, weights frozen
    opt = RowAdam(layers)
    masters = {layer.name: avoid_bf16_ties_(layer.module.weight.data) for layer in layers}  # no bf16 ties
    engine.load_full(sync.full_payload(masters, update=0, base_seed=0, rank=8, dtype=torch.float32))
    loss_fn(model, ids).backward()                                   # into the sketches
    opt.prepare()
    factors = opt.merge(alpha)                                       # the trainer: W -= F A_0
    payload = sync.Payload(0, 0, 8, {l.name: f for l, f in zip(layers, factors)})
    engine.apply(sync.decode(sync.encode(payload)))                  # the engine: W -= F A_0, from the seed
    sync.check_fingerprints(sync.fingerprint(layers), engine.fingerprint())  # equal, or it raises

For a Hugging Face causal LM `model` with fp32 weights, `engine_model` a bf16 copy of it (an
engine's weights), a batch `ids`, a `loss_fn(model, ids)` and a step `alpha` (kl_control.py).
`encode` makes the one uint8 buffer that travels (any torch.distributed backend, vLLM's
NCCL channel: infra/vllm_channel.py); the engine checks and merges it, and its weights then
equal bf16 of the trainer's, which the fingerprints confirm after every sync.
tests/test_sync.py::test_the_use_block_runs runs this block on the tiny Qwen2.

The math
--------
The paper's method section on seed-based sync (arXiv:2610.06647) has the trainer send
`alpha eta U` and a seed for `A`, O(d r) values instead of a full (d, k) delta; `F` is that
`alpha eta U` in bf16 (rowadam.py's `U = c D` stands for the paper's `eta U`). At update t,
per target layer:

    F     = bf16(alpha U)                       (d, r), what the trainer merged and sends
    A_t   = sketch.make_projection(r, k, projection_seed(base_seed, t, name))   (r, k), on the engine's device
    W    <- W - F @ A_t                         the engine, in the trainer's row chunks
    bytes = sum_layers 2 d r  (+ a header)      against sum_layers 2 d k for bf16 weights

The engine's weight is bf16, and a relative step of 6e-5 is far below bf16's resolution
(~4e-3): a plain in-place bf16 `W -= F @ A` rounds almost every update away and the engine
drifts from the trainer (tests/test_sync.py shows it). So it keeps the master (departure 1):

    W     = bf16(W) + j ulp(W)                  j an int16 (no bf16 ties: rowadam.py)
    merge: W = join(bf16, j);  W -= F @ A_t;  bf16, j = split(W)    chunk by chunk

and both sides check each other with two integer checksums per target of the bf16 weights,

    fingerprint = ( sum_i x_i,  sum_i x_i (i mod 65521 + 1) )      x_i: the 16-bit words

which add up over row shards (FSDP2) and name the first layer that differs.

Pieces
------
- `Payload(update, base_seed, rank, factors)` and `encode`/`decode`: one flat uint8 buffer
  per update (a checked header, then the tensors), so it travels over any
  `torch.distributed` backend as one message. `full_payload` carries full weights instead
  (start-up, recovery, and train.py's `--sync full` control), in the same format.
- `EngineWeights(model, base_seed=..., rank=..., layout="hf" | "vllm", exact=True)`: the
  engine side: the model's bf16 weights and, to merge factors, an int16 residual per target
  weight (departure 1). With `exact=False` it keeps no residual and takes only sparse deltas
  and full weights. Payloads must arrive in order; a full sync may be streamed one decoder
  layer per payload (`layer_groups`). vLLM fuses q/k/v into `qkv_proj` (rows [q; k; v]) and
  gate/up into `gate_up_proj` (rows [gate; up]); the "vllm" layout applies each sub-layer's
  factor to its own row block (`engine_layers`: architectures.py's table).
- `fingerprint(...)` / `EngineWeights.fingerprint()` / `check_fingerprints(a, b)`.
- `Sparse`, `changed_elements`, `gather_changes`, `sparse_delta`, `encode_index`/`decode_index`:
  the exact sparse bf16 delta (`--sync delta`, any optimizer; departure 2): per target, the
  positions and new bf16 values of the elements whose bf16 value an update changed, the
  positions as a bitmap or as LEB128 gaps, whichever is smaller, or the whole bf16 weight
  where that is no larger (a delta never exceeds a full bf16 sync); it carries the checksum
  of the weights it applies to.
- `send`/`recv` over a `torch.distributed` group. The trainer's side of each sync (streamed
  per decoder layer, row shards gathered) is infra/engine_sync.py; the vLLM side (the worker
  extension that runs `EngineWeights` inside each vLLM worker, the weight channel) is
  infra/'s too. This file is pure torch, with sketch.py and rowadam.py.

Defaults
--------
Factors in bf16, as the engines merge them (fp32 would double the payload); one payload per
decoder layer for a full sync, so neither side holds more than one layer's targets beyond its
state; `CHECK_WORDS` bounds a checksum's int64 work, `CODE_CHUNK` a position code's; `FACTOR_PAYLOAD_BYTES`
joins decoder layers into one factor payload while they fit (`payload_groups`).

Shape legend: d out rows, k in columns, r rank.

Departures from the paper
-------------------------
1. The paper has the engine regenerate `A_t` and apply the same update to its weights, and
   does not say how an engine that holds bf16 weights keeps a step far below bf16's
   resolution. Here the engine carries the trainer's fp32 master as its bf16 weight plus an
   int16 residual (2 extra bytes per target weight, not the 4 of an fp32 copy: 12.2 GiB
   instead of 24.3 at 7B, so that it fits beside vLLM's weights and KV cache), and merges
   into that master, so its weight is bf16(trainer master) after every update where a plain
   bf16 merge drifts. fp32 = bf16(fp32) + j fp32 ulps with j in [-32768, 32768]; only the
   value +32768 (a bf16 tie rounded down) does not fit an int16, and the trainer's merge
   never leaves a tie (rowadam.py departure 2), nor does the trainer's start-up sync
   (train.py applies `rowadam.avoid_bf16_ties_` first). An fp32 payload with a tie is
   refused. Tests: tests/test_sync.py, test_200_payloads_track_the_trainer_in_both_layouts
   (the plain bf16 engine drifts) and test_compact_state_is_the_masters_bits_over_1000_updates.

2. Not in the paper: the sparse delta (`kind="sparse"`), the sync that RL trainers without
   factors use (PULSE, arXiv:2602.03839: most bf16 weights do not change in one RL step). It
   is exact, since it sends what changed after the bf16 cast, needs no master on the engine
   and works for AdamW and LoRA too; its cost moves to the trainer, which keeps a bf16 copy
   of its rows of what the engines hold to find the changes (infra/engine_sync.py's `delta`). Whether
   it is smaller than the factors depends on the share of elements that change, which the
   step sets (bench/README.md, `syncs`). A delta made for other weights than
   the engine holds is refused by its base checksum, also when its update number fits (the
   trainer skipped sending one). A target whose changes would cost as many bytes as its bf16
   weight or more (LoRA's first merge) goes whole, so a delta never sends more than a full
   bf16 sync. Tests: tests/test_sync.py,
   test_sparse_deltas_keep_engines_without_a_master_equal_to_the_trainer,
   test_a_delta_never_sends_more_than_the_full_weight and
   test_bad_sparse_deltas_are_refused_and_change_nothing.

Implementation notes
--------------------
- Each layer in a payload carries two integer checksums of its bytes, so a corrupted buffer
  is refused before anything is merged (tests/test_sync.py,
  test_bad_payloads_are_rejected_and_change_nothing). The checksums of a payload's tensors,
  and of a fingerprint's, are read from the device once for all of them (`checksums`).
- A payload's header records the projection rule its factors were merged with
  (`Payload.projection`, sketch.PROJECTION; a header without one is projection 1, the CPU
  generator's draw of earlier releases). An engine merges factors only of its own rule: A
  would differ and the engine would silently drift, so factors of another are refused before
  anything changes; full weights and sparse deltas do not depend on A and load either way
  (tests/test_sync.py, test_bad_payloads_are_rejected_and_change_nothing).
- The engine makes A_update's signs for every target of a payload at once on its weights'
  device (sketch.make_signs_many) and merges the targets of one shape together where they fit
  rowadam.MERGE_ELEMENTS (rowadam.merge_layers, the trainer's bits), a larger target in row
  chunks; it reads the device once per payload (its finiteness check), not once per target.
- vLLM tensor parallelism inside an engine is not supported (Table 1's setup runs one vLLM
  engine per GPU); a sharded vLLM layer raises (test_a_tensor_parallel_vllm_layer_is_refused).
"""

import json
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rowadam import local_rows, merge_rows, rows_per_chunk
from sketch import PROJECTION, TARGETS, clean_name, make_signs, projection_from_signs, projection_seed, target_modules

MAGIC = b"LOGRASYN"
VERSION = 1
ALIGN = 16
CHECK_MOD = 65521  # positional weights of the checksum cycle through 1..65521
CHECK_WORDS = 2**20  # 16-bit words per checksum block (about 32 MiB of int64 work at most)
FACTOR_PAYLOAD_BYTES = 32 * 2**20  # bf16 factors per payload at most (one decoder layer's if larger)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# vLLM's target layers and the trainer's layers each holds, in row order (Qwen2, Llama, ...;
# architectures.py has one such map per model family and passes it as `engine_layers`).
VLLM_LAYERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


# -----------------------------------------------------------------------------
# The payload and its flat buffer

@dataclass
class Payload:
    """Per target (clean HF name) the bf16 factor F (d, r) merged by update `update`.

    kind="full": `factors` holds full weights (d, k) instead, and `update` is the number of
    updates they contain (the next delta the engine accepts).
    kind="sparse": `factors` holds a `Sparse` per target instead: the bf16 elements that
    update `update` changed (`changed_elements`), for engines that keep no fp32 master.
    """

    update: int
    base_seed: int
    rank: int
    factors: dict = field(default_factory=dict)
    kind: str = "delta"
    projection: int = PROJECTION  # the rule that made A (sketch.PROJECTION); decoded: 1 where the header has none


@dataclass
class Sparse:
    """The elements of one bf16 target weight (d, k) that an update changed: flat row-major
    `positions` (int64 (n,), increasing) and their new bf16 `values` (n,). `base`: the
    checksum (`checksum`) of the weight they apply to, which the engine checks first.
    `positions=None`: the dense form, every element in row-major order (`values` (d k,)),
    which `sparse_delta` sends where the changed elements would cost as many bytes or more."""

    shape: tuple
    positions: torch.Tensor | None
    values: torch.Tensor
    base: tuple


def changed_elements(before: torch.Tensor, after: torch.Tensor, row_offset: int = 0):
    """(positions, values) of the elements of bf16 `after` (c, k) whose bits differ from bf16
    `before` (c, k), rows `row_offset`.. of the whole weight: positions are flat row-major
    indices into the whole (d, k) weight, so that row shards' changes concatenate in row order."""
    if before.shape != after.shape or before.dtype != torch.bfloat16 or after.dtype != torch.bfloat16:
        raise ValueError(f"changed_elements compares two bf16 tensors of one shape, got {before.dtype} "
                         f"{tuple(before.shape)} and {after.dtype} {tuple(after.shape)}")
    changed = before.contiguous().view(torch.int16) != after.contiguous().view(torch.int16)  # (c, k) bits differ
    local = changed.flatten().nonzero().squeeze(1)  # (n,) row-major within the rows
    return local + row_offset * after.shape[1], after.flatten()[local]


def sparse_delta(shape, positions: torch.Tensor, values: torch.Tensor, base, whole) -> Sparse:
    """One target's delta as it goes on the wire: its changed elements (`positions`, `values`:
    every rank's, `gather_changes`), or the dense form, the whole bf16 weight `whole()` (d, k),
    where the changed elements' blob (position code and values) would take as many bytes as
    the dense blob or more: a delta never sends more than a full bf16 sync of the same weight
    (its header aside). `whole` is called only then; on row shards it gathers the weight, and
    every rank calls it, since every rank holds the same gathered positions."""
    numel = shape[0] * shape[1]
    if _aligned(_code_bytes(positions, numel)) + _aligned(2 * positions.numel()) >= _aligned(2 * numel):
        return Sparse(tuple(shape), None, whole().detach().to(torch.bfloat16).flatten(), base)  # (d k,)
    return Sparse(tuple(shape), positions, values, base)


def gather_changes(positions: torch.Tensor, values: torch.Tensor, group=None):
    """Every process's `changed_elements` of one weight, in rank order (row shards in row order,
    so positions stay increasing): one all_gather of the counts, one each of the padded positions
    and values. Without a process group (or a group of one): the arguments."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return positions, values
    world = dist.get_world_size(group)
    count = torch.tensor([positions.numel()], dtype=torch.int64, device=positions.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    counts = torch.cat(counts).tolist()
    most = max(counts)
    if most == 0:  # nothing changed on any rank (every rank sees the same counts)
        return positions, values
    pos = torch.zeros(most, dtype=torch.int64, device=positions.device)
    val = torch.zeros(most, dtype=torch.bfloat16, device=values.device)
    pos[:positions.numel()], val[:values.numel()] = positions, values
    all_pos = [torch.empty_like(pos) for _ in range(world)]
    all_val = [torch.empty_like(val) for _ in range(world)]
    dist.all_gather(all_pos, pos, group=group)
    dist.all_gather(all_val, val, group=group)
    return (torch.cat([p[:n] for p, n in zip(all_pos, counts)]),
            torch.cat([v[:n] for v, n in zip(all_val, counts)]))


# The positions of a sparse delta on the wire, per weight the smaller of two codes:
#   bitmap  one bit per element (element 8 j + i is bit i of byte j): d k / 8 bytes
#   gaps    each position's distance to the previous one minus 1 (the first's to -1), an
#           unsigned LEB128 varint: 7 bits a byte, low bits first, the high bit set on every
#           byte but a value's last: 1 byte below 128, 2 below 16384, ...
# At the few percent of elements an RL step changes, gaps are mostly one byte each. Where the
# code and the changed values would take as many bytes as the whole bf16 weight or more (LoRA's
# first merge changes every element), `sparse_delta` sends the weight itself ("dense"). Both codes
# are made and read CODE_CHUNK positions (or bytes) at a time, so that their int64 work stays
# bounded (at most 80 bytes for each of CODE_CHUNK bytes: infra/memory_plan.py counts it)
# beside the int64 positions themselves.
BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)  # bit i of a bitmap byte: 2^i
CODE_CHUNK = 2**20


def _gaps(positions: torch.Tensor):
    """CODE_CHUNK-position chunks of the gaps code's values (each position's distance to the
    previous one minus 1, the first's to -1): int64, all >= 0 for increasing positions >= 0."""
    for c in range(0, positions.numel(), CODE_CHUNK):
        p = positions[c:c + CODE_CHUNK].to(torch.int64)
        before = positions[c - 1:c].to(torch.int64) if c else p.new_full((1,), -1)
        yield torch.diff(p, prepend=before) - 1  # (c,)


def _varint_sizes(gaps: torch.Tensor) -> torch.Tensor:
    """The bytes of each gap's LEB128 varint (1 to 9 for gaps below 2^63)."""
    sizes = torch.ones_like(gaps)  # (c,)
    for b in range(1, 9):
        sizes += gaps >= 128 ** b
    return sizes


def _aligned(nbytes: int) -> int:
    return nbytes + -nbytes % ALIGN


def _gap_bytes(positions: torch.Tensor, numel: int) -> int:
    """The bytes of the gaps code of increasing positions in [0, numel) (raises otherwise)."""
    gap_bytes = 0
    for gaps in _gaps(positions):
        if int(gaps.min()) < 0:
            raise ValueError("a sparse delta's positions must be increasing and >= 0")
        gap_bytes += int(_varint_sizes(gaps).sum())
    if positions.numel() and int(positions[-1]) >= numel:
        raise ValueError(f"a position {int(positions[-1])} outside the weight's {numel} elements")
    return gap_bytes


def _code_bytes(positions: torch.Tensor, numel: int) -> int:
    """The bytes of the smaller position code (encode_index's)."""
    return min(_gap_bytes(positions, numel), -(-numel // 8))


def encode_index(positions: torch.Tensor, numel: int) -> tuple[str, torch.Tensor]:
    """("bitmap" | "gaps", uint8 bytes) of increasing positions in [0, numel): the smaller code,
    the gaps on a tie. Two passes over the positions (the gaps' sizes, then the chosen code),
    so that nothing but the code itself grows with the number of positions."""
    device, n, bitmap_bytes = positions.device, positions.numel(), -(-numel // 8)
    gap_bytes = _gap_bytes(positions, numel)
    if gap_bytes > bitmap_bytes:  # the bitmap: bit p % 8 of byte p // 8, distinct bits added
        code = torch.zeros(bitmap_bytes, dtype=torch.uint8, device=device)
        bits = BITS.to(device)
        for c in range(0, n, CODE_CHUNK):
            p = positions[c:c + CODE_CHUNK].to(torch.int64)  # (c,)
            code.index_add_(0, p >> 3, bits[p & 7])
        return "bitmap", code
    code, at = torch.empty(gap_bytes, dtype=torch.uint8, device=device), 0
    for gaps in _gaps(positions):
        sizes = _varint_sizes(gaps)
        starts = torch.cumsum(sizes, 0) - sizes + at  # (c,) the first byte of each varint
        for j in range(int(sizes.max())):
            has = sizes > j  # varints with a j-th byte
            more = (sizes[has] > j + 1).to(torch.int64) << 7  # the continuation bit
            code[starts[has] + j] = (((gaps[has] >> (7 * j)) & 0x7F) | more).to(torch.uint8)
        at += int(sizes.sum())
    return "gaps", code


def decode_index(encoding: str, data: torch.Tensor, count: int, numel: int) -> torch.Tensor:
    """The increasing int64 positions (count,) of `encode_index`'s bytes; raises on a code that
    is malformed, holds another number of positions, or points outside [0, numel). Read
    CODE_CHUNK bytes at a time (whole varints for the gaps)."""
    positions = torch.empty(count, dtype=torch.int64, device=data.device)
    found = 0
    if encoding == "bitmap":
        if data.numel() != -(-numel // 8):
            raise ValueError(f"a bitmap of {numel} elements has {-(-numel // 8)} bytes, got {data.numel()}")
        bits = BITS.to(data.device)
        for lo in range(0, data.numel(), CODE_CHUNK):
            p = ((data[lo:lo + CODE_CHUNK, None] & bits) != 0).flatten().nonzero().squeeze(1)  # (c,)
            p += 8 * lo
            if found + p.numel() > count:
                raise ValueError(f"the position code holds more than the {count} positions the header says")
            positions[found:found + p.numel()] = p
            found += p.numel()
    elif encoding == "gaps":
        last = (data & 0x80) == 0  # (m,) the last byte of each varint
        if data.numel() and not bool(last[-1]):
            raise ValueError("the position code ends inside a varint (truncated)")
        ends = last.nonzero().squeeze(1)  # (n,) where each varint ends
        found, previous, lo = ends.numel(), -1, 0
        if found != count:
            raise ValueError(f"the position code holds {found} positions, the header says {count}")
        c = 0
        while c < count:  # the varints that end within the next CODE_CHUNK bytes (at least one)
            stop = max(c + 1, int(torch.searchsorted(ends, lo + CODE_CHUNK)))
            e = ends[c:stop]  # (v,)
            hi = int(e[-1]) + 1
            u, l = data[lo:hi].to(torch.int64), last[lo:hi]  # (b,)
            value = torch.cumsum(l, 0) - l.to(torch.int64)  # (b,) which varint of the chunk each byte is in
            starts = torch.cat([e.new_zeros(1), e[:-1] + 1 - lo])  # (v,)
            j = torch.arange(hi - lo, device=u.device) - starts[value]  # (b,) the byte's place in its varint
            if int(j.max()) > 8:
                raise ValueError("a position gap of more than 9 bytes")
            gaps = torch.zeros(e.numel(), dtype=torch.int64, device=u.device)
            gaps.scatter_add_(0, value, (u & 0x7F) << (7 * j))
            if int(gaps.max()) >= numel:  # also keeps the sum below from overflowing
                raise ValueError(f"a position gap {int(gaps.max())} beyond the weight's {numel} elements")
            positions[c:stop] = torch.cumsum(gaps + 1, 0) + previous  # position = previous + gap + 1
            previous = int(positions[stop - 1])
            if previous >= numel:
                raise ValueError(f"a position {previous} outside the weight's {numel} elements")
            c, lo = stop, hi
    else:
        raise ValueError(f"unknown position code {encoding!r}")
    if found != count:
        raise ValueError(f"the position code holds {found} positions, the header says {count}")
    if count and not 0 <= int(positions[-1]) < numel:
        raise ValueError(f"a position {int(positions[-1])} outside the weight's {numel} elements")
    return positions


def full_payload(weights: dict, *, update: int, base_seed: int, rank: int, dtype=torch.bfloat16) -> Payload:
    """A full-weight payload from {clean name: (d, k) weight}. Send fp32 for an exact resync."""
    return Payload(update, base_seed, rank, {n: w.detach().to(dtype) for n, w in weights.items()}, kind="full")


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


def checksum(t: torch.Tensor) -> tuple[int, int]:
    """(sum of x, sum of x * (i mod 65521 + 1)) over the raw 16-bit words x of `t`, in int64.

    Rows are processed in chunks; both sums add up over row blocks, so the checksum of a
    row-sharded weight is the sum of its shards' (with their global row offset).
    """
    return tuple(checksum_tensor(t).tolist())


def checksum_tensor(t: torch.Tensor) -> torch.Tensor:
    """`checksum` as an int64 (2,) tensor on `t`'s device, not read to the host: the checksums
    of many tensors are read at once (`checksums`)."""
    if t.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=t.device)
    return _checksum_rows(t.detach().reshape(t.shape[0], -1) if t.dim() else t.reshape(1, 1), 0)


def checksums(tensors) -> list[tuple[int, int]]:
    """`checksum` of each tensor, with one host read for all of them (one per device)."""
    sums = [checksum_tensor(t) for t in tensors]  # (2,) each
    if not sums:
        return []
    read = torch.stack(sums).tolist() if len({s.device for s in sums}) == 1 else [s.tolist() for s in sums]
    return [tuple(pair) for pair in read]


def _checksum_rows(rows: torch.Tensor, row_offset: int) -> torch.Tensor:
    # Word i's weight is (i mod M) + 1, so s2 = sum_j (j + 1) c_j with c_j the sum of the words
    # whose global position is j mod M: the words viewed as rows of M, summed down the columns
    # (one pass, no per-word index), with the part before the first whole row and after the
    # last added on their own. Integer sums: the same value in any order, on any machine.
    words = rows.contiguous().view(torch.int16).reshape(-1)  # raw 16-bit words, flat
    first = (row_offset * (words.numel() // max(rows.shape[0], 1))) % CHECK_MOD  # residue of word 0
    cols = torch.zeros(CHECK_MOD, dtype=torch.int64, device=rows.device)
    head = min(words.numel(), (CHECK_MOD - first) % CHECK_MOD)  # words before residue 0
    cols[first:first + head] += words[:head]
    body = words[head:]
    whole = body.numel() // CHECK_MOD
    step = max(1, CHECK_WORDS // CHECK_MOD)  # rows of M words per block: CHECK_WORDS bounds the int64 work
    for start in range(0, whole, step):
        stop = min(start + step, whole)
        cols += body[start * CHECK_MOD:stop * CHECK_MOD].view(-1, CHECK_MOD).sum(0, dtype=torch.int64)
    tail = body[whole * CHECK_MOD:]
    cols[:tail.numel()] += tail
    s1 = cols.sum()
    s2 = cols.mul_(torch.arange(1, CHECK_MOD + 1, device=rows.device, dtype=torch.int64)).sum()
    return torch.stack([s1, s2])  # (2,) int64, on the rows' device


def encode(payload: Payload) -> torch.Tensor:
    """One flat uint8 buffer: magic, header length, JSON header, aligned tensor bytes."""
    entries, blobs, offset = [], [], 0
    for name, t in payload.factors.items():
        if isinstance(t, Sparse) != (payload.kind == "sparse"):
            raise ValueError(f"{name}: a {payload.kind} payload holds "
                             f"{'Sparse deltas' if payload.kind == 'sparse' else 'tensors'}, got {type(t).__name__}")
        if isinstance(t, Sparse):  # the position code, aligned, then the values: one blob
            entry, blob = _sparse_blob(name, t)
            entries.append({**entry, "offset": offset})
            blobs.append(blob)
            offset += blob.numel()
            continue
        dtype = next((k for k, v in DTYPES.items() if v == t.dtype), None)
        if dtype is None or t.dim() != 2:
            raise ValueError(f"{name}: factors must be 2-D {list(DTYPES)} tensors, got {t.dtype} {tuple(t.shape)}")
        raw = t.detach().contiguous().flatten().view(torch.uint8)
        entries.append({"name": name, "shape": list(t.shape), "dtype": dtype, "offset": offset,
                        "nbytes": raw.numel(), "check": t})  # the tensor until its checksum is read, below
        blobs.append(raw)
        pad = -raw.numel() % ALIGN
        if pad:
            blobs.append(torch.zeros(pad, dtype=torch.uint8, device=raw.device))
        offset += raw.numel() + pad
    dense = [e for e in entries if isinstance(e["check"], torch.Tensor)]
    for e, pair in zip(dense, checksums([e["check"] for e in dense])):  # one host read for the payload
        e["check"] = list(pair)
    header = json.dumps({"version": VERSION, "kind": payload.kind, "update": int(payload.update),
                         "base_seed": int(payload.base_seed), "rank": int(payload.rank),
                         "projection": int(payload.projection),
                         "layers": entries, "data_bytes": offset}).encode()
    header += b" " * (-(len(MAGIC) + 8 + len(header)) % ALIGN)
    device = blobs[0].device if blobs else "cpu"
    prefix = torch.frombuffer(bytearray(MAGIC + len(header).to_bytes(8, "little") + header), dtype=torch.uint8)
    return torch.cat([prefix.to(device)] + blobs)


def _sparse_blob(name: str, t: Sparse):
    """A `Sparse` as its header entry and its bytes: the position code padded to ALIGN, then the
    bf16 values padded to ALIGN; the checksum covers both."""
    d, k = t.shape
    dense = t.positions is None  # every element, in row-major order: no position code
    want = (d * k,) if dense else tuple(t.positions.shape)
    if t.values.dtype != torch.bfloat16 or t.values.dim() != 1 or tuple(t.values.shape) != want:
        raise ValueError(f"{name}: a sparse delta holds (n,) positions and (n,) bf16 values, or (d k,) bf16 values "
                         f"and no positions, got {None if dense else tuple(t.positions.shape)} and {t.values.dtype} "
                         f"{tuple(t.values.shape)}")
    if dense:
        encoding, index = "dense", torch.empty(0, dtype=torch.uint8, device=t.values.device)
    else:
        encoding, index = encode_index(t.positions, d * k)
    values = t.values.contiguous().view(torch.uint8)  # (2 n,)
    blob = torch.cat([index, index.new_zeros(-index.numel() % ALIGN), values.to(index.device),
                      index.new_zeros(-values.numel() % ALIGN)])
    entry = {"name": name, "shape": [d, k], "encoding": encoding, "count": t.values.numel(),
             "index_bytes": index.numel(), "nbytes": blob.numel(), "check": list(checksum(blob.view(-1, ALIGN) if blob.numel() else blob)),
             "base": [int(b) for b in t.base]}
    return entry, blob


def _sparse_entry(e: dict, data: torch.Tensor, expect: int, data_bytes: int) -> Sparse:
    """The `Sparse` of a header entry from `_sparse_blob`, every size and the checksum checked."""
    shape, count, index_bytes = e.get("shape"), e.get("count"), e.get("index_bytes")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(s, int) and s > 0 for s in shape)
            and isinstance(count, int) and 0 <= count <= shape[0] * shape[1] and isinstance(index_bytes, int)
            and index_bytes >= 0 and isinstance(e.get("base"), list) and len(e["base"]) == 2
            and all(isinstance(e.get(k), int) for k in ("offset", "nbytes")) and isinstance(e.get("name"), str)
            and e.get("encoding") in ("bitmap", "gaps", "dense") and isinstance(e.get("check"), list)
            and (e.get("encoding") != "dense" or (count == shape[0] * shape[1] and index_bytes == 0))):
        raise ValueError(f"malformed sparse layer entry {e}")
    values_at = index_bytes + (-index_bytes % ALIGN)
    nbytes = values_at + 2 * count + (-2 * count % ALIGN)
    if e["offset"] != expect or e["nbytes"] != nbytes or e["offset"] + nbytes > data_bytes:
        raise ValueError(f"{e['name']}: offset/size {e['offset']}/{e['nbytes']} inconsistent with {count} "
                         f"values and {index_bytes} bytes of positions")
    blob = data[e["offset"]:e["offset"] + nbytes]
    if list(checksum(blob.view(-1, ALIGN) if nbytes else blob)) != e["check"]:
        raise ValueError(f"{e['name']}: checksum mismatch, the payload is corrupted")
    positions = None if e["encoding"] == "dense" else \
        decode_index(e["encoding"], blob[:index_bytes], count, shape[0] * shape[1])
    values = blob[values_at:values_at + 2 * count].view(torch.bfloat16)
    return Sparse(tuple(shape), positions, values, tuple(e["base"]))


def decode(buffer: torch.Tensor) -> Payload:
    """Parse and check a buffer from `encode`; the factors are views into `buffer`."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError("a payload is a 1-D uint8 tensor")
    n = buffer.numel()
    if n < len(MAGIC) + 8 or bytes(buffer[:len(MAGIC)].cpu().tolist()) != MAGIC:
        raise ValueError("not a LoGRA payload (bad magic)")
    hlen = int.from_bytes(bytes(buffer[len(MAGIC):len(MAGIC) + 8].cpu().tolist()), "little")
    start = len(MAGIC) + 8 + hlen
    if start > n:
        raise ValueError(f"truncated payload: header claims {hlen} bytes, buffer has {n}")
    try:
        head = json.loads(bytes(buffer[len(MAGIC) + 8:start].cpu().tolist()))
        if head["version"] != VERSION or head["kind"] not in ("delta", "full", "sparse"):
            raise ValueError(f"unsupported payload version/kind {head['version']}/{head['kind']}")
        layers = head["layers"]
        update, base_seed, rank, data_bytes = (int(head[k]) for k in ("update", "base_seed", "rank", "data_bytes"))
        projection = int(head.get("projection", 1))  # a payload of a release before the versions: the CPU draw
    except (KeyError, TypeError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"malformed payload header: {e}") from None
    if start + data_bytes != n:
        raise ValueError(f"payload size mismatch: header says {start + data_bytes} bytes, got {n} (truncated?)")
    data = buffer[start:]
    factors, expect = {}, 0
    for e in layers:
        if head["kind"] == "sparse":
            if e.get("name") in factors:
                raise ValueError(f"duplicate layer {e.get('name')} in payload")
            factors[e["name"]] = _sparse_entry(e, data, expect, data_bytes)
            expect = e["offset"] + e["nbytes"]
            continue
        dtype = DTYPES.get(e.get("dtype"))
        shape = e.get("shape")
        if dtype is None or not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(s, int) and s > 0 for s in shape)):
            raise ValueError(f"malformed layer entry {e}")
        nbytes = shape[0] * shape[1] * dtype.itemsize
        if e["offset"] != expect or e["nbytes"] != nbytes or e["offset"] + nbytes > data_bytes:
            raise ValueError(f"{e['name']}: offset/size {e['offset']}/{e['nbytes']} inconsistent with {shape} {dtype}")
        t = data[e["offset"]:e["offset"] + nbytes].view(dtype).view(shape)
        if e["name"] in factors:
            raise ValueError(f"duplicate layer {e['name']} in payload")
        factors[e["name"]] = t
        expect = e["offset"] + nbytes + (-nbytes % ALIGN)
    if head["kind"] != "sparse":  # every tensor's checksum against its entry's: one host read for all
        for e, pair in zip(layers, checksums(factors.values())):
            if list(pair) != e["check"]:
                raise ValueError(f"{e['name']}: checksum mismatch, the payload is corrupted")
    return Payload(update, base_seed, rank, factors, kind=head["kind"], projection=projection)


# -----------------------------------------------------------------------------
# Engine-side weights

@dataclass
class _Slot:
    name: str  # clean HF name of the sub-layer, e.g. model.layers.0.self_attn.k_proj
    param: torch.nn.Parameter  # the model's bf16 weight (maybe fused)
    row: int  # first row of this sub-layer inside `param`
    rows: int  # d
    residual: torch.Tensor  # int16 (d, k): fp32 master = bf16 weight + residual fp32 ulps; None: no master

    @property
    def weight(self) -> torch.Tensor:
        return self.param.detach()[self.row:self.row + self.rows]  # (d, k) bf16 view


def join_master(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """fp32 master (c, k) from its bf16 rounding `hi` and int16 residual `lo` (in fp32 ulps).

    fp32 bit patterns of one sign are ordered like integers, so the residual is a plain
    integer difference of raw words, also across binade boundaries.
    """
    return hi.to(torch.float32).view(torch.int32).add_(lo.to(hi.device)).view(torch.float32)


def split_master(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16(w), int16 residual) of an fp32 tensor without bf16 ties (rowadam.avoid_bf16_ties_)."""
    hi = w.to(torch.bfloat16)  # round to nearest even
    lo = w.view(torch.int32) - hi.to(torch.float32).view(torch.int32)  # in [-32767, 32767]
    return hi, lo.to(torch.int16)


def store_master(master: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> None:
    """Write an fp32 master (c, k) as its bf16 `weight` and int16 `residual` in place, a value
    on a bf16 tie first moved one ulp toward zero (rowadam.avoid_bf16_ties_, the same rule), so
    that weight + residual is exactly the tie-free master. `master` is consumed.

    In integer arithmetic on the fp32 words, which for either sign round the magnitude:
    hi = (bits + 0x7FFF) with the low 16 bits cleared is the nearest bf16, a tie toward zero;
    bits - hi lies in [-32767, 32768], and 32768 (a tie) becomes 32767: the ulp moved.
    Six passes over the chunk where the tie rule, a rounding and a subtraction took ten.
    """
    bits = master.view(torch.int32)
    hi = bits.add(0x7FFF).bitwise_and_(-0x10000)  # bf16 values as fp32 words
    weight.copy_(hi.view(torch.float32))  # exact: every value is a bf16
    residual.copy_(bits.sub_(hi).clamp_max_(0x7FFF))  # int32 -> int16, in range


def bf16_ties(w: torch.Tensor) -> int:
    """How many fp32 values lie exactly halfway between two bf16 values (not representable)."""
    return int(((w.contiguous().view(torch.int32) & 0xFFFF) == 0x8000).sum())


def _target_blocks(model, layout, engine_layers=None):
    """[(clean sub-layer name, parameter, first row, rows)] of every target in `model`.
    `engine_layers` (layout "vllm"): vLLM's layer names and the trainer layers each holds, in
    row order (default VLLM_LAYERS); a layer holding one target is taken whole."""
    engine_layers = VLLM_LAYERS if engine_layers is None else engine_layers
    blocks = []
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        prefix = clean_name(name)[: -len(last)]
        if layout == "hf" and last in TARGETS:
            blocks.append((prefix + last, module.weight, 0, module.weight.shape[0]))
        elif layout == "vllm" and last in engine_layers:
            if getattr(module, "tp_size", 1) != 1:
                raise NotImplementedError(f"{name}: tensor-parallel vLLM layers are not supported: run one "
                                          f"engine per GPU, as the paper does")
            parts = tuple(engine_layers[last])
            sizes = list(getattr(module, "output_sizes", [module.weight.shape[0]])) if len(parts) > 1 \
                else [module.weight.shape[0]]  # one target: the whole layer (Phi-3's fused qkv_proj)
            if len(sizes) != len(parts) or sum(sizes) != module.weight.shape[0]:
                raise ValueError(f"{name}: output_sizes {sizes} do not split {module.weight.shape[0]} rows into {parts}")
            row = 0
            for part, size in zip(parts, sizes):
                blocks.append((prefix + part, module.weight, row, size))
                row += size
    if layout not in ("hf", "vllm"):
        raise ValueError(f"layout must be 'hf' or 'vllm', got {layout!r}")
    if not blocks:
        raise ValueError(f"no target layers found in {type(model).__name__} for layout {layout!r}")
    return blocks


class EngineWeights:
    """The rollout engine's target weights: vLLM's (or the HF model's) bf16 weight, plus an
    int16 residual that makes it the trainer's exact fp32 master (departure 1).

    `exact=False`: no residual, and so no master: the engine takes sparse deltas (the bf16
    elements an update changed, written as they are) and full payloads (fp32 ones rounded to
    bf16), and refuses factors, which it could not merge exactly. `residual_device`: where the
    residuals live (default: beside the weights; "cpu" puts them in pinned host memory, merged
    chunk by chunk, for models whose residual does not fit on the engine's GPU beside its
    weights and KV cache). A full sync may arrive in parts (one decoder layer per payload);
    deltas are refused until every layer has been received.
    """

    def __init__(self, model, *, base_seed, rank, layout="hf", update=0, residual_device=None, engine_layers=None,
                 exact=True):
        self.base_seed, self.rank, self.update, self.exact = base_seed, rank, update, exact
        self.slots = {}
        self._loading = {}  # name -> update of a full sync that has not reached every layer yet
        self._merged = set()  # layers that merged the current update's delta (a streamed update)
        for name, param, row, rows in _target_blocks(model, layout, engine_layers):
            if rank > param.shape[1]:
                raise ValueError(f"{name}: rank {rank} exceeds in_features {param.shape[1]}")
            if param.dtype != torch.bfloat16:
                raise TypeError(f"{name}: engine weights must be bf16, got {param.dtype}")
            device = torch.device(residual_device) if residual_device is not None else param.device
            pin = device.type == "cpu" and param.device.type == "cuda"
            residual = torch.zeros(rows, param.shape[1], dtype=torch.int16, device=device,
                                   pin_memory=pin) if exact else None  # (d, k): the weights start as their own masters
            self.slots[name] = _Slot(name, param, row, rows, residual)

    def state_bytes(self) -> int:
        """Bytes this object adds to the engine (the residuals), wherever they live."""
        return sum(s.residual.numel() * s.residual.element_size() for s in self.slots.values() if self.exact)

    def master(self, name: str) -> torch.Tensor:
        """The fp32 master of one target (d, k), rebuilt (for checks; the merges work in chunks)."""
        slot = self.slots[name]
        if not self.exact:
            return slot.weight.float()  # the engine keeps no master: its bf16 weight
        return join_master(slot.weight, slot.residual)

    def _check(self, payload, kind):
        if payload.kind != kind:
            raise ValueError(f"expected a {kind} payload, got {payload.kind}")
        if kind == "delta" and not self.exact:
            raise ValueError("this engine keeps no fp32 master (exact=False): it takes sparse deltas and full "
                             "weights, not factors, which it could not merge exactly")
        if kind == "sparse" and self.exact:
            raise ValueError("this engine merges factors into its exact masters (exact=True): a sparse delta "
                             "would leave its residuals behind")
        if payload.base_seed != self.base_seed or payload.rank != self.rank:
            raise ValueError(f"payload has seed {payload.base_seed}, rank {payload.rank}; engine expects "
                             f"seed {self.base_seed}, rank {self.rank}")
        if kind == "delta" and payload.projection != PROJECTION:
            raise ValueError(f"the factors of update {payload.update} were merged with projection {payload.projection} "
                             f"and this engine makes A by projection {PROJECTION} (sketch.PROJECTION): the trainer and "
                             f"its engines must run one release of LoGRA; nothing was merged")
        unknown = sorted(set(payload.factors) - set(self.slots))[:3]
        if unknown or not payload.factors:
            raise ValueError(f"payload layers differ from the engine's: unknown {unknown}, "
                             f"{len(payload.factors)} layers")
        again = sorted(set(payload.factors) & self._merged)[:3] if kind != "full" else []
        if again:
            raise ValueError(f"payload for update {payload.update} already merged (duplicate) for {again}")
        for name, t in payload.factors.items():
            slot = self.slots[name]
            want = (slot.rows, self.rank) if kind == "delta" else tuple(slot.weight.shape)
            if tuple(t.shape) != want:
                raise ValueError(f"{name}: tensor shape {tuple(t.shape)}, expected {want}")
        # Every layer's values finite: one host read for the whole payload, not one per layer
        finite = torch.stack([torch.isfinite(t.values if kind == "sparse" else t).all()
                              for t in payload.factors.values()])  # (layers,)
        if not bool(finite.all()):
            name = list(payload.factors)[int(finite.to(torch.int8).argmin())]
            raise ValueError(f"{name}: non-finite values in the payload")
        for name, t in payload.factors.items():
            slot = self.slots[name]
            if kind == "sparse" and checksum(slot.weight) != tuple(t.base):
                raise ValueError(f"{name}: the delta of update {payload.update} was made for other weights than the "
                                 f"engine holds (a skipped or repeated update?): resync with a full payload")
            if kind == "full" and self.exact and t.dtype == torch.float32 and bf16_ties(t):
                raise ValueError(f"{name}: {bf16_ties(t)} fp32 values lie exactly on a bf16 tie, which the engine's "
                                 f"bf16 + int16 state cannot hold; call rowadam.avoid_bf16_ties_ on the trainer's "
                                 f"weights before a full fp32 sync")

    @torch.no_grad()
    def apply(self, payload: Payload) -> None:
        """Merge W -= F @ A_update into the payload's targets (a sparse payload: write its changed
        elements, each target's weight first checked against the delta's base): all of them, or
        some (one decoder layer per payload); once every target has merged it, the engine
        expects the next update. Only the current update number is accepted, each layer once."""
        if self._loading:
            raise ValueError(f"a full sync is incomplete ({len(self.slots) - len(self._loading)} of "
                             f"{len(self.slots)} layers missing): no delta can be merged")
        if self._merged and payload.kind != "full" and payload.update != self.update:
            raise ValueError(f"update {self.update} is incomplete ({len(self.slots) - len(self._merged)} layers "
                             f"missing): payload for update {payload.update} refused")
        if payload.update != self.update:
            what = "already merged (duplicate)" if payload.update < self.update else "skips updates"
            raise ValueError(f"payload for update {payload.update} {what}: engine expects update {self.update}")
        self._check(payload, "sparse" if payload.kind == "sparse" else "delta")  # all checked before any change
        if payload.kind == "sparse":
            for name, t in payload.factors.items():  # the changed bf16 elements, written as they are
                weight = self.slots[name].weight.view(-1)  # (d k,) a view: the model's own storage
                if t.positions is None:  # the dense form: every element
                    weight.copy_(t.values)
                else:
                    weight.index_copy_(0, t.positions.to(weight.device), t.values.to(weight.device))
        else:
            self._merge_factors(payload)
        self._merged.update(payload.factors)
        if len(self._merged) == len(self.slots):
            self.update, self._merged = self.update + 1, set()

    def _merge_factors(self, payload: Payload) -> None:
        """W -= F @ A_update on every target of a factor payload, exactly as the trainer merges,
        one target at a time (infra/batched.py's `BatchedEngineWeights` merges a shape's together)."""
        for name, f in payload.factors.items():
            slot = self.slots[name]
            device = slot.param.device
            signs = make_signs(self.rank, slot.weight.shape[1], projection_seed(self.base_seed, payload.update, slot.name),
                               device=device)  # (r, k)
            self._merge_factor(slot, f.to(device), projection_from_signs(signs))  # A_update in fp32, as the trainer's

    def _merge_factor(self, slot: _Slot, f: torch.Tensor, a: torch.Tensor) -> None:
        """W -= F @ A on one target, chunk by chunk, `a` A_update (r, k) in fp32: rebuild the
        fp32 master, merge exactly as the trainer does, split it again."""
        w = slot.weight  # (d, k) bf16
        step = rows_per_chunk(w.shape[1])
        for start in range(0, slot.rows, step):
            stop = min(start + step, slot.rows)
            master = join_master(w[start:stop], slot.residual[start:stop])  # (c, k) fp32
            merge_rows(master, f, a, row_offset=start, chunk_rows=step, avoid_ties=False)  # W -= F A
            store_master(master, w[start:stop], slot.residual[start:stop])  # ties avoided here

    @torch.no_grad()
    def load_full(self, payload: Payload) -> None:
        """Replace target weights from a full payload: all of them, or some (a streamed sync,
        one decoder layer per payload); once every target has arrived with the same update
        number, the engine expects that update's delta next. fp32 payloads set the exact
        master (no bf16 ties allowed), bf16 ones a master equal to the bf16 weight."""
        self._check(payload, "full")
        if self._merged and self.exact:
            raise ValueError(f"update {self.update} is half merged: finish it before a full sync")
        self._merged = set()  # no master: full weights replace a half-written sparse update
        if self._loading and set(self._loading.values()) != {payload.update}:
            raise ValueError(f"a full sync for update {payload.update} arrived while one for update "
                             f"{next(iter(self._loading.values()))} is incomplete")
        for name, w in payload.factors.items():
            slot = self.slots[name]
            if not self.exact:  # no master: the bf16 weight, rounded to nearest even from fp32
                slot.weight.copy_(w)
            elif w.dtype == torch.bfloat16:  # the master is the bf16 weight itself: residual 0
                slot.weight.copy_(w)
                slot.residual.zero_()
            else:
                step = rows_per_chunk(w.shape[1])
                for start in range(0, slot.rows, step):
                    chunk = w[start:start + step].to(slot.param.device, torch.float32)  # (c, k)
                    hi, lo = split_master(chunk)
                    slot.weight[start:start + chunk.shape[0]].copy_(hi)
                    slot.residual[start:start + chunk.shape[0]].copy_(lo)
            self._loading[name] = payload.update
        if len(self._loading) == len(self.slots):
            self.update, self._loading = payload.update, {}

    def fingerprint(self) -> dict:
        return dict(zip(self.slots, checksums(s.weight for s in self.slots.values())))


# -----------------------------------------------------------------------------
# Trainer-side fingerprint and comparison

def fingerprint(layers_or_model, dtype=torch.bfloat16, group=None, weight=None) -> dict:
    """Checksums of bf16(W) per target, from a model or from sketch.attach's layers.

    Under FSDP2 each trainer process sums its row shard (at its global row offset) and one
    all_reduce adds the shards, so every process returns the whole model's fingerprint.
    `weight(module)`: the whole weight the engines should hold instead (LoRA's merged one,
    formed on every process, one target at a time).
    """
    if isinstance(layers_or_model, torch.nn.Module):
        mods = target_modules(layers_or_model)
    else:
        mods = {l.name: l.module for l in layers_or_model}
    names = sorted(mods)
    if weight is not None:
        return dict(zip(names, checksums(weight(mods[n]).detach().to(dtype) for n in names)))
    device = local_rows(mods[names[0]].weight)[0].device
    sums = torch.zeros(len(names), 2, dtype=torch.int64, device=device)  # on the device: NCCL reduces it
    for i, name in enumerate(names):
        rows, offset = local_rows(mods[name].weight)
        sums[i] = _checksum_rows(rows.detach().to(dtype), offset)
    if dist.is_available() and dist.is_initialized() and any(hasattr(mods[n].weight, "to_local") for n in names):
        dist.all_reduce(sums, group=group)
    return {n: tuple(s.tolist()) for n, s in zip(names, sums)}


def check_fingerprints(trainer: dict, engine: dict) -> None:
    """Raise naming the first layer whose checksums differ."""
    if set(trainer) != set(engine):
        raise RuntimeError(f"trainer and engine hold different layers: "
                           f"{sorted(set(trainer) ^ set(engine))[:3]}")
    for name in sorted(trainer):
        if tuple(trainer[name]) != tuple(engine[name]):
            raise RuntimeError(f"engine weights differ from the trainer's at {name}: resync with a full payload")


# -----------------------------------------------------------------------------
# Transport over torch.distributed (gloo on CPU, NCCL on GPU)

def send(payload: Payload, group, dst: int, device=None) -> int:
    """Send one payload as (length, buffer); returns the bytes sent."""
    buf = encode(payload)
    if device is not None:
        buf = buf.to(device)
    dist.send(torch.tensor([buf.numel()], dtype=torch.int64, device=buf.device), dst, group=group)
    dist.send(buf, dst, group=group)
    return buf.numel()


def recv(group, src: int, device=None) -> Payload:
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src, group=group)
    buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(buf, src, group=group)
    return decode(buf)
