"""
sync.py: seed-based weight sync from the trainer to the rollout engines.

After update t the trainer sends each engine the seed and, per target, the bf16 factor F (d, r) that RowAdam
merged (2 d r bytes, about r/k of a bf16 sync); the engine regenerates A_t by sketch.py's seed rule and merges
W -= F @ A_t as the trainer did, so its weights stay bf16 of the trainer's fp32 master (fingerprints check it).

Use
---
    import sketch  # tests/test_sync.py::test_the_use_block_runs runs this block
    import sync
    from rowadam import RowAdam, avoid_bf16_ties_
    engine = sync.EngineWeights(engine_model, base_seed=0, rank=8)  # a bf16 model; + an int16 residual per target
    layers = sketch.attach(model, rank=8, seed=0)                    # the fp32 trainer: S and A_0, weights frozen
    opt = RowAdam(layers)
    masters = {layer.name: avoid_bf16_ties_(layer.module.weight.data) for layer in layers}  # no bf16 ties
    engine.load_full(sync.full_payload(masters, update=0, base_seed=0, rank=8, dtype=torch.float32))
    loss_fn(model, ids).backward()                                   # any loss of a batch, into the sketches
    opt.prepare()
    factors = opt.merge(alpha)                                       # the trainer: W -= F A_0 (alpha: kl_control.py)
    payload = sync.Payload(0, 0, 8, {l.name: f for l, f in zip(layers, factors)})  # F and the seed's update
    engine.apply(payload)                                            # the engine: W -= F A_0, A_0 from the seed
    sync.check_fingerprints(sync.fingerprint(layers), engine.fingerprint())  # equal, or it raises

The math (arXiv:2610.06647, the method section on seed-based sync; d out rows, k in columns, r rank)
--------
    F     = bf16(alpha eta U)    (d, r), merged and sent instead of a (d, k) delta (rowadam.py's c D is eta U)
    A_t   = sketch.make_projection(r, k, projection_seed(base_seed, t, name))     (r, k)
    W     = bf16(W) + j ulp(W)                  the engine's master, j an int16 (departure 1)
    merge: W = join(bf16, j);  W -= F @ A_t;  bf16, j = split(W)       in the trainer's row chunks
    fingerprint = (sum_i x_i, sum_i x_i (i mod 65521 + 1))            x_i: the 16-bit words of bf16(W)

Defaults: bf16 factors, as engines merge them (fp32 doubles the payload); 65521, the largest prime < 2^16 (Adler-32).

Departures from the paper
-------------------------
1. The engine keeps the trainer's fp32 master as bf16 + an int16 residual: a relative step of 6e-5 is far
   below bf16's resolution, so a plain bf16 merge drifts (test_200_payloads_track_the_trainer_in_both_layouts).
2. Not the paper's: the exact sparse bf16 delta (`--sync delta`, PULSE, arXiv:2602.03839) for an engine
   without a master (infra/sparse_delta.py; test_sparse_deltas_keep_engines_without_a_master_equal_to_the_trainer).

Implementation notes: every payload, its projection rule too, is checked before anything changes. train.py runs
the companions infra/wire.py (one checked uint8 buffer), infra/checksum.py (the checksum in blocks),
infra/engine_weights.py (vLLM's layout, host residuals, streamed and batched merges), infra/engine_sync.py (FSDP2).
"""

from dataclasses import dataclass, field

import torch

from rowadam import merge_rows, rows_per_chunk
from sketch import PROJECTION, TARGETS, clean_name, make_signs, projection_from_signs, projection_seed, target_modules

CHECK_MOD = 65521  # positional weights of the checksum cycle through 1..65521


@dataclass
class Payload:
    """What an engine receives for update `update`, per target (clean HF name) in `layers`: the bf16 factor
    F (d, r) (kind "delta"), the full weight (d, k) (kind "full", `update` the updates it holds) or a sparse
    delta (kind "sparse", infra/sparse_delta.py)."""

    update: int
    base_seed: int
    rank: int
    layers: dict = field(default_factory=dict)
    kind: str = "delta"
    projection: int = PROJECTION  # the rule that made A (sketch.PROJECTION)

    @property
    def factors(self) -> dict:  # the name of earlier releases, for every kind
        return self.layers


