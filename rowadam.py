"""
rowadam.py: RowAdam, and the low-rank merge of its update into fp32 master weights.

Dense Adam keeps two fp32 moments per weight; RowAdam one second moment per output row of each
target layer, turning its sketch S = G A^T (sketch.py) into a direction merged into the full
weight. No first moment: A is redrawn every update, so sketch columns do not line up; rows do.

Use
---
    import sketch
    from rowadam import RowAdam
    layers = sketch.attach(model, rank=8, seed=0)  # S and A_0 on every target nn.Linear; weights frozen
    opt = RowAdam(layers)                          # the layers' seed (seed=0 would be checked)
    loss_fn(model, ids).backward()                 # into the sketches S = G A^T; no weight gradient
    try:
        opt.prepare()                              # U = c D per layer in opt.directions; nothing changed
        alpha = choose_alpha(layers, opt.directions)
    except Exception:
        opt.discard()                              # the batch dropped: S zeroed; W, v, counter kept
        raise
    factors = opt.merge(alpha)                     # W -= F A_0, F = bf16(alpha U); v set; update 1; S = 0; A_1

`loss_fn` (ppo.py's) and `choose_alpha` (kl_control.py's probe and solve_alpha) are the caller's;
tests/test_rowadam.py::test_the_use_block_runs runs it; sync.py sends `factors` to the engines.

The math (arXiv:2610.06647, the method section on RowAdam), per layer, at update t
--------------------------------------------------------------------------------
    v     <- beta2 v + (1 - beta2) mean_j S[i, j]^2          row-wise over the r columns
    root  <- sqrt(v / (1 - beta2^(t + 1)))                   t + 1: the sketches v has seen
    den   <- root + max(eps mean(root), tiny)
    s     <- min(den) / den;  s <- s / sqrt(mean(s^2))        row scales in (0, 1], RMS-normalised
    D     <- s[:, None] S;  D <- D ||S||_F / ||D||_F          keep the layer's sketch norm
    c     =  update_ratio sqrt( sum_layers ||W||_F^2 / sum_layers ||D A||_F^2 )
    W     <- W - F A_t,  F = bf16(alpha c D)                  alpha from kl_control.py
Code -> paper: `D` (`row_adam_direction`) is its U; `U = c D` (`directions`) its eta U (c is
eta); `F` its alpha eta U; `moments` v; t sketch.py's update counter. `merge_rows` forms F A in
float64, rounded once (any chunking or shard: the same bits), then every layer moves to A_{t+1}.

Defaults: beta2 = 0.95, eps = 1e-8, factor dtype bf16, the paper's; update_ratio = 1e-2
(`UPDATE_RATIO`, departure 4; the paper's is `update_ratio=6e-5`).

Departures from the paper (numbered; reason; test)
-------------------------------------------------
1. Row-sharded S, U, v, W under FSDP2 (infra/batched.py's `BatchedRowAdam`), row sums reduced in
   float64: d/world rows a process. tests/test_rowadam.py::test_row_sharded_state_equals_one_process_bitwise.
2. A moved fp32 weight halfway between two bf16 values moves one ulp toward zero, so an engine holds
   bf16 + int16 (sync.py). tests/test_rowadam.py::test_merge_moves_bf16_ties_one_ulp_toward_zero.
3. `prepare(per_layer=True)`: c_l = update_ratio ||W_l|| / ||D_l A_l||, for models from random weights.
   tests/test_rowadam.py::test_per_layer_scale_gives_each_layer_its_share_of_its_weights.
4. update_ratio 1e-2, not 6e-5: once the KL budget binds it sets the step and update_ratio only caps
   it (alpha_max x update_ratio of ||W||); 6e-5 left alpha at its cap and the toy at chance
   (bench/README.md, `defaults`). tests/test_kl_control.py::test_alpha_at_its_cap_is_warned_about_once.

Implementation notes
--------------------
- S is the mean-per-token loss's sketch, not divided again by the token count.
  tests/test_rowadam.py::test_the_moment_weights_updates_by_the_sketch_of_the_per_token_mean_loss.
- `prepare` changes nothing (`merge` commits, `discard` drops); a refusal changes nothing; a zero S
  gives D = 0. tests/test_rowadam.py::test_failures_change_nothing, test_zero_sketch_gives_zero_direction.
- Fast companion: infra/batched.py's `BatchedRowAdam`, the same bits over stacks of layers
  (tests/test_rowadam.py::test_batched_rowadam_equals_the_reference): prepare 5.9 -> 3.7 ms and merge
  7.0 -> 3.2 ms on the toy's 14 layers (bench/README.md, `loop_phases_companions`, batch 32).

Shape legend: d out rows, k in columns, r rank; n rows this process holds (n = d in one process).
"""

