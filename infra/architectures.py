"""
infra/architectures.py: the Hugging Face causal LMs that LoGRA trains, by `config.model_type`, and
how each one's target layers map onto its vLLM engine's.

The paper sketches the seven projections of every decoder layer: attention q, k, v, o and
MLP gate, up, down. Families name and fuse them differently. Each row of ARCHITECTURES says,
for one `model_type`:

- `targets`: the names of the trainer's target nn.Linear layers in every decoder layer (the
  Hugging Face model's own modules; each gets its own sketch and projection seed);
- `engine`: vLLM's module names in that decoder layer, each with the trainer targets it holds
  in the order of its rows. vLLM fuses q/k/v into `qkv_proj` (rows [q; k; v], the sizes from
  the config, GQA included) and gate/up into `gate_up_proj` (rows [gate; up]); a target that
  vLLM keeps whole maps to itself.

Phi-3's Hugging Face model already fuses `qkv_proj` and `gate_up_proj`, so its trainer
targets are the fused layers themselves (four sketches a layer, each with one projection for
its whole fused weight), and the engine's layers map one to one.

Adding a family is one row: read its decoder layer's module names (`print(model.model.layers[0])`)
and vLLM's (`vllm/model_executor/models/<family>.py`, its `packed_modules_mapping`), then add

    "family": Architecture(targets=(...), engine={"vllm_name": ("target", ...), ...}),

`check_config` refuses a `model_type` without a row before anything is loaded, and
`check_layers` refuses a model one of whose decoder layers lacks a target, naming the linear
layers it has, or that holds layers named as another row's targets (sketch.TARGETS holds
every row's names, and would sketch them). Errors are `ArchitectureError`, one line that says what to do.
"""

import dataclasses

import torch.nn as nn

from infra.errors import RunError


class ArchitectureError(RunError):
    """A model the table does not cover; the message is one line that says what to do."""


@dataclasses.dataclass(frozen=True)
class Architecture:
    targets: tuple  # the trainer's target layers in each decoder layer
    engine: dict  # vLLM's layer name -> the targets it holds, in row order


# Separate q, k, v, gate, up in the Hugging Face model; fused in vLLM.
SEPARATE = Architecture(
    targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    engine={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
            "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)})
# Fused in both.
FUSED = Architecture(
    targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    engine={"qkv_proj": ("qkv_proj",), "o_proj": ("o_proj",), "gate_up_proj": ("gate_up_proj",),
            "down_proj": ("down_proj",)})

ARCHITECTURES = {
    "qwen2": SEPARATE,  # Qwen2, Qwen2.5 (the paper's models)
    "qwen3": SEPARATE,
    "llama": SEPARATE,  # Llama 2 and 3, SmolLM and SmolLM2
    "mistral": SEPARATE,
    "gemma2": SEPARATE,
    "phi3": FUSED,  # Phi-3 and Phi-3.5 mini
}
# Every name a row can make a target: what sketch.TARGETS holds.
TARGET_NAMES = tuple(dict.fromkeys(name for a in ARCHITECTURES.values() for name in a.targets))


def lookup(model_type: str) -> Architecture:
    if model_type not in ARCHITECTURES:
        raise ArchitectureError(f"model_type {model_type!r} is not in the architecture table (architectures.py "
                                f"supports {', '.join(sorted(ARCHITECTURES))}); a decoder-only model with q/k/v/o "
                                f"and gate/up/down projections is one row there")
    return ARCHITECTURES[model_type]


def check_config(config: dict) -> Architecture:
    """The row of a checkpoint's config.json (a dict), before any weight is loaded."""
    return lookup(config.get("model_type", "(none: config.json has no model_type)"))


def decoder_layers(model: nn.Module):
    """The decoder layers of a causal LM: the one ModuleList named `layers`."""
    lists = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] == "layers" and isinstance(m, nn.ModuleList)]
    if len(lists) != 1:
        raise ArchitectureError(f"{type(model).__name__}: expected one ModuleList of decoder layers named 'layers', "
                                f"found {len(lists)}")
    return lists[0]


def check_layers(model: nn.Module) -> Architecture:
    """Every decoder layer of `model` holds every target of its row, each an nn.Linear."""
    arch = lookup(model.config.model_type)
    for i, layer in enumerate(decoder_layers(model)):
        linear = {n.rsplit(".", 1)[-1] for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
        missing = [t for t in arch.targets if t not in linear]
        if missing:
            raise ArchitectureError(f"{model.config.model_type}: decoder layer {i} has no nn.Linear "
                                    f"{', '.join(missing)}; its linear layers are {', '.join(sorted(linear)) or 'none'}"
                                    f": correct its row in architectures.py (targets, engine)")
    others = sorted({n.rsplit(".", 1)[-1] for n, _ in model.named_modules()
                     if n.rsplit(".", 1)[-1] in TARGET_NAMES and n.rsplit(".", 1)[-1] not in arch.targets})
    if others:  # sketch.TARGETS holds every row's names: none of another row's may be in this model
        raise ArchitectureError(f"{model.config.model_type}: layers named {', '.join(others)} would be sketched "
                                f"too; they are not in its row of architectures.py")
    return arch


def enable_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing of every decoder layer (transformers 5 name first)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()  # Hugging Face checkpoints only in train mode (Qwen2 has no dropout)


def reset_buffers(model) -> None:
    """A model made on the meta device and moved with to_empty() holds garbage in its
    non-persistent buffers, which checkpoints do not store: the buffers of every module with an
    inv_freq (the rotary embeddings) are computed again, as the module's constructor does."""
    for module in model.modules():
        if hasattr(module, "inv_freq"):
            fresh = type(module)(module.config)
            for name, buf in fresh.named_buffers():
                getattr(module, name).copy_(buf)
