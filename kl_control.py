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

The math
--------
The paper's method section on predicted-KL step control predicts how far an update would
move the token probabilities before applying it, and picks alpha so that the predicted KL
fits a budget; the prediction grows as alpha^2, and the paper calls it "an estimate used for
control, not a guarantee" (`realised_kl` measures the KL a merge really caused).

For the direction at alpha = 1, `dW = -U A`, a target layer's output moves to first order by

    dY = X dW^T = -(X A^T) U^T                                   (N, d)

Forward-mode AD pushes all these tangents through the model at once (weights untouched), so
each position gets its logits `z` and the logit tangent `u = dz/dalpha`. With temperature T,

    p   = softmax(z / T),   q = u / T
    kl1 = 0.5 * sum_v p_v (q_v - sum_w p_w q_w)^2                (half the variance of q under p)

which is the second-order term of KL(p || p(alpha)) = alpha^2 kl1 + O(alpha^3). KL1 is the
mean of kl1 over the generated tokens of the first `max_responses` responses of each trainer
process (sums and counts reduced across processes); then

    alpha  = min(alpha_max, sqrt(budget / KL1))        alpha_max = 3.0; KL1 = 0 gives 1.0
    budget = end + (start - end) * 0.5 (1 + cos(pi min(n / (H - 1), 1)))
             start = 2e-4, end = 2e-5, H = 300 updates

Mismatch subtraction (part of the LoGRA recipe in Table 1's setup: RowAdam with mismatch
subtraction and predicted-KL annealing): the rollout engine and the trainer disagree a little
on the log-probs of the same tokens (kernels, bf16). On the response tokens of samples that
ended with EOS,

    observed = max(0, mean(rollout_logprob - trainer_logprob))   (a Monte-Carlo KL(engine || trainer))
    m        <- 0.7 m + 0.3 observed
    budget   <- max(budget - m, 0.5 budget)

so the update only gets what the existing mismatch leaves of the budget. `m` is optimizer
state and is checkpointed.

Shape legend: B batch, T time, V vocab, N tokens, d out rows, k in columns, r rank, M scored
positions.

Departures, numbered
--------------------
1. The probe runs the decoder once and applies the output head to the scored positions
   only, in chunks of `HEAD_CHUNK_BYTES` (256 MiB) of work, so the (B, T, V) logits and
   their tangent are never held at once, whatever the vocabulary.
2. The cosine schedule is written as the weighted mean `w start + (1 - w) end`, which gives
   exactly `start` at update 0 and exactly `end` from update H - 1 on.
3. `max_tokens` (default 4096) truncates each probed sequence, prompt included, to its first
   `max_tokens` tokens.
4. The injected tangent -(X A^T) U^T is formed in the activations' dtype (bf16 on GPUs), as
   the rest of the forward is. The authors' newest probe forms it in fp32 and casts it back;
   tried on the tiny Qwen2 against float64, that did not lower KL1's error, which the bf16
   forward's own rounding dominates (the matmuls accumulate in fp32 already), while an fp32
   (N, d) tangent would double the probe's largest transient per layer.
   tests/test_kl_control.py bounds the bf16 error (0.5%, bf16 weights and bf16 autocast).
5. `solve_alpha` with KL1 = 0 (a direction that moves no scored logit) returns 1.0 capped at
   `alpha_max`, where the authors return 1.0 even when `alpha_max` < 1: `alpha_max` is the
   user's bound on every step, and it holds here without exception.
