"""Kernels batched over many layers: what makes sketch.py's, rowadam.py's and sync.py's
per-layer loops a few dozen tensor operations per update for a model's hundreds of targets.
Each is the per-layer reference's bits, proven by a test:

| here | the reference | test |
|---|---|---|
| `make_signs_many`, `refresh` | `sketch.make_signs`, `sketch.refresh` | tests/test_sketch.py::test_signs_made_together_equal_one_at_a_time |
| `row_adam_groups` | `rowadam.row_adam_direction` | tests/test_rowadam.py::test_directions_across_ranks_equal_the_plain_formulas |
| `merge_layers` | `rowadam.merge_rows` | tests/test_rowadam.py::test_layers_merged_together_equal_merge_rows_each |
| `BatchedRowAdam` | `rowadam.RowAdam` | tests/test_rowadam.py::test_batched_rowadam_equals_the_reference |
| `merge_layers`, `make_signs_many` in infra/engine_weights.py's `StreamedEngineWeights` | `sync.EngineWeights` | tests/test_sync.py::test_batched_engine_merge_equals_the_reference |

`BatchedRowAdam` is the only RowAdam that takes row-sharded layers (infra/row_shard.py): its
whole-layer sums and minima are this process's float64 partials, reduced over the group
(rowadam.py departure 1). Its sums over layers run in another order than the reference's, so
`prepare`'s returned ||S|| agrees to float64 rounding; directions, factors, weights and moments
are bitwise (tested). Measured: bench/README.md, `loop_phases` and "Moved from rowadam.py's
docstring". train.py, infra/, examples/ and bench/ use these.

Shape legend: d out rows, k in columns, r rank; n rows of this process; L layers of one shape.
"""

import math

import torch
import torch.distributed as dist

import rowadam
from rowadam import RowAdam, avoid_bf16_ties_, local_rows, merge_rows
from sketch import MASK32, ROUND_KEY, SIGNS_PER_WORD, check_signs, mix32, projection_from_signs, projection_seed

SIGN_BATCH = 2**20  # hashed words per batch of make_signs_many (its int64 work: a few 8 MiB tensors)
SUM_BLOCK = 2**22  # entries per float64 block of ||W||^2 (32 MiB: few launches at 7B, little memory)
GRAM_ELEMENTS = 2**22  # sign entries whose Gram matrices prepare forms at once (fp32: 16 MiB)


# -----------------------------------------------------------------------------
# The signs of A, many projections at once

_SIGN_TABLES = {}  # device -> (256, 8) int8: entry [v, i] is -1 where bit i of the byte v is set, else +1


def _sign_table(device) -> torch.Tensor:
    if device not in _SIGN_TABLES:  # made on the device itself: no copy from the host
        bits = torch.arange(256, dtype=torch.int32, device=device)[:, None] >> torch.arange(8, dtype=torch.int32,
                                                                                             device=device)
        _SIGN_TABLES[device] = (1 - 2 * (bits & 1)).to(torch.int8)  # (256, 8)
    return _SIGN_TABLES[device]


