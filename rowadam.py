"""rowadam.py: RowAdam, and the low-rank merge of its update into fp32 master weights.

One second moment per output row (dense Adam: two per weight) turns a layer's sketch S = G A^T (sketch.py)
into a direction merged into W. No first moment: A is redrawn every update; rows of S line up, columns do not.
Shape legend: d out rows, k in columns, r rank; n rows this process holds (n = d in one process).

Use
---
    import sketch, rowadam                         # run by tests/test_rowadam.py::test_the_use_block_runs
    layers = sketch.attach(model, rank=8, seed=0)  # S and A_0 on every target nn.Linear; weights frozen
    opt = rowadam.RowAdam(layers)                  # the layers' seed (seed=0 would be checked)
    loss_fn(model, ids).backward()                 # your per-token mean loss (ppo.py's): S = G A^T as is
    try:  # a refusal changes nothing: tests/test_rowadam.py::test_failures_change_nothing
        opt.prepare()                              # U = c D per layer in opt.directions; nothing changed
        alpha = choose_alpha(layers, opt.directions)  # your rule (kl_control.py's)
    except Exception:
        opt.discard()                              # the batch dropped: S zeroed; W, v, counter kept
        raise
    factors = opt.merge(alpha)                     # W -= F A_0, F = bf16(alpha U); v set; update 1; S = 0; A_1

The math (arXiv:2610.06647, RowAdam), at update t: tests/test_rowadam.py::test_direction_matches_float64_reference
------------------------------------------------------------------------------------------------------------------
    v     <- beta2 v + (1 - beta2) mean_j S[i, j]^2          row-wise over the r columns
    root  <- sqrt(v / (1 - beta2^(t + 1))),  den <- root + max(eps mean(root), tiny)   t + 1: the sketches v has seen
    s     <- min(den) / den;  s <- s / sqrt(mean(s^2));  D <- s[:, None] S;  D <- D ||S||_F / ||D||_F
    W     <- W - F A_t,  F = bf16(alpha c D),  c = update_ratio sqrt(sum_layers ||W||_F^2 / sum_layers ||D A||_F^2)
Code -> paper: `D` (`row_adam_direction`) is its U, `U = c D` (`directions`) its eta U, `F` alpha eta U, `moments` v.
Defaults: beta2 0.95, eps 1e-8, bf16 factors: the paper's; update_ratio 1e-2 (departure 4; bench/README.md, `defaults`).

Departures from the paper (numbered; reason; test)
-------------------------------------------------
1. S, U, v row-sharded as FSDP2's W, to fit: tests/test_rowadam.py::test_row_sharded_state_equals_one_process_bitwise.
2. A moved fp32 weight on a bf16 tie moves one ulp toward zero, so an engine holds bf16 + int16 (sync.py):
   tests/test_rowadam.py::test_merge_moves_bf16_ties_one_ulp_toward_zero.
3. `prepare(per_layer=True)`: c_l = update_ratio ||W_l|| / ||D_l A_l||, for models from random weights:
   tests/test_rowadam.py::test_per_layer_scale_gives_each_layer_its_share_of_its_weights.
4. update_ratio 1e-2: 6e-5 left the toy at chance: tests/test_kl_control.py::test_alpha_at_its_cap_is_warned_about_once.
Companion: infra/batched.py's `BatchedRowAdam` (row shards need it; bench/README.md, `loop_phases_companions`):
prepare 5.9 -> 3.7 ms, merge 7.0 -> 3.2 ms, same bits: tests/test_rowadam.py::test_batched_rowadam_equals_the_reference.
"""

import math

import torch
import torch.distributed as dist

from sketch import PROJECTION, LayerSketch, refresh

MERGE_ELEMENTS = 2**24  # entries of W a merge works on at once (a float64 F A block and its rounding: 256 MiB)
UPDATE_RATIO = 1e-2  # ||U A|| / ||W|| before alpha: departure 4


