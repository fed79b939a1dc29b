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
`hash()`), and its signs are a pure function of (seed, row, column) computed with integer
operations on the device that uses them (`make_signs`, a counter-based hash), so that the
trainer processes and the rollout engines build the same bits on any device, each its own,
with no host draw and no copy. The rule, projection version 2 (`PROJECTION`):

    lo, hi  = the low and high 32 bits of the seed
    mix32   = x ^= x >> 16; x *= 0x21F0AAAD; x ^= x >> 15; x *= 0x735A2D97; x ^= x >> 15   (mod 2^32)
    c       = i * ceil(k / 16) + b                      row i's block b of 16 columns
    h       = mix32(mix32(c ^ lo) ^ hi ^ 0x9E3779B9)
    A[i, 16 b + j] = -1/sqrt(r) where bit 16 + j of h is set, +1/sqrt(r) otherwise

mix32 is a bijection of 32-bit words, so distinct counters give distinct words; both
multipliers are below 2^31, so every product of a 32-bit word with one fits an int64 and no
device wraps or rounds (tests/test_sketch.py checks the signs' balance and the rows'
correlations, and E[A^T A] = I; the device check compares CPU and GPU bits). Version 1, the
authors' way, drew the signs with a CPU `torch.Generator` and copied them to the device: per
update ~63 M signs at 0.5B and ~290 M at 7B, in the trainer's merge and again in every engine,
each target a host draw and a copy. A checkpoint or sync payload without a version holds
version 1 (what each does with it: rowadam.py, sync.py). Update `t` uses `A_t` (the counter
below); after it is merged every layer switches to `A_{t+1}`.

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
- `P = X A^T` is stored in the compute dtype of `X` (bf16 under mixed precision), and the
  backward's product `dY^T P` is formed from it and `dY` in that dtype (`sketch_product`): one
  bf16 GEMM, at many times an fp32 GEMM's rate on a GPU (dense bf16 ~990 TFLOP/s against ~67
  for fp32 on an H100 or H200) and with no fp32 copies of `dY` (N, d) and `P`. Where the device
  has a GEMM that writes fp32 from bf16 factors (CUDA, `torch.mm(..., out_dtype=torch.float32)`),
  its fp32 accumulator is the product as it stands, never rounded to bf16; elsewhere the
  product is rounded once to bf16 and then added, as the authors do. The sketch itself
  accumulates in fp32 (float64 when the weight is float64, for tests); fp32 activations (a
  CPU run) give an fp32 GEMM as before. At 7B widths in bf16 (down_proj, 4096 tokens, r =
  256) the sketch's relative error against float64 is 1.66e-3 on an H200 with the fp32-output
  GEMM, the same as with the product in fp32 (gpu_check's `kernels` step, bench/README.md);
  the product rounded to bf16 (this CPU's path, `--cpu` at small widths) gives 2.3e-3 against
  1.7e-3. A backward of a one-process FSDP2 group skips the reduce-scatter: the sum over one
  process is its own (`reduce_scatter_rows`, `gather_rows`).
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
- The signs of every layer are made together (`make_signs_many`, `refresh`): the layers of one
  width in batches of SIGN_BATCH hashed words, a few dozen tensor operations for a model's
  hundreds of projections, where the CPU generator of projection 1 drew each on the host
  (1.4 ms for a 256 x 896 projection, 23 ms at 256 x 18944, then a copy to the device).
- `attach` lays out the sketches of layers of one shape as consecutive rows of one (L, n, r)
  tensor (`stack_of` gives it back), so that RowAdam runs its arithmetic over all of them
  at once (rowadam.py); each layer's `sketch` is its own (n, r) view.
"""

import hashlib
import math
import numbers
import warnings
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
# The rule that makes A's signs from a seed (`make_signs`, "The projection A"): checkpoints and
# sync payloads record it, and a missing record means 1, the CPU generator's draw of earlier releases.
PROJECTION = 2

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


# The signs of A as a counter-based hash (`make_signs`): 32-bit words in int64 tensors, each
# multiplier below 2^31 so that no product leaves int64 (no overflow on any device).
MASK32 = 0xFFFFFFFF
MIX_MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)
ROUND_KEY = 0x9E3779B9  # xored in with the seed's high word, so that seed 0 is no fixed point (mix32(0) = 0)
SIGNS_PER_WORD = 16  # the 16 high bits of each hashed word give 16 signs
SIGN_BATCH = 2**20  # hashed words per batch of make_signs_many (its int64 work: a few 8 MiB tensors)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of 32-bit words (values in [0, 2^32) of an int64 tensor): xor-shift and
    multiply rounds with odd multipliers (the `lowbias32` form of C. Wellons' hash prospector)."""
    x = x ^ (x >> 16)
    x = (x * MIX_MULTIPLIERS[0]) & MASK32
    x = x ^ (x >> 15)
    x = (x * MIX_MULTIPLIERS[1]) & MASK32
    return x ^ (x >> 15)


_SIGN_TABLES = {}  # device -> (256, 8) int8: entry [v, i] is -1 where bit i of the byte v is set, else +1


def _sign_table(device) -> torch.Tensor:
    if device not in _SIGN_TABLES:  # made on the device itself: no copy from the host
        bits = torch.arange(256, dtype=torch.int32, device=device)[:, None] >> torch.arange(8, dtype=torch.int32,
                                                                                             device=device)
        _SIGN_TABLES[device] = (1 - 2 * (bits & 1)).to(torch.int8)  # (256, 8)
    return _SIGN_TABLES[device]


def make_signs(rank: int, width: int, seed: int, *, device=None) -> torch.Tensor:
    """The signs of `A` (rank, width), int8 +-1: a pure function of (seed, row, column) made
    with integer operations on `device`, so every device makes the same bits without a host
    draw or copy (projection version `PROJECTION`). Stored instead of `A` itself: 1 byte per
    entry instead of 4.

    Row i's columns come in blocks of 16; block b's counter is c = i * ceil(width / 16) + b,
    its word h = mix32(mix32(c ^ lo) ^ hi ^ ROUND_KEY) with (lo, hi) the low and high 32 bits
    of `seed`, and A[i, 16 b + j] is -1 where bit 16 + j of h is set, +1 otherwise (the module
    docstring). `make_signs_many` makes many projections' signs at once, the same bits.
    """
    return make_signs_many(rank, [width], [seed], device=device)[0]


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
        if rank <= 0 or width <= 0:
            raise ValueError(f"projection needs rank > 0 and width > 0, got rank={rank}, width={width}")
        if not 0 <= seed < 2**64:
            raise ValueError(f"a projection seed is a 64-bit unsigned integer, got {seed}")
        if rank * -(-width // SIGNS_PER_WORD) > 2**32:
            raise ValueError(f"rank {rank} x width {width} needs more than 2^32 counters: a smaller rank")
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


def projection_from_signs(signs: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """A = signs / sqrt(r) (r, k) in `dtype`, on the signs' device: +-1 times the scale in
    the multiplication's own precision (fp32 for bf16 and fp16, as their kernels compute),
    rounded once, so that every device forms the same values (1/sqrt(r) itself where r is a
    power of 4: 1/16 at the paper's r = 256)."""
    return signs.to(dtype) * (1.0 / math.sqrt(signs.shape[0]))  # (r, k)


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
        # Sketch: S += dY^T P, the product formed from the activations' dtype (bf16 under mixed
        # precision) and added into the fp32 sketch (the implementation notes).
        # Shapes: (d, N) @ (N, r) -> (d, r)
        product = sketch_product(dy2.t(), p, sketch.dtype)
        if ctx.group is not None:  # this process keeps its rows of the sum over the group (departure 1)
            product = reduce_scatter_rows(product, ctx.group)
        sketch.add_(product)  # not addmm_: see the notes
        if ctx.layer is not None:
            ctx.layer.backwards += 1  # a Python int on the host: no device read
        dx = None
        if ctx.needs_input_grad[0] and ctx.input_grad:
            # Input gradient: dX = dY W, as in any linear layer.
            # Shapes: (..., d) @ (d, k) -> (..., k)
            dx = dy @ weight.to(dy.dtype)
        return dx, None, None, None, None, None, None, None


def _has_fp32_out_mm(device_type: str) -> bool:
    """Whether this torch has a GEMM of bf16/fp16 factors that writes fp32 on `device_type`
    (`torch.mm(a, b, out_dtype=...)`, aten::mm.dtype: CUDA builds of recent releases)."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm.dtype", device_type.upper())
    except (AttributeError, RuntimeError):  # an older torch: no such overload or query
        return False


_FP32_OUT_MM = {}  # device type -> _has_fp32_out_mm, asked once


def sketch_product(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`a @ b` in `dtype` (the sketch's, fp32) from factors in the activations' dtype: one GEMM
    at that dtype's rate. Where the factors are bf16 or fp16 and the device has a GEMM that
    writes fp32 from them, its fp32 accumulator is the result as it stands; elsewhere the
    product is rounded once to the factors' dtype and converted (the authors' way)."""
    if a.dtype == dtype:
        return a @ b
    kind = a.device.type
    if kind not in _FP32_OUT_MM:
        _FP32_OUT_MM[kind] = _has_fp32_out_mm(kind)
    if _FP32_OUT_MM[kind] and dtype == torch.float32:
        try:
            return torch.mm(a, b, out_dtype=dtype)
        except torch.OutOfMemoryError:
            raise
        except (TypeError, RuntimeError) as e:  # a build whose overload takes other inputs: the rounded product
            _FP32_OUT_MM[kind] = False
            warnings.warn(f"torch.mm(..., out_dtype=torch.float32) failed on {kind} ({type(e).__name__}: "
                          f"{str(e)[:120]}): the sketch's products are rounded to {a.dtype} from now on")
    return (a @ b).to(dtype)


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
    if dist.get_world_size(group) == 1:  # one process (FSDP2 on one GPU): the sum is its own
        return full
    d = full.shape[0]
    padded = full if _padded_rows(d, group) == d else \
        torch.cat([full, full.new_zeros(_padded_rows(d, group) - d, *full.shape[1:])])  # (world * chunk, r)
    out = full.new_empty(padded.shape[0] // dist.get_world_size(group), *full.shape[1:])  # (chunk, r)
    _reduce_scatter(out, padded, group=group)
    return out[:row_shard(d, group)[1]]


def gather_rows(local: torch.Tensor, d: int, group) -> torch.Tensor:
    """All `d` rows (d, r) from every process's rows (n, r) (the inverse of the row shard)."""
    world = dist.get_world_size(group)
    if world == 1:  # one process holds every row
        return local
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

    def projection_as(self, dtype) -> torch.Tensor:
        """A_t (r, k) in `dtype` (the activations'), formed from the signs (`projection_from_signs`)."""
        return projection_from_signs(self.signs, dtype)

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
        a = self.projection_as(x.dtype)  # (r, k) A_t in the activations' dtype (bf16 under mixed precision)
        return sketched_linear(x, m.weight, m.bias, a, self.sketch, self.group, layer=self)

    def refresh(self, update: int) -> None:
        """Switch to A_update (after update `update - 1` has been merged, or on resume);
        `refresh(layers, update)` moves many layers at once."""
        refresh([self], update)

    def zero_(self) -> None:
        """S = 0, and no backward counted into it."""
        self.sketch.zero_()
        self.backwards = 0


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


def refresh(layers, update: int) -> None:
    """Switch every layer to A_update, their signs made together (`make_signs_many`), one batch
    of tensor operations per device, rank and width rather than a dozen operations per layer."""
    groups = {}
    for layer in layers:
        groups.setdefault((layer.signs.device, layer.rank), []).append(layer)
    for (device, rank), group in groups.items():
        signs = make_signs_many(rank, [l.signs.shape[1] for l in group],
                                [projection_seed(l.base_seed, update, l.name) for l in group], device=device)
        for layer, s in zip(group, signs):
            layer.signs, layer.update = s, update


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
    already merged (the update counter; a resumed run's), which picks A_update (on a resume
    through `RowAdam.load_state_dict` the state's counter wins: it moves every layer to its own
    A whatever `update` was given here, so `update` matters only where no RowAdam state is
    loaded afterwards). `group`: the
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
        # the signs' shape (r, k), no memory: A_update's are made below
        signs = torch.empty((), dtype=torch.int8, device=weight.device).expand(rank, module.in_features)
        s = torch.empty((), device=weight.device, dtype=acc_dtype).expand(rows, rank)  # S's shape; its tensor below
        layers.append(LayerSketch(clean, module, signs, s, seed, update, group))
    # The sketches of layers of one shape: consecutive rows of one zeroed tensor (L, n, r)
    # (`stack_of`), so that RowAdam works on all of them at once. (d, r) each, or this process's (n, r).
    for members in shape_groups([layer.sketch for layer in layers], [layer.signs for layer in layers]):
        first = layers[members[0]].sketch
        stack = torch.zeros(len(members), *first.shape, dtype=first.dtype, device=first.device)  # (L, n, r)
        for j, i in enumerate(members):
            layers[i].sketch = stack[j]
    refresh(layers, update)  # the signs of A_update, every layer's made together

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
