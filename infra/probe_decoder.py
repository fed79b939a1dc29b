"""
infra/probe_decoder.py: the KL probe's fast path, `fast_probe`, the same Probe as kl_control.probe.

kl_control.probe (the reference) pushes dense dW = -U A through the model's whole forward by
torch.func.jvp and holds the (B, T, V) logits with their tangent. `fast_probe` gives the same
KL1, entropy and kept logits (tests/test_kl_control.py::test_the_fast_path_is_the_plain_probe:
within 1e-6 written out, 1e-12 float64 / 1e-5 fp32 by forward AD) without either:

- target layers' tangents dY = dX W^T - (X A^T) U^T, formed without the dense dW
  (`injected_tangents`, or `written_decoder`'s `linear`); the head's dH W_head^T likewise;
- the decoder runs once and the output head only on the scored positions, in chunks of
  HEAD_CHUNK_BYTES of work (`_head_chunks`), so the (B, T, V) logits are never held;
- for Qwen2, Qwen3, Llama and Mistral (`WRITTEN_OUT`) the decoder and its tangent written out
  (`written_decoder`): the primal op for op as transformers' modules with SDPA attention, the
  tangent of each op from its derivative, no forward AD; other families (and a sliding window
  shorter than the sequence, or a hook on a bypassed module) take forward AD through the
  model's own decoder with constant-operand tangents formed directly (`_ConstantOperands`,
  bit for bit PyTorch's: test_constant_operand_tangents_are_pytorch_own);
- row-sharded U (rowadam's) gathered per layer (`layer.all_rows`), FSDP2 roots gathered
  (`_root_gathered`), sums reduced over `group`.

The Probe it returns carries `scored_logits` (this file's), so that kl_control.realised_kl
recomputes the "after" logits by the same path and a step of alpha = 0 realises exactly 0
(test_the_kept_logits_are_the_realised_kls_before). train.py, bench/ and examples/ pass
`fast_probe` in (kl_control.LoGRAOptimizer(..., probe=fast_probe)); timings against the
reference: bench/README.md, `loop_phases` and `kl_probe`.
"""

import contextlib
from contextlib import contextmanager

import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from kl_control import MAX_TOKENS, PROBE_FLOOR, Probe, probe_mode, token_entropy, token_kl
from kl_control import _check_probe_inputs, _scored

# Bytes of output-head work per probe chunk: a scored position holds about 56 V bytes at once
# (the head's logits and tangent, and token_kl's float64 softmax and products), so at a
# vocabulary of 152k a chunk is 31 positions. Sized in bytes, so that no vocabulary makes a
# chunk too large.
HEAD_CHUNK_BYTES = 256 * 2**20
BYTES_PER_VOCAB_ENTRY = 56

# -----------------------------------------------------------------------------
# Forward AD with tangents injected at the targets (the families `written_decoder` does not cover)
#
# The fast path exists because the reference probe (kl_control.probe) does not fit a 7B run: it
# holds a dense (d, k) tangent for every target layer (a second copy of the targets' weights)
# and the (B, T, V) logits with their tangent (4.6 GiB in bf16 at a vocabulary of 152k and 2 x
# 4096 tokens, before token_kl's float64 work on them), and it pushes PyTorch's zero tangents of
# the norms, RoPE and the mask through Python meta kernels. The fast path is the same forward-
# mode AD without any of these: hooks form the target layers' and the head's tangents dY = dX
# W^T - (X A^T) U^T (no dW), `_ConstantOperands` forms constant-operand tangents directly (bit
# for bit PyTorch's), the decoder runs once and the head only on the scored positions, in
# chunks. Its KL1 and kept logits are kl_control.probe's up to the rounding of (X A^T) U^T
# against X (U A)^T and of the head's matmul on fewer rows
# (tests/test_kl_control.py::test_the_fast_path_is_the_plain_probe), and it runs under FSDP2.

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
            # -(X A^T) U^T, in the activations' dtype (kl_control.py's departure 1).
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


