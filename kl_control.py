"""
kl_control.py: predicted-KL step control, with mismatch subtraction.

What it is
----------
RowAdam proposes a direction `U` per target layer (d, r); the merged update is
`W -= alpha * U A`. An update that is small in parameter space can still move next-token
probabilities a lot, so before merging, LoGRA predicts the policy change and picks the step
multiplier `alpha` that spends a KL budget (a trust region in the spirit of TRPO).

Sources: the paper, arXiv:2610.06647, and the authors' code (the Molt library),
https://github.com/skzhang1/labs-molt/tree/logra/examples/scripts/logra.

Use
---
    import kl_control
    import ppo
    import sketch
    from rowadam import RowAdam

    temperature = 1.0                                  # the rollout's sampling temperature
    layers = sketch.attach(model, rank=16, seed=0)     # S and A on every target nn.Linear (the paper: rank 256)
    opt = RowAdam(layers, base_seed=0)                 # the seed attach drew A from
    # One update. The loss's backward goes into the sketches S = G A^T; no weight gradient exists.
    logp = ppo.response_logprobs(model(input_ids=ids).logits, ids, temperature)  # (B, T)
    loss, _ = ppo.policy_loss(logp, advantages, mask, num_tokens=ppo.global_token_count(mask))
    loss.backward()
    opt.prepare()                                      # RowAdam's directions U (d, r): opt.directions
    try:
        probe = kl_control.probe(model, layers, opt.directions, ids, mask, temperature=temperature,
                                 keep_positions=256)   # KL1, and the logits "before" at 256 positions
        budget = kl_control.kl_budget(opt.update)      # 2e-4 -> 2e-5 nats per token over 300 updates
        alpha = kl_control.solve_alpha(probe.kl1, budget=budget)  # min(3, sqrt(budget / KL1))
    except Exception:
        opt.discard()                                  # nothing merged: weights and RowAdam as they were
        raise
    factors = opt.merge(alpha)                         # W -= F A, F = bf16(alpha U): what engines receive
    kl_real = kl_control.realised_kl(probe, model, ids, mask)  # the merged step's exact KL per token

`model` is a causal LM with fp32 weights (RowAdam merges into them), `ids` (B, T) prompt and
response tokens, `mask` (B, T) True on response tokens, `advantages` (B,). The `Probe` that
`probe` returns records what it scored (which responses, the token limit, the temperature)
and the logits it kept, so `realised_kl` repeats none of it. With a separate rollout engine,
also subtract the mismatch: `mismatch.observe(rollout_logprobs, logp.detach(), mask, eos)`
after the backward and `budget = mismatch.adjust(kl_control.kl_budget(opt.update))` (a
`Mismatch`, kept and checkpointed with the optimizer). Every trainer process makes the same
calls (FSDP all-gathers inside).

The math
--------
The paper's method section on predicted-KL step control predicts how far an update would
move the token probabilities before applying it, and picks alpha so that the predicted KL
fits a budget; the prediction grows as alpha^2, and the paper calls it "an estimate used for
control, not a guarantee" (`realised_kl` measures the KL a merge really caused).

For the direction at alpha = 1 every target weight moves by `dW = -U A` (d, k). Forward-mode
AD pushes these weight tangents through the model at once (weights untouched), so each
position gets its logits `z` and the logit tangent `u = dz/dalpha`. At a target layer
`Y = X W^T + b` the output's tangent is

    dY = dX W^T + X dW^T = dX W^T - (X A^T) U^T                  (N, d)

With temperature T,

    p   = softmax(z / T),   q = u / T
    kl1 = 0.5 * sum_v p_v (q_v - sum_w p_w q_w)^2                (half the variance of q under p)

which is the second-order term of KL(p || p(alpha)) = alpha^2 kl1 + O(alpha^3). KL1 is the
mean of kl1 over the generated tokens of the probed responses of every trainer process (the
paper's first 2 of each process, and more until they hold 512 scored tokens: departure 3;
sums and counts reduced across processes); then

    alpha  = min(alpha_max, sqrt(budget / KL1))        alpha_max = 3.0; KL1 = 0 gives 1.0
    budget = end + (start - end) * 0.5 (1 + cos(pi min(n / (H - 1), 1)))
             start = 2e-4, end = 2e-5, H = 300 updates

`plain_probe` computes KL1 exactly as written here: dW, forward-mode AD through the model's
own forward, kl1 at every scored position. `probe` is the fast path (`fast_probe`): the
same numbers without the dense dW and without the whole (B, T, V) logits.

Mismatch subtraction (part of the LoGRA recipe in Table 1's setup: RowAdam with mismatch
subtraction and predicted-KL annealing): the rollout engine and the trainer disagree a little
on the log-probs of the same tokens (kernels, bf16). On the response tokens of samples that
ended with EOS (or of every sample: departure 4),

    observed = max(0, mean(rollout_logprob - trainer_logprob))   (a Monte-Carlo KL(engine || trainer))
    m        <- 0.7 m + 0.3 observed
    budget   <- max(budget - m, 0.5 budget)

so the update only gets what the existing mismatch leaves of the budget. `m` is optimizer
state and is checkpointed.

Shape legend: B batch, T time, V vocab, N tokens, d out rows, k in columns, r rank, h hidden
width, M scored positions, c positions of one output-head chunk.

Defaults, and how to choose them
--------------------------------
The paper's, for its 7B run: budget 2e-4 -> 2e-5 nats per token over H = 300 updates,
alpha_max = 3, the first 2 responses of each process probed (and more until they hold 512
scored tokens: departure 3), each cut to 4096 tokens; `temperature` is the sampling one.

The budget and alpha. RowAdam (rowadam.py) scales U so that ||U A|| = update_ratio ||W||,
and KL1 is quadratic in U, so with K the KL1 of the same direction scaled to ||U A|| = ||W||

    KL1         = update_ratio^2 K
    alpha       = min(alpha_max, sqrt(budget / KL1))
    alpha^2 KL1 = min(alpha_max^2 KL1, budget)          the step's predicted KL

- While alpha is capped (alpha = alpha_max: alpha_max^2 KL1 < budget), the budget does not
  bind: the step is alpha_max U, set by update_ratio, and spends less KL than budgeted.
- Once the budget binds (alpha < alpha_max), update_ratio stops mattering: the merged step
  alpha U = sqrt(budget / KL1) U is the same for any update_ratio, and its predicted KL is
  the budget. It binds once update_ratio is at least its present value times
  sqrt(budget / (alpha_max^2 KL1)).
(tests/test_kl_control.py::test_update_ratio_sets_the_step_only_while_alpha_is_capped.)

Rule: the budget is the KL, in nats per generated token, that one update may move the policy,
not tied to the model's size: keep the paper's 2e-4 -> 2e-5 for a pretrained LLM (this
repository's presets use it from 135M to 27B parameters); a toy policy that must move far in
few updates takes about 100x (train.py's toy presets, "tiny" and "tiny-math": 2e-2 -> 5e-3
over 150 updates, with update_ratio 2e-3). Measured on examples/minimal_loop.py's toy
(bench/README.md, `defaults_sweep.py`; 40 updates, seeds 0-2; the paper's sizes not measured):
the budget sets the pace once it binds. The paper's 2e-4 left the reward at chance; on the
2-layer width-64 model 5e-2 -> 1e-2 raised it from 0.03 to 0.19 and 2e-1 -> 5e-2 to 0.67
(AdamW: 0.99), with realised / predicted KL 0.85 and 0.63; on the 4-layer width-128 one no
setting took it past 0.06 in 40 updates (AdamW: 1.00). On an 85M-parameter model of the same
toy (16 layers, width 768, rank 32; `--large`, 20 updates) with the examples' std-0.2 weights
no budget moved the reward from chance (0.034), the largest (2e-1 -> 5e-2) at realised /
predicted KL 0.36, while AdamW went from 0.11 to 0.89: a random deep policy that chaotic
spends the budget on directions the second-order prediction does not describe. With weights
at a pretrained LLM's scale (std 0.02, `--init-std 0.02`) the toy rule learns there on every
seed: 2e-1 -> 5e-2 with update_ratio 1e-2 took the reward from 0.11 to 0.88 (0.84..0.91;
realised / predicted 0.75), where AdamW at lr 3e-3 reached 1.0 on two seeds and collapsed to
0 on the third; the paper's 2e-4 left it at chance in 20 updates, as it should for a policy
that must move this far. The paper's sizes and a pretrained ~100M model are not measured here.

What to watch: alpha, every update. alpha = alpha_max in every update means the budget never
binds (every step is update_ratio's, unbudgeted): raise update_ratio by the factor above. And
the realised KL (`realised_kl`) against the prediction alpha^2 KL1, which is second order: a
realised KL far from it means a step beyond that regime, so lower the budget.

Departures from the paper
-------------------------
1. The tangent -(X A^T) U^T that `probe` injects at a target layer is formed in the
   activations' dtype (bf16 on GPUs), as the rest of the forward is. The paper does not say
   in what precision; the authors' newest probe forms it in fp32 and casts it back. Tried on
   the tiny Qwen2 against float64, fp32 did not lower KL1's error, which the bf16 forward's
   own rounding dominates (the matmuls accumulate in fp32 already), while an fp32 (N, d)
   tangent would double the probe's largest transient per layer. Test:
   tests/test_kl_control.py::test_kl1_in_bf16_against_float64 (within 0.5% of float64, bf16
   weights and bf16 autocast).
2. `solve_alpha` with KL1 = 0 (a direction that moves no scored logit) returns
   min(1.0, alpha_max). The paper's alpha = min(alpha_max, sqrt(budget / KL1)) divides by
   zero there; the authors' code returns 1.0, even when `alpha_max` < 1. `alpha_max` is the
   user's bound on every step, and here it holds without exception. Test:
   tests/test_kl_control.py::test_solve_alpha.
3. The probe scores, by default, the paper's first 2 responses of each process and more
   until they hold 512 scored tokens (`probe_count`; all of them if they hold fewer). The
   paper's responses run to thousands of tokens, where 2 responses already hold 512 and
   this is the paper's rule; on short responses 2 of them are a few tokens (12 on 6-token
   responses), and KL1 from those is noise. `max_responses=n` scores exactly the first n.
   Test: tests/test_kl_control.py::test_the_default_probe_scores_512_tokens. With several
   responses per prompt (GRPO-style groups in contiguous rows), the first rows are one
   prompt's: pass the rows reordered so that each group's first response comes first (for
   groups of G, `order = torch.arange(B).view(-1, G).t().reshape(-1)`, as train.py does), and
   the same rows to `realised_kl`.
4. `Mismatch.observe(..., ended_with_eos=None)` counts every response. The paper's rule
   counts only responses that ended with EOS (pass their flags for it); fixed-length
   responses never do, and under that rule the mismatch would never be observed nor
   subtracted. Test: tests/test_kl_control.py::test_mismatch_without_eos_flags.

Implementation notes
--------------------
- The fast path runs the decoder once and applies the output head to the scored positions
  only, in chunks of `HEAD_CHUNK_BYTES` (256 MiB) of work, so the (B, T, V) logits and their
  tangent are never held at once, whatever the vocabulary.
- The fast path forms the tangent of every target layer and of the output head itself,
  dY = dX W^T (- (X A^T) U^T at the targets): PyTorch's own tangent of a linear layer whose
  weight has none also multiplies X by a zero weight tangent, one matmul more per layer, the
  head's (M, h) x (h, V) included. The same numbers (X 0 = 0 exactly).
- Elementwise + - * / with one dual and one constant operand (a norm's weight, RoPE's cos,
  a scalar) get their tangents formed directly (`_ConstantOperands`): PyTorch's zero-tensor
  path runs Python meta kernels, ~0.1 ms an op on a CPU. Bit for bit PyTorch's numbers
  (tests/test_kl_control.py::test_constant_operand_tangents_are_pytorch_own). With the two
  notes above, and the realised KL's "before" taken from the probe's own forward instead of
  one more forward, the probe phase of train.py's tiny preset (a 2-layer Qwen2 of width 64)
  went from 24-25 ms to 14 ms (median over 40 updates on a 2-core CPU).
  tests/test_kl_control.py::test_the_fast_path_is_the_plain_probe checks the fast path
  against `plain_probe`.
- The realised KL's "before" is the probe's own logits at its first `keep_positions` scored
  positions (all of them when there are fewer: `Probe.kept` says how many); `scored_logits`
  gives the same bits for the same weights
  (tests/test_kl_control.py::test_the_kept_logits_are_the_realised_kls_before).
- `max_tokens` (default 4096) cuts each probed sequence, prompt included, to its first
  `max_tokens` tokens: the paper's "at most 4096 tokens" read as the sequence the probe's
  forward holds. At the paper's context of 4096 tokens (prompt and response) it cuts nothing.
- The probe refuses, before its forward, what it cannot use: no directions yet (None:
  `RowAdam.prepare()` makes them), directions that are not one (n, r) per layer, a bad
  temperature or count. On any error it leaves no hook, no forward-AD level and no torch
  function mode behind, and the model in its mode (tests/test_kl_control.py::test_probe_errors).
- The cosine schedule is written as the weighted mean `w start + (1 - w) end`, which gives
  exactly `start` at update 0 and exactly `end` from update H - 1 on
  (tests/test_kl_control.py::test_kl_budget_schedule).
"""

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist

# Bytes of output-head work per probe chunk: a scored position holds about 56 V bytes at once
# (the head's logits and tangent, and token_kl's float64 softmax and products), so at a
# vocabulary of 152k a chunk is 31 positions. Sized in bytes, not positions, so that no
# vocabulary makes a chunk too large (implementation notes: the head in chunks).
HEAD_CHUNK_BYTES = 256 * 2**20
BYTES_PER_VOCAB_ENTRY = 56
# Positions per block of the realised KL's float64 work (two log-softmaxes, a product: about
# 32 V bytes a position, 311 MiB at a vocabulary of 152k).
KL_CHUNK_POSITIONS = 64
# What the probe scores by default: the paper's first 2 responses of each process, and more
# until they hold 512 scored tokens (departure 3); each sequence cut to the paper's 4096 tokens.
PROBE_RESPONSES = 2
PROBE_TOKENS = 512
MAX_TOKENS = 4096


# -----------------------------------------------------------------------------
# The second-order KL of one position

def token_kl(logits, tangent, temperature=1.0):
    """kl1 = 0.5 Var_p(tangent / T), p = softmax(logits / T), per position (...,), in float64."""
    if logits.shape != tangent.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and tangent {tuple(tangent.shape)} differ in shape")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    z = logits.to(torch.float64) / temperature  # (..., V)
    q = tangent.to(torch.float64) / temperature  # (..., V)
    p = torch.softmax(z, dim=-1)  # (..., V)
    # kl1 = 0.5 sum_v p_v (q_v - E_p[q])^2
    mean_q = (p * q).sum(-1, keepdim=True)  # (..., 1)
    return 0.5 * (p * (q - mean_q).square()).sum(-1)  # (...,)


