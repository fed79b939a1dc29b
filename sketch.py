"""
sketch.py: the low-rank gradient sketch of a linear layer, never the full gradient.

What it is
----------
A linear layer `Y = X W^T (+ b)` with `W` of shape (d, k) has the weight gradient
`G = dY^T X` (d, k). LoGRA never builds `G`. It keeps a random sign matrix `A` (r, k) and
accumulates the sketch

    S = G A^T = dY^T (X A^T)                                   (d, r)

directly in backward: forward keeps `P = X A^T` (N, r) instead of `X` (N, k), and backward
adds `dY^T P` to an fp32 buffer. The activation memory a target layer keeps for its weight
gradient drops by r/k, and the gradient buffer by r/k as well.

Use
---
    import sketch

    layers = sketch.attach(model, rank=8, seed=0)  # S = 0 and A_0 on every target nn.Linear; all frozen
    logits = model(input_ids=ids).logits           # (B, T, V)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()                                # S += G A^T in every target; no parameter gets a .grad
    sketches = {layer.name: layer.sketch for layer in layers}  # (d, r) fp32 each: what RowAdam reads
    sketch.detach(model)                           # nn.Linear's forward and the requires_grad flags again

`model` is a Hugging Face causal LM with fp32 weights and `ids` (B, T) its token ids;
tests/test_sketch.py runs this block on a tiny Qwen2. Each `layer.backwards` now reads 1: the
backward passes into its sketch since it was last zeroed. Any other `nn.Module` is attached the
same way once its targets are named: `attach(net, rank, seed, targets=("fc1", "fc2"))` (names of
modules), or a `{name: module}` mapping (the names seed `A`). rowadam.py turns the sketches into
the update.

The projection A
----------------
The paper's method section on the low-rank gradient sketch (arXiv:2610.06647) takes `A` as
independent random signs scaled by 1/sqrt(r), which may be redrawn each step (here it is) so
that successive updates are not trapped in one subspace:

    A[i, j] = +1/sqrt(r) or -1/sqrt(r), each with probability 1/2 (Rademacher)
    E[A^T A] = I_k  =>  E[G A^T A] = G    (the sketch expands to an unbiased gradient)

`A` is never learned and never sent. It is regenerated from an integer seed,
`projection_seed(base_seed, update, name)`, a sha256 of the three (not Python's salted
`hash()`), drawn with a CPU `torch.Generator` and only then moved to the device, so the
trainer processes and the rollout engines build the same bits anywhere. Update `t` uses `A_t`
(the counter below); after it is merged every layer switches to `A_{t+1}`.

The update counter
------------------
One convention for the whole project, stated here. `update` is the number of updates already
merged into the weights, counted from 0: update `t` is formed from sketches taken with `A_t` on
the weights that `t` merges have made, and once it is merged the counter reads `t + 1` and every
layer switches to `A_{t+1}` (`LayerSketch.refresh(t + 1)`). The same number is
`LayerSketch.update`, `attach(..., update=)` (a resumed run's count), the `update` of
`projection_seed(base_seed, update, name)`, RowAdam's `update` (rowadam.py), the `update` of
`kl_budget(update, ...)` (kl_control.py) and the rollout engines' (sync.py). A formula written with
steps counted from 1, as Adam's bias correction `1 - beta2^t` is, takes `t = update + 1` and says
so where it does.

Defaults: rank r = 256 (the rank of Table 1's LoGRA runs), or half the narrowest target's
input width rounded down to a power of 2 where that is smaller (`default_rank`: 32 on a
64-wide toy, 256 from 512 wide on), so that a sketch never holds more than half of the
gradient it stands for (rank 32 learned on examples/minimal_loop.py's 64-wide toy as fast as
AdamW: bench/README.md, `defaults.py`); targets = the attention/MLP
projections in `TARGETS`: the seven of Qwen2-like models, and the fused `qkv_proj` and
`gate_up_proj` of models whose Hugging Face code fuses them (Phi-3; architectures.py;
departure 2). Any other model names its own (`attach(..., targets=...)`).

Shape legend: d out rows, k in columns, r rank, N tokens (all leading dims flattened).

Departures from the paper
-------------------------
1. The paper sums the trainer processes' sketches once per update, with one all_reduce.
   Under FSDP2 each process here keeps only its rows of each sketch, the rows it holds of the
   weight (`attach(..., group=...)`): backward forms this micro-batch's `dY^T P` (d, r) for
   the layer and a reduce-scatter adds every process's contribution into the owners' rows,
   as FSDP reduce-scatters gradients. The sum over processes then happens per micro-batch
   instead of once per update, so that a process holds d/world rows of S (0.33 instead of
   1.33 GiB at 7B over 4 training GPUs, as in Table 1's setup). Without a group the sketch
   holds every row and `RowAdam.prepare` all-reduces it, as the paper does. Test:
   tests/test_rowadam.py, test_row_sharded_state_equals_one_process_bitwise.
2. The paper's targets are the seven attention/MLP projections of its Qwen models. A model
   whose Hugging Face code fuses q/k/v into `qkv_proj` or gate/up into `gate_up_proj`
   (Phi-3, not a model of the paper) has the fused layer as one target: one `A` and one
   sketch for all its rows, so RowAdam's per-layer quantities (the sketch norm that `D`
   keeps) cover the fused layer. The sub-layers share their input X, so one `P = X A^T` is
   kept instead of three, and the layer is sketched as the model computes it, without
   splitting its forward. Test: tests/test_architectures.py,
   test_every_family_trains_and_its_engines_follow (phi3).

Implementation notes
--------------------
- Every parameter of an attached model is frozen: the others (embeddings, norms, lm_head,
  biases) stay fixed as in the paper, and the target weights get no `.grad`, their update
  coming from the sketch. Backward must still reach the target layers, through activations
  that no parameter makes require grad. On a model with `get_input_embeddings` (Hugging
  Face's), the output of the input embedding is marked as requiring grad (the trick Hugging
  Face uses for adapters, `enable_input_require_grads`), so every activation above it does.
  On any other module, a sketched layer called with gradients enabled on an input that
  requires none runs on a leaf copy `x.detach().requires_grad_()`: its output then requires
  grad, so backward reaches it and forms `dY^T P`, and it skips `dX`, which nothing upstream
  would read. `G = dY^T X` needs only this layer's `X` and the `dY` from above it, so the
  sketch is dense autograd's `G A^T` all the same (tests/test_sketch.py,
  test_plain_module_sketches_equal_dense). A Hugging Face model never takes that path (its
  hook makes every target's input require grad), so its runs are the same bits as before.
  (Reentrant activation checkpointing runs its forward without gradients and recomputes only
  when an input requires grad: a plain module under it must mark its input itself.)
- `attach` checks everything before it changes anything (every target, the rank, the
  process group's sharding, the embedding): a refused attach leaves every forward, every
  `requires_grad` flag and every hook as it was, so that a second attempt, or `detach`,
  starts from the model as it was (tests/test_sketch.py, test_refused_attach_changes_nothing).
- A layer's signs and sketch live on the device its weight had at `attach`. A model moved
  afterwards (`model.to(...)`, `to_empty`) would leave them behind, so every call of a
  sketched layer compares the two devices (host-side `torch.device`s: no device sync) and
  raises, naming the layer, the devices and the fix. A dtype cast is not refused: under FSDP2
  mixed precision the layer is handed bf16 weights in every forward by design (as train.py
  shards on GPUs) while its fp32 master stays at rest, and the sketch accumulates in its own
  dtype, fixed at `attach`, whatever the compute dtype. Master weights cast to bf16 are for
  RowAdam to refuse, which merges into them (rowadam.py). Test: tests/test_sketch.py,
  test_a_moved_model_is_refused_and_a_cast_one_still_sketches.
- `LayerSketch.backwards` counts the backward passes into `S` since `zero_()` (a Python int
  that backward increments on the host: no device read), so a caller can tell a sketch that
  backward never reached from one that is zero (RowAdam's `prepare`). It counts one per call of
  the layer that backward reaches: a layer called twice in one forward counts 2, and a call
  under activation checkpointing counts once, however its forward is recomputed.
- `P = X A^T` is stored in the compute dtype of `X` (bf16 under mixed precision); the
  sketch itself accumulates in fp32 (float64 when the weight is float64, for tests).
- Each backward forms its product `dY^T P` from zero and then adds it to `S` (`S.add_(dY^T @
  P)`, never `S.addmm_(dY^T, P)`): a BLAS kernel may fold the existing `S` into its partial sums,
  in an order that depends on the CPU (AVX2 or AVX-512 blocking), so one process summing two
  micro-batches would differ in its last bits from two processes whose reduce-scatter sums
  the same two products. With each product formed first, both compute `m1 + m2` into a zeroed
  `S`, rounded the same way on any machine (tests/test_rowadam.py, test_row_sharded_state_equals_one_process_bitwise;
  tests/test_train.py, test_one_and_two_processes_agree). It costs one (d, r) temporary.
- When no gradient is being recorded (rollouts, evaluation, `torch.no_grad`), a sketched
  layer is a plain `F.linear`: no `P` is computed.
- A layer keeps the signs of `A` as int8 (1 byte per entry) and forms `A = signs / sqrt(r)`
  in the compute dtype when it is used: 0.27 GiB instead of 1.08 GiB of fp32 projections
  per GPU for the 7B targets at r = 256. The values are the ones an fp32 `A` would hold.
"""