# -----------------------------------------------------------------------------
# The decoder and its tangent written out (Llama-like decoders): no forward AD, no per-op Python mode
#
# For the decoders of the families below (RMSNorm, rotary attention, a SwiGLU MLP: Qwen2, Qwen3,
# Llama, Mistral) `written_decoder` runs the forward as Hugging Face's modules do, op for op, its
# attention torch's fused kernel (SDPA, the models' default), and beside it the tangent of each
# op from its derivative:
#
#   linear (a target)     dY = dX W^T - (X A^T) U^T           (injected_tangents' rule)
#   linear (not a target) dY = dX W^T
#   RMSNorm               y = w (x r),  r = 1/sqrt(mean(x^2) + eps)  ->  dy = w r (dx - x r^2 mean(x dx))
#   rotary embedding      linear in q and k: dq' = dq cos + rot(dq) sin
#   attention             S = q k^T s + mask, P = softmax(S), O = P v (fused: no (B, H, T, T) tensor)
#                         dS = (dq k^T + q dk^T) s,  dP = P (dS - sum_j P dS),  dO = dP v + P dv
#                         (P and dS formed once each; P dv fused too)
#   SiLU                  dy = dx sig(x) (1 + x (1 - sig(x)))
#   product, residual     d(a b) = da b + a db,  d(a + b) = da + db
#
# about half the tensor operations of the forward-AD path and none of its per-op Python (the
# function mode and dual tensors): the fixed cost per probe that measurement found (bench/README's
# `loop_phases`). Other families (Gemma 2's capped, sandwiched layers, Phi-3's fused ones) and a
# sliding window shorter than the sequence take the forward-AD path; both paths are checked
# against kl_control.probe (tests/test_kl_control.py).

WRITTEN_OUT = ("qwen2", "qwen3", "llama", "mistral")


def _written_out(model, length: int) -> bool:
    """Whether `written_decoder` covers this model at this sequence length: a family it writes
    out, plain nn.Linear projections, no sliding window shorter than the sequence, and no
    forward hook on a module it would bypass (a hook that changes an output would be lost)."""
    config = model.config
    if getattr(config, "model_type", None) not in WRITTEN_OUT or getattr(config, "hidden_act", "silu") != "silu":
        return False
    for block in model.get_decoder().layers:
        attn, mlp = block.self_attn, block.mlp
        linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
            [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(type(m) is torch.nn.Linear for m in linears):
            return False
        window = getattr(attn, "sliding_window", None)
        if window is not None and window < length:
            return False
        norms = [block.input_layernorm, block.post_attention_layernorm] + \
            [getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n)]
        if not _bypassable([attn, mlp] + norms, linears):
            return False
    return _bypassable([model.get_decoder().norm], [])  # the embedding and rotary modules are called as modules


def _bypassable(modules, linears) -> bool:
    """No forward hook and no forward of their own on `modules`; on `linears` none either, but
    a sketch's (sketch.py's LayerSketch.forward, a plain F.linear under torch.no_grad)."""
    for m in modules + linears:
        if m._forward_hooks or m._forward_pre_hooks:
            return False
        own = vars(m).get("forward")
        if own is not None and not (m in linears and getattr(getattr(own, "__self__", None), "module", None) is m):
            return False
    return True