def row_adam_direction(S, v, *, step, beta2=0.95, eps=1e-8):
    """(D (d, r), new v (d,)) of one layer from its sketch S (d, r) and row moments v (d,); step = update + 1."""
    if S.dim() != 2 or v.shape != (S.shape[0],):
        raise ValueError(f"sketch must be (n, r) and its second moment (n,), got {tuple(S.shape)}, {tuple(v.shape)}")
    if step < 1 or not 0.0 <= beta2 < 1.0 or not eps > 0:
        raise ValueError(f"need step >= 1 (1-based: update + 1), beta2 in [0, 1), eps > 0; got {step}, {beta2}, {eps}")
    d = torch.full((), float(S.shape[0]), dtype=torch.float64, device=S.device)  # () d, divided by as a tensor
    # v <- beta2 v + (1 - beta2) mean_j S_ij^2, then root <- sqrt(v / (1 - beta2^t))
    v = beta2 * v + (1 - beta2) * S.to(v.dtype).square().mean(dim=1)  # (d,)
    root = (v / (1 - beta2**step)).sqrt()  # (d,)
    # den <- root + max(eps mean(root), tiny)
    den = root + torch.clamp(eps * (root.double().sum() / d).to(root.dtype), min=torch.finfo(root.dtype).tiny)  # (d,)
    # s <- min(den) / den, then s <- s / sqrt(mean(s^2))
    s = den.min() / den  # (d,), in (0, 1]
    s = s / (s.double().square().sum() / d).sqrt().to(s.dtype)  # (d,)
    # D <- s[:, None] S, then D <- D ||S|| / ||D||
    D = S * s[:, None].to(S.dtype)  # (d, r)
    S_sq, D_sq = S.double().square().sum(), D.double().square().sum()
    D.mul_(torch.where(D_sq > 0, (S_sq / D_sq).sqrt(), 1.0).to(D.dtype))  # D = 0 stays 0; no host read
    return D, v