import hashlib
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# Every name a row of architectures.py makes a target (a model holds the names of its own row).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
# The rank of Table 1's LoGRA runs: `attach`'s without one, where the targets are wide enough (`default_rank`).
PAPER_RANK = 256

# Module-path parts that wrappers insert and that must not change a layer's seed:
# FSDP1, activation checkpointing and torch.compile. (FSDP2 inserts none.)
WRAPPER_PARTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


# -----------------------------------------------------------------------------
# Seeds and projections

def clean_name(name: str) -> str:
    """`model._orig_mod.layers.0._checkpoint_wrapped_module.mlp.up_proj` -> `model.layers.0.mlp.up_proj`."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def projection_seed(base_seed: int, update: int, name: str) -> int:
    """The seed of `A` for one layer at one update, identical in every process.

    sha256 of "base_seed:update:clean_name", first 8 bytes, as a non-negative int63
    (torch.Generator.manual_seed takes any 64-bit value; 63 bits keep it a plain int
    everywhere, JSON included).
    """
    if update < 0:
        raise ValueError(f"update must be >= 0, got {update}")
    text = f"{int(base_seed)}:{int(update)}:{clean_name(name)}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & (2**63 - 1)


def make_signs(rank: int, width: int, seed: int, *, device=None) -> torch.Tensor:
    """The signs of `A` (rank, width), int8 +-1, drawn on the CPU from `seed`: bit-identical
    on any device. Stored instead of `A` itself: 1 byte per entry instead of 4."""
    if rank <= 0 or width <= 0:
        raise ValueError(f"projection needs rank > 0 and width > 0, got rank={rank}, width={width}")
    g = torch.Generator(device="cpu").manual_seed(seed)
    bits = torch.randint(0, 2, (rank, width), generator=g, dtype=torch.int8)  # (r, k) in {0, 1}
    return (bits * 2 - 1).to(device)  # (r, k) in {-1, +1}


def projection_from_signs(signs: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """A = signs / sqrt(r) (r, k), formed in float64 (float32 otherwise) on the signs' device,
    so that every device receives the same rounded values."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return (signs.to(work) * (1.0 / math.sqrt(signs.shape[0]))).to(dtype)  # (r, k)