def _rms_norm(norm, x, dx):
    """Hugging Face's RMSNorm (in fp32, cast back, times the weight) and its tangent."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)  # (..., 1)
    xr = x32 * r
    y = norm.weight * xr.to(dtype)
    if dx is None:
        return y, None
    # dy = w r (dx - x r^2 mean(x dx)) = w r (dx - xr mean(xr dx))
    dx32 = dx.to(torch.float32)
    centred = torch.addcmul(dx32, xr, (xr * dx32).mean(-1, keepdim=True), value=-1)  # dx - xr mean(xr dx)
    return y, norm.weight * (r * centred).to(dtype)


def _rotary(x, dx, cos, sin):
    """x cos + rot(x) sin (Hugging Face's rotate_half: (x1, x2) -> (-x2, x1)), and the same of dx."""
    def rotate(t):
        half = t.shape[-1] // 2
        return torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return (x * cos) + (rotate(x) * sin), None if dx is None else (dx * cos) + (rotate(dx) * sin)


def _plus(a, b):
    """a + b of two tangents, either of which may be None (zero)."""
    return b if a is None else a if b is None else a + b


def written_decoder(model, input_ids, attention_mask=None, tangents=None):
    """The decoder's last hidden state (B, T, h) and, with `tangents` ({target module: (layer,
    this process's U)}), its tangent for the direction dW = -U A of every target; None without.
    The module notes above. Runs under FSDP2 (each decoder layer gathered for its turn)."""
    decoder = model.get_decoder()

    def linear(module, x, dx):
        y = F.linear(x, module.weight, module.bias)  # (..., d)
        if tangents is None:
            return y, None
        target = tangents.get(module)
        dy = None if dx is None else F.linear(dx, module.weight)  # dX W^T (the bias has no tangent)
        if target is not None:
            layer, u = target
            # -(X A^T) U^T in the activations' dtype (kl_control.py's departure 1), U gathered for this layer only
            # Shapes: (N, k) @ (k, r) -> (N, r); (N, r) @ (r, d) -> (N, d)
            p = x.reshape(-1, x.shape[-1]) @ layer.projection_as(x.dtype).t()
            pu = (p @ layer.all_rows(u).to(x.dtype).t()).reshape(y.shape)  # (X A^T) U^T
            dy = pu.neg_() if dy is None else dy.sub_(pu)
        return y, dy

    h = decoder.embed_tokens(input_ids)  # (B, T, h); the embedding is frozen: no tangent
    dh = None
    B, T = input_ids.shape
    positions = torch.arange(T, device=h.device)[None]  # (1, T), as the model's own forward
    cos, sin = decoder.rotary_emb(h, positions)  # (1, T, hd) each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    # The additive mask, as transformers forms it: 0 where key j <= query i (and j not padding), else
    # the dtype's min. Formed only where it is read: by the tangent's softmax, and by the fused
    # kernel for a padded batch (unpadded, its own causal mask serves: is_causal).
    mask = None
    if tangents is not None or attention_mask is not None:
        allowed = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()[None, None]  # (1, 1, T, T)
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, None, :]  # (B, 1, T, T)
        mask = torch.zeros(allowed.shape, dtype=h.dtype, device=h.device).masked_fill_(~allowed,
                                                                                         torch.finfo(h.dtype).min)
    fused_mask = None if attention_mask is None else mask
    for block in decoder.layers:
        gathered = hasattr(block, "unshard")  # an FSDP2 unit: its weights gathered for this layer only
        if gathered:
            block.unshard()
        attn, mlp = block.self_attn, block.mlp
        # --- attention
        x, dx = _rms_norm(block.input_layernorm, h, dh)
        shape = (B, T, -1, attn.head_dim)
        (q, dq), (k, dk), (v, dv) = (linear(m, x, dx) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
        q, dq, k, dk, v, dv = (None if t is None else t.view(shape) for t in (q, dq, k, dk, v, dv))
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm of every head's q and k
            q, dq = _rms_norm(attn.q_norm, q, dq)
            k, dk = _rms_norm(attn.k_norm, k, dk)
        q, dq, k, dk, v, dv = (None if t is None else t.transpose(1, 2) for t in (q, dq, k, dk, v, dv))  # (B, H, T, hd)
        q, dq = _rotary(q, dq, cos, sin)
        k, dk = _rotary(k, dk, cos, sin)
        groups = attn.num_key_value_groups
        k, dk, v, dv = (None if t is None else t.repeat_interleave(groups, dim=1) for t in (k, dk, v, dv))
        # O = softmax(q k^T s + mask) v by torch's fused attention: no (B, H, T, T) tensor
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=fused_mask, is_causal=fused_mask is None,
                                           scale=attn.scaling)  # (B, H, T, hd)
        do = None
        if dq is not None or dk is not None or dv is not None:
            dq, dk, dv = (torch.zeros_like(t) if dt is None else dt for t, dt in ((q, dq), (k, dk), (v, dv)))
            # dO = dP v + P dv with dP = P (dS - c), c = sum_j P dS, dS = (dq k^T + q dk^T) s: P and dS
            # formed, dP in dS's place; P dv by the fused attention
            scores = torch.matmul(q * attn.scaling, k.transpose(2, 3)).add_(mask)  # (B, H, T, T)
            p32 = torch.softmax(scores, dim=-1, dtype=torch.float32)  # (B, H, T, T) fp32
            del scores
            ds = torch.matmul(torch.cat([dq, q], dim=-1) * attn.scaling,
                              torch.cat([k, dk], dim=-1).transpose(2, 3))  # (B, H, T, T): dq k^T s + q dk^T s
            c = (p32 * ds).sum(-1, keepdim=True)  # (B, H, T, 1) fp32
            dp = (ds - c).mul_(p32)  # (B, H, T, T) fp32
            del ds, p32
            do = torch.matmul(dp.to(v.dtype), v) + F.scaled_dot_product_attention(
                q, k, dv, attn_mask=fused_mask, is_causal=fused_mask is None, scale=attn.scaling)
            del dp
        o = o.transpose(1, 2).reshape(B, T, -1)
        do = None if do is None else do.transpose(1, 2).reshape(B, T, -1)
        y, dy = linear(attn.o_proj, o, do)
        h, dh = h + y, _plus(dh, dy)
        # --- MLP: down(silu(gate(x)) * up(x))
        x, dx = _rms_norm(block.post_attention_layernorm, h, dh)
        (g, dg), (u, du) = linear(mlp.gate_proj, x, dx), linear(mlp.up_proj, x, dx)
        a = F.silu(g)
        # d silu(g) = dg sig(g) (1 + g (1 - sig(g))): SiLU's own derivative kernel, applied to dg
        da = None if dg is None else torch.ops.aten.silu_backward(dg, g)
        m, dm = a * u, _plus(None if da is None else da * u, None if du is None else a * du)
        y, dy = linear(mlp.down_proj, m, dm)
        h, dh = h + y, _plus(dh, dy)
        if gathered:
            block.reshard()
    return _rms_norm(decoder.norm, h, dh)