def make_signs_many(rank: int, widths, seeds, *, device=None) -> list:
    """`make_signs(rank, width, seed)` for each (width, seed), computed together: the projections
    of one width in batches of at most SIGN_BATCH hashed words, so that a model's hundreds of
    projections take a few dozen tensor operations instead of a dozen each. Bit for bit
    `make_signs` one at a time. Each result is (rank, width); results of one batch may be views
    of one tensor. Seeds reach the device in one copy per batch (from pinned memory on a GPU:
    no wait for the device)."""
    widths, seeds = [int(w) for w in widths], [int(s) for s in seeds]
    if len(widths) != len(seeds):
        raise ValueError(f"{len(widths)} widths but {len(seeds)} seeds")
    for width, seed in zip(widths, seeds):
        check_signs(rank, width, seed)
    device = torch.device("cpu") if device is None else torch.device(device)
    out = [None] * len(widths)
    by_width = {}
    for i, width in enumerate(widths):
        by_width.setdefault(width, []).append(i)
    for width, members in by_width.items():
        blocks = -(-width // SIGNS_PER_WORD)  # words per row
        counter = torch.arange(rank * blocks, dtype=torch.int64, device=device)  # (r * blocks,)
        per_batch = max(1, SIGN_BATCH // (rank * blocks))
        for first in range(0, len(members), per_batch):
            part = members[first:first + per_batch]
            lo, hi = _seed_words([seeds[i] for i in part], device)  # (n, 1) each, or ints for one seed
            h = mix32(mix32(counter ^ lo) ^ hi)  # (n, r * blocks) words in [0, 2^32)
            high = torch.stack([(h >> 16) & 0xFF, h >> 24], dim=-1)  # (n, r * blocks, 2): bits 16-23 and 24-31
            del h
            # (n, r * blocks, 2, 8) int8: bit 16 + j of a word's h -> column 16 b + j of its row
            signs = _sign_table(device)[high].view(-1, rank, blocks * SIGNS_PER_WORD)[:, :, :width]  # (n, r, k)
            for j, i in enumerate(part):
                out[i] = signs[j] if width == blocks * SIGNS_PER_WORD else signs[j].contiguous()  # (r, k)
    return out


def _seed_words(seeds, device):
    """(lo, hi ^ ROUND_KEY) of each seed: Python ints for one seed (scalars in the kernels), else
    (n, 1) int64 tensors on `device`, copied from pinned memory on a GPU without waiting for it."""
    if len(seeds) == 1:
        return seeds[0] & MASK32, (seeds[0] >> 32) ^ ROUND_KEY
    words = torch.tensor([[s & MASK32, (s >> 32) ^ ROUND_KEY] for s in seeds], dtype=torch.int64)  # (n, 2)
    if device.type == "cuda":
        words = words.pin_memory().to(device, non_blocking=True)
    else:
        words = words.to(device)
    return words[:, :1], words[:, 1:]


def refresh(layers, update: int) -> None:
    """`sketch.refresh`: every layer to A_update, their signs made together (`make_signs_many`),
    one batch of tensor operations per device, rank and width."""
    groups = {}
    for layer in layers:
        groups.setdefault((layer.signs.device, layer.rank), []).append(layer)
    for (device, rank), group in groups.items():
        signs = make_signs_many(rank, [l.signs.shape[1] for l in group],
                                [projection_seed(l.base_seed, update, l.name) for l in group], device=device)
        for layer, s in zip(group, signs):
            layer.signs, layer.update = s, update


# -----------------------------------------------------------------------------
# Layers of one shape as one stack

def stack_of(tensors):
    """The (L, ...) tensor whose [i] is `tensors[i]` when they are consecutive equal-shaped
    contiguous views of one storage (as `attach` lays out the sketches of one shape), else
    None: what lets RowAdam's arithmetic run over many layers in one tensor operation."""
    first = tensors[0]
    step = first.numel()
    for i, t in enumerate(tensors):
        if not (t.shape == first.shape and t.dtype == first.dtype and t.device == first.device
                and t.is_contiguous() and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                and t.storage_offset() == first.storage_offset() + i * step):
            return None
    return first.as_strided((len(tensors), *first.shape), (step, *first.stride()), first.storage_offset())


def shape_groups(*lists) -> list:
    """The indices i grouped by the shape, dtype and device of `lists[0][i]`, `lists[1][i]`,
    ... (one list of tensors, or several of one length), each group in order."""
    groups = {}
    for i, ts in enumerate(zip(*lists)):
        groups.setdefault(tuple((tuple(t.shape), t.dtype, t.device) for t in ts), []).append(i)
    return list(groups.values())


# -----------------------------------------------------------------------------
# RowAdam's formulas and merge over stacks of layers

def row_adam_groups(sketches, moments, rows, *, step, beta2=0.95, eps=1e-8, group=None, out=None):
    """`row_adam_direction` of many layers with one batch of tensor operations per shape:
    `sketches` a list of (L, n, r) stacks of layers of one shape, `moments` their (L, n) row
    moments, `rows` their (L,) float64 whole-layer row counts d. With `group`, each process
    holds n of a layer's d rows, and every quantity the formulas take over all of a layer's rows
    (mean(root), min(den), mean(s^2), ||S||^2, ||D||^2) is this process's partial float64 sum or
    minimum, for all layers in one tensor, reduced across `group`: four small all_reduces in
    all (departure 1). Returns (D (L, n, r) and new v (L, n) per stack); changes nothing in
    place but `out` (preallocated (L, n, r) buffers for D). The division by d and every
    rounding are `row_adam_direction`'s, whose reductions over a layer's rows these are."""
    # row_adam_direction's refusals, over every layer's rows
    for S, v in zip([S.flatten(0, 1) for S in sketches], [v.flatten() for v in moments]):
        if S.dim() != 2 or v.shape != (S.shape[0],):
            raise ValueError(f"sketch must be (n, r) and its second moment (n,), got {tuple(S.shape)}, "
                             f"{tuple(v.shape)}")
    if step < 1 or not 0.0 <= beta2 < 1.0 or not eps > 0:
        raise ValueError(f"need step >= 1 (1-based: update + 1), beta2 in [0, 1), eps > 0; got {step}, {beta2}, {eps}")

    def reduced(parts, op=None):  # per-stack (L,) float64 partials, all reduced in one collective
        if group is None:
            return parts
        joined = torch.cat(parts)
        dist.all_reduce(joined, group=group, **({} if op is None else {"op": op}))
        return list(joined.split([len(p) for p in parts]))

    # v <- beta2 v + (1 - beta2) mean_j S_ij^2 ; root <- sqrt(v / (1 - beta2^t)), row by row
    new_v = [beta2 * v + (1 - beta2) * S.to(v.dtype).square().mean(dim=-1) for S, v in zip(sketches, moments)]  # (L, n)
    roots = [(v / (1 - beta2**step)).sqrt() for v in new_v]  # (L, n)
    # den <- root + max(eps mean(root), tiny), the mean over all d rows of each layer
    root_sums = reduced([root.double().sum(dim=-1) for root in roots])  # (L,) each
    dens = [root + torch.clamp(eps * (total / d).to(root.dtype), min=torch.finfo(root.dtype).tiny)[:, None]
            for root, total, d in zip(roots, root_sums, rows)]  # (L, n)
    # s <- min(den) / den, then s <- s / sqrt(mean(s^2)); a process without rows of a layer offers +inf
    den_min = reduced([den.min(dim=-1).values.double() if den.shape[-1] else
                       torch.full(den.shape[:1], math.inf, dtype=torch.float64, device=den.device) for den in dens],
                      dist.ReduceOp.MIN)  # (L,) each
    s = [m.to(den.dtype)[:, None] / den for m, den in zip(den_min, dens)]  # (L, n) each, in (0, 1]
    sq_sums = reduced([s_l.double().square().sum(dim=-1) for s_l in s])
    s = [s_l / (q / d).sqrt().to(s_l.dtype)[:, None] for s_l, q, d in zip(s, sq_sums, rows)]
    # D <- s[:, None] S, then D <- D ||S|| / ||D||
    D = [torch.mul(S, s_l[..., None].to(S.dtype), out=None if out is None else out[i])
         for i, (S, s_l) in enumerate(zip(sketches, s))]  # (L, n, r)
    norms = reduced([torch.stack([S.double().square().sum(dim=(1, 2)), D_l.double().square().sum(dim=(1, 2))], dim=1)
                     .flatten() for S, D_l in zip(sketches, D)])  # (2 L,): ||S||^2, ||D||^2 of each layer
    for D_l, pairs in zip(D, norms):  # no host read
        S_sq, D_sq = pairs.view(-1, 2).unbind(1)
        D_l.mul_(torch.where(D_sq > 0, (S_sq / D_sq).sqrt(), 1.0).to(D_l.dtype)[:, None, None])  # D = 0 stays 0
    return D, new_v


def _da_squared(layers, D, per_layer=False) -> torch.Tensor:
    """sum over `layers` (one shape) of ||D A||^2 = sum((D (A A^T)) * D) in float64, D (L, n, r)
    their directions (`per_layer`: each layer's, (L,)): the Gram matrices of as many layers as
    GRAM_ELEMENTS holds at once."""
    r, k = layers[0].signs.shape
    magnitude_sq = entry_magnitude(r, layers[0].sketch.dtype) ** 2  # 1/r, with A's own rounding
    per = max(1, GRAM_ELEMENTS // (r * k))
    total = torch.zeros(len(layers) if per_layer else (), dtype=torch.float64, device=D.device)
    for first in range(0, len(layers), per):
        part = slice(first, first + per)
        signs = torch.stack([l.signs for l in layers[part]]).to(torch.float32)  # (L, r, k)
        # A A^T: +-1 products summed by an fp32 GEMM, integers below 2^24 and so exact in any order
        gram = (signs @ signs.transpose(1, 2)).to(torch.float64) * magnitude_sq  # (L, r, r)
        del signs
        D64 = D[part].to(torch.float64)  # (L, n, r)
        if per_layer:
            total[part] = ((D64 @ gram) * D64).sum(dim=(1, 2))
        else:
            total += ((D64 @ gram) * D64).sum()
        del gram, D64  # before the next batch: one batch's float64 work at a time
    return total


def _sum_squares(t, block=SUM_BLOCK):
    """sum(t^2) in float64, a block of elements at a time (no float64 copy of a whole weight)."""
    flat = t.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for start in range(0, flat.numel(), block):
        part = flat[start:start + block].to(torch.float64)
        total += torch.dot(part, part)
        del part  # before the next block is made: one block at a time
    return total


def entry_magnitude(rank: int, dtype) -> float:
    """|A's entries| as `sketch.projection_from_signs` rounds them in `dtype` (1/sqrt(rank))."""
    return float(projection_from_signs(torch.ones(rank, 1, dtype=torch.int8), dtype)[0, 0])


def merge_layers(weights, factors, signs, magnitude: float, *, avoid_ties=True):
    """`merge_rows` for layers of one shape: W_i -= F_i @ A_i for this process's rows W_i
    (n, k) of each, F (L, n, r) their factors' rows, A_i = signs_i (r, k) times `magnitude` (the
    value A's entries hold: `entry_magnitude`). As many layers as MERGE_ELEMENTS holds are merged
    with one batch of tensor operations (stacked, F A in float64 rounded once, written back),
    a larger layer in row chunks: the same bits as `merge_rows` layer by layer, since F A is
    exact in float64 whatever the order of its sums (rowadam.merge_rows)."""
    n, k = weights[0].shape
    per = rowadam.MERGE_ELEMENTS // max(n * k, 1)
    if per < 2:  # two layers would overflow the budget: each layer's rows in chunks
        for w, f, s in zip(weights, factors, signs):
            merge_rows(w, f, s.to(torch.float64).mul_(magnitude), avoid_ties=avoid_ties)  # A (r, k) in float64
        return
    for first in range(0, len(weights), per):
        part = slice(first, first + per)
        W = torch.stack(weights[part])  # (L, n, k): a copy, written back below
        f = factors[part]  # (L, n, r)
        a = torch.stack(signs[part]).to(torch.float64).mul_(magnitude)  # (L, r, k) A of each layer
        # Shapes: (L, n, r) @ (L, r, k) -> (L, n, k); a row of F that is zero gives +0: W - 0 A = W
        W.sub_((f.to(torch.float64) @ a).to(W.dtype))
        del a
        if avoid_ties and W.dtype == torch.float32:  # departure 2, in the moved rows only
            avoid_bf16_ties_(W, rows=f.ne(0).any(dim=-1))
        torch._foreach_copy_(weights[part], list(W.unbind(0)))


# -----------------------------------------------------------------------------
# RowAdam over stacks of layers

class BatchedRowAdam(RowAdam):
    """`rowadam.RowAdam` whose arithmetic runs over each shape's stack of layers: S (L, n, r),
    v (L, n) and U (L, n, r) held together (each layer's `sketch`, `moments` and `directions`
    are views of them), and which takes row-sharded layers (their group's sums reduced in
    float64: rowadam.py departure 1). The same calls, refusals and state_dict."""

    shards_rows = True

    def __init__(self, layers, **settings):
        super().__init__(layers, **settings)
        # Each shape's (members, S (L, n, r), v (L, n), U (L, n, r), d (L,) whole row counts):
        # sketches made apart are copied into one stack and the layers pointed at it.
        self._groups = []
        self.moments, self._u = [None] * len(layers), [None] * len(layers)
        for members in shape_groups([l.sketch for l in layers], [l.signs for l in layers]):
            S = stack_of([layers[i].sketch for i in members])
            if S is None:
                S = torch.stack([layers[i].sketch for i in members])  # (L, n, r)
                for j, i in enumerate(members):
                    layers[i].sketch = S[j]
            v, U = torch.zeros(S.shape[:2], dtype=S.dtype, device=S.device), torch.empty_like(S)  # (L, n), (L, n, r)
            d = torch.tensor([layers[i].rows for i in members], dtype=torch.float64, device=S.device)  # (L,)
            self._groups.append((members, S, v, U, d))
            for j, i in enumerate(members):
                self.moments[i], self._u[i] = v[j], U[j]  # (n,), (n, r): views, in the layers' order

    def _sketches(self):
        return [S for _, S, _, _, _ in self._groups]  # (L, n, r) each

    def _sketch_squares(self):
        S_sq = torch.cat([S.double().square().sum(dim=(1, 2)) for S in self._sketches()])  # (L,) by group
        if self.group is not None:
            dist.all_reduce(S_sq, group=self.group)  # this process's rows -> all rows (departure 1)
        return S_sq

    def _directions(self, step, per_layer):
        """(U = c D of every layer, views of the stacks' U buffers; the stacks' new v), by `row_adam_groups`."""
        D, new_v = row_adam_groups(self._sketches(), [v for _, _, v, _, _ in self._groups],
                                   [d for *_, d in self._groups], step=step, beta2=self.beta2, eps=self.eps,
                                   group=self.group, out=[U for _, _, _, U, _ in self._groups])  # (L, n, r) each
        if per_layer:
            self._scale_per_layer(D)  # U = c_l D per layer (departure 3)
        else:
            self._scale_all_layers(D)  # U = c D, the paper's one scale
        return list(self._u), new_v  # (n, r) each: views of the groups' U

    def _scale_all_layers(self, D):
        """U = c D in place for every layer, c = update_ratio sqrt( sum ||W||^2 / sum ||D A||^2 ),
        both summed over this process's rows (||D A||^2 = sum((D A A^T) * D): implementation
        notes); c = 0 where every D A is zero."""
        totals = torch.zeros(2, dtype=torch.float64, device=D[0].device)  # (sum ||W||^2, sum ||D A||^2)
        for layer in self.layers:
            totals[0] += _sum_squares(local_rows(layer.module.weight)[0])
        for (members, *_), D_g in zip(self._groups, D):
            totals[1] += _da_squared([self.layers[i] for i in members], D_g)
        if self.group is not None:
            dist.all_reduce(totals, group=self.group)  # this process's rows -> all rows (departure 1)
        W_sq, DA_sq = totals.tolist()
        c = self.update_ratio * math.sqrt(W_sq / DA_sq) if DA_sq > 0 else 0.0
        for D_g in D:
            D_g.mul_(c)  # U = c D, in place

    def _scale_per_layer(self, D):
        """U_l = c_l D_l in place, c_l = update_ratio ||W_l|| / ||D_l A_l|| (0 where D_l A_l = 0),
        the two norms of each layer summed over this process's rows and reduced in one collective."""
        device = D[0].device
        totals = torch.zeros(2, len(self.layers), dtype=torch.float64, device=device)  # (||W_l||^2, ||D_l A_l||^2)
        totals[0] = torch.stack([_sum_squares(local_rows(layer.module.weight)[0]) for layer in self.layers])
        indices = [torch.tensor(members, device=device) for members, *_ in self._groups]  # each group's layers
        for (members, *_), index, D_g in zip(self._groups, indices, D):
            totals[1].index_copy_(0, index, _da_squared([self.layers[i] for i in members], D_g, per_layer=True))
        if self.group is not None:
            dist.all_reduce(totals, group=self.group)  # this process's rows -> all rows (departure 1)
        W_sq, DA_sq = totals
        c = torch.where(DA_sq > 0, self.update_ratio * (W_sq / DA_sq.clamp(min=torch.finfo(torch.float64).tiny)).sqrt(),
                        0.0)  # (L,) float64
        for index, D_g in zip(indices, D):
            D_g.mul_(c[index].to(D_g.dtype)[:, None, None])  # U = c_l D, in place

    def _zero_sketches(self):
        for _, S, _, _, _ in self._groups:
            S.zero_()
        for layer in self.layers:
            layer.backwards = 0

    def _factors(self, alpha):
        self._stacked = [(alpha * U).to(self.factor_dtype) for _, _, _, U, _ in self._groups]  # F (L, n, r) per shape
        factors = [None] * len(self.layers)
        for (members, *_), F_g in zip(self._groups, self._stacked):
            for j, i in enumerate(members):
                factors[i] = F_g[j]  # (n, r), in the layers' order
        return factors, bool(torch.stack([torch.isfinite(F_g).all() for F_g in self._stacked]).all())

    def _merge(self, rows, factors):
        """W -= F A_t, each weight shape's layers together (`merge_layers`: merge_rows' bits); v committed; S = 0."""
        magnitude = entry_magnitude(self.rank, self.layers[0].sketch.dtype)  # |A's entries| as the layers form A
        for (members, *_), F_g in zip(self._groups, self._stacked):
            merge_layers([rows[i] for i in members], F_g, [self.layers[i].signs for i in members], magnitude)
        for (_, _, v, _, _), new in zip(self._groups, self._pending_moments):
            v.copy_(new)
        self._stacked = None
        self._zero_sketches()

    refresh = staticmethod(refresh)  # every layer's signs made together

    def _saved(self, layer, v):
        return v if layer.shard is None else layer.shard.saved(v, layer.module.weight, layer.rows)