# -----------------------------------------------------------------------------
# The probe as its math reads: dW = -U A pushed through the model by forward-mode AD

@contextmanager
def probe_mode(model):
    """Eval mode and eager attention (SDPA's fused kernels have no forward AD); restored on exit.
    The realised KL's forwards run in it too, so that they see the probe's own logits."""
    training = [m for m in model.modules() if m.training]  # each module's own mode comes back
    attn = model.config._attn_implementation
    for m in training:  # model.eval(), without its walk of every module when none trains
        m.training = False
    if attn != "eager":
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if attn != "eager":
            model.set_attn_implementation(attn)
        for m in training:
            m.training = True


def _scored(input_ids, response_mask, max_responses, min_tokens, max_tokens, attention_mask):
    """The probed part of the batch: (ids (B', T'), scored positions (B', T' - 1), attention mask
    (B', T') or None). Every sequence is cut to its first `max_tokens` tokens, and position t is
    scored when token t + 1 was generated. B' = `max_responses` (all when fewer), or with None
    the first PROBE_RESPONSES and more until they hold `min_tokens` scored positions (departure 3)."""
    if input_ids.dim() != 2 or input_ids.shape != response_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and response_mask "
                         f"{tuple(response_mask.shape)} differ in shape, or are not (B, T)")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} and input_ids "
                         f"{tuple(input_ids.shape)} differ in shape")
    if not max_tokens >= 2:
        raise ValueError(f"max_tokens must be >= 2 (a token and the generated one it scores), got {max_tokens}")
    if max_responses is not None and not max_responses >= 1:
        raise ValueError(f"max_responses must be >= 1, or None for the default rule, got {max_responses}")
    if not min_tokens >= 0:
        raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
    scored = response_mask[:, :max_tokens].bool()[:, 1:]  # (B, T' - 1)
    n = probe_count(scored, PROBE_RESPONSES, min_tokens) if max_responses is None else max_responses
    am = None if attention_mask is None else attention_mask[:n, :max_tokens]
    return input_ids[:n, :max_tokens], scored[:n], am