def make_projection(rank: int, width: int, seed: int, *, device=None, dtype=torch.float32) -> torch.Tensor:
    """Rademacher `A` (rank, width) with entries +-1/sqrt(rank), bit-identical for a seed on any device."""
    return projection_from_signs(make_signs(rank, width, seed, device=device), dtype)


# -----------------------------------------------------------------------------
# The autograd function

class _SketchedLinear(torch.autograd.Function):
    """Y = X W^T + b; backward adds dY^T (X A^T) into `sketch`, and gives dX if `input_grad`; no dW."""

    @staticmethod
    def forward(ctx, x, weight, bias, projection, sketch, group, input_grad, layer):
        y = F.linear(x, weight, bias)  # (..., d)
        # P = X A^T, kept for the sketch instead of X.
        # Shapes: (N, k) @ (k, r) -> (N, r)
        p = x.reshape(-1, x.shape[-1]) @ projection.to(x.dtype).t()
        ctx.save_for_backward(p, weight)
        ctx.sketch, ctx.group, ctx.input_grad, ctx.layer = sketch, group, input_grad, layer
        return y

    @staticmethod
    def backward(ctx, dy):
        p, weight = ctx.saved_tensors
        sketch = ctx.sketch
        dy2 = dy.reshape(-1, dy.shape[-1])  # (N, d)
        # Sketch: S += dY^T P, accumulated in the sketch's dtype (fp32).
        # Shapes: (d, N) @ (N, r) -> (d, r)
        if ctx.group is None:
            sketch.add_(dy2.t().to(sketch.dtype) @ p.to(sketch.dtype))  # not addmm_: see the notes
        else:  # this process keeps its rows of the sum over the group (departure 1)
            sketch.add_(reduce_scatter_rows(dy2.t().to(sketch.dtype) @ p.to(sketch.dtype), ctx.group))
        if ctx.layer is not None:
            ctx.layer.backwards += 1  # a Python int on the host: no device read
        dx = None
        if ctx.needs_input_grad[0] and ctx.input_grad:
            # Input gradient: dX = dY W, as in any linear layer.
            # Shapes: (..., d) @ (d, k) -> (..., k)
            dx = dy @ weight.to(dy.dtype)
        return dx, None, None, None, None, None, None, None


