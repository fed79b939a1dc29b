"""
rowadam.py: RowAdam, and the low-rank merge of its update into fp32 master weights.

What it is
----------
Dense Adam keeps two fp32 moments per weight. RowAdam keeps one fp32 second moment per
output row of each target layer, `v` (d,), and turns the layer's sketch `S = G A^T` (d, r)
into a direction `D` (d, r) that is merged into the full weight as `W -= alpha * c * D A`.
There is no first moment: `A` is redrawn every update, so sketch coordinates of two updates
do not line up; per-row statistics do.

The math (SPEC sections 3 and 4), per target layer, update t (1-based in the formulas)
--------------------------------------------------------------------------------------
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
    opt = RowAdam(layers, base_seed=seed)      # layers = sketch.attach(model, rank, seed)
    ...backward into the sketches...
    opt.prepare()                               # all_reduce, directions, global scale
    alpha = ...                                 # kl_control.py, from opt.directions
    factors = opt.merge(alpha)                  # W -= F A; zero sketches; refresh A

Shape legend: d out rows, k in columns, r rank; n rows of a weight held by this rank.

Departures, numbered
--------------------
1. `||D A||_F^2` is computed as `sum((D G) * D)` with the (r, r) Gram matrix `G = A A^T`,
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
"""

import math

import torch
import torch.distributed as dist

from sketch import LayerSketch

MERGE_CHUNK_ROWS = 1024


# -----------------------------------------------------------------------------
# The per-layer direction