import math

import torch
import torch.distributed as dist

from sketch import PROJECTION, LayerSketch, refresh

MERGE_ELEMENTS = 2**24  # entries of W a merge works on at once (a float64 F A block and its rounding: 256 MiB)
UPDATE_RATIO = 1e-2  # ||U A|| / ||W|| before alpha: departure 4

def row_adam_direction(S, v, *, step, beta2=0.95, eps=1e-8):
    """RowAdam's D (d, r) of one layer from its sketch S (d, r) and row moments v (d,); returns
    (D, new v), nothing changed in place. `step`: the bias correction's, update + 1."""
    check_direction_inputs([S], [v], step, beta2, eps)
    d = torch.full((), float(S.shape[0]), dtype=torch.float64, device=S.device)  # () d, divided by as a tensor
    # v <- beta2 v + (1 - beta2) mean_j S_ij^2
    v = beta2 * v + (1 - beta2) * S.to(v.dtype).square().mean(dim=1)  # (d,)
    # root <- sqrt(v / (1 - beta2^t))
    root = (v / (1 - beta2**step)).sqrt()  # (d,)
    # den <- root + max(eps mean(root), tiny)
    mean_root = (root.double().sum() / d).to(root.dtype)  # ()
    den = root + torch.clamp(eps * mean_root, min=torch.finfo(root.dtype).tiny)  # (d,)
    # s <- min(den) / den, then s <- s / sqrt(mean(s^2))
    s = den.min() / den  # (d,), in (0, 1]
    s = s / (s.double().square().sum() / d).sqrt().to(s.dtype)  # (d,)
    # D <- s[:, None] S, then D <- D ||S|| / ||D||
    D = S * s[:, None].to(S.dtype)  # (d, r)
    S_sq, D_sq = S.double().square().sum(), D.double().square().sum()
    D.mul_(torch.where(D_sq > 0, (S_sq / D_sq).sqrt(), 1.0).to(D.dtype))  # D = 0 stays 0; no host read
    return D, v

def check_direction_inputs(sketches, moments, step, beta2, eps):
    for S, v in zip(sketches, moments):
        if S.dim() != 2 or v.shape != (S.shape[0],):
            raise ValueError(f"sketch must be (n, r) and its second moment (n,), got {tuple(S.shape)}, {tuple(v.shape)}")
    if step < 1 or not 0.0 <= beta2 < 1.0 or not eps > 0:
        raise ValueError(f"need step >= 1 (1-based: update + 1), beta2 in [0, 1), eps > 0; got {step}, {beta2}, {eps}")