def sketched_linear(x, weight, bias, projection, sketch, group=None, *, layer=None):
    """`x @ weight.T + bias` whose backward adds `dY^T (x A^T)` into `sketch` (d, r) in place.

    With a process `group`, `sketch` holds this process's rows only (`row_shard`) and backward
    adds this process's rows of the sum over the group (one reduce-scatter). Differentiable with
    respect to `x` only. Inputs of any leading shape (..., k). `layer`: the LayerSketch whose
    `backwards` count each backward increments (`LayerSketch.forward` passes itself), or None.

    With gradients enabled the sketch is always formed: an `x` that requires no grad (nothing
    above the layer is trainable) is run as a leaf copy that does, so that backward reaches the
    layer, and backward then forms no dX (the module docstring's notes).

    Forward-mode AD (the KL probe) runs under `torch.no_grad()`, where this is `F.linear` and
    the tangent is PyTorch's own, `dX W^T + X dW^T + db`. With gradients enabled, a dual input
    is refused: the sketch's autograd function defines backward only.
    """
    d, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, weight expects {k}")
    if projection.shape[-1] != k or projection.dim() != 2:
        raise ValueError(f"projection must be (r, {k}), got {tuple(projection.shape)}")
    rows = d if group is None else row_shard(d, group)[1]
    if sketch.shape != (rows, projection.shape[0]):
        raise ValueError(f"sketch must be ({rows}, {projection.shape[0]}), got {tuple(sketch.shape)}")
    if not torch.is_grad_enabled():
        return F.linear(x, weight, bias)  # no backward will run: P would never be used
    if any(t is not None and fwAD.unpack_dual(t).tangent is not None for t in (x, weight, bias)):
        raise ValueError("forward-mode AD through a sketched layer needs torch.no_grad() (as the KL probe runs)")
    input_grad = x.requires_grad
    if not input_grad:
        # Nothing above this layer requires grad (a module without Hugging Face's embedding
        # hook): on a leaf copy that does, backward reaches this layer's sketch, and skips dX.
        x = x.detach().requires_grad_(True)
    return _SketchedLinear.apply(x, weight, bias, projection, sketch, group, input_grad, layer)


# -----------------------------------------------------------------------------
# Row shards of a sketch (the rows an FSDP2 process holds of the weight: torch.chunk of dim 0)

