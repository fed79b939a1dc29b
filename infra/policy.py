"""
infra/policy.py: the policy train.py trains: built or loaded, frozen for its method, sharded, and
the optimizer that trains it.

What it is
----------
- `tiny_policy(...)`: the tiny presets' Qwen2 (`build_model`, from the preset's widths, no
  download) and its base policy (`base_policy`: the supervised warm-up of tasks.warmup, cached
  next to the run directory under a hash of everything it depends on, `base_policy_path`, and
  copied into the run directory, from which a resumed run loads it).
- `load_pretrained_sharded(...)`: a chat checkpoint on the meta device, FSDP2-sharded, then
  filled by a sharded load (rank 0 reads the checkpoint once; the state dict is broadcast).
- `freeze_for(model, optimizer, ...)`: what trains. LoGRA: nothing has a gradient (the
  sketches replace them, sketch.py); AdamW: the seven target projections only; LoRA: its
  adapters (lora.py).
- `shard(model, world, optimizer, device)`: FSDP2, one unit per decoder layer, then the root.
- `make_optimizer(...)`: (optimizer, sketched layers): RowAdam over sketch.attach's layers, or
  AdamW over the targets or the adapters.
- `state_bytes(opt, layers, optimizer)`: the bytes of what the method adds beside the weights on this rank,
  counted from the tensors themselves (each metrics row's `state_mib`).

Departures from the paper
-------------------------
1. The dense baseline trains the same seven target projections as LoGRA, with every other
   parameter frozen as for LoGRA, so the two differ only in how the targets are updated (the
   paper does not say which parameters its Adam baseline trains). Test:
   tests/test_train.py's AdamW runs; bench/memory_model.py counts those parameters.
"""

import hashlib
import io
import json
import os
import time

import torch
import torch.distributed as dist

import sketch
from infra import architectures, checkpoint, launch, lora, metrics, tasks
from infra.batched import BatchedRowAdam
from infra.row_shard import RowShard
from infra.architectures import ArchitectureError
from infra.errors import RunError


class ModelError(RunError):
    """A checkpoint that cannot be read on some node; the message says what to do."""


# -----------------------------------------------------------------------------
# The tiny presets' model and its base policy

