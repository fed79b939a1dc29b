"""kl_control.py: predicted-KL step control (arXiv:2610.06647, its method section; Table 1's setup). Before a step
is merged, `probe` predicts how far it moves the policy's next-token distributions (a second-order KL, by forward AD
through the model's own forward); alpha scales the step to spend a KL budget ("an estimate ..., not a guarantee").

Use
---
    import kl_control, ppo, rowadam, sketch
    layers = sketch.attach(model, seed=0)              # S and A on every target nn.Linear
    opt = rowadam.RowAdam(layers)
    logp = ppo.response_logprobs(model(input_ids=ids, attention_mask=am).logits, ids, temperature=1.0)  # (B, T)
    ppo.policy_loss(logp, advantages, mask, num_tokens=ppo.global_token_count(mask))[0].backward()  # S = G A^T
    try:
        opt.prepare()                                  # the directions U (d, r): opt.directions
        probe = kl_control.probe(model, layers, opt.directions, ids, mask, attention_mask=am, keep_positions=256)
        budget = kl_control.budget_for(probe)          # departure 7; the paper's: kl_budget(...)
        alpha = kl_control.solve_alpha(probe.kl1, budget=budget)  # min(3, sqrt(budget / KL1))
    except Exception:
        opt.discard()                                  # nothing merged
        raise
    factors = opt.merge(alpha)                         # W -= F A, F = bf16(alpha U)
    kl_real = kl_control.realised_kl(probe, model, ids, mask, attention_mask=am)  # the step's exact KL a token

`ids`, `am` from generate, `mask` (B, T) True on generated tokens. With an engine: `mismatch.observe(rollout_logp,
logp.detach(), mask, eos)`, `budget = mismatch.adjust(budget)`. One torch.optim step, bit for bit: LoGRAOptimizer.
In infra/: one_call.py (settings by start), probe_decoder.py (probe 31 -> 8.5 ms: `loop_phases_companions`).

The math (U = opt.directions, the paper's eta U; T the sampling temperature; budgets in nats a generated token):
    z, u = the logits and dz/dalpha at a scored position (every target's dW = -U A),  p = softmax(z / T),  q = u / T
    kl1 = 0.5 sum_v p_v (q_v - sum_w p_w q_w)^2,  KL(p || p(alpha)) ~ alpha^2 kl1,  KL1 = Probe.kl1 its mean
    alpha = min(alpha_max, sqrt(budget / KL1))                                  solve_alpha
    budget_n = end + (start - end) 0.5 (1 + cos(pi min(n / (H - 1), 1)))       kl_budget (the paper's)
    m <- 0.7 m + 0.3 max(0, mean(rollout - trainer logprob) over the responses ended by EOS)         Mismatch
    budget <- max(budget - m, 0.5 budget)
Defaults, the paper's (method section, Table 1's setup): alpha_max 3, the 4096-token cut, the budget 2e-4 -> 2e-5
(kl_budget, H the run's updates), Mismatch's 0.7 and 0.5, 2 responses probed a process.

Departures from the paper (reason, bench/README.md's table; test); 5, 6, 8 (random weights): infra/one_call.py
1. Tangents in the activations' dtype (fp32: no better, 2x the largest transient); test_kl1_in_bf16_against_float64.
2. KL1 = 0 gives alpha = min(1, alpha_max), the paper divides by zero; test_solve_alpha.
3. Probed: an eighth of the batch (a choice), >= 2 responses, >= 128 tokens; test_probe_scores_an_eighth_of_the_batch.
4. ended_with_eos=None counts every response (fixed-length ones never end with EOS); test_mismatch_without_eos_flags.
7. Budget min(0.2 H, 2 / L), H entropy a token, L tokens a response (`defaults`); test_budget_for_shares_the_entropy.
"""

import contextlib
import math
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

MAX_TOKENS = 4096  # each probed sequence cut to its first 4096 tokens: the paper's "at most 4096 tokens"
PROBE_RESPONSES, PROBE_SHARE, PROBE_FLOOR = 2, 8, 128  # the probe's size: probe_count, departure 3
ENTROPY_SHARE, PER_RESPONSE = 0.2, 2.0  # budget_for's rule: departure 7
KL_CHUNK_POSITIONS = 64  # positions per block of realised_kl's float64 work (32 V bytes a position)
CAPPED_UPDATES = 5  # updates in a row at alpha_max before LoGRAOptimizer warns (a choice, not measured)


def _all_reduce(total, group):
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, group=group)


