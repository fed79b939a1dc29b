"""
rowadam.py: RowAdam, and the low-rank merge of its update into fp32 master weights.

What it is
----------
Dense Adam keeps two fp32 moments per weight. RowAdam keeps one fp32 second moment per
output row of each target layer, `v` (d,), and turns the layer's sketch `S = G A^T` (d, r)
into a direction `D` (d, r) that is merged into the full weight as `W -= alpha * c * D A`.
There is no first moment: `A` is redrawn every update, so sketch coordinates of two updates
do not line up; per-row statistics do.

The math, per target layer, update t (1-based)
----------------------------------------------
The paper's method section on RowAdam (arXiv:2610.06647) keeps Adam's adaptive scaling, but
per row of the sketch instead of per element, and merges the update straight into the full
weight as `W <- W - alpha eta U A`. Below, the paper's `U` is `D` and its learning rate eta
is the global scale `c`, so this file's `U = c D` stands for the paper's `eta U`:

    v     <- beta2 * v + (1 - beta2) * mean_j S[i, j]^2         row-wise over the r columns
    root  <- sqrt(v / (1 - beta2^t))
    den   <- root + max(eps * mean(root), tiny)
    s     <- min(den) / den                     inverse row scale in (0, 1], no overflow
    s     <- s / sqrt(mean(s^2))                RMS-normalise the row scales
    D     <- s[:, None] * S
    D     <- D * ||S||_F / ||D||_F              keep this layer's sketch norm

then one global scale over all target layers (and all FSDP shards):

    c = update_ratio * sqrt( sum_layers ||W||_F^2 / sum_layers ||D A||_F^2 )
    U = c * D                                   so ||U A|| = update_ratio * ||W||

and the merge, for the step multiplier alpha chosen by kl_control.py:

    F = bf16(alpha * U)                         what the rollout engines receive
    W <- W - F @ A                              fp32 master weights, in row chunks

Defaults: beta2 = 0.95, eps = 1e-8, update_ratio = 6e-5, factor dtype bf16.

Use
---
    opt = RowAdam(layers, base_seed=seed)      # layers = sketch.attach(model, rank, seed[, group])
    ...backward into the sketches...
    opt.prepare()                               # directions, global scale (this process's rows)
    alpha = ...                                 # kl_control.py, from opt.directions
    factors = opt.merge(alpha)                  # W -= F A; zero sketches; refresh A

Shape legend: d out rows, k in columns, r rank; n rows of a weight held by this process.

Departures, numbered
--------------------
1. `||D A||_F^2` is computed as `sum((D (A A^T)) * D)` with the (r, r) Gram matrix `A A^T`,
   identical in exact arithmetic and never forming any (rows, k) block: O(r^2 k + d r^2)
   instead of O(d r k).
2. `prepare` computes the new moments but `merge` commits them, together with the update
   counter: a step abandoned between the two (`discard()`, e.g. when the KL probe fails)
   leaves the optimizer exactly as it was.
3. float64 weights are accepted (for tests against float64 references); bf16/fp16 weights
   are refused: an update of 6e-5 relative is far below their resolution.
4. The merge computes `F @ A` in float64 and rounds it once. A bf16 factor times +-1/sqrt(r)
   is exact in float64 for r a power of 4 (r = 256: 1/16), so the delta is the correctly
   rounded one whatever the summation order: a sharded trainer and an unsharded engine hold
   bit-identical fp32 masters. The cost is one float64 (c, k) block per chunk.
5. After every fp32 merge, a weight that lies exactly halfway between two bf16 values moves
   one fp32 ulp (2^-24 relative) toward zero (`avoid_bf16_ties_`, about 1 weight in 65536).
   Then fp32 = bf16(fp32) + an int16 count of fp32 ulps, exactly, so a rollout engine can hold
   the trainer's fp32 master as vLLM's bf16 weight plus a 2-byte residual (sync.py) instead
   of a 4-byte copy. Both sides apply the same rule to the same bits.
6. State is row-sharded like the weights under FSDP2 (sketch.py departure 5): each trainer
   process holds its rows of S, U and v and merges its rows of W. What the formulas take over
   all of a layer's rows (mean root, minimum denominator, mean square scale, the norms, c) is
   summed from per-process partial sums in float64 with small all_reduces, so that no process
   ever holds a whole layer's S or U; the KL probe and the engine sync gather U or F one
   layer at a time.
7. `S` is the sketch of the global mean-per-token loss (ppo.py divides each rank's loss by the
   global token count N), taken as it is: the paper's RowAdam is stated on that sketch. The
   authors' NeMo-RL code divides the sketch by the valid-token count before RowAdam
   (`normalization_tokens`); on the same inputs that amounted to a second division of this
   sketch, which within one update changes nothing (D does not depend on the scale of S) but
   weights each update's square in the moving moment v by 1/N^2, so that updates with fewer
   tokens count for more. Not done here (tests/test_rowadam.py shows the two differ once N
   varies).
"""

