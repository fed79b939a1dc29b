"""
infra/lora.py: the LoRA baseline of the paper's Table 2 (LoGRA against LoRA, both at rank 256).

What it is
----------
LoRA (Hu et al., arXiv:2106.09685) freezes each target weight W (d, k) and trains a low-rank
product beside it:

    y = W x + (alpha / r) B A x,      A (r, k), B (d, r)

so the trained state is A, B, their gradients and AdamW's two moments: r (d + k) numbers per
target where dense AdamW keeps d k of each. The paper's Table 2 compares LoGRA with LoRA at
the same rank 256 on Qwen2.5-Math-1.5B (arXiv:2610.06647): LoRA averages 13.21 GiB per GPU
against LoGRA's 7.18 GiB, with a slightly higher mean Pass@1 and a slightly faster training
call. `train.py --optimizer lora` runs it with the same RL loss, logging, checkpoints and
evaluation as the other two methods.

The adapters are peft's (`inject_adapter_in_model`, the standard implementation), put into
the seven target projections in place: every module keeps its name, the frozen weight moves
to `<name>.base_layer.weight`, and the adapters are `<name>.lora_A.default.weight` (r, k) and
`<name>.lora_B.default.weight` (d, r). The rollout engines run the merged weights
W + (alpha / r) B A (`merged_weight`), which train.py sends as a full bf16 sync streamed one
decoder layer at a time, as AdamW's: the engines' kernels, fingerprints and restarts stay as
they are for every method (serving adapters would need vLLM's LoRA path per model family,
and at rank 256 its kernels are slower than merged weights).

Choices, numbered (the paper gives only the rank)
-------------------------------------------------
1. alpha = 32, the value "LoRA Without Regret" (Schulman and Thinking Machines Lab, 2025)
   keeps fixed across ranks; the learning rate is 10x dense AdamW's, the ratio that study
   found optimal for LoRA in supervised and RL fine-tuning alike, annealed with the KL
   budget exactly as AdamW's (train.py). Both are preset values (`lora_alpha`, `lora_lr`).
2. Dropout 0: the trainer's log-probs must be the policy the engines sampled from (the
   importance ratio and mismatch subtraction compare the two); dropout would make them differ.
3. A is drawn as peft draws it (Kaiming-uniform, a = sqrt(5)) but from a generator seeded by
   (seed, layer name), and B = 0, so the first policy is the base model's and the initial
   adapters are the same whatever the number of ranks (`initial_state`, which a sharded
   model loads with its checkpoint).

Shape legend: d out rows, k in columns, r rank.
"""

import hashlib
import math

import torch

from infra.errors import RunError

# Every model family's target names (sketch.TARGETS, architectures.py's rows): Phi-3's fused
# qkv_proj and gate_up_proj too; architectures.check_layers lets a model hold only its own row's.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
ADAPTER = "default"


class LoraError(RunError, ValueError):
    """LoRA cannot be set up as asked (peft missing, a bad rank, no target)."""


def attach(model, *, rank: int, alpha: float, seed: int, targets=TARGETS) -> list:
    """Put rank-`rank` adapters into every target projection of `model` in place and freeze
    everything else; returns the trainable parameters (A and B of every target). A model with
    weights gets the adapters' start (choice 3) here; one on the meta device gets it with its
    checkpoint (`checkpoint_state`)."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise LoraError("--optimizer lora needs peft: pip install peft") from None
    if rank <= 0 or not alpha > 0:
        raise LoraError(f"LoRA needs rank > 0 and alpha > 0, got rank {rank}, alpha {alpha}")
    linears = {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in targets}
    if not linears:
        raise LoraError(f"no module named one of {list(targets)} in {type(model).__name__}")
    narrow = min(linears.items(), key=lambda item: min(item[1].weight.shape))
    if rank > min(narrow[1].weight.shape):
        raise LoraError(f"LoRA rank {rank} exceeds the smallest side {min(narrow[1].weight.shape)} of {narrow[0]}")
    for p in model.parameters():
        p.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none",
                                       target_modules=list(targets)), model, adapter_name=ADAPTER)
    trainable = [p for n, p in model.named_parameters() if ".lora_" in n]
    for p in trainable:
        p.requires_grad_(True)
    if not any(p.is_meta for p in trainable):
        unexpected = model.load_state_dict(initial_state(model, seed), strict=False).unexpected_keys
        assert not unexpected, unexpected
    return trainable


def layers(model) -> dict:
    """{name: adapted module} of every target that carries an adapter, in module order."""
    return {n: m for n, m in model.named_modules() if hasattr(m, "lora_A") and ADAPTER in m.lora_A}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2 shards are gathered


def merged_weight(module) -> torch.Tensor:
    """W + (alpha / r) B A (d, k) of one adapted module, in fp32, whole (under FSDP2 every
    process gathers W, A and B: collective). What the engines run."""
    w = _full(module.base_layer.weight).float()
    a = _full(module.lora_A[ADAPTER].weight).float()  # (r, k)
    b = _full(module.lora_B[ADAPTER].weight).float()  # (d, r)
    # Shapes: (d, r) @ (r, k) -> (d, k)
    return torch.addmm(w, b, a, alpha=module.scaling[ADAPTER])


def initial_state(model, seed: int) -> dict:
    """The adapters' starting values, whole and on the CPU (choice 3): {state-dict key: tensor}.
    Works on a model on the meta device (from the shapes)."""
    state = {}
    for name, module in layers(model).items():
        a, b = module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight
        g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(f"lora:{seed}:{name}".encode()).digest()[:8],
                                                         "little"))
        bound = 1.0 / math.sqrt(a.shape[1])  # kaiming_uniform_(a=sqrt(5)) on (r, k): U(-1/sqrt(k), 1/sqrt(k))
        state[f"{name}.lora_A.{ADAPTER}.weight"] = (torch.rand(a.shape, generator=g) * 2 - 1) * bound
        state[f"{name}.lora_B.{ADAPTER}.weight"] = torch.zeros(b.shape)
    return state


def checkpoint_state(weights: dict, model, seed: int) -> dict:
    """A plain model's state dict (a Hugging Face checkpoint) as the adapted model's: each
    target's weight and bias under `base_layer`, and the adapters' starting values added."""
    adapted = layers(model)
    state = {}
    for key, value in weights.items():
        owner, _, leaf = key.rpartition(".")
        state[f"{owner}.base_layer.{leaf}" if owner in adapted else key] = value
    state.update(initial_state(model, seed))
    return state
