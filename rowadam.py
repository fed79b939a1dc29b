"""
rowadam.py: RowAdam, and the low-rank merge of its update into fp32 master weights.

What it is
----------
Dense Adam keeps two fp32 moments per weight. RowAdam keeps one fp32 second moment per
output row of each target layer, `v` (d,), and turns the layer's sketch `S = G A^T` (d, r)
into a direction `D` (d, r) that is merged into the full weight as `W -= alpha * c * D A`.
There is no first moment: `A` is redrawn every update, so sketch coordinates of two updates
do not line up; per-row statistics do.

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

One update, given a Hugging Face causal LM `model` with fp32 weights, a batch `ids` (B, T),
a `loss_fn(model, ids)` (train.py: ppo.py's policy loss) and a `choose_alpha(layers,
directions)` that returns the step multiplier alpha >= 0 (train.py: kl_control.py's probe
and solve_alpha; kl_control.py's Use block is the whole update with them). `factors`, this
process's rows of each layer's F, is what sync.py sends to the rollout engines. The next
update runs the same lines from the backward on: `merge` has zeroed the sketches and moved
every layer to A_1. `RowAdam`'s docstring says what each call does and refuses;
tests/test_rowadam.py::test_the_use_block_runs runs this block on the tiny Qwen2.

The math, per target layer, at update t
---------------------------------------
The paper's method section on RowAdam (arXiv:2610.06647) keeps Adam's adaptive scaling, but
per row of the sketch instead of per element, and merges the update straight into the full
weight as `W <- W - alpha eta U A`. Below, the paper's `U` is `D` and its learning rate eta
is the global scale `c`, so this file's `U = c D` stands for the paper's `eta U`. The update
t is the project's one counter (sketch.py, "The update counter"): the 0-based count of
updates merged before this one, `RowAdam.update`; update t uses A_t, and the bias
correction's step is t + 1, the number of sketches v has averaged, this one included:

    v     <- beta2 * v + (1 - beta2) * mean_j S[i, j]^2         row-wise over the r columns
    root  <- sqrt(v / (1 - beta2^(t + 1)))
    den   <- root + max(eps * mean(root), tiny)
    s     <- min(den) / den                     inverse row scale in (0, 1], no overflow
    s     <- s / sqrt(mean(s^2))                RMS-normalise the row scales
    D     <- s[:, None] * S
    D     <- D * ||S||_F / ||D||_F              keep this layer's sketch norm

(`row_adam_direction`), then one global scale over all target layers:

    c = update_ratio * sqrt( sum_layers ||W||_F^2 / sum_layers ||D A||_F^2 )
    U = c * D                                   so ||U A|| = update_ratio * ||W||

(`RowAdam.prepare`; `prepare(per_layer=True)` instead scales each layer to its own weights,
c_l = update_ratio ||W_l|| / ||D_l A_l||: departure 3), and the merge, for the step
multiplier alpha chosen by kl_control.py:

    F = bf16(alpha * U)                         what the rollout engines receive
    W <- W - F @ A_t                            fp32 master weights, in row chunks

(`RowAdam.merge`, `merge_rows`), after which the layers move to A_{t+1}.

Defaults, and how to choose them
--------------------------------
beta2 = 0.95, eps = 1e-8 and factor dtype bf16, the paper's; update_ratio = 1e-2
(`UPDATE_RATIO`), where the paper takes 6e-5 (train.py's paper presets keep it).
- update_ratio and the KL budget. `prepare` scales U so that ||U A|| = update_ratio ||W||,
  and kl_control.py's KL1 is quadratic in U: KL1 = update_ratio^2 K, where K is the KL1 of
  the same direction scaled to ||U A|| = ||W||. alpha = min(alpha_max, sqrt(budget / KL1))
  then makes the merged step, relative to the weights,

      ||alpha U A|| / ||W|| = min(alpha_max * update_ratio, sqrt(budget / K))

  Once the budget binds (alpha < alpha_max, predicted KL = budget), the step is
  sqrt(budget / K) and update_ratio does not matter; while alpha sits at its cap, the step is
  alpha_max * update_ratio and the budget does nothing. So update_ratio is the largest step
  an update may take, as a share of the weights: the default allows 3% of ||W|| (alpha_max 3
  x 1e-2), so that the KL budget, which is what knows how far the policy may move, sets the
  step. Measured with the three calls' budget and calibration (bench/README.md, `defaults.py`:
  nine small loops, seeds 5-9, the earlier defaults of kl_control.LoGRAOptimizer), alpha sat
  at its cap in at most 1 update of a run on the one-token loops at std 0.2, in 25-47% of
  the toy's updates, in up to 51% on the 64-token loop, and in all of the std-0.02 loop's
  (LoGRAOptimizer's defaults for random weights, its start='scratch', scale the step per layer
  and cap it at 9x, departure 3). The paper's
  6e-5 with its budget of 2e-4 per token leaves alpha at its cap and
  examples/minimal_loop.py's toy at chance: a policy that must move far needs steps the cap
  forbids. Where the paper's pair binds (its 7B run; not measured here), 1e-2 gives the same
  steps: it only raises a bound the budget sits under. If
  alpha sits at its cap for updates in a row (kl_control.LoGRAOptimizer and train.py warn
  after 5), any value above update_ratio * sqrt(budget / (alpha_max^2 KL1)), from one
  update's logged KL1 and budget, makes the budget bind; but that is not always better. On the
  one loop of bench/README.md's `defaults` family where the cap bound throughout (a random
  model at std 0.02, one-token answers), 0.01 was the best of 0.001, 0.003, 0.01, 0.03 and
  0.1 on held-out problems (kl_control.py, "What to watch"), so the warning asks for a
  held-out metric before a change.
- beta2: v averages the squared sketch rows over about 1 / (1 - beta2) = 20 updates.
- eps is relative to mean(root), so it does not depend on the scale of the loss.
- factor dtype: what the engines receive and merge; fp32 would double the sync payload.

Shape legend: d out rows, k in columns, r rank; n rows of a weight held by this process
(n = d in one process); L target layers; m rows of a merge chunk.

Departures from the paper
-------------------------
1. Row-sharded state. The paper sums the trainer processes' sketches with one all_reduce, so
   that every process holds all rows of each layer's S, and with them of U and v. Here,
   under FSDP2, a process holds only its rows of S, U and v, the rows it holds of W
   (sketch.py departure 1, `attach(..., group=...)`), and merges only those rows of W. What
   the formulas take over all of a layer's rows (mean(root), min(den), mean(s^2), ||S||,
   ||D||) and c's two sums are this process's partial sums or minima in float64, reduced
   with small all_reduces (`row_adam_groups`); the KL probe and the engine
   sync gather U or F one layer at a time. Reason: S and U of the 7B targets at r = 256
   take 1.33 GiB each in fp32, of which a process of 4 holds 0.33 GiB. From the same summed
   sketch, the directions, moments and weights are one process's, bit for bit. Tests:
   tests/test_rowadam.py::test_directions_across_ranks_equal_the_plain_formulas,
   tests/test_rowadam.py::test_row_sharded_state_equals_one_process_bitwise.
2. No bf16 ties in the master weights. The paper merges `W <- W - F A`. Here, after every
   fp32 merge, a weight that lies exactly halfway between two bf16 values moves one fp32 ulp
   (at most 2^-23 relative) toward zero (`avoid_bf16_ties_`, about 1 weight in 65536), in
   every row the merge moves: a row whose factor row is zero is left bit for bit (W - 0 A is
   W), so that `merge(0.0)` changes no weight. Reason: fp32 is then bf16(fp32) plus an int16
   count of fp32 ulps, exactly, so a rollout engine can hold the trainer's fp32 master as
   vLLM's bf16 weight plus a 2-byte residual (sync.py) instead of a 4-byte copy; both sides
   apply the same rule to the same bits, and weights that start without a tie (train.py
   applies `avoid_bf16_ties_` before the engines' start-up sync) never hold one. The engine
   needs no rule of its own for rows it does not move: its master cannot hold a tie.
   Tests: tests/test_rowadam.py::test_merge_moves_bf16_ties_one_ulp_toward_zero,
   tests/test_rowadam.py::test_merge_of_alpha_zero_changes_no_weight_here_or_on_the_engine,
   tests/test_sync.py::test_compact_state_is_the_masters_bits_over_1000_updates.
3. One scale per layer, on request. `prepare(per_layer=True)` scales each layer's D to
   ||U_l A_l|| = update_ratio ||W_l|| (c_l = update_ratio ||W_l|| / ||D_l A_l||, 0 where
   D_l A_l = 0), where the paper takes one c for all layers, under which a layer moves in
   proportion to its sketch's norm (on the tests' tiny Qwen2 after one backward, 0.02% to 2.8%
   of each layer's ||W|| for a total step of 1% of ||W||). The total step is the same,
   update_ratio ||W||; D and v are the same. `prepare()` is the paper's, and so are the
   Use block and train.py; kl_control.LoGRAOptimizer asks for it for a model that starts from
   random weights (its start='scratch'; kl_control.py's departure 6 gives the measurement). The two norms of each layer are float64 sums over this
   process's rows, reduced in one all_reduce with a group (departure 1). Tests:
   tests/test_rowadam.py::test_per_layer_scale_gives_each_layer_its_share_of_its_weights,
   tests/test_rowadam.py::test_row_sharded_state_equals_one_process_bitwise.

Implementation notes
--------------------
- The scale of S. `S` is the sketch of the global mean-per-token loss (ppo.py divides each
  process's loss by the global token count N), taken as it is: the paper's RowAdam is stated
  on that sketch. The authors' NeMo-RL code divides the sketch by the valid-token count
  before RowAdam (`normalization_tokens`); on the same inputs that amounted to a second
  division, which within one update changes nothing (D does not depend on the scale of S)
  but weights each update's square in the moving moment v by 1/N^2, so that updates with
  fewer tokens count for more. Not done here:
  tests/test_rowadam.py::test_the_moment_weights_updates_by_the_sketch_of_the_per_token_mean_loss
  shows the two differ once N varies.
- Every mean over a layer's rows is a float64 sum divided by the row count d, rounded once
  to S's dtype, and the norms are float64 sums. d is a float64 tensor on S's device in both
  paths: a GPU divides by a Python number as a multiplication by its reciprocal, which can
  round differently. Float64 partial sums, reduced, then the same division: one process and
  several agree bitwise.
- `||D A||_F^2` is computed as `sum((D (A A^T)) * D)` with the (r, r) Gram matrix `A A^T`,
  identical in exact arithmetic and never forming any (n, k) block: O(r^2 k + n r^2)
  instead of O(n r k). `A A^T` is the signs' Gram matrix, an fp32 GEMM of +-1 whose sums are
  integers below 2^24 (k < 16.7 M) and so exact in any order, times 1/r as A's entries round.
- The merge computes `F @ A` in float64 and rounds it once to W's dtype. A bf16 factor times
  +-1/sqrt(r) is exact in float64 for r a power of 4 (r = 256: 1/16), and so is a sum of r of
  them unless a row of F spans more than 2^37 in magnitude: the delta is then the correctly
  rounded one whatever the summation order, so a sharded trainer and an unsharded engine
  hold bit-identical fp32 masters. The cost is one float64 block of MERGE_ELEMENTS entries
  at a time. Test: tests/test_rowadam.py::test_sharded_merge_equals_unsharded.
- The layers' state lives in one tensor per shape: sketch.attach lays out the sketches of
  layers of one shape as consecutive rows of one (L, n, r) tensor, and RowAdam keeps v (L, n)
  and U (L, n, r) beside it (`moments`, `directions`: the layers' views). `prepare` runs the
  formulas over each shape's stack (`row_adam_groups`, reductions over the last dimensions:
  the same sums as `row_adam_direction`'s), forms the Gram matrices of a batch of layers with
  one GEMM, and `merge` merges as many layers of one shape as MERGE_ELEMENTS holds with one
  float64 GEMM (`merge_layers`); no step reads the device per layer. A model of many small
  layers pays a few dozen tensor operations an update, not a few dozen per layer: on the
  2-layer toy of examples/minimal_loop.py, prepare went from 3.7 to 2.2 ms and the merge from
  2.8 to 1.9 ms (its signs made together too: sketch.make_signs_many; bench/README.md,
  `loop_phases`, both in one run). The batched formulas and merge are the line-by-line ones bit for bit
  (tests/test_rowadam.py::test_directions_across_ranks_equal_the_plain_formulas,
  test_sharded_merge_equals_unsharded, test_row_sharded_state_equals_one_process_bitwise).
- `prepare` computes the new moments but `merge` commits them, together with the update
  counter: a step abandoned between the two (`discard()`, e.g. when the KL probe fails)
  leaves the weights, moments and counter exactly as they were and zeroes the sketches (the
  batch is dropped, so the next backward starts a new one). Every refusal (no backward
  since the last merge, a second `prepare`, a non-finite sketch, a bad alpha or factor)
  raises before anything changes, except that `prepare(group)` sums whole sketches in place
  before it finds their sum non-finite (`discard()` then drops it). Tests:
  tests/test_rowadam.py::test_failures_change_nothing,
  tests/test_rowadam.py::test_prepare_without_a_backward_is_refused,
  tests/test_rowadam.py::test_discard_drops_the_batch_and_keeps_the_optimizer.
- A layer whose sketch is zero gets D = 0 (no 0/0), and if every D A is zero, c = 0: the
  merge then changes no weight (departure 2). A backward of a zero loss (every advantage
  zero) gives such sketches and is a batch like any other, not refused as a missing backward.
  Tests: tests/test_rowadam.py::test_zero_sketch_gives_zero_direction,
  tests/test_rowadam.py::test_prepare_without_a_backward_is_refused.
- float64 weights are accepted (for tests against float64 references); bf16/fp16 weights
  are refused: a relative update of 1e-2 and less is mostly below their resolution (cast to
  bf16, a merge loses most of it in rounding). So is a cast after the constructor
  (`model.to(torch.bfloat16)`), at the next `prepare` or `merge`, before anything changes.
  Tests: tests/test_rowadam.py::test_bf16_weights_refused,
  tests/test_rowadam.py::test_a_cast_after_the_constructor_is_refused.
"""