def _check_probe_inputs(layers, directions, temperature, keep_positions):
    """Refuse, before any forward or hook, what the probe cannot use (implementation notes)."""
    if directions is None:
        raise ValueError("directions is None: the probe needs RowAdam's directions U; call opt.prepare() "
                         "first (after the loss's backward) and pass opt.directions")
    if len(directions) != len(layers):
        raise ValueError(f"{len(layers)} layers but {len(directions)} directions: pass the directions that "
                         f"prepare() made for these layers (opt.directions of the RowAdam over them)")
    for layer, u in zip(layers, directions):
        # U has the sketch's shape: (d, r), or this process's (n, r) rows of a row-sharded layer
        if not isinstance(u, torch.Tensor) or u.shape != layer.sketch.shape:
            got = tuple(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__
            raise ValueError(f"{layer.name}: direction {got}, but the layer's U is {tuple(layer.sketch.shape)} "
                             f"(its sketch's shape): pass opt.directions, in the order of `layers`")
    _check_temperature(temperature)
    if not keep_positions >= 0:
        raise ValueError(f"keep_positions must be >= 0, got {keep_positions}")


def _check_temperature(temperature):
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0 (the sampling temperature), got {temperature}")


@dataclass(frozen=True)
class Probe:
    """What one probe gives: KL1 (reduced over processes), what it scored, and the logits it
    kept for `realised_kl`, which reads all of it from here and so cannot disagree with it."""
    kl1: float
    logits: torch.Tensor | None  # (kept, V): this process's, at its first scored positions; None: keep_positions=0
    kept: int  # rows of `logits`: min(keep_positions, this process's scored positions)
    responses: int  # this process's first `responses` responses were scored,
    max_tokens: int  # each cut to its first `max_tokens` tokens,
    temperature: float  # at this temperature


@torch.no_grad()
def probe_logits(model, layers, directions, input_ids, attention_mask=None):
    """(logits z, logit tangent u = dz/dalpha) (B, T, V) of the model's own forward, with the
    tangent dW = -U A on every target layer's weight, by `torch.func.jvp`. One process, whole
    directions (d, r); dense (d, k) tangents: for reading and for tests (the JVP is checked
    against finite differences)."""
    _check_probe_inputs(layers, directions, 1.0, 0)
    if any(layer.group is not None for layer in layers):
        raise ValueError("the plain probe runs on one process with whole directions; "
                         "layers attached with a group need probe(...)")
    names = {module: name for name, module in model.named_modules()}
    weights, tangents = {}, {}
    for layer, u in zip(layers, directions):
        w = layer.module.weight  # (d, k)
        weights[names[layer.module] + ".weight"] = w
        # dW = -U A. Shapes: (d, r) @ (r, k) -> (d, k)
        tangents[names[layer.module] + ".weight"] = -(u.to(w.dtype) @ layer.projection.to(w.dtype))

    def logits(target_weights):  # the model's logits (B, T, V) with these target weights
        return torch.func.functional_call(model, target_weights, kwargs=dict(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False)).logits

    with probe_mode(model):
        return torch.func.jvp(logits, (weights,), (tangents,))  # (B, T, V) each


@torch.no_grad()
def plain_probe(model, layers, directions, input_ids, response_mask, *, temperature=1.0, max_responses=None,
                min_tokens=PROBE_TOKENS, max_tokens=MAX_TOKENS, attention_mask=None, keep_positions=0) -> Probe:
    """`probe` as the module docstring's math reads, on one process: the logits and their
    tangent at every position (`probe_logits`), then KL1 = the mean of kl1 over the scored
    positions. `probe`'s arguments (but `group`) and result, to rounding; it holds a dense
    (d, k) tangent per target layer and the (B, T, V) logits with their tangent, which the fast
    path avoids."""
    _check_probe_inputs(layers, directions, temperature, keep_positions)
    ids, scored, am = _scored(input_ids, response_mask, max_responses, min_tokens, max_tokens, attention_mask)
    z, u = probe_logits(model, layers, directions, ids, am)  # (B', T', V) each
    # (M, V) each: the positions that sampled a generated token
    z, u = z[:, :-1][scored], u[:, :-1][scored]
    if z.shape[0] == 0:
        raise ValueError("no generated token to score: response_mask has no position after the first")
    # KL1 = mean over the scored positions of kl1 = 0.5 Var_p(u / T)
    kl1 = token_kl(z, u, temperature).mean().item()
    kept = z[:keep_positions] if keep_positions > 0 else None  # (kept, V)
    return Probe(kl1, kept, 0 if kept is None else kept.shape[0], ids.shape[0], max_tokens, float(temperature))


# -----------------------------------------------------------------------------
# The fast path: `probe`, the same KL1 as `plain_probe` at a fraction of its work
#
# It exists because the plain probe does not fit a 7B run: it holds a dense (d, k) tangent for
# every target layer (a second copy of the targets' weights) and the (B, T, V) logits with
# their tangent (4.6 GiB in bf16 at a vocabulary of 152k and 2 x 4096 tokens, before token_kl's
# float64 work on them), and it pushes PyTorch's zero tangents of the norms, RoPE and the mask
# through Python meta kernels. The fast path is the same forward-mode AD without any of these:
# hooks form the target layers' and the head's tangents dY = dX W^T - (X A^T) U^T (no dW),
# `_ConstantOperands` forms constant-operand tangents directly (bit for bit PyTorch's), the
# decoder runs once and the head only on the scored positions, in chunks. Its KL1 and kept
# logits are `plain_probe`'s up to the rounding of (X A^T) U^T against X (U A)^T and of the
# head's matmul on fewer rows (tests/test_kl_control.py::test_the_fast_path_is_the_plain_probe),
# and it runs under FSDP2.

@contextmanager
def injected_tangents(layers, directions):
    """Each target layer's output gets the tangent of Y = X (W - alpha U A)^T + b at alpha = 0,

        dY = dX W^T - (X A^T) U^T

    formed here, without PyTorch's X dW^T with a zero dW: a pre-hook hands the layer its primal
    input only, so that its forward is the plain one, and keeps the incoming tangent dX; the hook
    forms dY. `directions` are whole (d, r) or, for layers attached with a group, this process's
    rows of U."""

    def hooks_for(layer, u):
        incoming = []  # dX, from the pre-hook to the hook of the same call

        def strip(module, args):
            x, dx = fwAD.unpack_dual(args[0])
            incoming.append(dx)
            return (x, *args[1:])

        def inject(module, args, y):
            dx, x = incoming.pop(), args[0]  # (..., k) each; dx is None before the first target
            # -(X A^T) U^T, in the activations' dtype (departure 1).
            # Shapes: (N, k) @ (k, r) -> (N, r); (N, r) @ (r, d) -> (N, d)
            p = x.reshape(-1, x.shape[-1]) @ layer.projection.to(x.dtype).t()
            # Row-sharded U (rowadam.py departure 1): this layer's whole U, gathered for this
            # forward only, as FSDP gathers the weight.
            u_all = layer.all_rows(u)  # (d, r)
            dy = (p @ -u_all.to(x.dtype).t()).reshape(y.shape)  # the sign on U: no (N, d) negation
            if dx is not None:
                dy = F.linear(dx, module.weight).add_(dy)  # dX W^T (the bias has no tangent), + dy
            return fwAD.make_dual(y, dy)

        return strip, inject

    _check_probe_inputs(layers, directions, 1.0, 0)
    handles = []
    try:
        for layer, u in zip(layers, directions):
            strip, inject = hooks_for(layer, u)
            handles += [layer.module.register_forward_pre_hook(strip), layer.module.register_forward_hook(inject)]
        yield
    finally:
        for h in handles:
            h.remove()


class _ConstantOperands(TorchFunctionMode):
    """Tangents of `dual op constant` for + - * / formed directly.

    Where one operand of an elementwise op carries a tangent and the other does not (a norm's
    weight, RoPE's cos and sin, the attention mask, a Python scalar), PyTorch's forward AD gives
    the constant a zero tangent, and arithmetic with zero tensors runs through Python meta
    kernels: about 0.1 ms an op on a CPU, a third of the tiny preset's probe. Those ops' tangents
    are linear in the dual operand's and formed here instead; every other call, and every call
    with two dual operands or none, is PyTorch's own. The same numbers bit for bit: x + 0 = x and
    the products are the same products.
    """

    FAST = {torch.Tensor.mul, torch.mul, torch.Tensor.add, torch.add, torch.Tensor.sub, torch.sub,
            torch.Tensor.div, torch.div}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs or len(args) != 2 or func not in self.FAST:
            return func(*args, **(kwargs or {}))
        (a, da), (b, db) = (_split(x) for x in args)
        if (da is None) == (db is None) or (db is not None and func in (torch.Tensor.div, torch.div)):
            return func(*args)  # two dual operands, none, or constant / dual: PyTorch's own rule
        out = func(a, b)
        if func in (torch.Tensor.mul, torch.mul):
            tangent = da * b if db is None else a * db
        elif func in (torch.Tensor.div, torch.div):
            tangent = da / b
        else:  # + and -: the dual operand's tangent, broadcast to the result
            tangent = da if db is None else (db if func in (torch.Tensor.add, torch.add) else -db)
            tangent = tangent.to(out.dtype).expand(out.shape)
        return fwAD.make_dual(out, tangent)


def _split(x):
    """(primal, tangent or None) of a tensor; (x, None) of anything else."""
    return tuple(fwAD.unpack_dual(x)) if isinstance(x, torch.Tensor) else (x, None)


@contextmanager
def _root_gathered(model):
    """Under FSDP2 the root module owns the embedding, final norm and output head; calling the
    decoder and head directly bypasses its hooks, so its parameters are gathered explicitly."""
    fsdp_root = hasattr(model, "unshard") and hasattr(model, "reshard")
    if fsdp_root:
        model.unshard()
    try:
        yield
    finally:
        if fsdp_root:
            model.reshard()


def _head_chunks(model, hidden, tangent=None):
    """The output head on the scored rows (M, h), a chunk of positions at a time: yields (logits,
    logit tangent or None), (c, V) each. The head's tangent is dH W_head^T, formed here as the
    target layers' are. Gemma 2's cap tanh(z / cap) cap, which its forward applies after the
    head, is applied here too, with its derivative 1 - tanh^2(z / cap). No rows give one empty
    chunk (0, V): a process without a scored position still has its (0, V) logits."""
    head = model.get_output_embeddings()
    chunk = max(1, HEAD_CHUNK_BYTES // (BYTES_PER_VOCAB_ENTRY * head.weight.shape[0]))  # positions
    cap = getattr(model.config, "final_logit_softcapping", None)
    for start in range(0, max(hidden.shape[0], 1), chunk):
        z = head(hidden[start:start + chunk])  # (c, V)
        u = None if tangent is None else F.linear(tangent[start:start + chunk], head.weight)  # (c, V)
        if cap:
            t = torch.tanh(z / cap)
            z = t * cap
            u = None if u is None else u * (1 - t * t)
        yield z, u


@torch.no_grad()
def fast_probe(model, layers, directions, input_ids, response_mask, *, temperature=1.0, max_responses=None,
               min_tokens=PROBE_TOKENS, max_tokens=MAX_TOKENS, attention_mask=None, keep_positions=0,
               group=None) -> Probe:
    """KL1, the mean second-order KL per generated token for the direction alpha = 1, from one
    forward pass with tangents over this process's probed responses: the fast path (above), the
    same numbers as `plain_probe`. Weights are not touched.

    `directions`: RowAdam's U, one (d, r) per layer of `layers` (this process's (n, r) rows of a
    row-sharded layer), as `opt.prepare()` leaves them in `opt.directions`. `response_mask`
    (B, T) marks generated tokens; the token at t is scored on the logits at t - 1, at
    `temperature` (the sampling one). Probed: the first 2 responses and more until they hold
    `min_tokens` scored tokens (all of them if they hold fewer; departure 3), or, given
    `max_responses`, exactly the first `max_responses`; each cut to its first `max_tokens` tokens.
    `keep_positions` > 0 keeps the logits (the forward's primal) at the first `keep_positions`
    scored positions, or at all of them when there are fewer (`Probe.kept` says how many): the
    "before" of `realised_kl`, at no extra forward. Every trainer process must call this (FSDP
    all-gathers inside).
    """
    _check_probe_inputs(layers, directions, temperature, keep_positions)
    ids, scored, am = _scored(input_ids, response_mask, max_responses, min_tokens, max_tokens, attention_mask)
    decoder = model.get_decoder()
    total = torch.zeros(2, dtype=torch.float64, device=ids.device)  # (sum kl1, count)
    kept = []
    with _root_gathered(model), probe_mode(model), injected_tangents(layers, directions), fwAD.dual_level(), \
            _ConstantOperands():
        hidden, tangent = fwAD.unpack_dual(decoder(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state)
        if tangent is None:
            raise RuntimeError("the tangent was lost in the decoder (an op without forward AD?)")
        # (M, h) each: the positions that sampled a generated token
        hidden, tangent = hidden[:, :-1][scored], tangent[:, :-1][scored]
        for z, u in _head_chunks(model, hidden, tangent):
            kl = token_kl(z, u, temperature)  # (c,)
            total[0] += kl.sum()
            total[1] += kl.numel()
            need = keep_positions - sum(len(k) for k in kept)
            if need > 0:  # a part of a chunk is copied, so that the chunk itself is freed
                kept.append(z[:need].clone() if need < len(z) else z)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, group=group)
    kl_sum, count = total.tolist()
    if count == 0:
        raise ValueError("no generated token to score: response_mask has no position after the first")
    logits = torch.cat(kept) if keep_positions > 0 else None  # (kept, V)
    return Probe(kl_sum / count, logits, 0 if logits is None else logits.shape[0], ids.shape[0], max_tokens,
                 float(temperature))


# The probe to call: the fast path.
probe = fast_probe


def predict_kl(model, layers, directions, input_ids, response_mask, **kwargs) -> float:
    """KL1 alone: `probe(...).kl1`."""
    return probe(model, layers, directions, input_ids, response_mask, **kwargs).kl1


# -----------------------------------------------------------------------------
# The realised KL of a merged step

@torch.no_grad()
def scored_logits(model, input_ids, response_mask, *, max_responses=None, min_tokens=PROBE_TOKENS,
                  max_positions=512, max_tokens=MAX_TOKENS, attention_mask=None) -> torch.Tensor:
    """The policy's logits (M', V) at the probe's first `max_positions` scored positions (all of
    them when there are fewer), the probe's arguments choosing the positions, by the probe's path
    without tangents (eager attention, the decoder, the head on those rows): the same numbers as
    the probe's own primal for the same weights, bit for bit."""
    ids, scored, am = _scored(input_ids, response_mask, max_responses, min_tokens, max_tokens, attention_mask)
    with _root_gathered(model), probe_mode(model):
        hidden = model.get_decoder()(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state
        return torch.cat([z for z, _ in _head_chunks(model, hidden[:, :-1][scored][:max_positions])])


@torch.no_grad()
def realised_kl(probe, model, input_ids, response_mask, *, attention_mask=None, group=None, temperature=None,
                max_responses=None, max_tokens=None) -> float:
    """Exact KL(pi_old || pi_new) per scored token, full vocabulary, in float64 (a step's KL is
    far below fp32's resolution of a log-prob), at the positions whose logits `probe` kept
    before the merge, reduced across processes: what the prediction alpha^2 KL1 stands for.

    `probe` is the `Probe` that `probe(...)` returned before the merge: it records the
    responses, token limit and temperature it scored and the logits it kept, so pass the same
    `input_ids`, `response_mask` (and `attention_mask`) and nothing else. It must have kept
    logits (`keep_positions` > 0). `temperature`, `max_responses` and `max_tokens` are for the
    older form, `realised_kl(probe.logits, ...)`, which repeats the probe's arguments by hand
    (defaults: the probe's); given with a Probe, each must be the probe's own. Inputs that do
    not give the kept positions back are refused, before any collective.
    """
    if isinstance(probe, torch.Tensor):  # the older form: the kept logits, with the probe's arguments repeated
        limit = MAX_TOKENS if max_tokens is None else max_tokens
        temperature = 1.0 if temperature is None else temperature
        _check_temperature(temperature)
        ids, _, _ = _scored(input_ids, response_mask, max_responses, PROBE_TOKENS, limit, attention_mask)
        probe = Probe(math.nan, probe, probe.shape[0], ids.shape[0], limit, temperature)
    elif isinstance(probe, Probe):
        given = (("temperature", temperature, probe.temperature), ("max_tokens", max_tokens, probe.max_tokens),
                 ("max_responses", None if max_responses is None else min(max_responses, len(input_ids)),
                  probe.responses))
        for name, value, own in given:
            if value is not None and value != own:
                raise ValueError(f"realised_kl got {name}={value}, but the probe scored with {name}={own}: "
                                 f"drop the argument (the Probe records it)")
    elif probe is not None:
        raise TypeError(f"realised_kl takes the Probe that probe(...) returned, got {type(probe).__name__}")
    if probe is None or probe.logits is None:
        raise ValueError("the probe kept no logits (keep_positions=0), so there is no 'before' to compare with: "
                         "pass keep_positions > 0 to probe(...)")
    new_logits = scored_logits(model, input_ids, response_mask, max_responses=probe.responses,
                               max_positions=probe.kept, max_tokens=probe.max_tokens,
                               attention_mask=attention_mask)  # (kept, V)
    if new_logits.shape != probe.logits.shape:
        raise ValueError(f"the probe kept logits {tuple(probe.logits.shape)}, but these inputs give "
                         f"{tuple(new_logits.shape)} at its positions: pass the probe's own input_ids, "
                         f"response_mask and attention_mask (and, in the older form, its max_responses)")
    total = torch.zeros(2, dtype=torch.float64, device=new_logits.device)
    for start in range(0, new_logits.shape[0], KL_CHUNK_POSITIONS):
        stop = start + KL_CHUNK_POSITIONS
        old = torch.log_softmax(probe.logits[start:stop].double() / probe.temperature, dim=-1)  # (c, V)
        new = torch.log_softmax(new_logits[start:stop].double() / probe.temperature, dim=-1)
        # KL = sum_v p_old (log p_old - log p_new)
        total[0] += (old.exp() * (old - new)).sum()
        total[1] += old.shape[0]
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, group=group)
    kl_sum, count = total.tolist()
    return kl_sum / count if count else 0.0


# -----------------------------------------------------------------------------
# Step size, budget schedule, mismatch subtraction

def solve_alpha(kl1, *, budget, alpha_max=3.0) -> float:
    """alpha = min(alpha_max, sqrt(budget / KL1)); KL1 == 0 gives 1.0 capped at alpha_max (departure 2)."""
    kl1 = float(kl1)
    if not math.isfinite(kl1) or kl1 < 0:
        raise ValueError(f"predicted KL must be finite and >= 0, got {kl1}: refusing an uncontrolled update")
    if not (math.isfinite(budget) and budget > 0) or not alpha_max > 0:
        raise ValueError(f"need budget > 0 and alpha_max > 0, got {budget}, {alpha_max}")
    if kl1 == 0.0:
        return min(1.0, alpha_max)
    return min(alpha_max, math.sqrt(budget / kl1))


def kl_budget(update, *, start=2e-4, end=2e-5, horizon=300) -> float:
    """Cosine schedule from `start` (update 0) to `end` (update horizon - 1 and later)."""
    if update < 0 or horizon < 2:
        raise ValueError(f"need update >= 0 and horizon >= 2, got {update}, {horizon}")
    w = 0.5 * (1.0 + math.cos(math.pi * min(update / (horizon - 1), 1.0)))  # 1 -> 0
    return w * start + (1.0 - w) * end


class Mismatch:
    """EMA m of the engine-vs-trainer log-prob gap on the responses that count; shrinks the budget."""

    def __init__(self, momentum=0.7):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum
        self.m = 0.0
        self.active = False  # whether a response of the last observed global batch counted

    @torch.no_grad()
    def observe(self, rollout_logprobs, trainer_logprobs, response_mask, ended_with_eos=None, group=None):
        """observed = max(0, mean(rollout - trainer)) over the response tokens of the responses
        that count, summed and counted across processes; m <- 0.7 m + 0.3 observed.

        `ended_with_eos` (B,) bool: only responses that ended with EOS count (the paper's rule);
        None: every response counts (fixed-length responses, which never end with EOS;
        departure 4). Returns the observed value. A global batch in which no response counts
        (none ended with EOS, or no response token) returns None and leaves the estimate m as it
        was; `adjust` then leaves this update's budget whole, and the next batch in which one
        counts subtracts again.
        """
        if not (rollout_logprobs.shape == trainer_logprobs.shape == response_mask.shape):
            raise ValueError("rollout log-probs, trainer log-probs and mask must have one shape (B, T)")
        counts = response_mask.bool()  # (B, T)
        if ended_with_eos is not None:
            if ended_with_eos.shape != response_mask.shape[:1]:
                raise ValueError(f"ended_with_eos must be ({response_mask.shape[0]},), or None to count every "
                                 f"response, got {tuple(ended_with_eos.shape)}")
            counts = counts & ended_with_eos.bool()[:, None]  # (B, T)
        gap = (rollout_logprobs.double() - trainer_logprobs.double())[counts]  # (M,)
        if not torch.isfinite(gap).all():
            raise FloatingPointError("non-finite log-probs in the mismatch estimate")
        total = torch.stack([gap.sum(), torch.tensor(float(gap.numel()), dtype=torch.float64,
                                                     device=gap.device)])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total, group=group)
        gap_sum, count = total.tolist()
        self.active = count > 0
        if count == 0:
            return None
        observed = max(0.0, gap_sum / count)
        self.m = self.momentum * self.m + (1.0 - self.momentum) * observed
        return observed

    def adjust(self, budget) -> float:
        """budget <- max(budget - m, 0.5 budget); unchanged when no response of the last observed
        global batch counted (then m was not updated either, as in the authors' code linked in
        the module docstring)."""
        return max(budget - self.m, 0.5 * budget) if self.active else budget

    def state_dict(self):
        return {"m": self.m, "momentum": self.momentum}

    def load_state_dict(self, state):
        self.m, self.momentum = float(state["m"]), float(state["momentum"])


def probe_count(mask, responses: int, tokens: int) -> int:
    """How many of this process's responses to probe: the first `responses` (the paper's 2), and
    more until they hold at least `tokens` generated tokens (all of them if they hold fewer);
    `mask` (B, T) marks the generated tokens. The probe's default is this rule with 2 and 512
    (departure 3): the paper's responses run to thousands of tokens, where it gives the paper's
    2; on short responses KL1 from 2 of them would be noise. `tokens=0` gives the paper's 2."""
    per_response = mask.sum(dim=1).tolist()  # generated tokens of each response
    count, seen = 0, 0
    for n in per_response:
        if count >= responses and seen >= tokens:
            break
        count, seen = count + 1, seen + n
    return max(count, min(responses, len(per_response)))