import math

import torch
import torch.distributed as dist

from sketch import LayerSketch

MERGE_CHUNK_ROWS = 1024


# -----------------------------------------------------------------------------
# The direction, over row shards

def _sum_over(values, group, op=None):
    """Reduce a small vector over `group`; `group=None`: this process holds every row (identity)."""
    if group is not None:
        dist.all_reduce(values, op=op or dist.ReduceOp.SUM, group=group)
    return values


def row_adam_directions(sketches, moments, *, step, beta2=0.95, eps=1e-8, rows=None, group=None, out=None):
    """RowAdam directions D (n, r), one per layer, from this process's sketch rows S (n, r) and
    row moments v (n,); returns (directions, new moments, sum over layers of ||S||_F^2) and
    changes nothing in place.

    Every quantity taken over all of a layer's rows (the mean root, the minimum denominator,
    the mean square of the row scales, the two Frobenius norms) is this process's partial sum
    or minimum, reduced across `group` in float64 (departure 6); `rows[i]` is layer i's total
    row count d. `group=None`: this process holds all rows (the formulas of the module
    docstring's section "The math").
    `out`: preallocated (n, r) buffers for the directions (no transient copies).
    """
    for S, v in zip(sketches, moments):
        if S.dim() != 2:
            raise ValueError(f"sketch must be (n, r), got shape {tuple(S.shape)}")
        if v.shape != (S.shape[0],):
            raise ValueError(f"second moment must have shape ({S.shape[0]},), got {tuple(v.shape)}")
    if step < 1:
        raise ValueError(f"step is 1-based, got {step}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"beta2 must be in [0, 1), got {beta2}")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    device = sketches[0].device
    d_rows = torch.tensor([S.shape[0] for S in sketches] if rows is None else rows,
                          dtype=torch.float64, device=device)  # (L,): each layer's d, all processes together

    # v <- beta2 v + (1 - beta2) mean_j S_ij^2 ; root <- sqrt(v / (1 - beta2^t))
    new_v = [beta2 * v + (1 - beta2) * S.to(v.dtype).square().mean(dim=1) for S, v in zip(sketches, moments)]  # (n,)
    roots = [(v / (1 - beta2**step)).sqrt() for v in new_v]  # (n,)
    # den <- root + max(eps mean(root), tiny), mean over all d rows of the layer
    root_sum = _sum_over(torch.stack([root.double().sum() for root in roots]), group)  # (L,)
    dens = []
    for root, total, d in zip(roots, root_sum, d_rows):
        tiny = torch.finfo(root.dtype).tiny
        dens.append(root + torch.clamp(eps * (total / d).to(root.dtype), min=tiny))  # (n,)
    # s <- min(den) / den, then s <- s / sqrt(mean(s^2))
    inf = float("inf")
    den_min = _sum_over(torch.stack([den.min().double() if den.numel() else torch.tensor(inf, dtype=torch.float64,
                                     device=device) for den in dens]), group, dist.ReduceOp.MIN)  # (L,)
    s = [m.to(den.dtype) / den for m, den in zip(den_min, dens)]  # (n,) each, in (0, 1]
    sq_sum = _sum_over(torch.stack([s_l.double().square().sum() for s_l in s]), group)  # (L,)
    s = [s_l / (q / d).sqrt().to(s_l.dtype) for s_l, q, d in zip(s, sq_sum, d_rows)]
    # D <- s[:, None] S, then D <- D ||S|| / ||D||
    D = []
    for i, (S, s_l) in enumerate(zip(sketches, s)):
        buf = out[i] if out is not None else torch.empty_like(S)
        D.append(torch.mul(S, s_l[:, None].to(S.dtype), out=buf))  # (n, r)
    norms = _sum_over(torch.stack([torch.stack([S.double().square().sum(), D_l.double().square().sum()])
                                   for S, D_l in zip(sketches, D)]), group)  # (L, 2): ||S||^2, ||D||^2
    for D_l, (S_sq, D_sq) in zip(D, norms):
        if D_sq > 0:
            D_l.mul_((S_sq / D_sq).sqrt().to(D_l.dtype))
    return D, new_v, norms[:, 0].sum().item()


def _sum_squares(t, block=2**20):
    """sum(t^2) in float64, a block of elements at a time (no float64 copy of a whole weight)."""
    flat = t.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for start in range(0, flat.numel(), block):
        part = flat[start:start + block].to(torch.float64)
        total += torch.dot(part, part)
        del part  # before the next block is made: one block at a time
    return total


# -----------------------------------------------------------------------------
# Rows of a (possibly FSDP2-sharded) weight

def local_rows(weight):
    """(this process's rows of `weight`, their global row offset). FSDP2 shards dim 0 like torch.chunk."""
    if hasattr(weight, "to_local"):  # a DTensor (FSDP2 at rest)
        local = weight.to_local()  # (n, k)
        mesh = weight.device_mesh
        if mesh.ndim != 1:
            raise NotImplementedError("only 1-D FSDP meshes are supported")
        chunk = -(-weight.shape[0] // mesh.size())  # ceil(d / world)
        return local, min(mesh.get_local_rank() * chunk, weight.shape[0])
    return weight, 0


@torch.no_grad()
def merge_rows(rows, factor, projection, row_offset=0, chunk_rows=MERGE_CHUNK_ROWS, avoid_ties=True):
    """W[o:o+n] -= F[o:o+n] @ A for this process's rows, in row chunks (never a whole (n, k) delta).

    F @ A is computed in float64 and rounded once to W's dtype (departure 4), so the result
    does not depend on the chunking or the device: FSDP row shards and the engines' merges
    (sync.py) give the same bits as an unsharded merge. `avoid_ties=False` leaves bf16 ties
    (departure 5) to the caller: the engines move them as they split the result.
    """
    n = rows.shape[0]
    a = projection.to(torch.float64)  # (r, k)
    for start in range(0, n, chunk_rows):
        stop = min(start + chunk_rows, n)
        f = factor[row_offset + start:row_offset + stop].to(torch.float64)  # (c, r)
        # Shapes: (c, r) @ (r, k) -> (c, k)
        rows[start:stop].sub_((f @ a).to(rows.dtype))
        if avoid_ties and rows.dtype == torch.float32:
            avoid_bf16_ties_(rows[start:stop])  # departure 5


def avoid_bf16_ties_(w):
    """Move every fp32 value that lies exactly halfway between two bf16 values (low 16 bits
    0x8000) one fp32 ulp toward zero, in place (departure 5).

    An fp32 weight is then exactly its bf16 rounding plus a residual in [-32767, 32767] fp32
    ulps, which an int16 holds: the rollout engines keep that residual next to vLLM's bf16
    weight instead of a whole fp32 copy (sync.py). Both sides apply it after every merge.
    """
    bits = w.view(torch.int32)  # (n, k) raw fp32 words
    bits.sub_(((bits & 0xFFFF) == 0x8000).to(torch.int32))
    return w


# -----------------------------------------------------------------------------
# The optimizer

class RowAdam:
    def __init__(self, layers: list[LayerSketch], *, base_seed, beta2=0.95, eps=1e-8,
                 update_ratio=6e-5, factor_dtype=torch.bfloat16):
        if not layers:
            raise ValueError("RowAdam needs at least one LayerSketch")
        for layer in layers:
            dtype = layer.module.weight.dtype
            if dtype not in (torch.float32, torch.float64):
                raise TypeError(f"{layer.name}: weight is {dtype}; RowAdam merges into fp32 master "
                                f"weights (a relative update of ~{update_ratio:g} is below bf16's "
                                f"resolution of ~4e-3 and would be rounded away)")
        if len({layer.update for layer in layers}) != 1 or len({l.base_seed for l in layers}) != 1:
            raise ValueError("all layers must share one base seed and update number")
        if len({id(layer.group) for layer in layers}) != 1:
            raise ValueError("all layers must share one process group (or none)")
        if layers[0].base_seed != base_seed:
            raise ValueError(f"layers were attached with seed {layers[0].base_seed}, not {base_seed}")
        if not 0.0 <= beta2 < 1.0 or not eps > 0 or not update_ratio > 0:
            raise ValueError("need 0 <= beta2 < 1, eps > 0, update_ratio > 0")
        self.layers = layers
        self.group = layers[0].group  # rows are sharded over it (sketch.py departure 5), or None
        self.base_seed, self.beta2, self.eps = base_seed, beta2, eps
        self.update_ratio, self.factor_dtype = update_ratio, factor_dtype
        self.update = layers[0].update  # completed updates; the formulas' t is update + 1
        # v: one fp32 second moment per output row this process holds, per layer.
        self.moments = [torch.zeros(l.sketch.shape[0], dtype=l.sketch.dtype, device=l.sketch.device)
                        for l in layers]  # (n,) each
        # U per layer, this process's rows (n, r): allocated once and written in place by every
        # prepare (no transient copies); `directions` exposes them between prepare and merge.
        self._u = [torch.empty_like(l.sketch) for l in layers]
        self.directions = None
        self._pending_moments = None

    @property
    def rank(self):
        return self.layers[0].rank

    # -- prepare: directions, global scale --------------------------------------------

    @torch.no_grad()
    def prepare(self, group=None) -> float:
        """Compute every layer's U = c D (this process's rows); return ||S|| over all layers.

        The sketches were already summed over processes: in backward (row-sharded layers) or, for
        whole sketches held by several processes, here with one all_reduce each over `group`.
        """
        if self.directions is not None:
            raise RuntimeError("prepare() was already called for this update: merge() or discard() first")
        if group is not None and self.group is None:
            for l in self.layers:  # whole sketches on every process: sum them (in place)
                dist.all_reduce(l.sketch, group=group)
        sketches = [l.sketch for l in self.layers]  # (n, r) each, summed over processes
        bad = torch.tensor([float(sum(int(not torch.isfinite(s).all()) for s in sketches))],
                           dtype=torch.float64, device=sketches[0].device)
        if _sum_over(bad, self.group).item():
            raise FloatingPointError("summed sketch has non-finite values: nothing was changed")

        D, moments, S_sq = row_adam_directions(sketches, self.moments, step=self.update + 1, beta2=self.beta2,
                                               eps=self.eps, rows=[l.rows for l in self.layers], group=self.group,
                                               out=self._u)  # D (n, r) each, in the U buffers

        # c = update_ratio sqrt( sum ||W||^2 / sum ||D A||^2 ), both summed over this process's
        # rows, then across processes (departure 1: ||D A||^2 = sum((D A A^T) * D)).
        totals = torch.zeros(2, dtype=torch.float64, device=sketches[0].device)
        for layer, D_l in zip(self.layers, D):
            W_rows, _ = local_rows(layer.module.weight)
            a = layer.projection.to(torch.float64)  # (r, k)
            gram = a @ a.t()  # (r, r)
            D64 = D_l.to(torch.float64)  # (n, r)
            totals[0] += _sum_squares(W_rows)
            totals[1] += ((D64 @ gram) * D64).sum()
        W_sq, DA_sq = _sum_over(totals, self.group).tolist()
        c = self.update_ratio * math.sqrt(W_sq / DA_sq) if DA_sq > 0 else 0.0
        for D_l in D:
            D_l.mul_(c)  # U = c D, in place
        self.directions = D
        self._pending_moments = moments
        return math.sqrt(S_sq)

    def discard(self) -> None:
        """Abandon a prepared update: directions dropped, moments and counter unchanged."""
        self.directions = self._pending_moments = None

    # -- merge: W -= bf16(alpha U) A ----------------------------------------------------

    @torch.no_grad()
    def merge(self, alpha: float) -> list[torch.Tensor]:
        """Merge bf16(alpha U) @ A into this process's rows of every weight; return this
        process's rows of the factors F exactly as merged (`sketch.gather_rows` completes them)."""
        if self.directions is None:
            raise RuntimeError("merge() needs prepare() first")
        alpha = float(alpha)
        if not math.isfinite(alpha) or alpha < 0:
            raise ValueError(f"alpha must be finite and >= 0, got {alpha}")
        factors = [(alpha * u).to(self.factor_dtype) for u in self.directions]  # F (n, r) each
        for layer, f in zip(self.layers, factors):
            rows, _ = local_rows(layer.module.weight)
            if rows.shape[0] != f.shape[0]:
                raise RuntimeError(f"{layer.name}: {rows.shape[0]} local weight rows but {f.shape[0]} sketch rows "
                                   f"(attach(..., group=...) must match the FSDP2 sharding)")
            merge_rows(rows, f, layer.projection)
        for v, new in zip(self.moments, self._pending_moments):
            v.copy_(new)
        self.discard()
        self.update += 1
        for layer in self.layers:
            layer.zero_()
            layer.refresh(self.update)  # A_{t+1}
        return factors

    # -- checkpoints ----------------------------------------------------------------

    def state_dict(self) -> dict:
        """Moments, counter and configuration. Row-sharded moments are DTensors on the
        weights' device mesh, so that torch.distributed.checkpoint saves every process's rows."""
        return {
            "update": self.update,
            "moments": {l.name: self._shared(l, v.clone()) for l, v in zip(self.layers, self.moments)},
            "base_seed": self.base_seed, "rank": self.rank,
            "beta2": self.beta2, "eps": self.eps, "update_ratio": self.update_ratio,
        }

    def _shared(self, layer, v):
        if self.group is None:
            return v
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(v, layer.module.weight.device_mesh, [Shard(0)], run_check=False,
                                  shape=(layer.rows,), stride=(1,))

    def load_state_dict(self, state: dict) -> None:
        names = [l.name for l in self.layers]
        if state["rank"] != self.rank or state["base_seed"] != self.base_seed:
            raise ValueError(f"checkpoint has rank {state['rank']}, seed {state['base_seed']}; "
                             f"this optimizer has rank {self.rank}, seed {self.base_seed}")
        if list(state["moments"]) != names:
            raise ValueError("checkpoint holds a different set of target layers")
        local = {n: (m.to_local() if hasattr(m, "to_local") else m) for n, m in state["moments"].items()}
        for l, v in zip(self.layers, self.moments):
            if local[l.name].shape != v.shape:
                raise ValueError(f"{l.name}: moment shape {tuple(local[l.name].shape)} != {tuple(v.shape)}")
        if self.directions is not None:
            raise RuntimeError("cannot load state over a prepared update: discard() first")
        for l, v in zip(self.layers, self.moments):
            v.copy_(local[l.name])
        self.beta2, self.eps, self.update_ratio = state["beta2"], state["eps"], state["update_ratio"]
        self.update = state["update"]
        for layer in self.layers:
            layer.zero_()
            layer.refresh(self.update)