def token_kl(logits, tangent, temperature=1.0):
    """kl1 = 0.5 Var_p(tangent / T), p = softmax(logits / T), per position (...,), in float64."""
    if logits.shape != tangent.shape or not temperature > 0:
        raise ValueError(f"need one shape and temperature > 0: {logits.shape}, {tangent.shape}, {temperature}")
    z = logits.to(torch.float64) / temperature  # (..., V)
    q = tangent.to(torch.float64) / temperature  # (..., V)
    p = torch.softmax(z, dim=-1)  # (..., V)
    mean_q = (p * q).sum(-1, keepdim=True)  # (..., 1)
    return 0.5 * (p * (q - mean_q).square()).sum(-1)  # (...,)


def token_entropy(logits, temperature=1.0):
    """H(p) = -sum_v p_v log p_v, p = softmax(logits / T), per position (...,), in float64."""
    log_p = torch.log_softmax(logits.to(torch.float64) / temperature, dim=-1)  # (..., V)
    return -(log_p.exp() * log_p).sum(-1)  # (...,)


@dataclass(frozen=True)
class Probe:
    """One probe's result, reduced over processes, and the logits `realised_kl` compares with."""
    kl1: float
    logits: torch.Tensor | None  # (kept, V) at this process's first scored positions; None: keep_positions=0
    kept: int  # rows of `logits`
    responses: int  # this process's first `responses` responses were scored,
    max_tokens: int  # each cut to its first `max_tokens` tokens,
    temperature: float  # at this temperature
    entropy: float = math.nan  # the policy's mean entropy per scored token (nats)
    tokens_per_response: float = math.nan  # scored tokens per probed response
    scored_logits: object = None  # f(model, ids, mask, **kw) -> the kept logits' path; None: this file's