import math

import torch
import torch.distributed as dist

from sketch import PROJECTION, LayerSketch, projection_from_signs, refresh, shape_groups, stack_of

# Entries of W a merge works on at once (W's copy, float64 F A and its fp32 rounding: 16 bytes
# each, 256 MiB): several layers of one shape together, or a larger layer's rows in chunks.
MERGE_ELEMENTS = 2**24
SUM_BLOCK = 2**22  # entries per float64 block of ||W||^2 (32 MiB: few launches at 7B, little memory)
GRAM_ELEMENTS = 2**22  # sign entries whose Gram matrices prepare forms at once (fp32: 16 MiB)
# ||U A|| / ||W|| before alpha: with the default budget (kl_control.budget_for) binding, only the
# largest step, alpha_max * UPDATE_RATIO of ||W||, depends on it ("Defaults" above).
UPDATE_RATIO = 1e-2


# -----------------------------------------------------------------------------
# The direction of one layer: the formulas of "The math", line by line

def row_adam_direction(S, v, *, step, beta2=0.95, eps=1e-8, out=None):
    """RowAdam's direction D (d, r) of one layer from its sketch S (d, r) and row moments
    v (d,), this process holding every row; returns (D, new v) and changes nothing in place.
    `step`: the bias correction's step, update + 1. `out`: a preallocated (d, r) buffer for D
    (no transient copy)."""
    _check_direction_inputs([S], [v], step, beta2, eps)
    # d as a float64 tensor on S's device, divided by as the sharded path does (implementation notes)
    d = torch.full((), float(S.shape[0]), dtype=torch.float64, device=S.device)  # () made there: no host copy
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
    D = torch.mul(S, s[:, None].to(S.dtype), out=out)  # (d, r)
    S_sq, D_sq = S.double().square().sum(), D.double().square().sum()
    D.mul_(torch.where(D_sq > 0, (S_sq / D_sq).sqrt(), 1.0).to(D.dtype))  # D = 0 stays 0; no host read
    return D, v


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
    _check_direction_inputs([S.flatten(0, 1) for S in sketches], [v.flatten() for v in moments], step, beta2, eps)

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