def rows_per_chunk(width: int) -> int:
    return max(1, MERGE_ELEMENTS // width)  # rows of a (., width) weight merged at once

@torch.no_grad()
def merge_rows(rows, factor, projection, row_offset=0, chunk_rows=None, avoid_ties=True):
    """W[o:o+n] -= F[o:o+n] @ A for this process's rows, in row chunks: F A in float64 rounded once
    to W's dtype (any chunking, shard or device: the same bits). A row whose factor row is zero is
    left bit for bit; `avoid_ties=False` leaves the moved rows' bf16 ties to the caller (sync.py)."""
    n = rows.shape[0]
    moved = factor[row_offset:row_offset + n].ne(0).any(dim=1)  # (n,) rows F moves; never read to the host
    a = projection.to(torch.float64)  # (r, k)
    step = chunk_rows or rows_per_chunk(rows.shape[1])
    for start in range(0, n, step):
        stop = min(start + step, n)
        f = factor[row_offset + start:row_offset + stop].to(torch.float64)  # (m, r)
        # Shapes: (m, r) @ (r, k) -> (m, k); a zero row of F gives +0: W - 0 A = W
        rows[start:stop].sub_((f @ a).to(rows.dtype))
        if avoid_ties and rows.dtype == torch.float32:  # departure 2, in the moved rows only
            avoid_bf16_ties_(rows[start:stop], rows=moved[start:stop])

def avoid_bf16_ties_(w, *, rows=None):
    """Move every fp32 value exactly halfway between two bf16 values (low 16 bits 0x8000) one
    fp32 ulp toward zero, in place (departure 2); `rows` (n,) bool: only those rows."""
    bits = w.view(torch.int32)  # (..., n, k) raw fp32 words
    tie = (bits & 0xFFFF) == 0x8000  # (..., n, k)
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
    Refused, changing nothing: no backward since the last merge, a second prepare, a non-finite
    sum, a bad alpha, a cast from fp32."""

    shards_rows = False  # whether this class reduces row-sharded layers' sums over their group

    def __init__(self, layers: list[LayerSketch], *, seed=None, beta2=0.95, eps=1e-8,
                 update_ratio=UPDATE_RATIO, factor_dtype=torch.bfloat16):
        if not layers:
            raise ValueError("RowAdam needs at least one LayerSketch")
        for layer in layers:
            _check_master_dtype(layer, layer.module.weight.dtype, update_ratio)
        if len({(l.update, l.base_seed, id(l.group)) for l in layers}) != 1:
            raise ValueError("all layers must share one base seed, update number and process group (or none)")
        if layers[0].group is not None and not self.shards_rows:
            raise ValueError("row-sharded layers (attach(..., shard=...)): use infra/batched.py's BatchedRowAdam")
        if seed is not None and layers[0].base_seed != seed:
            raise ValueError(f"layers were attached with seed {layers[0].base_seed}, not seed={seed}: "
                             f"pass attach's seed, or leave seed out (the layers hold it)")
        if not 0.0 <= beta2 < 1.0 or not eps > 0 or not update_ratio > 0:
            raise ValueError("need 0 <= beta2 < 1, eps > 0, update_ratio > 0")
        self.layers, self.group, self.base_seed, self.update = layers, layers[0].group, layers[0].base_seed, layers[0].update
        self.beta2, self.eps, self.update_ratio, self.factor_dtype = beta2, eps, update_ratio, factor_dtype
        self._dtypes = [layer.module.weight.dtype for layer in layers]  # a later cast is refused
        self.moments = [torch.zeros(l.sketch.shape[0], dtype=l.sketch.dtype, device=l.sketch.device) for l in layers]
        self.directions = self._pending_moments = None  # U (n, r) each, and the new v, between prepare and merge

    rank = property(lambda self: self.layers[0].rank)
    refresh = staticmethod(refresh)  # every layer to A_t (infra/batched.py's makes their signs together)

    @torch.no_grad()
    def prepare(self, group=None, *, per_layer=False) -> float:
        """U = c D of every layer into `directions` (c_l each with `per_layer`); returns ||S||."""
        if self.directions is not None:
            raise RuntimeError("prepare() was already called for this update and its directions are in "
                               "opt.directions: merge(alpha) them, or discard() the batch and run a new backward")
        self._check_dtypes()
        whole = group is not None and self.group is None  # whole sketches on every process: summed here
        self._check_a_backward_ran(group if whole else None)
        for S in self._sketches() if whole else ():
            dist.all_reduce(S, group=group)  # in place: the summed sketches are the batch's
        S_sq = self._sketch_squares()  # (L,) float64 ||S_l||^2: the norm returned, and the finiteness check
        if not torch.isfinite(S_sq).all():
            raise FloatingPointError("summed sketch is not finite (or its squared norm overflows float64): "
                                     "weights, moments and counter unchanged; discard() drops the batch")
        D, self._pending_moments = self._directions(self.update + 1)
        self.directions = self._scale(D, per_layer)
        return math.sqrt(S_sq.sum().item())

    def _sketches(self):
        return [layer.sketch for layer in self.layers]

    def _sketch_squares(self):
        return torch.stack([layer.sketch.double().square().sum() for layer in self.layers])  # (L,)

    def _directions(self, step):  # (D of each layer, new v of each layer)
        out = [row_adam_direction(l.sketch, v, step=step, beta2=self.beta2, eps=self.eps)
               for l, v in zip(self.layers, self.moments)]
        return [D for D, _ in out], [v for _, v in out]

    def _scale(self, D, per_layer):
        """U = c D in place, c = update_ratio sqrt(sum ||W||^2 / sum ||D A||^2) (0 where D A = 0), or
        c_l per layer (departure 3); ||D A||^2 = sum((D (A A^T)) * D) in float64, no (n, k) block."""
        W_sq = torch.stack([local_rows(l.module.weight)[0].double().square().sum() for l in self.layers])  # (L,)
        A = [l.projection.double() for l in self.layers]  # (r, k) each
        DA_sq = torch.stack([((D_l.double() @ (a @ a.t())) * D_l.double()).sum() for D_l, a in zip(D, A)])  # (L,)
        if not per_layer:
            W_sq, DA_sq = W_sq.sum().expand(len(D)), DA_sq.sum().expand(len(D))
        c = torch.where(DA_sq > 0, self.update_ratio * (W_sq / DA_sq.clamp(min=torch.finfo(torch.float64).tiny)).sqrt(),
                        0.0)  # (L,) float64
        return [D_l.mul_(c_l.to(D_l.dtype)) for D_l, c_l in zip(D, c)]

    def _check_dtypes(self):
        for layer, dtype in zip(self.layers, self._dtypes):  # a cast of the model since the constructor
            if layer.module.weight.dtype != dtype:
                _check_master_dtype(layer, layer.module.weight.dtype, self.update_ratio)  # bf16, fp16: the reason
                raise TypeError(f"{layer.name}: the weight is {layer.module.weight.dtype}, but was {dtype} when RowAdam "
                                f"was built: the model was cast since; cast it back (nothing was changed)")

    def _check_a_backward_ran(self, group):
        """Refuse a batch no backward reached; with `group` every process refuses or none."""
        total = torch.tensor(sum(int(l.backwards) for l in self.layers), dtype=torch.int64)  # ()
        if group is not None:
            total = total.to(self.layers[0].sketch.device)
            dist.all_reduce(total, group=group)
        if int(total) == 0:
            raise ValueError("prepare(): no backward reached any sketch since the last merge() or discard(): call "
                             "loss.backward() between merges (nothing was changed)")

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
        alpha = float(alpha)
        if not math.isfinite(alpha) or alpha < 0:
            raise ValueError(f"alpha must be finite and >= 0, got {alpha}")
        factors, finite = self._factors(alpha)  # F (n, r) each; whether all are finite
        rows = [local_rows(layer.module.weight)[0] for layer in self.layers]  # (n, k) each
        for layer, w, f in zip(self.layers, rows, factors):
            if w.shape[0] != f.shape[0]:
                raise RuntimeError(f"{layer.name}: {w.shape[0]} weight rows here but {f.shape[0]} sketch rows: shard both alike")
        if not finite:  # a finite alpha can still overflow F
            raise ValueError(f"alpha = {alpha:g} makes F = alpha U overflow {self.factor_dtype}: nothing was merged")
        self._merge(rows, factors, self._pending_moments)
        self.directions = self._pending_moments = None
        self.update += 1
        self._zero_sketches()
        self.refresh(self.layers, self.update)
        return factors

    def _factors(self, alpha):
        factors = [(alpha * U).to(self.factor_dtype) for U in self.directions]  # F = bf16(alpha U)
        return factors, bool(torch.stack([torch.isfinite(f).all() for f in factors]).all())

    def _merge(self, rows, factors, moments):
        for layer, w, f, v, new in zip(self.layers, rows, factors, self.moments, moments):
            merge_rows(w, f, layer.projection)  # W -= F A_t
            v.copy_(new)

    def state_dict(self) -> dict:
        """Moments by layer name, counter, settings and the projection rule (sketch.PROJECTION)."""
        return {"update": self.update, "moments": {l.name: self._saved(l, v.clone()) for l, v in zip(self.layers, self.moments)},
                "base_seed": self.base_seed, "rank": self.rank, "beta2": self.beta2, "eps": self.eps,
                "update_ratio": self.update_ratio, "projection": PROJECTION}

    def _saved(self, layer, v):
        return v

    def load_state_dict(self, state: dict) -> None:
        """`state_dict()`'s moments, counter, settings; refused if of another projection (none: 1)."""
        projection = int(state.get("projection", 1))
        if projection != PROJECTION:
            raise ValueError(f"this state was saved under projection {projection}; this release makes A by "
                             f"projection {PROJECTION} only (sketch.PROJECTION): resume it with the release that saved it")
        if state["rank"] != self.rank or state["base_seed"] != self.base_seed:
            raise ValueError(f"checkpoint has rank {state['rank']}, seed {state['base_seed']}; this has {self.rank}, {self.base_seed}")
        if list(state["moments"]) != [l.name for l in self.layers]:
            raise ValueError("checkpoint holds a different set of target layers")
        local = {n: (m.to_local() if hasattr(m, "to_local") else m) for n, m in state["moments"].items()}
        if any(local[l.name].shape != v.shape for l, v in zip(self.layers, self.moments)):
            raise ValueError(f"moment shapes {[tuple(m.shape) for m in local.values()]} differ from this model's")
        if self.directions is not None:
            raise RuntimeError("cannot load state over a prepared update: discard() first")
        for l, v in zip(self.layers, self.moments):
            v.copy_(local[l.name])
        self.beta2, self.eps, self.update_ratio, self.update = (state[k] for k in ("beta2", "eps", "update_ratio", "update"))
        self._zero_sketches()
        self.refresh(self.layers, self.update)

def _check_master_dtype(layer, dtype, update_ratio):
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{layer.name}: weight is {dtype}; RowAdam merges into fp32 master weights (an update of "
                        f"~{update_ratio:g} is below bf16's resolution, ~4e-3): keep the weights fp32 (nothing was changed)")