def row_adam_direction(sketch, second_moment, *, step, beta2=0.95, eps=1e-8):
    """RowAdam direction D (d, r) of one layer's sketch; updates `second_moment` (d,) in place.

    Validates everything first: on error the moment is left unchanged.
    """
    if sketch.dim() != 2:
        raise ValueError(f"sketch must be (d, r), got shape {tuple(sketch.shape)}")
    if second_moment.shape != (sketch.shape[0],):
        raise ValueError(f"second moment must have shape ({sketch.shape[0]},), got {tuple(second_moment.shape)}")
    if step < 1:
        raise ValueError(f"step is 1-based, got {step}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"beta2 must be in [0, 1), got {beta2}")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    if not torch.isfinite(sketch).all():
        raise FloatingPointError("sketch has non-finite values (inf/nan in the loss or its backward)")

    s_ = sketch.to(second_moment.dtype)  # (d, r)
    # v <- beta2 v + (1 - beta2) mean_j S_ij^2
    v = beta2 * second_moment + (1 - beta2) * s_.square().mean(dim=1)  # (d,)
    # root <- sqrt(v / (1 - beta2^t))
    root = (v / (1 - beta2**step)).sqrt()  # (d,)
    # den <- root + max(eps mean(root), tiny)
    tiny = torch.finfo(root.dtype).tiny
    den = root + torch.clamp(eps * root.mean(), min=tiny)  # (d,)
    # s <- min(den) / den, then s <- s / sqrt(mean(s^2))
    scale = den.min() / den  # (d,), in (0, 1]
    scale = scale / scale.square().mean().sqrt()
    # D <- s[:, None] S, then D <- D ||S|| / ||D||
    d = scale[:, None] * s_  # (d, r)
    d_norm = d.norm()
    if d_norm > 0:
        d = d * (s_.norm() / d_norm)
    second_moment.copy_(v)
    return d.to(sketch.dtype)


# -----------------------------------------------------------------------------
# Rows of a (possibly FSDP2-sharded) weight

def local_rows(weight):
    """(this rank's rows of `weight`, their global row offset). FSDP2 shards dim 0 like torch.chunk."""
    if hasattr(weight, "to_local"):  # a DTensor (FSDP2 at rest)
        local = weight.to_local()  # (n, k)
        mesh = weight.device_mesh
        if mesh.ndim != 1:
            raise NotImplementedError("only 1-D FSDP meshes are supported")
        chunk = -(-weight.shape[0] // mesh.size())  # ceil(d / world)
        return local, min(mesh.get_local_rank() * chunk, weight.shape[0])
    return weight, 0


@torch.no_grad()
def merge_rows(rows, factor, projection, row_offset=0, chunk_rows=MERGE_CHUNK_ROWS):
    """W[o:o+n] -= F[o:o+n] @ A for this rank's rows, in row chunks (never a whole (n, k) delta).

    F @ A is computed in float64 and rounded once to W's dtype (departure 4), so the result
    does not depend on the chunking or the device: FSDP row shards and the engines' merges
    (sync.py) give the same bits as an unsharded merge.
    """
    n = rows.shape[0]
    a = projection.to(torch.float64)  # (r, k)
    for start in range(0, n, chunk_rows):
        stop = min(start + chunk_rows, n)
        f = factor[row_offset + start:row_offset + stop].to(torch.float64)  # (c, r)
        # Shapes: (c, r) @ (r, k) -> (c, k)
        rows[start:stop].sub_((f @ a).to(rows.dtype))
        if rows.dtype == torch.float32:
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


def _sum_across(values, group):
    """Sum a small fp64 vector over the data-parallel group (identity with one process)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(values, group=group)
    return values


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
        if layers[0].base_seed != base_seed:
            raise ValueError(f"layers were attached with seed {layers[0].base_seed}, not {base_seed}")
        if not 0.0 <= beta2 < 1.0 or not eps > 0 or not update_ratio > 0:
            raise ValueError("need 0 <= beta2 < 1, eps > 0, update_ratio > 0")
        self.layers = layers
        self.base_seed, self.beta2, self.eps = base_seed, beta2, eps
        self.update_ratio, self.factor_dtype = update_ratio, factor_dtype
        self.update = layers[0].update  # completed updates; the formulas' t is update + 1
        # v: one fp32 second moment per output row, per layer.
        self.moments = [torch.zeros(l.sketch.shape[0], dtype=l.sketch.dtype, device=l.sketch.device)
                        for l in layers]  # (d,) each
        self.directions = None  # U per layer (d, r), set by prepare
        self._pending_moments = None

    @property
    def rank(self):
        return self.layers[0].rank

    # -- prepare: reduce sketches, directions, global scale -------------------------

    @torch.no_grad()
    def prepare(self, group=None) -> float:
        """Sum the sketches over ranks, compute every layer's U = c D; return ||S|| (all layers)."""
        if self.directions is not None:
            raise RuntimeError("prepare() was already called for this update: merge() or discard() first")
        # One all_reduce of all sketches, into a copy: the sketches stay as they were if this fails.
        flat = torch.cat([l.sketch.flatten() for l in self.layers])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flat, group=group)
        if not torch.isfinite(flat).all():
            raise FloatingPointError("summed sketch has non-finite values: nothing was changed")
        sketches = list(torch.split(flat, [l.sketch.numel() for l in self.layers]))
        sketches = [s.view_as(l.sketch) for s, l in zip(sketches, self.layers)]  # (d, r) each

        moments = [v.clone() for v in self.moments]
        dirs = [row_adam_direction(s, v, step=self.update + 1, beta2=self.beta2, eps=self.eps)
                for s, v in zip(sketches, moments)]  # D (d, r) each

        # c = update_ratio sqrt( sum ||W||^2 / sum ||D A||^2 ), both summed over this rank's
        # rows, then across ranks (departure 1: ||D A||^2 = sum((D A A^T) * D)).
        totals = torch.zeros(2, dtype=torch.float64, device=flat.device)
        for layer, d in zip(self.layers, dirs):
            rows, offset = local_rows(layer.module.weight)
            a = layer.projection.to(torch.float64)  # (r, k)
            gram = a @ a.t()  # (r, r)
            d_local = d[offset:offset + rows.shape[0]].to(torch.float64)  # (n, r)
            totals[0] += rows.to(torch.float64).square().sum()
            totals[1] += ((d_local @ gram) * d_local).sum()
        w_sq, da_sq = _sum_across(totals, group).tolist()
        c = self.update_ratio * math.sqrt(w_sq / da_sq) if da_sq > 0 else 0.0
        self.directions = [c * d for d in dirs]  # U (d, r) each
        self._pending_moments = moments
        return flat.norm().item()

    def discard(self) -> None:
        """Abandon a prepared update: directions dropped, moments and counter unchanged."""
        self.directions = self._pending_moments = None

    # -- merge: W -= bf16(alpha U) A ----------------------------------------------------

    @torch.no_grad()
    def merge(self, alpha: float) -> list[torch.Tensor]:
        """Merge bf16(alpha U) @ A into every weight; return the factors F exactly as merged."""
        if self.directions is None:
            raise RuntimeError("merge() needs prepare() first")
        alpha = float(alpha)
        if not math.isfinite(alpha) or alpha < 0:
            raise ValueError(f"alpha must be finite and >= 0, got {alpha}")
        factors = [(alpha * u).to(self.factor_dtype) for u in self.directions]  # F (d, r) each
        for layer, f in zip(self.layers, factors):
            rows, offset = local_rows(layer.module.weight)
            merge_rows(rows, f, layer.projection, offset)
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
        return {
            "update": self.update,
            "moments": {l.name: v.clone() for l, v in zip(self.layers, self.moments)},
            "base_seed": self.base_seed, "rank": self.rank,
            "beta2": self.beta2, "eps": self.eps, "update_ratio": self.update_ratio,
        }

    def load_state_dict(self, state: dict) -> None:
        names = [l.name for l in self.layers]
        if state["rank"] != self.rank or state["base_seed"] != self.base_seed:
            raise ValueError(f"checkpoint has rank {state['rank']}, seed {state['base_seed']}; "
                             f"this optimizer has rank {self.rank}, seed {self.base_seed}")
        if list(state["moments"]) != names:
            raise ValueError("checkpoint holds a different set of target layers")
        for l, v in zip(self.layers, self.moments):
            if state["moments"][l.name].shape != v.shape:
                raise ValueError(f"{l.name}: moment shape {tuple(state['moments'][l.name].shape)} "
                                 f"!= {tuple(v.shape)}")
        if self.directions is not None:
            raise RuntimeError("cannot load state over a prepared update: discard() first")
        for l, v in zip(self.layers, self.moments):
            v.copy_(state["moments"][l.name])
        self.beta2, self.eps, self.update_ratio = state["beta2"], state["eps"], state["update_ratio"]
        self.update = state["update"]
        for layer in self.layers:
            layer.zero_()
            layer.refresh(self.update)