def full_payload(weights: dict, *, update: int, base_seed: int, rank: int, dtype=torch.bfloat16) -> Payload:
    """A full-weight payload from {clean name: (d, k) weight}. Send fp32 for an exact resync."""
    return Payload(update, base_seed, rank, {n: w.detach().to(dtype) for n, w in weights.items()}, kind="full")

# --- The engine's master: bf16 + int16 (departure 1) --------------------------------------------


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
    """fp32 master (c, k) from bf16 `hi` and int16 residual `lo` in fp32 ulps (words of one sign order as integers)."""
    return hi.to(torch.float32).view(torch.int32).add_(lo.to(hi.device)).view(torch.float32)


def split_master(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16(w), int16 residual) of an fp32 tensor without bf16 ties (rowadam.avoid_bf16_ties_)."""
    hi = w.to(torch.bfloat16)  # round to nearest even
    lo = w.view(torch.int32) - hi.to(torch.float32).view(torch.int32)  # in [-32767, 32767]
    return hi, lo.to(torch.int16)


def store_master(master: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> None:
    """An fp32 master (c, k) into bf16 `weight` + int16 `residual` in place, `master` consumed, a bf16 tie moved one
    ulp toward zero (avoid_bf16_ties_): hi = (bits + 0x7FFF) & ~0xFFFF, bits - hi in [-32767, 32768], a tie 32767."""
    bits = master.view(torch.int32)
    hi = bits.add(0x7FFF).bitwise_and_(-0x10000)  # bf16 values as fp32 words
    weight.copy_(hi.view(torch.float32))  # exact: every value is a bf16
    residual.copy_(bits.sub_(hi).clamp_max_(0x7FFF))  # int32 -> int16, in range


def bf16_ties(w: torch.Tensor) -> int:
    """How many fp32 values lie exactly halfway between two bf16 values (not representable)."""
    return int(((w.contiguous().view(torch.int32) & 0xFFFF) == 0x8000).sum())


class EngineWeights:
    """The rollout engine's target weights: the HF model's bf16 weights, plus an int16 residual that makes each
    the trainer's exact fp32 master (departure 1); a payload holds every target (infra/engine_weights.py: streamed)."""

    def __init__(self, model, *, base_seed, rank, update=0, checksums=None):
        self.base_seed, self.rank, self.update = base_seed, rank, update
        self.checksums = checksums or word_checksums  # infra/checksum.checksums: the same, in blocks
        self.slots = {}
        for name, param, row, rows in self._blocks(model):
            if rank > param.shape[1]:
                raise ValueError(f"{name}: rank {rank} exceeds in_features {param.shape[1]}")
            if param.dtype != torch.bfloat16:
                raise TypeError(f"{name}: engine weights must be bf16, got {param.dtype}")
            self.slots[name] = _Slot(name, param, row, rows, self._residual(param, rows))
        if not self.slots:
            raise ValueError(f"no target layers found in {type(model).__name__}")

    def _blocks(self, model):
        """[(clean name, parameter, first row, rows)] of every target: one target a module."""
        return [(clean_name(n), m.weight, 0, m.weight.shape[0]) for n, m in model.named_modules()
                if n.rsplit(".", 1)[-1] in TARGETS]

    def _residual(self, param, rows):  # (d, k) int16 zeros: the weights start as their own masters
        return torch.zeros(rows, param.shape[1], dtype=torch.int16, device=param.device)

    def master(self, name: str) -> torch.Tensor:
        """The fp32 master of one target (d, k), rebuilt (for checks; the merges work in chunks)."""
        return join_master(self.slots[name].weight, self.slots[name].residual)

    def _check(self, payload, kind):
        got = (payload.kind, payload.base_seed, payload.rank, payload.projection)
        want = (kind, self.base_seed, self.rank, PROJECTION if kind == "delta" else payload.projection)
        odd = sorted(set(payload.layers) ^ set(self.slots))[:3]  # layers missing or unknown
        if got != want or odd or (kind == "delta" and payload.update != self.update):
            raise ValueError(f"a payload (kind, seed, rank, projection) {got} of update {payload.update}, layers "
                             f"{odd} not the engine's: it expects {want} of update {self.update}")
        for name, t in payload.layers.items():
            want = (self.slots[name].rows, self.rank) if kind == "delta" else tuple(self.slots[name].weight.shape)
            if tuple(t.shape) != want or not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name}: shape {tuple(t.shape)} (expected {want}) or non-finite values")
            if kind == "full" and t.dtype == torch.float32 and bf16_ties(t):
                raise ValueError(f"{name}: fp32 values on a bf16 tie, which bf16 + int16 cannot hold: call "
                                 f"rowadam.avoid_bf16_ties_ on the trainer's weights first")

    @torch.no_grad()
    def apply(self, payload: Payload) -> None:
        """W -= F @ A_update on every target, A_update from the seed; the engine then expects the next update."""
        self._check(payload, "delta")
        self._merge_factors(payload)
        self.update += 1

    def _merge_factors(self, payload: Payload) -> None:
        """W -= F @ A_update as the trainer merges, one target at a time (infra/engine_weights.py: batched)."""
        for name, f in payload.factors.items():
            slot = self.slots[name]
            seed = projection_seed(self.base_seed, payload.update, slot.name)
            signs = make_signs(self.rank, slot.weight.shape[1], seed, device=slot.param.device)  # (r, k)
            self._merge_factor(slot, f.to(slot.param.device), projection_from_signs(signs))  # A_update, fp32

    def _merge_factor(self, slot: _Slot, f: torch.Tensor, a: torch.Tensor) -> None:
        """W -= F @ A on one target by row chunks, `a` A_update (r, k) in fp32: join, merge as the trainer, split."""
        w = slot.weight  # (d, k) bf16
        step = rows_per_chunk(w.shape[1])
        for start in range(0, slot.rows, step):
            master = join_master(w[start:start + step], slot.residual[start:start + step])  # (c, k) fp32
            merge_rows(master, f, a, row_offset=start, chunk_rows=step, avoid_ties=False)  # W -= F A
            store_master(master, w[start:start + step], slot.residual[start:start + step])  # ties avoided here

    @torch.no_grad()
    def load_full(self, payload: Payload) -> None:
        """Replace every target (fp32: the exact master, no bf16 ties; bf16: residual 0); expect `payload.update`."""
        self._check(payload, "full")
        for name, w in payload.layers.items():
            self._load(self.slots[name], w)
        self.update = payload.update

    def _load(self, slot: _Slot, w: torch.Tensor) -> None:  # bf16 w: the master w itself, residual 0
        step = rows_per_chunk(w.shape[1])
        for start in range(0, slot.rows, step):
            hi, lo = split_master(w[start:start + step].to(slot.param.device, torch.float32))  # (c, k) each
            slot.weight[start:start + step].copy_(hi)
            slot.residual[start:start + step].copy_(lo)

    def fingerprint(self) -> dict:
        return dict(zip(self.slots, self.checksums(s.weight for s in self.slots.values())))