"""

import math
from contextlib import contextmanager

import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist

# Bytes of output-head work per probe chunk: a scored position holds about 56 V bytes at once
# (the head's logits and tangent, and token_kl's float64 softmax and products), so at a
# vocabulary of 152k a chunk is 31 positions. Sized in bytes, not positions (departure 1).
HEAD_CHUNK_BYTES = 256 * 2**20
BYTES_PER_VOCAB_ENTRY = 56


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
# The probe: tangents injected at every target layer, pushed through with forward AD

@contextmanager
def probe_mode(model):
    """Eval mode and eager attention (SDPA's fused kernels have no forward AD); restored on exit."""
    was_training = model.training
    attn = model.config._attn_implementation
    model.eval()
    if attn != "eager":
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if attn != "eager":
            model.set_attn_implementation(attn)
        model.train(was_training)


@contextmanager
def injected_tangents(layers, directions):
    """Each target layer's output gets the extra tangent -(X A^T) U^T (alpha = 1). `directions`
    are whole (d, r) or, for layers attached with a group, this process's rows of U."""

    def hook_for(layer, u):
        def hook(module, args, out):
            x = fwAD.unpack_dual(args[0]).primal  # (..., k)
            y, y_t = fwAD.unpack_dual(out)  # (..., d), upstream tangent or None
            # dY = -(X A^T) U^T. Shapes: (N, k) @ (k, r) -> (N, r); (N, r) @ (r, d) -> (N, d)
            p = x.reshape(-1, x.shape[-1]) @ layer.projection.to(x.dtype).t()
            # Row-sharded U (rowadam.py departure 6): this layer's whole U, gathered for this
            # forward only, as FSDP gathers the weight.
            u_all = layer.all_rows(u)  # (d, r)
            dy = -(p @ u_all.to(x.dtype).t()).reshape(y.shape)
            return fwAD.make_dual(y, dy if y_t is None else y_t + dy)
        return hook

    if len(layers) != len(directions):
        raise ValueError(f"{len(layers)} layers but {len(directions)} directions")
    handles = [l.module.register_forward_hook(hook_for(l, u)) for l, u in zip(layers, directions)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _decoder_and_head(model):
    return model.get_decoder(), model.get_output_embeddings()


@torch.no_grad()
def probe_logits(model, layers, directions, input_ids, attention_mask=None):
    """(logits, logit tangent) (B, T, V) of the whole batch, for small inputs.

    Used by the tests as the raw logit tangent (the JVP that `predict_kl` reduces to KL1 without
    returning it), checked against finite differences; train.py does not call it.
    """
    with probe_mode(model), injected_tangents(layers, directions), fwAD.dual_level():
        out = model(input_ids=input_ids, attention_mask=attention_mask).logits
        logits, tangent = fwAD.unpack_dual(out)
        if tangent is None:
            raise RuntimeError("the tangent was lost on the way to the logits")
        return logits.clone(), tangent.clone()


@torch.no_grad()
def predict_kl(model, layers, directions, input_ids, response_mask, *, temperature=1.0,
               max_responses=2, max_tokens=4096, attention_mask=None, group=None) -> float:
    """KL1: mean second-order KL per generated token for the direction alpha = 1.

    `response_mask` (B, T) marks generated tokens; the token at t is scored on the logits at
    t - 1. Weights are not touched. Every trainer process must call this (FSDP all-gathers
    inside).
    """
    if input_ids.shape != response_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and response_mask "
                         f"{tuple(response_mask.shape)} differ in shape")
    ids = input_ids[:max_responses, :max_tokens]  # (B', T')
    mask = response_mask[:max_responses, :max_tokens].bool()  # (B', T')
    am = None if attention_mask is None else attention_mask[:max_responses, :max_tokens]
    decoder, head = _decoder_and_head(model)
    total = torch.zeros(2, dtype=torch.float64, device=ids.device)  # (sum kl1, count)
    # Under FSDP2 the root module owns the embedding, final norm and output head; calling the
    # decoder and head directly bypasses its hooks, so gather its parameters explicitly.
    fsdp_root = hasattr(model, "unshard") and hasattr(model, "reshard")
    if fsdp_root:
        model.unshard()
    try:
        _probe_sums(model, decoder, head, layers, directions, ids, mask, am, temperature, total)
    finally:
        if fsdp_root:
            model.reshard()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, group=group)
    kl_sum, count = total.tolist()
    if count == 0:
        raise ValueError("no generated token to score: response_mask has no position after the first")
    return kl_sum / count