def rows_per_chunk(width: int) -> int:
    return max(1, MERGE_ELEMENTS // width)  # rows of a (., width) weight merged at once


@torch.no_grad()
def merge_rows(rows, factor, projection, row_offset=0, chunk_rows=None, avoid_ties=True):
    """W -= F[o:o+n] @ A on this process's n rows W, in row chunks: F A in float64 rounded once (any chunking,
    shard or device: the same bits); a zero row of F leaves W's row bit for bit. `avoid_ties`: departure 2."""
    factor = factor[row_offset:row_offset + rows.shape[0]]  # (n, r) this process's rows of F
    moved = factor.ne(0).any(dim=1)  # (n,) rows F moves; never read to the host
    a = projection.to(torch.float64)  # (r, k)
    step = chunk_rows or rows_per_chunk(rows.shape[1])
    for start in range(0, rows.shape[0], step):
        f = factor[start:start + step].to(torch.float64)  # (m, r)
        # Shapes: (m, r) @ (r, k) -> (m, k); a zero row of F gives +0: W - 0 A = W
        rows[start:start + step].sub_((f @ a).to(rows.dtype))
        if avoid_ties and rows.dtype == torch.float32:  # departure 2, in the moved rows only
            avoid_bf16_ties_(rows[start:start + step], rows=moved[start:start + step])


def avoid_bf16_ties_(w, *, rows=None):
    """Each fp32 value halfway between two bf16 values one ulp toward zero, in place; `rows` (n,): only those."""
    bits = w.view(torch.int32)  # (..., n, k) raw fp32 words
    tie = (bits & 0xFFFF) == 0x8000  # (..., n, k): low 16 bits 0x8000
    if rows is not None:
        tie &= rows[..., None]
    bits.sub_(tie.to(torch.int32))
    return w


def local_rows(weight):
    """(this process's rows of `weight`, their first row): an FSDP2 DTensor's dim-0 chunk, or all."""
    if not hasattr(weight, "to_local"):
        return weight, 0
    mesh = weight.device_mesh
    if mesh.ndim != 1:
        raise NotImplementedError("only 1-D FSDP meshes are supported")
    chunk = -(-weight.shape[0] // mesh.size())  # ceil(d / world)
    return weight.to_local(), min(mesh.get_local_rank() * chunk, weight.shape[0])


class RowAdam:
    """RowAdam over `sketch.attach`'s layers: `prepare()` makes `directions` U; `merge(alpha)` writes
    W -= bf16(alpha U) A_t, commits v, counts the update, zeroes S, moves to A_{t+1}; `discard()`
    drops the batch. `prepare(group)` first all_reduces whole sketches (data parallel, the paper's).
    `prepare` changes nothing (`merge` commits); a refusal changes nothing: no backward since the
    last merge, a second prepare, a non-finite sum, a bad alpha, a cast from fp32. The private
    methods are what infra/batched.py's `BatchedRowAdam` runs over stacks of layers."""

    shards_rows = False  # whether this class reduces row-sharded layers' sums over their group

    def __init__(self, layers: list[LayerSketch], *, seed=None, beta2=0.95, eps=1e-8,
                 update_ratio=UPDATE_RATIO, factor_dtype=torch.bfloat16):
        self.layers, self.update_ratio, self._dtypes = layers, update_ratio, [l.module.weight.dtype for l in layers]
        self._check_dtypes()
        if len({(l.update, l.base_seed, id(l.group)) for l in layers}) != 1:  # none, or several
            raise ValueError("need one layer or more, all of one base seed, update number and process group (or none)")
        if layers[0].group is not None and not self.shards_rows:
            raise ValueError("row-sharded layers (attach(..., shard=...)): use infra/batched.py's BatchedRowAdam")
        if seed is not None and layers[0].base_seed != seed:
            raise ValueError(f"layers were attached with seed {layers[0].base_seed}, not seed={seed}: leave seed out")
        if not 0.0 <= beta2 < 1.0 or not eps > 0 or not update_ratio > 0:
            raise ValueError("need 0 <= beta2 < 1, eps > 0, update_ratio > 0")
        self.group, self.base_seed, self.update = layers[0].group, layers[0].base_seed, layers[0].update
        self.beta2, self.eps, self.factor_dtype = beta2, eps, factor_dtype
        self.moments = [torch.zeros(l.sketch.shape[0], dtype=l.sketch.dtype, device=l.sketch.device) for l in layers]
        self.directions = self._pending_moments = None  # U (n, r) each, and the new v, between prepare and merge

    rank = property(lambda self: self.layers[0].rank)
    refresh = staticmethod(refresh)  # every layer to A_t (infra/batched.py's makes their signs together)

    @torch.no_grad()
    def prepare(self, group=None, *, per_layer=False) -> float:
        """U = c D of every layer into `directions` (c_l each with `per_layer`); returns ||S||."""
        if self.directions is not None:
            raise RuntimeError("prepare() was already called: merge(alpha) opt.directions, or discard() the batch")
        self._check_dtypes()
        whole = group is not None and self.group is None  # whole sketches on every process: summed here
        backwards = torch.tensor(sum(int(l.backwards) for l in self.layers), dtype=torch.int64,
                                 device=self.layers[0].sketch.device if whole else None)  # ()
        if whole:  # every process refuses, or none
            dist.all_reduce(backwards, group=group)
        if int(backwards) == 0:
            raise ValueError("no backward since the last merge() or discard(): call loss.backward() between merges")
        for S in self._sketches() if whole else ():
            dist.all_reduce(S, group=group)  # in place: the summed sketches are the batch's
        S_sq = self._sketch_squares()  # (L,) float64 ||S_l||^2: the norm returned, and the finiteness check
        if not torch.isfinite(S_sq).all():
            raise FloatingPointError("summed sketch not finite (or its norm^2 overflows): discard() drops the batch")
        self.directions, self._pending_moments = self._directions(self.update + 1, per_layer)
        return math.sqrt(S_sq.sum().item())

    def _sketches(self):
        return [layer.sketch for layer in self.layers]

    def _sketch_squares(self):
        return torch.stack([layer.sketch.double().square().sum() for layer in self.layers])  # (L,)

    def _directions(self, step, per_layer):
        """(U = c D, new v) of each layer; ||D A||^2 = sum((D (A A^T)) * D) in float64, no (n, k) block."""
        D, v = zip(*[row_adam_direction(l.sketch, v, step=step, beta2=self.beta2, eps=self.eps)
                     for l, v in zip(self.layers, self.moments)])
        W_sq = torch.stack([local_rows(l.module.weight)[0].double().square().sum() for l in self.layers])  # (L,)
        A = [l.projection.double() for l in self.layers]  # (r, k) each
        DA_sq = torch.stack([((D_l.double() @ (a @ a.t())) * D_l.double()).sum() for D_l, a in zip(D, A)])  # (L,)
        if not per_layer:
            W_sq, DA_sq = W_sq.sum().expand(len(D)), DA_sq.sum().expand(len(D))
        # c = update_ratio sqrt(sum ||W||^2 / sum ||D A||^2), 0 where D A = 0; c_l of each layer (departure 3)
        c = torch.where(DA_sq > 0, self.update_ratio * (W_sq / DA_sq.clamp(min=torch.finfo(torch.float64).tiny)).sqrt(),
                        0.0)  # (L,) float64
        return [D_l.mul_(c_l.to(D_l.dtype)) for D_l, c_l in zip(D, c)], list(v)

    def _check_dtypes(self):  # fp32 (or float64) master weights, of the dtype they had when RowAdam was built
        for layer, was in zip(self.layers, self._dtypes):
            if (dtype := layer.module.weight.dtype) not in (torch.float32, torch.float64):
                raise TypeError(f"{layer.name}: weight is {dtype}; RowAdam merges into fp32 master weights (an update "
                                f"of ~{self.update_ratio:g} is below bf16's resolution, ~4e-3): keep the weights fp32")
            if dtype != was:
                raise TypeError(f"{layer.name}: weight is {dtype}, was {was} when RowAdam was built: cast it back")

    def discard(self) -> None:
        """Abandon the batch: directions dropped, sketches zeroed; weights, v and counter kept."""
        self.directions = self._pending_moments = None
        self._zero_sketches()

    def _zero_sketches(self):
        for layer in self.layers:
            layer.zero_()

    @torch.no_grad()
    def merge(self, alpha: float) -> list[torch.Tensor]:
        """W -= F A_t, F = bf16(alpha U), on this process's rows; returns every F (n, r) as merged."""
        if self.directions is None:
            raise RuntimeError("merge() needs prepare() first")
        self._check_dtypes()
        if not math.isfinite(alpha := float(alpha)) or alpha < 0:
            raise ValueError(f"alpha must be finite and >= 0, got {alpha}")
        factors, finite = self._factors(alpha)  # F (n, r) each; whether all are finite
        rows = [local_rows(layer.module.weight)[0] for layer in self.layers]  # (n, k) each
        for layer, w, f in zip(self.layers, rows, factors):
            if w.shape[0] != f.shape[0]:
                raise RuntimeError(f"{layer.name}: {w.shape[0]} rows of W here, {f.shape[0]} of S: shard both alike")
        if not finite:  # a finite alpha can still overflow F
            raise ValueError(f"alpha = {alpha:g} makes F = alpha U overflow {self.factor_dtype}: nothing was merged")
        self._merge(rows, factors)
        self.directions = self._pending_moments = None
        self.update += 1
        self.refresh(self.layers, self.update)
        return factors

    def _factors(self, alpha):
        factors = [(alpha * U).to(self.factor_dtype) for U in self.directions]  # F = bf16(alpha U)
        return factors, bool(torch.stack([torch.isfinite(f).all() for f in factors]).all())

    def _merge(self, rows, factors):  # W -= F A_t, v committed, S zeroed
        for layer, w, f, v, new in zip(self.layers, rows, factors, self.moments, self._pending_moments):
            merge_rows(w, f, layer.projection)
            v.copy_(new)
            layer.zero_()

    def state_dict(self) -> dict:
        """Moments by layer name, counter, settings and the projection rule (sketch.PROJECTION)."""
        moments = {l.name: self._saved(l, v.clone()) for l, v in zip(self.layers, self.moments)}
        return {"update": self.update, "moments": moments, "base_seed": self.base_seed, "rank": self.rank,
                "beta2": self.beta2, "eps": self.eps, "update_ratio": self.update_ratio, "projection": PROJECTION}

    def _saved(self, layer, v):
        return v

    def load_state_dict(self, state: dict) -> None:
        """`state_dict()`'s moments, counter, settings; refused if of another projection (none: 1)."""
        projection = int(state.get("projection", 1))
        if projection != PROJECTION:
            raise ValueError(f"this state was saved under projection {projection}; this release makes A by projection "
                             f"{PROJECTION} only (sketch.PROJECTION): resume it with the release that saved it")
        if state["rank"] != self.rank or state["base_seed"] != self.base_seed:
            raise ValueError(f"checkpoint has rank {state['rank']}, seed {state['base_seed']}; "
                             f"this has {self.rank}, {self.base_seed}")
        if list(state["moments"]) != [l.name for l in self.layers]:
            raise ValueError("checkpoint holds a different set of target layers")
        local = {n: (m.to_local() if hasattr(m, "to_local") else m) for n, m in state["moments"].items()}
        if any(local[l.name].shape != v.shape for l, v in zip(self.layers, self.moments)):
            raise ValueError(f"moment shapes {[tuple(m.shape) for m in local.values()]} differ from this model's")
        if self.directions is not None:
            raise RuntimeError("cannot load state over a prepared update: discard() first")
        for l, v in zip(self.layers, self.moments):
            v.copy_(local[l.name])
        keys = ("beta2", "eps", "update_ratio", "update")
        self.beta2, self.eps, self.update_ratio, self.update = (state[k] for k in keys)
        self._zero_sketches()
        self.refresh(self.layers, self.update)