# torch 2.13 names them *_single; older releases *_tensor.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def row_shard(d: int, group) -> tuple[int, int]:
    """(first row, row count) of this process's chunk of `d` rows: ceil(d / world) rows each."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    chunk = -(-d // world)
    start = min(me * chunk, d)
    return start, min(chunk, d - start)


def _padded_rows(d: int, group) -> int:
    return -(-d // dist.get_world_size(group)) * dist.get_world_size(group)


def reduce_scatter_rows(full: torch.Tensor, group) -> torch.Tensor:
    """This process's rows (n, r) of the sum over `group` of every process's `full` (d, r)."""
    d = full.shape[0]
    padded = full if _padded_rows(d, group) == d else \
        torch.cat([full, full.new_zeros(_padded_rows(d, group) - d, *full.shape[1:])])  # (world * chunk, r)
    out = full.new_empty(padded.shape[0] // dist.get_world_size(group), *full.shape[1:])  # (chunk, r)
    _reduce_scatter(out, padded, group=group)
    return out[:row_shard(d, group)[1]]


def gather_rows(local: torch.Tensor, d: int, group) -> torch.Tensor:
    """All `d` rows (d, r) from every process's rows (n, r) (the inverse of the row shard)."""
    world = dist.get_world_size(group)
    chunk = -(-d // world)
    padded = local if local.shape[0] == chunk else \
        torch.cat([local, local.new_zeros(chunk - local.shape[0], *local.shape[1:])])  # (chunk, r)
    out = local.new_empty(chunk * world, *local.shape[1:])  # (world * chunk, r)
    _all_gather(out, padded, group=group)
    return out[:d]


# -----------------------------------------------------------------------------
# Attaching sketches to a model

@dataclass(eq=False)
class LayerSketch:
    """One target layer: its clean name, module, the signs of A_t (r, k) and sketch S (d, r)."""

    name: str  # the clean module name, which seeds A (`projection_seed`)
    module: nn.Linear
    signs: torch.Tensor  # (r, k) int8 +-1: A_t = signs / sqrt(r), a quarter of fp32 A's bytes
    sketch: torch.Tensor  # (d, r), or this process's (n, r) rows with a group; fp32 (float64 for float64 models)
    base_seed: int
    update: int = 0  # t of the A_t in use: the updates already merged (the update counter, above)
    group: object = None  # the process group over which rows are sharded (departure 1), or None
    backwards: int = 0  # backward passes into `sketch` since the last zero_() (0: backward never reached it)

    @property
    def rows(self) -> int:
        """d, the layer's out_features (all rows, whichever this process holds)."""
        return self.module.weight.shape[0]

    @property
    def rank(self) -> int:
        return self.signs.shape[0]

    @property
    def projection(self) -> torch.Tensor:
        """A_t (r, k) in the sketch's dtype, formed from the signs on each use."""
        return projection_from_signs(self.signs, self.sketch.dtype)

    def all_rows(self, local: torch.Tensor) -> torch.Tensor:
        """All d rows (d, r) of a row-sharded (n, r) tensor such as U or F (gathered over the
        group), or `local` itself when rows are not sharded."""
        return local if self.group is None else gather_rows(local, self.rows, self.group)

    def forward(self, x):
        """The target's forward while attached: `sketched_linear` on its weight, this layer's A_t and S."""
        m = self.module
        # The signs and S stay where attach made them: a model moved since would run on a
        # weight and a sketch on two devices (torch.device objects: compared without a sync).
        if m.weight.device != self.sketch.device:
            raise RuntimeError(f"{self.name}: the weight is on {m.weight.device} but its sketch and signs are on "
                               f"{self.sketch.device}, where sketch.attach made them: move the model before "
                               f"attach, or detach(model) and attach again after the move")
        if not torch.is_grad_enabled():  # no backward follows (a rollout, the KL probe): no A to form
            return F.linear(x, m.weight, m.bias)
        return sketched_linear(x, m.weight, m.bias, self.projection, self.sketch, self.group, layer=self)

    def refresh(self, update: int) -> None:
        """Switch to A_update (after update `update - 1` has been merged, or on resume)."""
        seed = projection_seed(self.base_seed, update, self.name)
        self.signs = make_signs(self.rank, self.signs.shape[1], seed, device=self.signs.device)
        self.update = update

    def zero_(self) -> None:
        """S = 0, and no backward counted into it."""
        self.sketch.zero_()
        self.backwards = 0


def target_modules(model: nn.Module, targets=TARGETS) -> dict:
    """{clean name: module} of the targets. `targets`: names, each matching a module's last
    name part (`q_proj`, as `TARGETS`) or its whole clean name (`layers.0.fc`), in module order;
    or a {name: module} mapping, taken as given, in its order (its names seed A)."""
    if isinstance(targets, Mapping):
        found = {}
        for name, module in targets.items():
            clean = clean_name(name)
            if clean in found or any(m is module for m in found.values()):
                raise ValueError(f"targets name {clean} or its module twice: give each module one name")
            found[clean] = module
        return found
    names = (targets,) if isinstance(targets, str) else tuple(targets)  # one name, not its letters
    return {clean_name(n): m for n, m in model.named_modules()
            if n.rsplit(".", 1)[-1] in names or clean_name(n) in names}


def _input_embedding(model: nn.Module):
    """A Hugging Face model's input embedding, or None for a module without one."""
    get = getattr(model, "get_input_embeddings", None)
    if get is None:
        return None
    try:
        embedding = get()
    except NotImplementedError:  # PreTrainedModel's own, for a model that has no embedding
        return None
    return embedding if isinstance(embedding, nn.Module) else None


def _require_grad_hook(module, args, output):
    return output.requires_grad_(True) if torch.is_grad_enabled() else output


def default_rank(modules) -> int:
    """The rank `attach` takes when none is given: the paper's 256, or half the narrowest
    target's input width rounded down to a power of 2 where that is smaller (64 -> 32, 576 -> 256),
    so that the sketch (d, r) stays half or less of the weight (d, k) it stands for."""
    narrowest = min(m.in_features for m in modules)
    return max(1, min(PAPER_RANK, 2 ** int(math.floor(math.log2(max(narrowest // 2, 1))))))


def attach(model: nn.Module, rank: int | None = None, seed: int = 0, targets=TARGETS, *,
           update: int = 0, group=None) -> list[LayerSketch]:
    """Install sketches on every target `nn.Linear` of `model`; freeze every parameter.

    `model`: any `nn.Module`; a Hugging Face causal LM's targets are found by the default
    `targets`. `rank`: r of every sketch; None, `default_rank`'s rule (the paper's 256, capped
    at half the narrowest target's width). `seed`: the base seed every projection A is drawn
    from (RowAdam and the engines read it from the layers). `targets`: names (a module's last
    name part or its clean name), or a {name: module} mapping of modules of `model`
    (`target_modules`). `update`: the updates
    already merged (the update counter; a resumed run's), which picks A_update. `group`: the
    FSDP2 data-parallel group of an FSDP2-sharded model. Each process then keeps only its rows
    of every sketch (the rows it holds of the weight), summed over the group in backward
    (departure 1). Returns the layers in module order (a mapping's: its order).

    Everything is checked before anything changes: a refused attach leaves the model's
    forwards, requires_grad flags and hooks as they were. Undo with `detach(model)`.

    Afterwards the model has no trainable parameter (`requires_grad` is False everywhere): the
    target weights still change, by RowAdam's merge, but through no `.grad`. A trainer that
    counts trainable parameters, or builds its optimizer from them, counts 0; the weights
    LoGRA trains are `[layer.module.weight for layer in layers]` (kl_control.LoGRAOptimizer's
    param group).
    """
    # -- checks: nothing of the model changes until all of them have passed
    if not isinstance(model, nn.Module):
        raise TypeError(f"attach needs an nn.Module, got {type(model).__name__}")
    if getattr(model, "_logra_attached", None) is not None:
        raise RuntimeError("model already has sketches attached; call detach(model) first")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank <= 0):
        raise ValueError(f"rank must be a positive int (or None: default_rank's rule), got {rank!r}")
    if update < 0:
        raise ValueError(f"update must be >= 0, got {update}")
    found = target_modules(model, targets)
    members = {id(m) for m in model.modules()}
    for name, module in found.items():
        if id(module) not in members:
            raise ValueError(f"target {name} is not a module of this {type(model).__name__}: "
                             f"attach the model that holds it")
        if not isinstance(module, nn.Linear):
            raise TypeError(f"target {name} is a {type(module).__name__}, not nn.Linear: "
                            f"remove its name from `targets`")
        if rank is not None and rank > module.in_features:  # default_rank never exceeds it
            raise ValueError(f"rank {rank} exceeds in_features {module.in_features} of {name}: "
                             f"choose rank <= {module.in_features}")
        if "forward" in vars(module):  # detach() could not restore what it would replace
            raise RuntimeError(f"target {name} already has its own forward (sketches attached through "
                               f"another module, or a hook library that patched it): detach that first")
        if group is not None:
            rows = row_shard(module.out_features, group)[1]
            weight = module.weight
            local = weight.to_local().shape[0] if hasattr(weight, "to_local") else None
            if local != rows:
                raise ValueError(f"{name}: row-sharded sketches need the weight sharded the same way (FSDP2 "
                                 f"fully_shard over the group: {rows} rows here), got "
                                 f"{'a replicated weight' if local is None else f'{local} local rows'}")
    if not found:
        what = "an empty mapping" if isinstance(targets, Mapping) else f"no nn.Linear named one of {targets}"
        raise ValueError(f"{what} in {type(model).__name__}: pass `targets`, names of its nn.Linear "
                         f"modules or a {{name: module}} mapping")
    if rank is None:  # every target an nn.Linear, checked above
        rank = default_rank(found.values())
    embedding = _input_embedding(model)  # None: the sketched layers' own leaf inputs (module notes)

    # -- the state of each layer: allocated before the model is touched
    layers = []
    for clean, module in found.items():
        weight = module.weight
        acc_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        rows = module.out_features if group is None else row_shard(module.out_features, group)[1]
        signs = make_signs(rank, module.in_features, projection_seed(seed, update, clean),
                           device=weight.device)  # (r, k) int8
        s = torch.zeros(rows, rank, device=weight.device, dtype=acc_dtype)  # (d, r), or this process's (n, r)
        layers.append(LayerSketch(clean, module, signs, s, seed, update, group))

    # -- the changes, none of which can fail
    for layer in layers:
        layer.module.forward = layer.forward  # an instance attribute: `del` restores nn.Linear.forward
    # Freeze everything, the targets too (their update comes from the sketch), remembering how it was.
    frozen = {n: p.requires_grad for n, p in model.named_parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    hook = None if embedding is None else embedding.register_forward_hook(_require_grad_hook)
    model._logra_attached = (layers, frozen, hook)
    return layers


def detach(model: nn.Module) -> None:
    """Undo `attach`: plain nn.Linear forwards, original requires_grad flags, no hook. The
    layers' sketches stay readable."""
    state = getattr(model, "_logra_attached", None)
    if state is None:
        raise RuntimeError("model has no sketches attached")
    layers, frozen, hook = state
    for layer in layers:
        del layer.module.forward
    for n, p in model.named_parameters():
        p.requires_grad_(frozen[n])
    if hook is not None:
        hook.remove()
    model._logra_attached = None


# -----------------------------------------------------------------------------
# Demo: `python sketch.py` checks one layer's sketch against the dense gradient.

if __name__ == "__main__":
    torch.manual_seed(0)
    d, k, r, n = 512, 1024, 64, 2048
    lin = nn.Linear(k, d)
    x = torch.randn(n, k, requires_grad=True)
    dy = torch.randn(n, d)
    lin(x).backward(dy)
    a = make_projection(r, k, projection_seed(0, 0, "demo"))
    s = torch.zeros(d, r)
    sketched_linear(x.detach().requires_grad_(True), lin.weight.detach(), lin.bias.detach(), a, s).backward(dy)
    ref = lin.weight.grad @ a.t()
    print(f"layer {d}x{k}, rank {r}, {n} tokens")
    print(f"max |S - G A^T| / max |G A^T| = {((s - ref).abs().max() / ref.abs().max()).item():.2e}")
    print(f"bytes: G {d * k * 4:,}  S {d * r * 4:,}  (ratio {r / k:.4f})")