def _probe_sums(model, decoder, head, layers, directions, ids, mask, am, temperature, total):
    with probe_mode(model), injected_tangents(layers, directions), fwAD.dual_level():
        hidden = decoder(input_ids=ids, attention_mask=am).last_hidden_state  # (B', T', h), dual
        if fwAD.unpack_dual(hidden).tangent is None:
            raise RuntimeError("the tangent was lost in the decoder (an op without forward AD?)")
        scored = hidden[:, :-1][mask[:, 1:]]  # (M, h): the positions that sampled a generated token
        chunk = max(1, HEAD_CHUNK_BYTES // (BYTES_PER_VOCAB_ENTRY * head.weight.shape[0]))  # positions
        cap = getattr(model.config, "final_logit_softcapping", None)  # Gemma 2: logits = cap tanh(z / cap)
        for start in range(0, scored.shape[0], chunk):
            out = head(scored[start:start + chunk])  # (c, V), dual
            if cap:  # the model's forward applies it after the head; the probe calls the head itself
                out = torch.tanh(out / cap) * cap
            z, u = fwAD.unpack_dual(out)  # (c, V) each
            if u is None:
                raise RuntimeError("the tangent was lost in the output head")
            kl = token_kl(z, u, temperature)  # (c,)
            total[0] += kl.sum()
            total[1] += kl.numel()


@torch.no_grad()
def scored_logprobs(model, input_ids, response_mask, *, temperature=1.0, max_responses=2, max_positions=512):
    """log softmax(z / T) (M, V) at the positions the probe scores (the logits at t - 1 of each
    generated token t of the first `max_responses` responses), at most `max_positions` of them,
    in float64 (a step's KL is far below fp32's resolution of a log-prob): taken before a
    merge, they let `realised_kl` measure the step after it."""
    ids = input_ids[:max_responses]  # (B', T)
    mask = response_mask[:max_responses].bool()  # (B', T)
    logits = model(input_ids=ids).logits[:, :-1][mask[:, 1:]][:max_positions]  # (M, V)
    return torch.log_softmax(logits.double() / temperature, dim=-1)


@torch.no_grad()
def realised_kl(old_logprobs, model, input_ids, response_mask, *, temperature=1.0, max_responses=2,
                max_positions=512, group=None) -> float:
    """Exact KL(pi_old || pi_new) per scored token, averaged over the same positions as
    `old_logprobs` (from `scored_logprobs` before the merge), full vocabulary, float64;
    sums and counts reduced across processes. What the prediction alpha^2 KL1 stands for."""
    new = scored_logprobs(model, input_ids, response_mask, temperature=temperature, max_responses=max_responses,
                          max_positions=max_positions)  # (M, V)
    total = torch.zeros(2, dtype=torch.float64, device=new.device)
    for start in range(0, new.shape[0], 256):
        old_c, new_c = old_logprobs[start:start + 256], new[start:start + 256]  # (c, V) float64
        # KL = sum_v p_old (log p_old - log p_new)
        total[0] += (old_c.exp() * (old_c - new_c)).sum()
        total[1] += old_c.shape[0]
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, group=group)
    kl_sum, count = total.tolist()
    return kl_sum / count if count else 0.0


# -----------------------------------------------------------------------------
# Step size, budget schedule, mismatch subtraction

def solve_alpha(kl1, *, budget, alpha_max=3.0) -> float:
    """alpha = min(alpha_max, sqrt(budget / KL1)); KL1 == 0 gives 1.0 capped at alpha_max (departure 5)."""
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
    """EMA of the engine-vs-trainer log-prob gap on EOS-terminated responses; shrinks the budget."""

    def __init__(self, momentum=0.7):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum
        self.m = 0.0
        self.active = False  # whether the last observed global batch had an EOS response

    @torch.no_grad()
    def observe(self, rollout_logprobs, trainer_logprobs, response_mask, ended_with_eos, group=None):
        """observed = max(0, mean(rollout - trainer)) over EOS responses; m <- 0.7 m + 0.3 observed.

        Returns the observed value (None, and m unchanged, when no response ended with EOS).
        """
        if not (rollout_logprobs.shape == trainer_logprobs.shape == response_mask.shape):
            raise ValueError("rollout log-probs, trainer log-probs and mask must have one shape (B, T)")
        if ended_with_eos.shape != response_mask.shape[:1]:
            raise ValueError(f"ended_with_eos must be ({response_mask.shape[0]},)")
        keep = response_mask.bool() & ended_with_eos.bool()[:, None]  # (B, T)
        gap = (rollout_logprobs.double() - trainer_logprobs.double())[keep]  # (M,)
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
        global batch ended with EOS (then m was not updated either, as in the authors' code
        linked in the module docstring)."""
        return max(budget - self.m, 0.5 * budget) if self.active else budget

    def state_dict(self):
        return {"m": self.m, "momentum": self.momentum}

    def load_state_dict(self, state):
        self.m, self.momentum = float(state["m"]), float(state["momentum"])


def probe_count(mask, responses: int, tokens: int) -> int:
    """How many of this rank's responses the KL probe scores: the first `responses` (the
    paper's 2), and more until they hold at least `tokens` generated tokens (all if need be).
    The paper's responses run to thousands of tokens; a tiny task's are a few, and KL1 from
    2 of them would be noise (train.py's departure 4)."""
    per_response = mask.sum(dim=1).tolist()  # generated tokens of each response
    count, seen = 0, 0
    for n in per_response:
        if count >= responses and seen >= tokens:
            break
        count, seen = count + 1, seen + n
    return max(count, min(responses, len(per_response)))
