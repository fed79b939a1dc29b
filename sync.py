"""
sync.py: seed-based weight sync from the trainer to the rollout engines.

What it is
----------
After update t is merged, the trainer sends each rollout engine, per target layer, only the
bf16 factor `F = alpha U` (d, r) that RowAdam merged, plus the update number. The engine
regenerates `A_t` from the seed rule of sketch.py and merges `W -= F @ A_t` itself. The
payload is `sum_layers d * r * 2` bytes, about r/k of a full bf16 weight sync. The paper's
method section on seed-based sync (arXiv:2610.06647) has the trainer send `alpha eta U` and a
seed for `A`, O(d r) values instead of a full (d, k) delta; `F` is that `alpha eta U` in
bf16 (rowadam.py's `U = c D` stands for the paper's `eta U`).

Pieces
------
- `Payload(update, base_seed, rank, factors)` and `encode`/`decode`: one flat uint8 buffer
  per update (a checked header, then the tensors), so it travels over any
  `torch.distributed` backend as one message. `full_payload` carries full weights instead
  (start-up, recovery, and train.py's `--sync full` control), in the same format.
- `EngineWeights(model, base_seed=..., rank=..., layout="hf" | "vllm")`: the engine side.
  Next to the model's bf16 weight it keeps an int16 residual per target weight, so that
  bf16 weight + residual is the trainer's fp32 master exactly (departure 1); every merge
  rebuilds the master chunk by chunk, merges as the trainer does and splits it again, so
  the model's weight is always bf16(trainer master). Payloads must arrive in order; a full
  sync may be streamed one decoder layer per payload (`layer_groups`).
- `fingerprint(...)` / `EngineWeights.fingerprint()` / `check_fingerprints(a, b)`: two
  integer checksums per layer of the bf16 weights, comparable between the trainer (whose
  fp32 master is rounded the same way) and the engine; a mismatch names the first layer.
- `send`/`recv` over a `torch.distributed` group. The vLLM side (the worker extension that
  calls `EngineWeights` inside each vLLM worker, and the weight channel) is in infra/vllm_engine.py;
  this file is pure torch.

Why the engine needs more than its bf16 weight: a relative step of 6e-5 is far below bf16's
resolution (~4e-3). A plain in-place bf16 `W -= F @ A` rounds almost every update away, and
the engine silently drifts from the trainer (tests/test_sync.py shows it).

vLLM fuses q/k/v into `qkv_proj` (rows [q; k; v]) and gate/up into `gate_up_proj`
(rows [gate; up]); the "vllm" layout applies each sub-layer's factor to its own row block
(`engine_layers`: which trainer layers each vLLM layer holds; architectures.py's table).

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

Implementation notes
--------------------
- Each layer in a payload carries two integer checksums of its bytes, so a corrupted buffer
  is refused before anything is merged (tests/test_sync.py,
  test_bad_payloads_are_rejected_and_change_nothing).
- vLLM tensor parallelism inside an engine is not supported (Table 1's setup runs one vLLM
  engine per GPU); a sharded vLLM layer raises (test_a_tensor_parallel_vllm_layer_is_refused).
"""

import json
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rowadam import MERGE_CHUNK_ROWS, local_rows, merge_rows
from sketch import TARGETS, clean_name, make_projection, projection_seed, target_modules