def _check_direction_inputs(sketches, moments, step, beta2, eps):
    for S, v in zip(sketches, moments):
        if S.dim() != 2:
            raise ValueError(f"sketch must be (n, r), got shape {tuple(S.shape)}")
        if v.shape != (S.shape[0],):
            raise ValueError(f"second moment must have shape ({S.shape[0]},), got {tuple(v.shape)}")
    if step < 1:
        raise ValueError(f"step is 1-based (update + 1), got {step}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"beta2 must be in [0, 1), got {beta2}")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")


# -----------------------------------------------------------------------------
# The merge: W -= F A, this process's rows, in row chunks

def rows_per_chunk(width: int) -> int:
    """Rows of a (., width) weight that a merge works on at once: MERGE_ELEMENTS entries."""
    return max(1, MERGE_ELEMENTS // width)


@torch.no_grad()
def merge_rows(rows, factor, projection, row_offset=0, chunk_rows=None, avoid_ties=True):
    """W[o:o+n] -= F[o:o+n] @ A for this process's rows, in row chunks (never a whole (n, k)
    delta; `chunk_rows`: rows a chunk, default `rows_per_chunk(k)`).

    F @ A is computed in float64 and rounded once to W's dtype (implementation notes), so the
    result does not depend on the chunking or the device: FSDP row shards and the engines'
    merges (sync.py) give the same bits as an unsharded merge. A row whose factor row is zero
    is left bit for bit, ties included (departure 2); `avoid_ties=False` leaves the bf16 ties
    of the moved rows to the caller: the engines move them as they split the result.
    """
    n = rows.shape[0]
    # (n,) the rows it moves: F's row is not zero. A mask, never read back to the host: the
    # engines merge chunk by chunk on the GPU and must not wait on it. W - 0 A = W, ties and
    # all, so merge(0.0) changes no weight.
    moved = factor[row_offset:row_offset + n].ne(0).any(dim=1)
    a = projection.to(torch.float64)  # (r, k)
    step = chunk_rows or rows_per_chunk(rows.shape[1])
    for start in range(0, n, step):
        stop = min(start + step, n)
        f = factor[row_offset + start:row_offset + stop].to(torch.float64)  # (m, r)
        # Shapes: (m, r) @ (r, k) -> (m, k); a row of F that is zero gives +0: W - 0 A = W
        rows[start:stop].sub_((f @ a).to(rows.dtype))
        if avoid_ties and rows.dtype == torch.float32:  # departure 2, in the moved rows only
            avoid_bf16_ties_(rows[start:stop], rows=moved[start:stop])


def avoid_bf16_ties_(w, *, rows=None):
    """Move every fp32 value that lies exactly halfway between two bf16 values (low 16 bits
    0x8000) one fp32 ulp toward zero, in place (departure 2); `rows` (n,) bool: only in those
    rows (all by default).

    An fp32 weight is then exactly its bf16 rounding plus a residual in [-32767, 32767] fp32
    ulps, which an int16 holds: the rollout engines keep that residual next to vLLM's bf16
    weight instead of a whole fp32 copy (sync.py). Both sides apply it after every merge.
    """
    bits = w.view(torch.int32)  # (..., n, k) raw fp32 words
    tie = (bits & 0xFFFF) == 0x8000  # (..., n, k)
    if rows is not None:
        tie &= rows[..., None]
    bits.sub_(tie.to(torch.int32))
    return w


def merge_layers(weights, factors, signs, magnitude: float, *, avoid_ties=True):
    """`merge_rows` for layers of one shape: W_i -= F_i @ A_i for this process's rows W_i
    (n, k) of each, F (L, n, r) their factors' rows, A_i = signs_i (r, k) times `magnitude` (the
    value A's entries hold: `entry_magnitude`). As many layers as MERGE_ELEMENTS holds are merged
    with one batch of tensor operations (stacked, F A in float64 rounded once, written back),
    a larger layer in row chunks: the same bits as `merge_rows` layer by layer, since F A is
    exact in float64 whatever the order of its sums (implementation notes)."""
    n, k = weights[0].shape
    per = MERGE_ELEMENTS // max(n * k, 1)
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


def entry_magnitude(rank: int, dtype) -> float:
    """|A[i, j]| as `projection_from_signs` rounds it in `dtype` (1/sqrt(rank)), formed on the host."""
    return float(projection_from_signs(torch.ones(rank, 1, dtype=torch.int8), dtype)[0, 0])


# -----------------------------------------------------------------------------
# The optimizer

class RowAdam:
    """RowAdam over the sketched target layers of one model: `prepare()` turns their sketches S
    into directions U (`directions`), `merge(alpha)` writes `W -= bf16(alpha U) A` into the
    fp32 master weights and moves every layer on to its next projection A. The module
    docstring's Use block shows one update.

    An update is `prepare()` and then `merge(alpha)`, or `discard()`:
    - `prepare()` computes every layer's U = c D and the new moments v, and changes nothing
      (with `group`, whole sketches are first summed over the processes in place). It refuses
      when no backward reached any sketch since the last `merge` or `discard` (sketch.py's
      `LayerSketch.backwards`): the directions would be zero and `merge` would still count an
      update. A backward of a zero loss is a backward: its zero sketch gives U = 0. Called
      again before `merge` or `discard`, it refuses too: the first call's directions stand,
      and with `group` a second call would sum the sketches twice.
    - `merge(alpha)`, alpha finite and >= 0: W -= F A_t with F = bf16(alpha U), then v is
      committed, the counter goes from t to t + 1, the sketches are zeroed and every layer
      moves to A_{t+1}. `merge(0.0)` changes no weight bit (departure 2), here or on the
      engines that merge its zero factors, and is an update all the same: v takes in the
      batch, the counter and A move on. To drop a batch instead, `discard()`.
    - `discard()`: the batch is abandoned. The directions are dropped and the sketches zeroed
      (the next backward starts a new batch); the weights, v and the counter stay as they
      were. Also without `prepare()`, to drop a half-accumulated batch.
    Every refusal raises before anything changes (the module docstring's implementation notes).

    Arguments:
        layers: `sketch.attach(model, ...)`'s layers: one model, one seed, one update number
            and one process group (or none); their weights fp32 (or float64, for tests).
        seed: optional, the seed they were attached with (`attach`'s `seed`), which they hold;
            given, it is checked against theirs. A_t is drawn from it.
        beta2: decay of the row second moments v (0.95).
        eps: added to each row's root as eps * mean(root), with the root's tiny as a floor (1e-8).
        update_ratio: ||U A|| / ||W|| over all target layers, before alpha (1e-2; the paper's 6e-5):
            the largest step is alpha_max times it ("Defaults").
        factor_dtype: the dtype of F = alpha U, as merged here and sent to the engines (bf16).
    """

    def __init__(self, layers: list[LayerSketch], *, seed=None, beta2=0.95, eps=1e-8,
                 update_ratio=UPDATE_RATIO, factor_dtype=torch.bfloat16):
        if not layers:
            raise ValueError("RowAdam needs at least one LayerSketch")
        for layer in layers:
            _check_master_dtype(layer, layer.module.weight.dtype, update_ratio)
        if len({layer.update for layer in layers}) != 1 or len({l.base_seed for l in layers}) != 1:
            raise ValueError("all layers must share one base seed and update number")
        if len({id(layer.group) for layer in layers}) != 1:
            raise ValueError("all layers must share one process group (or none)")
        if seed is not None and layers[0].base_seed != seed:
            raise ValueError(f"layers were attached with seed {layers[0].base_seed}, not seed={seed}: "
                             f"pass attach's seed, or leave seed out (the layers hold it)")
        if not 0.0 <= beta2 < 1.0 or not eps > 0 or not update_ratio > 0:
            raise ValueError("need 0 <= beta2 < 1, eps > 0, update_ratio > 0")
        self.layers = layers
        self.group = layers[0].group  # rows are sharded over it (departure 1), or None
        self.base_seed, self.beta2, self.eps = layers[0].base_seed, beta2, eps
        self.update_ratio, self.factor_dtype = update_ratio, factor_dtype
        # The weights' dtype now: a model cast afterwards (model.to(torch.bfloat16)) is refused at
        # the next prepare or merge, before anything changes (the class docstring).
        self._dtypes = [layer.module.weight.dtype for layer in layers]
        # t, the 0-based count of merged updates (sketch.py, "The update counter"); step t + 1
        self.update = layers[0].update
        # The layers by shape (S's and A's, `shape_groups`): each group's sketches S one (L, n, r)
        # tensor, as sketch.attach lays them out (sketches made apart are copied into one and the
        # layers pointed at it), and beside it its v (L, n): one fp32 second moment per output row
        # this process holds; U (L, n, r), allocated once and written in place by every prepare
        # (no transient copies); and d (L,), each layer's whole row count.
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
        self.directions = None  # the layers' U (n, r) between prepare and merge
        self._pending_moments = None  # the groups' new v, committed by merge
        self.resumed_projection = None  # the projection a loaded state was saved under (load_state_dict)

    @property
    def rank(self):
        return self.layers[0].rank

    # -- prepare: directions, global scale --------------------------------------------

    @torch.no_grad()
    def prepare(self, group=None, *, per_layer=False) -> float:
        """Compute every layer's U = c D (this process's rows) into `directions`; return ||S||
        over all layers. Weights, moments and the update counter are not touched (`merge`
        commits, `discard` abandons). Refused without a backward since the last merge or
        discard, and when called twice (the class docstring). `per_layer`: one c per layer,
        c_l = update_ratio ||W_l|| / ||D_l A_l|| (departure 3), instead of the paper's one c.

        The sketches were already summed over processes: in backward (row-sharded layers) or, for
        whole sketches held by several processes, here with one all_reduce each over `group`.
        """
        if self.directions is not None:
            raise RuntimeError("prepare() was already called for this update and its directions are in "
                               "opt.directions: merge(alpha) them, or discard() the batch and run a new backward")
        self._check_dtypes()
        whole = group is not None and self.group is None  # whole sketches on every process: summed here
        self._check_a_backward_ran(group if whole else None)
        stacks = [S for _, S, _, _, _ in self._groups]  # (L, n, r) each: every layer's sketch, by shape
        if whole:
            for S in stacks:
                dist.all_reduce(S, group=group)  # in place: the summed sketches are the batch's
        # ||S||^2 of each layer in float64 over all its rows: the norm returned, and the check
        # that S is finite (and that the directions' own ||S||^2 does not overflow)
        S_sq = torch.cat([S.double().square().sum(dim=(1, 2)) for S in stacks])  # (L,)
        if self.group is not None:
            dist.all_reduce(S_sq, group=self.group)  # this process's rows -> all rows (departure 1)
        if not torch.isfinite(S_sq).all():
            raise FloatingPointError("summed sketch is not finite (or its squared norm overflows float64): "
                                     "weights, moments and counter unchanged; discard() drops the batch")

        # D and the new v of every layer, one batch of operations per shape (row_adam_groups: the
        # formulas of `row_adam_direction`; with a group, this process's rows, departure 1)
        t = self.update + 1  # the bias correction's step: update + 1 (the module docstring's math)
        D, moments = row_adam_groups(stacks, [v for _, _, v, _, _ in self._groups], [d for *_, d in self._groups],
                                     step=t, beta2=self.beta2, eps=self.eps, group=self.group,
                                     out=[U for _, _, _, U, _ in self._groups])  # (L, n, r) each, in the U buffers

        if per_layer:
            self._scale_per_layer(D)  # U = c_l D per layer (departure 3)
        else:
            self._scale_all_layers(D)  # U = c D, the paper's one scale
        self.directions = list(self._u)  # (n, r) each: views of the groups' U
        self._pending_moments = moments
        return math.sqrt(S_sq.sum().item())

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

    def _check_dtypes(self):
        """Refuse weights whose dtype changed since the constructor (a cast of the model)."""
        for layer, dtype in zip(self.layers, self._dtypes):
            now = layer.module.weight.dtype
            if now != dtype:
                _check_master_dtype(layer, now, self.update_ratio)  # bf16 and fp16: the reason below
                raise TypeError(f"{layer.name}: the weight is {now}, but was {dtype} when RowAdam was built: the "
                                f"model was cast since; cast it back (nothing was changed)")

    def _check_a_backward_ran(self, group):
        """Refuse a batch that no backward reached. sketch.py's `LayerSketch.backwards` counts
        the backwards into a layer's sketch since its last `zero_()`, which `merge` and
        `discard` call; a sketch.py without that count (None) is not checked. `group`: whole
        sketches summed over its processes, each counting its own backwards, so the counts are
        summed too and every process refuses or none (the row-sharded backward is itself a
        collective: every process counts the same)."""
        counts = [getattr(l, "backwards", None) for l in self.layers]
        if any(c is None for c in counts):
            return
        total = sum(int(c) for c in counts)
        if group is not None:
            total_t = torch.tensor(total, dtype=torch.int64, device=self.layers[0].sketch.device)  # ()
            dist.all_reduce(total_t, group=group)
            total = int(total_t)
        if total == 0:
            raise ValueError("prepare(): no backward reached any sketch since the last merge() or discard(), so the "
                             "directions would be zero and merge() would still count an update; call "
                             "loss.backward() between merges (nothing was changed)")

    def discard(self) -> None:
        """Abandon the batch: directions dropped and sketches zeroed (the next backward starts a
        new batch); weights, moments and the update counter unchanged. Also without prepare()."""
        self.directions = self._pending_moments = None
        self._zero_sketches()

    def _zero_sketches(self):
        """S = 0 in every layer (one operation per shape), and no backward counted into it."""
        for _, S, _, _, _ in self._groups:
            S.zero_()
        for layer in self.layers:
            layer.backwards = 0

    # -- merge: W -= bf16(alpha U) A ----------------------------------------------------

    @torch.no_grad()
    def merge(self, alpha: float) -> list[torch.Tensor]:
        """Merge bf16(alpha U) @ A_t into this process's rows of every weight, commit the moments,
        count the update and move to A_{t+1}; return this process's rows of the factors F exactly
        as merged (`sketch.gather_rows` completes them). alpha = 0 changes no weight (departure 2)."""
        if self.directions is None:
            raise RuntimeError("merge() needs prepare() first")
        self._check_dtypes()
        alpha = float(alpha)
        if not math.isfinite(alpha) or alpha < 0:
            raise ValueError(f"alpha must be finite and >= 0, got {alpha}")
        stacked = [(alpha * U).to(self.factor_dtype) for _, _, _, U, _ in self._groups]  # F (L, n, r) per shape
        factors = [None] * len(self.layers)
        for (members, *_), F_g in zip(self._groups, stacked):
            for j, i in enumerate(members):
                factors[i] = F_g[j]  # (n, r), in the layers' order
        # Every check before the first weight changes: a finite alpha can still overflow F.
        rows = [local_rows(layer.module.weight)[0] for layer in self.layers]  # (n, k) each
        for layer, w, f in zip(self.layers, rows, factors):
            if w.shape[0] != f.shape[0]:
                raise RuntimeError(f"{layer.name}: {w.shape[0]} local weight rows but {f.shape[0]} sketch rows "
                                   f"(attach(..., group=...) must match the FSDP2 sharding)")
        if not torch.stack([torch.isfinite(F_g).all() for F_g in stacked]).all():
            raise ValueError(f"alpha = {alpha:g} makes F = alpha U overflow {self.factor_dtype}: nothing was merged")
        # W -= F A_t, the layers of one weight shape together (merge_layers: merge_rows' bits)
        magnitude = entry_magnitude(self.rank, self.layers[0].sketch.dtype)  # |A's entries| as the layers form A
        for (members, *_), F_g in zip(self._groups, stacked):
            merge_layers([rows[i] for i in members], F_g, [self.layers[i].signs for i in members], magnitude)
        for (_, _, v, _, _), new in zip(self._groups, self._pending_moments):
            v.copy_(new)
        self.directions = self._pending_moments = None
        self.update += 1
        self._zero_sketches()
        refresh(self.layers, self.update)  # A_{t+1}, every layer's signs made together
        return factors

    # -- checkpoints ----------------------------------------------------------------

    def state_dict(self) -> dict:
        """Moments, counter, configuration and the projection rule (sketch.PROJECTION).
        Row-sharded moments are DTensors on the weights' device mesh, so that
        torch.distributed.checkpoint saves every process's rows."""
        return {
            "update": self.update,
            "moments": {l.name: self._shared(l, v.clone()) for l, v in zip(self.layers, self.moments)},
            "base_seed": self.base_seed, "rank": self.rank,
            "beta2": self.beta2, "eps": self.eps, "update_ratio": self.update_ratio,
            "projection": PROJECTION,
        }

    def _shared(self, layer, v):
        if self.group is None:
            return v
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(v, layer.module.weight.device_mesh, [Shard(0)], run_check=False,
                                  shape=(layer.rows,), stride=(1,))

    def load_state_dict(self, state: dict) -> None:
        """Moments, counter and settings from `state_dict()`'s dict; the layers move to A_update.
        A state of an earlier projection (`projection` 1, or none: sketch.py's "The projection A")
        is resumed as it is: it holds nothing drawn from A (the moments are per row, the sketches
        zero between updates), so the next update simply draws A_update by this file's rule
        (`resumed_projection` says which rule the state was saved under). A later projection than
        this file knows is refused."""
        names = [l.name for l in self.layers]
        projection = int(state.get("projection", 1))
        if projection > PROJECTION:
            raise ValueError(f"this state was saved with projection {projection}, and this rowadam.py knows "
                             f"projections up to {PROJECTION} (sketch.PROJECTION): load it with the release that saved it")
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
        self.resumed_projection = projection
        self._zero_sketches()
        refresh(self.layers, self.update)


def _check_master_dtype(layer, dtype, update_ratio):
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{layer.name}: weight is {dtype}; RowAdam merges into fp32 master weights (a relative "
                        f"update of ~{update_ratio:g} and less is mostly below bf16's resolution of ~4e-3 and "
                        f"would be rounded away): keep the weights fp32 (nothing was changed)")


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


# -----------------------------------------------------------------------------
# Row-sharded state (departure 1): the same formulas, each whole-layer quantity reduced across ranks

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