def build_model(widths: dict, vocab_size: int, seed: int, device="cpu"):
    """The tiny presets' Qwen2, built from the preset's widths (no download), initialised on
    `device` (7b-random's 7.6B parameters on the GPU, not in host memory first)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)  # Hugging Face initialises with the global generator (and so CUDA's)
    kw = dict(widths)
    kw["vocab_size"] = max(vocab_size, kw.get("vocab_size", 0))  # a larger vocab: realistic head cost
    config = Qwen2Config(bos_token_id=1, eos_token_id=2, pad_token_id=0, **kw)
    with torch.device(device):
        return Qwen2ForCausalLM(config)


def engine_copy(model):
    """The in-process engine's bf16 copy of `model` (infra/engine.py), made a tensor at a time:
    bf16 tensors allocated empty on the model's device, each filled with its fp32 tensor's cast
    (round to nearest even), so that no fp32 copy of the whole model exists beside the master
    (copy.deepcopy(model).to(torch.bfloat16) holds one: 28 GiB at 7B). The same bits, buffers
    (RoPE's frequencies) included (tests/test_one_gpu.py)."""
    import copy

    device = next(model.parameters()).device
    with torch.device("meta"):
        twin = type(model)(copy.deepcopy(model.config))
    twin = twin.to(torch.bfloat16).to_empty(device=device)
    if model.config.tie_word_embeddings:
        twin.tie_weights()  # to_empty makes the tied head a tensor of its own
    theirs = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    mine = {**dict(twin.named_parameters()), **dict(twin.named_buffers())}
    if mine.keys() != theirs.keys():
        raise ModelError(f"the engine's copy of {type(model).__name__} has other tensors than the model: "
                         f"{sorted(mine.keys() ^ theirs.keys())[:3]}")
    with torch.no_grad():
        for name, tensor in mine.items():
            tensor.copy_(theirs[name])  # cast in place: bf16 (fp32 buffers cast as Module.to casts them)
    return twin.train(model.training)


def base_policy_path(widths: dict, task, run_dir: str, *, preset: str, seed: int, warmup: dict) -> str:
    """Where the warm-up's result is cached: next to the run directory, named by a hash of
    everything it depends on, so runs of the same seed share it and nothing stale is reused."""
    depends = [widths, seed, warmup["steps"], warmup["batch"], warmup["lr"], warmup["unboxed"], task.vocab,
               task.VERSION]
    key = hashlib.sha256(json.dumps(depends).encode()).hexdigest()[:12]
    return os.path.join(os.path.dirname(os.path.abspath(run_dir)), f"base-{preset}-{key}.pt")


def base_policy(model, task, path: str, *, steps: int, batch: int, lr: float, unboxed: float, seed: int, log,
                interrupt=None):
    """The tiny task's base policy: the cached warm-up, or the warm-up made and cached.
    `interrupt()` runs after every warm-up step and may raise to abandon it (nothing cached)."""
    device = next(model.parameters()).device  # on the GPU for the smoke preset
    if os.path.exists(path):
        model.load_state_dict(torch.load(path, weights_only=True, map_location=device))
        log(f"base policy: loaded {path}")
        return
    t0 = time.time()
    bar = metrics.Progress(steps, "base policy: warm-up steps", interrupt=interrupt)
    tasks.warmup(model, task, steps=steps, batch=batch, lr=lr, unboxed=unboxed, seed=seed, progress=bar.update)
    bar.close()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    checkpoint.write_atomic(path, buffer.getvalue())
    log(f"base policy: {steps} warm-up steps in {time.time() - t0:.0f} s, saved {path}")


def tiny_policy(widths: dict, task, run_dir: str, *, preset: str, seed: int, warmup: dict, rank: int, world: int,
                device, log, interrupt=None):
    """The tiny presets' policy on every rank: built from the preset's widths, then its base
    policy (`warmup`: base_policy's steps, batch, lr and unboxed; no steps, none), which rank 0
    loads from the cache or makes and caches, and the others then read, each step agreed (a
    failure on one rank stops all). `interrupt`: base_policy's."""
    model = build_model(widths, task.vocab_size, seed, device)
    if warmup["steps"]:
        shared = base_policy_path(widths, task, run_dir, preset=preset, seed=seed, warmup=warmup)
        # The run's own copy, in its directory: a run resumed elsewhere (a copied or moved run
        # directory, another machine) starts its engine from the very bits it was trained from,
        # not from a warm-up made again, whose bits another CPU's rounding may change.
        own = os.path.join(run_dir, os.path.basename(shared))
        path = own if os.path.exists(own) else shared

        def load_or_make():
            base_policy(model, task, path, **warmup, seed=seed, log=log, interrupt=interrupt)
            if path != own:
                checkpoint.write_atomic(own, open(path, "rb").read())

        launch.agreed(lambda: load_or_make() if rank == 0 else None)
        if world > 1:
            launch.agreed(lambda: model.load_state_dict(torch.load(path, weights_only=True, map_location=device))
                          if rank else None)
    return model.eval()  # no dropout in Qwen2; eval keeps generation and training forwards identical


# -----------------------------------------------------------------------------
# A chat checkpoint, loaded sharded

def load_pretrained_sharded(model_path: str, optimizer: str, device, world: int, rank: int, *, sketch_rank=None,
                            lora_alpha=None, seed: int = 0):
    """Meta-device model, FSDP2-sharded, then filled by a sharded load: rank 0 reads the
    checkpoint once and the state dict is broadcast, each rank keeping its own rows. The reads
    are agreed: a node without the checkpoint stops every rank, none waits in the broadcast."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    def read():
        try:
            config = AutoConfig.from_pretrained(model_path)
            architectures.check_config(config.to_dict())  # before any weight is read
            weights = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict() \
                if rank == 0 else {}
        except ArchitectureError:
            raise
        except Exception as e:
            if os.path.isdir(model_path):  # the folder is there: its files are missing or damaged
                words = (str(e).strip().splitlines() or [""])[0][:200]
                raise ModelError(f"--model-path {model_path}: its weights do not load ({type(e).__name__}: {words}): "
                                 f"copy the checkpoint's files (*.safetensors and their index) again") from e
            raise ModelError(f"no checkpoint at {model_path} ({type(e).__name__}). Download it once with "
                             f"network access (hf download {model_path}) or pass --model-path DIR, on "
                             f"every node") from e
        return config, weights

    config, full = launch.agreed(read)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    architectures.check_layers(model)  # every decoder layer has its family's targets (on every rank alike)
    freeze_for(model, optimizer, sketch_rank=sketch_rank, lora_alpha=lora_alpha, seed=seed)
    shard(model, world, optimizer, device)
    model.to_empty(device=device)
    architectures.reset_buffers(model)  # rotary inv_freq: not in checkpoints
    if optimizer == "lora" and full:  # the targets' weights under base_layer, the adapters' start added
        full = lora.checkpoint_state(full, model, seed)
    if dist.is_initialized():
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    else:  # one process on a CPU: no process group to broadcast over
        model.load_state_dict(full)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


# -----------------------------------------------------------------------------
# What trains, its sharding and its optimizer

def freeze_for(model, optimizer: str, *, sketch_rank: int, lora_alpha: float, seed: int):
    """LoGRA: every parameter frozen (sketch.attach also does). AdamW: only the targets train
    (departure 1). LoRA: adapters put into the targets, only they train (lora.py). Done before
    FSDP2 wraps the parameters."""
    for p in model.parameters():
        p.requires_grad_(False)
    if optimizer == "adam":
        for module in sketch.target_modules(model).values():
            module.weight.requires_grad_(True)
    elif optimizer == "lora":
        lora.attach(model, rank=sketch_rank, alpha=lora_alpha, seed=seed)


def shard(model, world: int, optimizer: str, device):
    """FSDP2: one unit per decoder layer, then the root (its embedding, norm and head). On GPUs
    always (also one rank): fp32 master weights at rest, bf16 compute, fp32 gradient reduction;
    on the CPU only with several ranks, in fp32."""
    if device.type == "cpu" and world == 1:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" \
        else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if optimizer != "logra":
        # Each rank's loss is already divided by the global token count: sum, do not average.
        for module in model.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(1.0)
                if device.type == "cpu":  # gloo has no PREMUL_SUM: plain sums (a factor of 1 needs no scaling)
                    module.set_force_sum_reduction_for_comms(True)


def make_optimizer(model, optimizer: str, *, sketch_rank: int, seed: int, update_ratio: float, adam_lr: float,
                   lora_lr: float, checkpointing: bool):
    """(opt, layers). LoGRA: the sketched target layers and RowAdam; under FSDP2 each rank keeps
    its rows of every sketch, direction and moment, the rows it holds of the weight (sketch.py
    and rowadam.py, on sharding). AdamW: the seven targets' weights; LoRA: its adapters (layers
    None). Both at betas (0.9, 0.95), no weight decay."""
    if checkpointing:
        architectures.enable_checkpointing(model)
    if optimizer == "logra":
        sharded = any(hasattr(module.weight, "to_local") for module in sketch.target_modules(model).values())
        layers = sketch.attach(model, rank=sketch_rank, seed=seed,
                               shard=RowShard(dist.group.WORLD) if sharded else None)
        return BatchedRowAdam(layers, seed=seed, update_ratio=update_ratio), layers
    if optimizer == "lora":  # its adapters, at its own learning rate (lora.py)
        trained, lr = [p for p in model.parameters() if p.requires_grad], lora_lr
    else:
        trained, lr = [module.weight for module in sketch.target_modules(model).values()], adam_lr
    return torch.optim.AdamW(trained, lr=lr, betas=(0.9, 0.95), weight_decay=0.0), None


def _local_bytes(tensors) -> int:
    """Bytes of this rank's part of each tensor (a DTensor counts its local shard)."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors
               if t is not None)


def state_bytes(opt, layers, optimizer: str) -> int:
    """The bytes of the method's own state on this rank, from the tensors that exist: LoGRA's
    sketches, int8 signs, RowAdam's row moments and direction buffers; AdamW's gradients of the
    targets and its two moments; LoRA's adapters, their gradients and moments. Call it after
    the optimizer step and before the gradients are set to None (train.py's loop does), when
    everything the step needs is allocated at once."""
    if optimizer == "logra":
        return _local_bytes([l.sketch for l in layers] + [l.signs for l in layers] + list(opt.moments)
                            + list(opt._u))
    params = [p for group in opt.param_groups for p in group["params"]]
    state = [t for p in params for t in opt.state.get(p, {}).values() if torch.is_tensor(t) and t.dim() > 0]
    adapters = params if optimizer == "lora" else []  # AdamW's params are the model's own weights
    return _local_bytes([p.grad for p in params] + state + adapters)