MAGIC = b"LOGRASYN"
VERSION = 1
ALIGN = 16
CHECK_MOD = 65521  # positional weights of the checksum cycle through 1..65521
CHECK_WORDS = 2**20  # 16-bit words per checksum block (about 32 MiB of int64 work at most)
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
    """

    update: int
    base_seed: int
    rank: int
    factors: dict = field(default_factory=dict)
    kind: str = "delta"


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


def checksum(t: torch.Tensor) -> tuple[int, int]:
    """(sum of x, sum of x * (i mod 65521 + 1)) over the raw 16-bit words x of `t`, in int64.

    Rows are processed in chunks; both sums add up over row blocks, so the checksum of a
    row-sharded weight is the sum of its shards' (with their global row offset).
    """
    return _checksum_rows(t.detach().reshape(t.shape[0], -1) if t.dim() else t.reshape(1, 1), 0)


def _checksum_rows(rows: torch.Tensor, row_offset: int) -> tuple[int, int]:
    words = rows.contiguous().view(torch.int16)  # (n, k * bytes / 2): raw 16-bit words
    width = words.shape[1]
    s1 = torch.zeros((), dtype=torch.int64, device=rows.device)
    s2 = torch.zeros((), dtype=torch.int64, device=rows.device)
    block_rows = max(1, CHECK_WORDS // max(width, 1))
    for start in range(0, words.shape[0], block_rows):
        block = words[start:start + block_rows].to(torch.int64)  # (c, k')
        first = (row_offset + start) * width
        pos = torch.arange(first, first + block.numel(), device=rows.device, dtype=torch.int64)
        s1 += block.sum()
        s2 += (block.flatten() * (pos % CHECK_MOD + 1)).sum()
    return int(s1), int(s2)


def encode(payload: Payload) -> torch.Tensor:
    """One flat uint8 buffer: magic, header length, JSON header, aligned tensor bytes."""
    entries, blobs, offset = [], [], 0
    for name, t in payload.factors.items():
        dtype = next((k for k, v in DTYPES.items() if v == t.dtype), None)
        if dtype is None or t.dim() != 2:
            raise ValueError(f"{name}: factors must be 2-D {list(DTYPES)} tensors, got {t.dtype} {tuple(t.shape)}")
        raw = t.detach().contiguous().flatten().view(torch.uint8)
        entries.append({"name": name, "shape": list(t.shape), "dtype": dtype, "offset": offset,
                        "nbytes": raw.numel(), "check": list(checksum(t))})
        blobs.append(raw)
        pad = -raw.numel() % ALIGN
        if pad:
            blobs.append(torch.zeros(pad, dtype=torch.uint8, device=raw.device))
        offset += raw.numel() + pad
    header = json.dumps({"version": VERSION, "kind": payload.kind, "update": int(payload.update),
                         "base_seed": int(payload.base_seed), "rank": int(payload.rank),
                         "layers": entries, "data_bytes": offset}).encode()
    header += b" " * (-(len(MAGIC) + 8 + len(header)) % ALIGN)
    device = blobs[0].device if blobs else "cpu"
    prefix = torch.frombuffer(bytearray(MAGIC + len(header).to_bytes(8, "little") + header), dtype=torch.uint8)
    return torch.cat([prefix.to(device)] + blobs)


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
        if head["version"] != VERSION or head["kind"] not in ("delta", "full"):
            raise ValueError(f"unsupported payload version/kind {head['version']}/{head['kind']}")
        layers = head["layers"]
        update, base_seed, rank, data_bytes = (int(head[k]) for k in ("update", "base_seed", "rank", "data_bytes"))
    except (KeyError, TypeError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"malformed payload header: {e}") from None
    if start + data_bytes != n:
        raise ValueError(f"payload size mismatch: header says {start + data_bytes} bytes, got {n} (truncated?)")
    data = buffer[start:]
    factors, expect = {}, 0
    for e in layers:
        dtype = DTYPES.get(e.get("dtype"))
        shape = e.get("shape")
        if dtype is None or not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(s, int) and s > 0 for s in shape)):
            raise ValueError(f"malformed layer entry {e}")
        nbytes = shape[0] * shape[1] * dtype.itemsize
        if e["offset"] != expect or e["nbytes"] != nbytes or e["offset"] + nbytes > data_bytes:
            raise ValueError(f"{e['name']}: offset/size {e['offset']}/{e['nbytes']} inconsistent with {shape} {dtype}")
        t = data[e["offset"]:e["offset"] + nbytes].view(dtype).view(shape)
        if list(checksum(t)) != e["check"]:
            raise ValueError(f"{e['name']}: checksum mismatch, the payload is corrupted")
        if e["name"] in factors:
            raise ValueError(f"duplicate layer {e['name']} in payload")
        factors[e["name"]] = t
        expect = e["offset"] + nbytes + (-nbytes % ALIGN)
    return Payload(update, base_seed, rank, factors, kind=head["kind"])


# -----------------------------------------------------------------------------
# Engine-side weights

@dataclass
class _Slot:
    name: str  # clean HF name of the sub-layer, e.g. model.layers.0.self_attn.k_proj
    param: torch.nn.Parameter  # the model's bf16 weight (maybe fused)
    row: int  # first row of this sub-layer inside `param`
    rows: int  # d
    residual: torch.Tensor  # int16 (d, k): fp32 master = bf16 weight + residual fp32 ulps

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

    `residual_device`: where the residuals live (default: beside the weights; "cpu" puts them
    in pinned host memory, merged chunk by chunk, for models whose residual does not fit on
    the engine's GPU beside its weights and KV cache). A full sync may arrive in parts (one
    decoder layer per payload); deltas are refused until every layer has been received.
    """

    def __init__(self, model, *, base_seed, rank, layout="hf", update=0, residual_device=None, engine_layers=None):
        self.base_seed, self.rank, self.update = base_seed, rank, update
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
                                   pin_memory=pin)  # (d, k): the weights start as their own masters
            self.slots[name] = _Slot(name, param, row, rows, residual)

    def state_bytes(self) -> int:
        """Bytes this object adds to the engine (the residuals), wherever they live."""
        return sum(s.residual.numel() * s.residual.element_size() for s in self.slots.values())

    def master(self, name: str) -> torch.Tensor:
        """The fp32 master of one target (d, k), rebuilt (for checks; the merges work in chunks)."""
        slot = self.slots[name]
        return join_master(slot.weight, slot.residual)

    def _check(self, payload, kind):
        if payload.kind != kind:
            raise ValueError(f"expected a {kind} payload, got {payload.kind}")
        if payload.base_seed != self.base_seed or payload.rank != self.rank:
            raise ValueError(f"payload has seed {payload.base_seed}, rank {payload.rank}; engine expects "
                             f"seed {self.base_seed}, rank {self.rank}")
        unknown = sorted(set(payload.factors) - set(self.slots))[:3]
        if unknown or not payload.factors:
            raise ValueError(f"payload layers differ from the engine's: unknown {unknown}, "
                             f"{len(payload.factors)} layers")
        again = sorted(set(payload.factors) & self._merged)[:3] if kind == "delta" else []
        if again:
            raise ValueError(f"payload for update {payload.update} already merged (duplicate) for {again}")
        for name, t in payload.factors.items():
            slot = self.slots[name]
            want = (slot.rows, self.rank) if kind == "delta" else tuple(slot.residual.shape)
            if tuple(t.shape) != want:
                raise ValueError(f"{name}: tensor shape {tuple(t.shape)}, expected {want}")
            if not torch.isfinite(t).all():
                raise ValueError(f"{name}: non-finite values in the payload")
            if kind == "full" and t.dtype == torch.float32 and bf16_ties(t):
                raise ValueError(f"{name}: {bf16_ties(t)} fp32 values lie exactly on a bf16 tie, which the engine's "
                                 f"bf16 + int16 state cannot hold; call rowadam.avoid_bf16_ties_ on the trainer's "
                                 f"weights before a full fp32 sync")

    @torch.no_grad()
    def apply(self, payload: Payload) -> None:
        """Merge W -= F @ A_update into the payload's targets: all of them, or some (one decoder
        layer per payload); once every target has merged it, the engine expects the next
        update. Only the current update number is accepted, each layer once."""
        if self._loading:
            raise ValueError(f"a full sync is incomplete ({len(self.slots) - len(self._loading)} of "
                             f"{len(self.slots)} layers missing): no delta can be merged")
        if self._merged and payload.kind == "delta" and payload.update != self.update:
            raise ValueError(f"update {self.update} is incomplete ({len(self.slots) - len(self._merged)} layers "
                             f"missing): payload for update {payload.update} refused")
        if payload.update != self.update:
            what = "already merged (duplicate)" if payload.update < self.update else "skips updates"
            raise ValueError(f"payload for update {payload.update} {what}: engine expects update {self.update}")
        self._check(payload, "delta")  # everything is checked before anything changes
        for name, f in payload.factors.items():
            slot = self.slots[name]
            w = slot.weight  # (d, k) bf16
            seed = projection_seed(self.base_seed, payload.update, name)
            a = make_projection(self.rank, w.shape[1], seed, device=w.device)  # (r, k)
            f = f.to(w.device)
            # Chunk by chunk: rebuild the fp32 master, merge exactly as the trainer does, split.
            for start in range(0, slot.rows, MERGE_CHUNK_ROWS):
                stop = min(start + MERGE_CHUNK_ROWS, slot.rows)
                master = join_master(w[start:stop], slot.residual[start:stop])  # (c, k) fp32
                merge_rows(master, f, a, row_offset=start, avoid_ties=False)  # W -= F A
                store_master(master, w[start:stop], slot.residual[start:stop])  # ties avoided here
            self._merged.add(name)
        if len(self._merged) == len(self.slots):
            self.update, self._merged = self.update + 1, set()

    @torch.no_grad()
    def load_full(self, payload: Payload) -> None:
        """Replace target weights from a full payload: all of them, or some (a streamed sync,
        one decoder layer per payload); once every target has arrived with the same update
        number, the engine expects that update's delta next. fp32 payloads set the exact
        master (no bf16 ties allowed), bf16 ones a master equal to the bf16 weight."""
        self._check(payload, "full")
        if self._merged:
            raise ValueError(f"update {self.update} is half merged: finish it before a full sync")
        if self._loading and set(self._loading.values()) != {payload.update}:
            raise ValueError(f"a full sync for update {payload.update} arrived while one for update "
                             f"{next(iter(self._loading.values()))} is incomplete")
        for name, w in payload.factors.items():
            slot = self.slots[name]
            if w.dtype == torch.bfloat16:  # the master is the bf16 weight itself: residual 0
                slot.weight.copy_(w)
                slot.residual.zero_()
            else:
                for start in range(0, slot.rows, MERGE_CHUNK_ROWS):
                    chunk = w[start:start + MERGE_CHUNK_ROWS].to(slot.param.device, torch.float32)  # (c, k)
                    hi, lo = split_master(chunk)
                    slot.weight[start:start + chunk.shape[0]].copy_(hi)
                    slot.residual[start:start + chunk.shape[0]].copy_(lo)
            self._loading[name] = payload.update
        if len(self._loading) == len(self.slots):
            self.update, self._loading = payload.update, {}

    def fingerprint(self) -> dict:
        return {name: checksum(s.weight) for name, s in self.slots.items()}


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
        return {n: checksum(weight(mods[n]).detach().to(dtype)) for n in names}
    device = local_rows(mods[names[0]].weight)[0].device
    sums = torch.zeros(len(names), 2, dtype=torch.int64, device=device)  # on the device: NCCL reduces it
    for i, name in enumerate(names):
        rows, offset = local_rows(mods[name].weight)
        sums[i] = torch.tensor(_checksum_rows(rows.detach().to(dtype), offset))
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