def probe_count(mask, responses=None, tokens=PROBE_FLOOR) -> int:
    """The first `responses` rows of `mask` (B, T) (None: an eighth, at least 2; departure 3), and more until
    they hold `tokens` generated tokens (all when fewer)."""
    responses = max(PROBE_RESPONSES, -(-len(mask) // PROBE_SHARE)) if responses is None else responses
    seen = [0, *mask.sum(dim=1).cumsum(0).tolist()]  # generated tokens in the first i rows
    return next((i for i, n in enumerate(seen) if i >= responses and n >= tokens), len(mask))


def _scored(input_ids, response_mask, max_responses, min_tokens, max_tokens, attention_mask):
    """The probed rows cut to `max_tokens`: ids (B', T'), scored positions (B', T' - 1), attention mask or None."""
    shapes = [tuple(t.shape) for t in (input_ids, response_mask, attention_mask) if t is not None]
    if input_ids.dim() != 2 or len(set(shapes)) > 1 or not (
            max_tokens >= 2 and min_tokens >= 0 and (max_responses is None or max_responses >= 1)):
        raise ValueError(f"input_ids, response_mask and attention_mask {shapes} must be (B, T), not differ in shape; "
                         f"max_tokens must be >= 2, min_tokens must be >= 0, max_responses must be >= 1 or None")
    scored = response_mask[:, :max_tokens].bool()[:, 1:]  # (B, T' - 1): t when token t + 1 was generated
    n = probe_count(scored, None, min_tokens) if max_responses is None else max_responses
    return input_ids[:n, :max_tokens], scored[:n], None if attention_mask is None else attention_mask[:n, :max_tokens]


def _check_probe_inputs(layers, directions, temperature, keep_positions):
    """Refuse, before any forward or hook, what the probe cannot use."""
    if directions is None or len(directions) != len(layers):
        raise ValueError("directions is None: the probe needs U; call opt.prepare() first and pass opt.directions"
                         if directions is None else f"{len(layers)} layers but {len(directions)} directions")
    for layer, u in zip(layers, directions):  # U has the sketch's shape (d, r), or this process's rows (n, r)
        if not isinstance(u, torch.Tensor) or u.shape != layer.sketch.shape:
            got = tuple(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__
            raise ValueError(f"{layer.name}: direction {got}, but the layer's U is {tuple(layer.sketch.shape)}")
    if not (math.isfinite(temperature) and temperature > 0 and keep_positions >= 0):
        raise ValueError(f"temperature must be finite > 0, keep_positions must be >= 0: {temperature} {keep_positions}")


def left_padded_rows(input_ids, pad_token_id) -> torch.Tensor:
    """Rows that begin with more `pad_token_id` tokens than another (padded on the left): a 0-dim count."""
    if pad_token_id is None or input_ids.numel() == 0:
        return torch.zeros((), dtype=torch.long, device=input_ids.device)
    lead = (input_ids == pad_token_id).long().cumprod(1).sum(1)  # (B,) leading pad tokens
    return (lead > lead.min()).sum()


def check_batch(input_ids, response_mask, *, attention_mask=None, max_responses=None, min_tokens=PROBE_FLOOR,
                max_tokens=MAX_TOKENS, group=None, pad_token_id=None):
    """`_scored`'s rows; refused alike on every process: a mask on a row's first position, none to score, or
    rows padded on the left without their attention_mask."""
    ids, scored, am = _scored(input_ids, response_mask, max_responses, min_tokens, max_tokens, attention_mask)
    left = left_padded_rows(input_ids, pad_token_id if attention_mask is None else None)
    counts = torch.stack([response_mask[:, 0].bool().sum(), scored.sum(), left]).to(torch.float64)  # (3,)
    _all_reduce(counts, group)
    first, count, left = counts.tolist()
    if first:
        raise ValueError(f"response_mask covers the first position of {int(first)} row(s): mark only the response")
    if not count or left:
        raise ValueError("no generated token to score: response_mask has no position after the first" if not count
                         else f"{int(left)} row(s) begin with more pad tokens (id {pad_token_id}) than others: the "
                         f"batch was padded on the left; pass its attention_mask, step(ids, mask, attention_mask)")
    return ids, scored, am


@contextlib.contextmanager
def probe_mode(model):
    """Eval mode and eager attention (SDPA has no forward AD), restored on exit; JVP rules imported quietly."""
    if "torch._decomp.decompositions_for_jvp" not in sys.modules:
        with warnings.catch_warnings(), contextlib.suppress(ImportError):
            warnings.filterwarnings("ignore", r".*torch\.jit\.script.* is deprecated", DeprecationWarning)
            import torch._decomp.decompositions_for_jvp  # noqa: F401
    training, attn = [m for m in model.modules() if m.training], model.config._attn_implementation
    model.eval()
    if attn != "eager":
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if attn != "eager":
            model.set_attn_implementation(attn)
        for m in training:
            m.training = True


@torch.no_grad()
def probe_logits(model, layers, directions, input_ids, attention_mask=None):
    """(z, u = dz/dalpha), (B, T, V) each: torch.func.jvp of the model's own forward, dW = -U A per target."""
    _check_probe_inputs(layers, directions, 1.0, 0)
    if any(layer.group is not None for layer in layers):
        raise ValueError("this probe runs on one process: layers attached with a group need infra/probe_decoder.py")
    names = {module: name for name, module in model.named_modules()}
    weights, tangents = {}, {}
    for layer, u in zip(layers, directions):
        w, name = layer.module.weight, names[layer.module] + ".weight"  # (d, k)
        weights[name], tangents[name] = w, -(u.to(w.dtype) @ layer.projection.to(w.dtype))  # dW (d, k)

    def logits(target_weights):  # (B, T, V)
        return torch.func.functional_call(model, target_weights, kwargs=dict(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False)).logits
    with probe_mode(model):
        return torch.func.jvp(logits, (weights,), (tangents,))


@torch.no_grad()
def probe(model, layers, directions, input_ids, response_mask, *, temperature=1.0, max_responses=None,
          min_tokens=PROBE_FLOOR, max_tokens=MAX_TOKENS, attention_mask=None, keep_positions=0, group=None) -> Probe:
    """KL1 of U, the entropy a token, the first `keep_positions` scored logits (realised_kl's), over the probed rows."""
    _check_probe_inputs(layers, directions, temperature, keep_positions)
    ids, scored, am = check_batch(input_ids, response_mask, attention_mask=attention_mask, max_responses=max_responses,
                                  min_tokens=min_tokens, max_tokens=max_tokens, group=group)
    z, u = probe_logits(model, layers, directions, ids, am)  # (B', T', V) each
    z, u = z[:, :-1][scored], u[:, :-1][scored]  # (M, V): the positions that sampled a generated token
    total = torch.stack([token_kl(z, u, temperature).sum(), z.new_tensor(z.shape[0], dtype=torch.float64),
                         token_entropy(z, temperature).sum(), z.new_tensor(ids.shape[0], dtype=torch.float64)])
    _all_reduce(total, group)
    kl_sum, count, entropy_sum, responses = total.tolist()
    kept = z[:keep_positions] if keep_positions > 0 else None  # (kept, V)
    return Probe(kl_sum / count, kept, 0 if kept is None else kept.shape[0], ids.shape[0], max_tokens,
                 float(temperature), entropy_sum / count, count / responses, scored_logits)


@torch.no_grad()
def scored_logits(model, input_ids, response_mask, *, max_responses=None, min_tokens=PROBE_FLOOR,
                  max_positions=512, max_tokens=MAX_TOKENS, attention_mask=None) -> torch.Tensor:
    """The logits (M', V) at the probe's first `max_positions` scored positions, by `probe`'s forward."""
    ids, scored, am = _scored(input_ids, response_mask, max_responses, min_tokens, max_tokens, attention_mask)
    with probe_mode(model):
        z = model(input_ids=ids, attention_mask=am, use_cache=False).logits  # (B', T', V)
    return z[:, :-1][scored][:max_positions]


@torch.no_grad()
def realised_kl(probe, model, input_ids, response_mask, *, attention_mask=None, group=None) -> float:
    """Exact KL(pi_old || pi_new) a token in float64 where `probe` kept logits before the merge (alpha^2 KL1's)."""
    if not isinstance(probe, Probe) or probe.logits is None:
        raise (TypeError(f"realised_kl takes the Probe that probe(...) returned, got {type(probe).__name__}")
               if not isinstance(probe, Probe) else ValueError("the probe kept no logits (keep_positions=0), so "
                                                               "there is no 'before': pass keep_positions > 0"))
    new_logits = (probe.scored_logits or scored_logits)(
        model, input_ids, response_mask, max_responses=probe.responses, max_positions=probe.kept,
        max_tokens=probe.max_tokens, attention_mask=attention_mask)  # (kept, V)
    if new_logits.shape != probe.logits.shape:
        raise ValueError(f"the probe kept logits {tuple(probe.logits.shape)}, but these inputs give "
                         f"{tuple(new_logits.shape)}: pass the probe's own input_ids, response_mask and attention_mask")
    total = torch.tensor([0.0, len(new_logits)], dtype=torch.float64, device=new_logits.device)  # (sum KL, count)
    for old, new in zip(probe.logits.split(KL_CHUNK_POSITIONS), new_logits.split(KL_CHUNK_POSITIONS)):  # (c, V)
        old = torch.log_softmax(old.double() / probe.temperature, dim=-1)
        new = torch.log_softmax(new.double() / probe.temperature, dim=-1)
        total[0] += (old.exp() * (old - new)).sum()  # sum_v p_old (log p_old - log p_new)
    _all_reduce(total, group)
    kl_sum, count = total.tolist()
    return kl_sum / count if count else 0.0


def solve_alpha(kl1, *, budget, alpha_max=3.0) -> float:
    """alpha = min(alpha_max, sqrt(budget / KL1)); KL1 == 0 gives min(1, alpha_max) (departure 2)."""
    kl1 = float(kl1)
    if not (math.isfinite(kl1) and kl1 >= 0 and math.isfinite(budget) and budget > 0 and alpha_max > 0):
        raise ValueError(f"need a finite KL1 >= 0 (else an uncontrolled update), budget > 0, alpha_max > 0: {kl1}")
    return min(1.0, alpha_max) if kl1 == 0.0 else min(alpha_max, math.sqrt(budget / kl1))


def budget_for(probe, *, entropy_share=ENTROPY_SHARE, per_response=PER_RESPONSE) -> float:
    """Departure 7's budget, nats per generated token: min(entropy_share H, per_response / L), at least 1e-12."""
    if not isinstance(probe, Probe):
        raise TypeError(f"budget_for takes the Probe that probe(...) returned, got {type(probe).__name__}")
    if not (entropy_share > 0 and per_response > 0 and math.isfinite(probe.entropy + probe.tokens_per_response)):
        raise ValueError(f"need entropy_share > 0 and per_response > 0 (got {entropy_share}, {per_response}) and a "
                         f"Probe from probe(...): one with no entropy or response length sets no budget")
    return max(min(entropy_share * probe.entropy, per_response / probe.tokens_per_response), 1e-12)


def kl_budget(update, *, start, end, horizon) -> float:
    """The paper's cosine annealing from `start` at update 0 to `end` at horizon - 1 and after (exact ends)."""
    if not (update >= 0 and horizon >= 2 and start > 0 and end > 0):
        raise ValueError(f"need update >= 0, horizon >= 2, start > 0 and end > 0: {update}, {horizon}, {start}, {end}")
    w = 0.5 * (1.0 + math.cos(math.pi * min(update / (horizon - 1), 1.0)))  # 1 -> 0
    return w * start + (1.0 - w) * end


class Mismatch:
    """m, the moving mean of the engine-vs-trainer log-prob gap, subtracted from the budget."""

    def __init__(self, momentum=0.7):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum, self.m, self.active = momentum, 0.0, False  # active: the last batch counted a response

    @torch.no_grad()
    def observe(self, rollout_logprobs, trainer_logprobs, response_mask, ended_with_eos=None, group=None):
        """The rule above over `ended_with_eos` ((B,); None: all, departure 4): `observed`, or None if none counts."""
        if not (rollout_logprobs.shape == trainer_logprobs.shape == response_mask.shape) or not (
                ended_with_eos is None or ended_with_eos.shape == response_mask.shape[:1]):
            raise ValueError(f"rollout log-probs, trainer log-probs and mask must have one shape (B, T), and "
                             f"ended_with_eos must be ({response_mask.shape[0]},), or None to count every response")
        counts = response_mask.bool() & (True if ended_with_eos is None else ended_with_eos.bool()[:, None])  # (B, T)
        gap = (rollout_logprobs.double() - trainer_logprobs.double())[counts]  # (M,)
        if not torch.isfinite(gap).all():
            raise FloatingPointError("non-finite log-probs in the mismatch estimate")
        total = torch.stack([gap.sum(), torch.tensor(float(gap.numel()), dtype=torch.float64, device=gap.device)])
        _all_reduce(total, group)
        gap_sum, count = total.tolist()
        self.active = count > 0
        if self.active:
            self.m = self.momentum * self.m + (1.0 - self.momentum) * (observed := max(0.0, gap_sum / count))
        return observed if self.active else None

    def adjust(self, budget) -> float:
        """max(budget - m, 0.5 budget); the budget whole when the last batch counted nothing."""
        return max(budget - self.m, 0.5 * budget) if self.active else budget

    def state_dict(self):
        return {"m": self.m, "momentum": self.momentum}

    def load_state_dict(self, state):
        self.m, self.momentum = float(state["m"]), float(state["momentum"])


class LoGRAOptimizer(torch.optim.Optimizer):
    """The Use block as one step, `opt.step(ids, mask, attention_mask)` (or `opt.batch = (ids, attention_mask, mask)`
    first): a batch the probe would refuse changes nothing, a later failure discards it; warns once when alpha sits
    at its cap. `last`: alpha, budget, kl_predicted, entropy, kl_scale, kl_realised. Calibration: infra/one_call.py."""
    calibration = None  # KL1's scale (.scale, .observe(realised, predicted)): one_call.py's; None: the paper's alpha

    def __init__(self, model, rowadam, *, temperature=1.0, alpha_max=3.0, kl_start=None, kl_end=None, horizon=None,
                 entropy_share=ENTROPY_SHARE, per_response=PER_RESPONSE, per_layer=False, keep_positions=0,
                 max_responses=None, group=None, probe=probe):
        self.schedule = (kl_start, kl_end, horizon)
        if None in self.schedule and any(v is not None for v in self.schedule):
            raise ValueError("the paper's budget schedule needs kl_start, kl_end and horizon (the run's updates) "
                             "together; leave all three out for the default budget (budget_for)")
        _check_probe_inputs([], [], temperature, keep_positions)
        if not (alpha_max > 0 and entropy_share > 0 and per_response > 0):
            raise ValueError(f"need alpha_max > 0, entropy_share > 0, per_response > 0: {alpha_max}, {entropy_share}, "
                             f"{per_response}")
        if not all(hasattr(rowadam, a) for a in ("prepare", "merge", "discard", "directions", "layers")):
            raise TypeError(f"LoGRAOptimizer takes a RowAdam over the sketched layers, got {type(rowadam).__name__}")
        super().__init__([layer.module.weight for layer in rowadam.layers], {"lr": 0.0})
        self.model, self.rowadam, self.layers, self.group = model, rowadam, rowadam.layers, group
        self.temperature, self.alpha_max, self.probe = float(temperature), float(alpha_max), probe
        self.keep_positions, self.max_responses, self.per_layer = keep_positions, max_responses, bool(per_layer)
        self.mismatch, self.batch, self.last, self.factors = Mismatch(), None, {}, None
        self.shares, self.capped, self.warned = {"entropy_share": entropy_share, "per_response": per_response}, 0, False

    update = property(lambda self: self.rowadam.update)  # RowAdam's counter of merged updates

    def zero_grad(self, set_to_none=True):
        """Nothing to zero: no target weight has a gradient, and `merge` zeroed the sketches."""

    @torch.no_grad()
    def step(self, ids=None, mask=None, attention_mask=None, *, closure=None):
        if closure is not None or (ids is not None and mask is None):
            raise ValueError("step(ids, mask) takes no closure, and the response mask (B, T) with the ids")
        if ids is None and self.batch is None:
            raise RuntimeError("step() needs the batch its backward ran on: step(ids, mask), or opt.batch first")
        ids, attention_mask, mask = self.batch if ids is None else (ids, attention_mask, mask)
        self.batch, pad = None, next((p for c in ("generation_config", "config") if isinstance(
            p := getattr(getattr(self.model, c, None), "pad_token_id", None), int)), None)
        try:  # refused before RowAdam's prepare: nothing changed, the sketches still hold the batch
            check_batch(ids, mask, attention_mask=attention_mask, max_responses=self.max_responses, group=self.group,
                        pad_token_id=pad)
        except ValueError as e:
            raise ValueError(f"{e} (nothing was changed: call step again with the corrected batch, without a new "
                             f"backward)") from None
        opt, (kl_start, kl_end, horizon) = self.rowadam, self.schedule
        try:
            opt.prepare(self.group, per_layer=self.per_layer)  # U per layer (d, r); nothing changed yet
            probe = self.probe(self.model, self.layers, opt.directions, ids, mask, temperature=self.temperature,
                               max_responses=self.max_responses, attention_mask=attention_mask,
                               keep_positions=self.keep_positions, group=self.group)
            budget = self.mismatch.adjust(budget_for(probe, **self.shares) if kl_start is None else
                                          kl_budget(opt.update, start=kl_start, end=kl_end, horizon=horizon))
            scale = self.calibration.scale if self.calibration else 1.0
            alpha = solve_alpha(probe.kl1 * scale, budget=budget, alpha_max=self.alpha_max)
        except BaseException:
            opt.discard()  # nothing merged: weights, moments and counter as they were
            raise
        self.factors = opt.merge(alpha)  # W -= F A, F = bf16(alpha U)
        self.last = {"alpha": alpha, "budget": budget, "kl_predicted": alpha**2 * probe.kl1,
                     "entropy": probe.entropy, "kl_scale": scale}
        if self.keep_positions:
            self.last["kl_realised"] = realised_kl(probe, self.model, ids, mask, attention_mask=attention_mask,
                                                   group=self.group)
            if self.calibration and alpha < self.alpha_max:  # the budget set this step: learn KL1's scale
                self.calibration.observe(self.last["kl_realised"], self.last["kl_predicted"])
        self.capped = self.capped + 1 if alpha >= self.alpha_max else 0  # the budget did not bind
        if self.capped >= CAPPED_UPDATES and not self.warned:  # said once an optimizer, at the caller's line
            self.warned = True
            warnings.warn(f"alpha has been at its cap alpha_max={self.alpha_max:g} for {self.capped} updates in a row: "
                          f"the KL budget does not bind, update_ratio (RowAdam's: {opt.update_ratio:g}) sets the step; "
                          f"change it only if a held-out metric says so (bench/README.md, defaults)", stacklevel=4)

    def state_dict(self) -> dict:
        return {"rowadam": self.rowadam.state_dict(), "mismatch": self.mismatch.state_dict(), "capped": self.capped,
                "warned": self.warned, "calibration": self.calibration and self.calibration.state_dict(),
                "per_layer": self.per_layer}

    def load_state_dict(self, state: dict) -> None:
        saved, has = state.get("calibration"), (self.calibration is not None, self.per_layer)
        was = (saved is not None if "calibration" in state else has[0], state.get("per_layer", False))
        if was != has:  # refused before anything is loaded; per_layer absent: saved before the option, one scale
            raise ValueError(f"this state was saved with calibrate={was[0]}, per_layer={was[1]}"
                             f"{'' if 'per_layer' in state else ' (saved before the option existed)'}, and this "
                             f"optimizer has calibrate={has[0]}, per_layer={has[1]}: make them the same (one_call.py's "
                             f"start='scratch' calibrates and scales per layer; the defaults do neither)")
        self.rowadam.load_state_dict(state["rowadam"])
        self.mismatch.load_state_dict(state["mismatch"])
        self.capped, self.warned = int(state.get("capped", 0)), bool(state.get("warned", False))