def _refuse(first, count):
    """kl_control.check_batch's refusals, with its messages, from fast_probe's reduced counts (read
    with its sums after the forward, so that the probe has no host read of its own for them): a
    mask on a row's first position (its token has no log-prob), or nothing to score."""
    if first:
        raise ValueError(f"response_mask covers the first position of {int(first)} row(s): mark only the response")
    if not count:
        raise ValueError("no generated token to score: response_mask has no position after the first")


@torch.no_grad()
def fast_probe(model, layers, directions, input_ids, response_mask, *, temperature=1.0, max_responses=None,
               min_tokens=PROBE_FLOOR, max_tokens=MAX_TOKENS, attention_mask=None, keep_positions=0,
               group=None) -> Probe:
    """KL1, the mean second-order KL per generated token for the direction alpha = 1, from one
    forward pass with tangents over this process's probed responses: the fast path (above), the
    same numbers as kl_control.probe. Weights are not touched.

    `directions`: RowAdam's U, one (d, r) per layer of `layers` (this process's (n, r) rows of a
    row-sharded layer), as `opt.prepare()` leaves them in `opt.directions`. `response_mask`
    (B, T) marks generated tokens; the token at t is scored on the logits at t - 1, at
    `temperature` (the sampling one). Probed: kl_control.probe_count's responses (kl_control.py's
    departure 3), or, given `max_responses`, exactly the first `max_responses`; each cut to its
    first `max_tokens` tokens.
    `keep_positions` > 0 keeps the logits (the forward's primal) at the first `keep_positions`
    scored positions, or at all of them when there are fewer (`Probe.kept` says how many): the
    "before" of `realised_kl`, at no extra forward. Every trainer process must call this (FSDP
    all-gathers inside).
    """
    _check_probe_inputs(layers, directions, temperature, keep_positions)
    ids, scored, am = _scored(input_ids, response_mask, max_responses, min_tokens, max_tokens, attention_mask)
    decoder = model.get_decoder()
    # (sum kl1, scored positions, sum entropy, probed responses, rows whose mask covers position 0)
    total = torch.zeros(5, dtype=torch.float64, device=ids.device)
    total[3] = ids.shape[0]
    total[4] = response_mask[:, 0].bool().sum()  # read with the sums below: no host read of its own
    kept = []
    with _root_gathered(model), contextlib.ExitStack() as stack:
        if _written_out(model, ids.shape[1]):  # the decoder and its tangent written out (above)
            tangents = {layer.module: (layer, u) for layer, u in zip(layers, directions)}
            hidden, tangent = written_decoder(model, ids, am, tangents)
        else:  # forward-mode AD through the model's own decoder (in eval mode, eager attention), tangents injected
            for context in (probe_mode(model), injected_tangents(layers, directions), fwAD.dual_level(),
                            _ConstantOperands()):
                stack.enter_context(context)
            hidden, tangent = fwAD.unpack_dual(decoder(input_ids=ids, attention_mask=am,
                                                       use_cache=False).last_hidden_state)
        if tangent is None:
            raise RuntimeError("the tangent was lost in the decoder (an op without forward AD?)")
        # (M, h) each: the positions that sampled a generated token
        hidden, tangent = hidden[:, :-1][scored], tangent[:, :-1][scored]
        for z, u in _head_chunks(model, hidden, tangent):
            kl = token_kl(z, u, temperature)  # (c,)
            total[0] += kl.sum()
            total[1] += kl.numel()
            total[2] += token_entropy(z, temperature).sum()
            need = keep_positions - sum(len(k) for k in kept)
            if need > 0:  # a part of a chunk is copied, so that the chunk itself is freed
                kept.append(z[:need].clone() if need < len(z) else z)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, group=group)
    kl_sum, count, entropy_sum, responses, first = total.tolist()
    _refuse(first, count)  # on every process alike: the counts are reduced
    logits = torch.cat(kept) if keep_positions > 0 else None  # (kept, V)
    return Probe(kl_sum / count, logits, 0 if logits is None else logits.shape[0], ids.shape[0], max_tokens,
                 float(temperature), entropy_sum / count, count / responses, scored_logits)


@torch.no_grad()
def scored_logits(model, input_ids, response_mask, *, max_responses=None, min_tokens=PROBE_FLOOR,
                  max_positions=512, max_tokens=MAX_TOKENS, attention_mask=None) -> torch.Tensor:
    """The policy's logits (M', V) at the probe's first `max_positions` scored positions (all of
    them when there are fewer), the probe's arguments choosing the positions, by the probe's path
    without tangents (eager attention, the decoder, the head on those rows): the same numbers as
    the probe's own primal for the same weights, bit for bit."""
    ids, scored, am = _scored(input_ids, response_mask, max_responses, min_tokens, max_tokens, attention_mask)
    with _root_gathered(model):
        if _written_out(model, ids.shape[1]):  # the probe's own primal, op for op the model's
            hidden, _ = written_decoder(model, ids, am)
        else:
            with probe_mode(model):
                hidden = model.get_decoder()(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state
        return torch.cat([z for z, _ in _head_chunks(model, hidden[:, :-1][scored][:max_positions])])