# --- Fingerprints: what the trainer and an engine hold, compared after every sync ---------------


def word_checksums(tensors) -> list[tuple[int, int]]:
    """(sum_i x_i, sum_i x_i (i mod 65521 + 1)) in int64 over each tensor's 16-bit words x_i, word
    by word (infra/checksum.py: the same in bounded blocks); one host read for all."""
    sums = []
    for t in tensors:
        x = t.detach().contiguous().view(torch.int16).flatten().to(torch.int64)  # (words,)
        i = torch.arange(x.numel(), device=x.device) % CHECK_MOD + 1  # (words,)
        sums.append(torch.stack([x.sum(), (x * i).sum()]))
    return [tuple(pair) for pair in torch.stack(sums).cpu().tolist()] if sums else []


def checksum(t: torch.Tensor) -> tuple[int, int]:
    return word_checksums([t])[0]


def fingerprint(layers_or_model, checksums=word_checksums) -> dict:
    """Checksums of bf16(W) per target of a model or of sketch.attach's layers (FSDP2: infra/engine_sync.py)."""
    model = isinstance(layers_or_model, torch.nn.Module)
    mods = target_modules(layers_or_model) if model else {l.name: l.module for l in layers_or_model}
    names = sorted(mods)
    return dict(zip(names, checksums(mods[n].weight.detach().to(torch.bfloat16) for n in names)))


def check_fingerprints(trainer: dict, engine: dict) -> None:
    """Raise naming the first layer whose checksums differ (or that one side lacks)."""
    for name in sorted(set(trainer) | set(engine)):
        if tuple(trainer.get(name, ())) != tuple(engine.get(name, ())):
            raise RuntimeError(f"engine weights differ from the trainer's at {name}: resync with a full payload")
