"""
infra/options.py: the run's configuration, one typed value, and the command line made from it.

What it is
----------
`Config` holds everything a run depends on, each field typed and frozen: train.py's presets
are `Config` instances (its `PRESETS` table), the command line replaces fields of one of them
(`parse`, then `resolve`), and `Config.check(world, preset)` refuses what no run can take, in
one line that says what to change (`OptionError`), before anything is written or started.
`record()` is the run's config.json, which a resumed run must match (run_dir.py). The run's
own flags, which choose a preset and say where the run's files go but are not part of its
configuration, are the fields of `Flags`.

One place per option
--------------------
Every field carries, in its metadata, its help text, its flag (made from the name:
`kl_start` -> `--kl-start`, unless `flag=` names another: `--rank`, the paper's word, is the
field `sketch_rank`, told apart from a process rank), its bound (`least=` and `most=`,
inclusive; `positive=True`: finite and > 0), its `choices`, and `task=` for an option of one
chat task (refused with another). From these come the parser and `--help` (`parse`), the
overrides (`resolve`) and the bounds (`check`). A new knob is one field; a field with no
default must be set by every preset. Two fields are structure, set by a preset and no flag:
`preset`, its name, and `model`, the widths of a model built from its config (a local
checkpoint's are read once the run starts: planning.check_nodes).

The checks that need more than the configuration and torchrun's WORLD_SIZE (this machine's
GPUs, the files of each node, the layout of ranks and engines) are planning.py's.
"""

import argparse
import dataclasses
import math

from infra.checkpoint import CHECKPOINT_NAME
from infra.errors import RunError
from infra.tasks import CHAT_TASKS, Arithmetic, TaskError, check_gym_tasks, gym_mixture


class OptionError(RunError):
    """A run that cannot start as asked; the message is one line that says what to change."""


# Where a preset's local checkpoint and data come from, for the refusal that asks for them.
MAKERS = {"tiny-math": "python tests/tiny_math.py DIR makes small ones",
          "smollm2-cpu": "python bench/real_model.py --checkpoint DIR --convert-only makes the checkpoint, "
                         "and its runs write the data into --out's data/"}
ENGINE_EXIT_S = 60  # beyond --engine-timeout, how long an engine given up on may take to be killed and reported


def knob(help: str, *, default=dataclasses.MISSING, flag=None, least=None, most=None, positive=False,
         choices=None, task=None, words=None):
    """A field of the run's configuration that a flag may override; without `default`, every
    preset must give it. `words`: the values the flag takes by name ({"on": True, ...}): the bare
    flag is the first, --no-NAME the second; another word is refused by `check` (OptionError)."""
    return dataclasses.field(default=default, metadata=dict(
        help=help, flag=flag, least=least, most=most, positive=positive, choices=choices, task=task, words=words))


def structure(help: str, default=None):
    """A field that a preset sets and no flag does."""
    return dataclasses.field(default=default, metadata=dict(help=help, structure=True))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """A run's configuration: the fields of --help's "configuration" group, in its order, and
    the structure a preset sets. A bool field is --NAME/--no-NAME."""

    # --- structure: no flag ------------------------------------------------------------------------
    preset: str = structure("the preset's name (--model picks it)", default="")
    model: dict = structure("the widths of the model: a preset's, or once the run starts a local checkpoint's "
                            "config.json's")
    plan_gib: float = structure("the memory plan's peak per GPU of the update as the run set it up, in GiB "
                                "(infra/memory_plan.peak; runs on GPUs and --gpus 1)")

    # --- the method and the model -----------------------------------------------------------------
    optimizer: str = knob("LoGRA, the dense AdamW baseline (Table 1), or LoRA adapters at the same rank (Table 2)",
                          default="logra", choices=("logra", "adam", "lora"))
    model_path: str = knob("a local Hugging Face checkpoint of a chat preset (required for 27b); default: the "
                           "preset's hub id", default=None, task=CHAT_TASKS)
    sync: str = knob("what an update sends the engine: LoGRA's bf16 factors + seed (AdamW and LoRA: full weights), "
                     "full bf16 weights (the paper's control), or the bf16 elements it changed (any optimizer; the "
                     "engine keeps no fp32 master)", default="factors", choices=("factors", "full", "delta"))

    # --- the update: sketches, RowAdam, the KL budget, the baselines --------------------------------
    sketch_rank: int = knob("sketch rank r", flag="--rank", least=1)
    batch: int = knob("responses per update, all ranks together", least=1)
    micro_batch: int = knob("responses per forward and backward on a rank", least=1)
    group_size: int = knob("responses per prompt, sampled with distinct seeds on one rank (1: the paper's; the batch "
                           "stays --batch responses, so batch / G prompts an update)", default=1, least=1)
    advantage: str = knob("the running baseline over the global batch (the paper's), or a response against its "
                          "group: GRPO (mean and std), Dr. GRPO (mean), RLOO (leave-one-out mean); "
                          "infra/group_advantages.py",
                          default="running", choices=("running", "grpo", "drgrpo", "rloo"))
    updates: int = knob("RL updates of the run", least=1)
    update_ratio: float = knob("RowAdam's step size: ||U A|| / ||W|| before alpha", positive=True)
    kl_start: float = knob("KL budget of the first update", positive=True)
    kl_end: float = knob("KL budget from --kl-horizon on (<= --kl-start)", positive=True)
    kl_horizon: int = knob("updates over which the budget's cosine goes from start to end", least=2)
    kl_entropy_share: float = knob("> 0: the KL budget is kl_control.budget_for's rule, min(share x the policy's "
                                   "entropy per token, --kl-per-response / tokens per response), read from each "
                                   "update's probe (the modules' default: 0.2), in place of the --kl-start schedule "
                                   "(0: the schedule)", default=0.0, least=0.0)
    kl_per_response: float = knob("with --kl-entropy-share: nats a whole response may move (the modules' default: 2)",
                                  default=2.0, positive=True)
    alpha_max: float = knob("the largest step scale alpha the KL probe may choose (kl_control.solve_alpha)",
                            default=3.0, positive=True)
    probe_responses: int = knob("responses of each rank the KL probe scores, at least", default=2, least=1)
    probe_tokens: int = knob("the probe scores more responses until they hold this many generated tokens", default=0,
                             least=0)
    kl_real_positions: int = knob("positions at which the realised KL of each step is measured (0: off)",
                                  default=256, least=0)
    adam_lr: float = knob("AdamW's learning rate before annealing (--optimizer adam)", positive=True)
    lora_lr: float = knob("LoRA's learning rate before annealing (--optimizer lora; infra/lora.py)", positive=True)
    lora_alpha: float = knob("LoRA's alpha: the adapters' product is scaled by alpha / r (--optimizer lora)",
                             default=32.0, positive=True)

    # --- rollouts, the trainer's sequences, evaluation ------------------------------------------------
    temperature: float = knob("sampling temperature of the rollouts (and of the log-probs the loss and the KL probe "
                              "score)", default=1.0, positive=True)
    max_new_tokens: int = knob("tokens a response may have (rollouts and evaluation)", least=1)
    context: int = knob("tokens of prompt + response the engines and the trainer hold per sequence", least=2)
    checkpointing: bool | str = knob("activation checkpointing of every decoder layer in the trainer: on, off, or auto "
                               "(on GPUs: off where the memory plan says the update fits without it, else on; on a "
                               "CPU: on); config.json records the choice", default="auto",
                               words={"on": True, "off": False, "auto": "auto"})
    eval_temperature: float = knob("sampling temperature of the held-out evaluation", positive=True)
    eval_top_p: float = knob("top-p (nucleus) sampling of the held-out evaluation, in (0, 1]", positive=True,
                             most=1.0)
    warmup_steps: int = knob("supervised warm-up steps that make a tiny preset's base policy", default=0, least=0)
    warmup_batch: int = knob("problems per supervised warm-up step", default=None, least=1)
    warmup_lr: float = knob("learning rate of the supervised warm-up", default=None, positive=True)
    warmup_unboxed: float = knob("share of the warm-up's answers written without the box, in [0, 1] "
                                 "(infra/tasks.py, warmup)", default=None, least=0.0, most=1.0)
    eval_every: int = knob("updates between held-out evaluations (0: the base policy only)", least=0)
    eval_problems: int = knob("held-out problems per evaluation", least=1)
    eval_samples: int = knob("samples per held-out problem: the k of Pass@k", least=1)
    eval_base: bool = knob("evaluate the base policy (--no-eval-base: a bench that evaluates one start once for "
                           "several runs; the start's fingerprint is logged either way)", default=True)
    curve_problems: int = knob("held-out problems of the evaluations before the last (0: --eval-problems; the last "
                               "and the base's take all)", default=0, least=0)
    curve_samples: int = knob("samples per problem of the evaluations before the last (0: --eval-samples)", default=0,
                              least=0)
    save_every: int = knob("updates between checkpoints (0: none)", least=0)
    seed: int = knob("the run's seed: initialisation, data order, rollouts, projections", default=0, least=0)

    # --- where it runs: device, engines, timeouts ---------------------------------------------------
    device: str = knob("the device of the trainer (a preset's own: cpu for the CPU presets)", choices=("cpu", "cuda"))
    engine: str = knob("rollout engine: the in-process Hugging Face one (tiny preset) or vLLM processes",
                       choices=("hf", "vllm"))
    gpus: int = knob("1: the trainer and its in-process Hugging Face engine on one GPU (a CPU preset: this CPU); "
                     "after every merge the engine's bf16 weights are cast from the trainer's fp32 master, with no "
                     "payload and no int16 residual (infra/one_gpu.py); the arithmetic presets (7b-random)",
                     default=None)
    gpu_memory: float = knob("GiB of a GPU's memory the memory plan may fill (--checkpointing auto, --gpus 1); "
                             "default: what the GPU reports free when the run starts; with --dry-run --gpus 1 the "
                             "plan for this size only (default: 80 GB and 141 GB GPUs)", default=None, positive=True)
    engine_gpus: str = knob("GPUs of a node's vLLM engines, one per training rank of the node (the same on every "
                            "node)", default=None)
    gpu_memory_utilization: float = knob("share of memory a CPU vLLM engine may take (vLLM's "
                                         "gpu_memory_utilization; on a GPU the card less the LoGRA state is used), "
                                         "in (0, 1]", default=None, positive=True, most=1.0)
    engine_timeout: float = knob("seconds an engine may take to start or to answer one command", positive=True)
    engine_restarts: int = knob("engines that may be restarted in a run after dying or going silent (infra/heal.py)",
                                default=3, least=0)
    check_outputs: int = knob("syncs between checks of the engine's outputs: its log-probs of a short response it "
                              "samples against the trainer's on the same tokens (infra/engine_sync.py; 0: never; "
                              "default: every sync on cuda, never on cpu)", default=None, least=0)
    dist_timeout: float = knob("seconds a rank waits for the others in a collective (torch.distributed's timeout; "
                               "longer than --engine-timeout)", positive=True)

    # --- the task ----------------------------------------------------------------------------------
    task: str = knob("the task: a chat checkpoint's (the paper's math, or Reasoning Gym: its 27B long run), or the "
                     "tiny presets' arithmetic", choices=(*CHAT_TASKS, "arithmetic"))
    train_data: str = knob("DAPO-Math-17k-format training data: a local .parquet/.jsonl file or folder, or a hub id",
                           default=None, task=("math",))
    eval_data: str = knob("MATH-500-format evaluation data: a local .parquet/.jsonl file or folder, or a hub id",
                          default=None, task=("math",))
    grader: str = knob("how a math answer is graded, in the rollouts' reward and the held-out evaluation alike: "
                       "math-verify (the paper's; the default) or number (the last \\boxed{} must hold exactly "
                       "the integer answer: tasks.grade_number)", default=None, choices=("math-verify", "number"),
                       task=("math",))
    shots: str = knob("worked examples shown before every math problem as earlier user and assistant turns, in the "
                      "rollouts and the held-out evaluation alike: a .jsonl file of {\"problem\", \"solution\"} rows "
                      "(default: none, the paper's prompt; a small model copies their form, bench/README.md's "
                      "strict_prompts)", default=None, task=("math",))
    gym_tasks: str = knob("with --task reasoning-gym: a mixture (hard: tasks.GYM_HARD) or NAME[:WEIGHT],... of its "
                          "tasks", default=None, task=("reasoning-gym",))
    gym_level: int = knob("with --task reasoning-gym: the level of every task's curriculum (0: the easiest)",
                          default=None, least=0, task=("reasoning-gym",))

    def record(self) -> dict:
        """The configuration as plain JSON values: what config.json holds and a resume compares."""
        return dataclasses.asdict(self)

    def check(self, world: int, preset: "Config") -> None:
        """Everything that this configuration and torchrun's WORLD_SIZE (`world`) decide, the same
        verdict on every rank before the process group exists; `preset`: the preset it was
        resolved from (its own task, device and engine GPUs word the refusals)."""
        # --- the numbers, in the order of --help ---------------------------------------------------
        for f in KNOBS:
            value, bound = getattr(self, f.name), f.metadata
            if value is None:  # not set: an option of another task, or of no use to this preset
                continue
            if bound["least"] is not None and not value >= bound["least"]:
                raise OptionError(f"{flag(f.name)} {value} must be >= {bound['least']}")
            if bound["positive"] and not (math.isfinite(value) and value > 0):
                raise OptionError(f"{flag(f.name)} {value} must be a finite number > 0")
            if bound["most"] is not None and not value <= bound["most"]:
                raise OptionError(f"{flag(f.name)} {value} must be <= {bound['most']}")
            if bound["words"] and not any(value == v and type(value) is type(v) for v in bound["words"].values()):
                raise OptionError(f"{flag(f.name)} {value}: one of {', '.join(bound['words'])}")
        if self.seed >= 2**63:
            raise OptionError(f"--seed {self.seed} must be below 2**63 (torch generators take 64-bit seeds)")
        if self.kl_end > self.kl_start:
            raise OptionError(f"--kl-end {self.kl_end} must be <= --kl-start {self.kl_start}: the KL budget anneals "
                              f"from start to end")
        if self.max_new_tokens >= self.context:
            raise OptionError(f"--max-new-tokens {self.max_new_tokens} must be below --context {self.context}: the "
                              f"prompt needs room too")
        if self.dist_timeout < self.engine_timeout + ENGINE_EXIT_S:
            raise OptionError(f"--dist-timeout {self.dist_timeout} must be at least --engine-timeout "
                              f"{self.engine_timeout} + {ENGINE_EXIT_S}: every rank waits in a collective while the "
                              f"slowest engine starts, or is given up and restarted")
        if self.curve_problems > self.eval_problems:
            raise OptionError(f"--curve-problems {self.curve_problems} must be <= --eval-problems {self.eval_problems}: "
                              f"the evaluations between take a subset of the held-out problems")
        if self.task == "arithmetic" and self.eval_problems > Arithmetic.PROBLEMS // 2:
            raise OptionError(f"--eval-problems {self.eval_problems} must be <= {Arithmetic.PROBLEMS // 2}: the tiny "
                              f"task has {Arithmetic.PROBLEMS} problems and keeps at least half of them for training")

        # --- what the preset and its task need --------------------------------------------------------
        if (preset.task in CHAT_TASKS) != (self.task in CHAT_TASKS):
            raise OptionError(f"--task {self.task}: preset '{self.preset}' runs the tiny arithmetic task on a model "
                              f"built from its config; the chat tasks need a chat checkpoint's preset (tiny-math, "
                              f"1.5b, 7b, 27b, smollm2-135m, smollm2-cpu)")
        others = [f for f in KNOBS if f.metadata["task"] and self.task not in f.metadata["task"]
                  and getattr(self, f.name) is not None]
        if others:  # given on the command line (resolve drops the preset's): those of the first such task
            task = others[0].metadata["task"]
            given = [flag(f.name) for f in others if f.metadata["task"] == task]
            raise OptionError(f"{', '.join(given)}: an option of --task {' or '.join(task)}, not of this run's task "
                              f"({self.task})")
        if self.task == "reasoning-gym":  # the mixture's form, then its names in the installed package
            try:
                check_gym_tasks(name for name, _ in gym_mixture(self.gym_tasks))
            except TaskError as e:
                raise OptionError(str(e)) from e
        if self.task in CHAT_TASKS:
            needs = (("--model-path DIR", self.model_path), *((("--train-data PATH", self.train_data),
                     ("--eval-data PATH", self.eval_data)) if self.task == "math" else ()))
            missing = [option for option, value in needs if not value]
            if missing:
                data = "; DAPO-Math-17k- and MATH-500-format data" if self.task == "math" else ""
                raise OptionError(f"preset '{self.preset}' needs {', '.join(missing)} (a local Hugging Face "
                                  f"checkpoint of a family in architectures.py{data}"
                                  f"{'; ' + MAKERS[self.preset] if self.preset in MAKERS else ''})")
            if self.engine != "vllm" and self.gpus != 1:  # --gpus 1's dry run plans it; a run is refused
                raise OptionError(f"the {self.task} task's rollouts need --engine vllm (the HF engine takes prompts "
                                  f"of one length)")
        else:  # the preset's own widths (a checkpoint's are checked once read: planning.check_nodes)
            self.check_model()
        if self.engine == "vllm" and self.device == "cuda" and not self.engine_gpus:
            raise OptionError("--engine vllm on GPUs needs --engine-gpus, one GPU per training rank of a node "
                              "(e.g. --engine-gpus 1)")

        # --- one GPU: trainer and engine together (infra/one_gpu.py) -------------------------------------
        if self.gpus is not None:
            if self.gpus != 1:
                raise OptionError(f"--gpus {self.gpus}: 1 is the layout it sets (trainer and engine on one GPU); more "
                                  f"GPUs run under torchrun, a training rank per vLLM engine GPU (--engine-gpus)")
            if world > 1:
                raise OptionError(f"--gpus 1 runs one process and torchrun started {world}: start it with python "
                                  f"train.py")
            if self.engine != "hf":
                raise OptionError("--gpus 1 runs the in-process Hugging Face engine beside the trainer: leave --engine "
                                  "out (vLLM's sleep and wake on one GPU are not built)")
            if self.sync != "factors":
                raise OptionError(f"--sync {self.sync}: with --gpus 1 the engine's weights are cast from the trainer's "
                                  f"master and no payload is sent: leave --sync out")

        # --- how the batch splits across ranks ------------------------------------------------------
        if self.batch % world:
            raise OptionError(f"--batch {self.batch} does not split across {world} ranks: use a multiple of {world}")
        if (self.batch // world) % self.micro_batch and self.micro_batch < self.batch // world:
            raise OptionError(f"--micro-batch {self.micro_batch} must divide the per-rank batch {self.batch // world}")
        if self.advantage != "running" and self.group_size < 2:
            raise OptionError(f"--advantage {self.advantage} compares a response with the others of its prompt: it "
                              f"needs --group-size 2 or more (the paper's one response per prompt takes --advantage "
                              f"running)")
        if (self.batch // world) % self.group_size:
            raise OptionError(f"--batch {self.batch} does not split into whole groups of --group-size "
                              f"{self.group_size} on each of {world} rank(s): use a multiple of "
                              f"{world * self.group_size}")
        if self.eval_problems < world:
            raise OptionError(f"--eval-problems {self.eval_problems} must be >= the number of ranks, {world}")

    def check_model(self) -> None:
        """The limits that the model's widths set: the sketch rank, the positions, vLLM's CPU attention."""
        shapes = self.model
        head_dim = shapes.get("head_dim") or shapes["hidden_size"] // shapes["num_attention_heads"]
        widths = (shapes["hidden_size"], shapes["intermediate_size"], shapes["num_attention_heads"] * head_dim)
        if self.optimizer in ("logra", "lora") and self.sketch_rank > min(widths):
            raise OptionError(f"--rank {self.sketch_rank} must be in 1..{min(widths)}, the smallest target "
                              f"in_features of '{self.preset}'")
        positions = shapes.get("max_position_embeddings")
        if positions and self.context > positions:
            raise OptionError(f"--context {self.context} exceeds the model's max_position_embeddings {positions}")
        if self.engine == "vllm" and self.device == "cpu" and head_dim % 32:
            raise OptionError(f"vLLM's CPU attention needs a head_dim that is a multiple of 32; this model has "
                              f"{head_dim}")


def own(default, help: str, *, choices=None, metavar=None):
    """A flag of the run itself, not part of its configuration. `choices` may be a function of the presets."""
    return dataclasses.field(default=default, metadata=dict(help=help, choices=choices, metavar=metavar))


@dataclasses.dataclass(frozen=True)
class Flags:
    """The run's own flags, in the order of --help: which preset, where its files go, how it
    starts. None of them is part of the configuration a resume compares."""

    model: str = own("tiny", "preset name", choices=sorted)  # sorted(presets): their names
    run_dir: str = own(None, "default: runs/<model>-<optimizer>")
    resume: str = own(None, "continue the run in RUN_DIR", metavar="RUN_DIR")
    resume_from: str = own(None, "with --resume: continue from this kept checkpoint (checkpoint-N) instead of the "
                           "latest", metavar="CHECKPOINT")
    keep: int = own(2, "checkpoints kept: the newest N (default 2)")
    dry_run: bool = own(False, "build the preset on the meta device, print the sharding plan and memory estimate, "
                        "exit")
    json: bool = own(False, "with --dry-run: one JSON object with the byte estimates")
    wandb: str = own(None, "also log every row to this W&B project (pip install wandb; WANDB_MODE=offline without a "
                     "network); TensorBoard scalars are written whenever tensorboard is installed", metavar="PROJECT")
    nodes: int = own(None, "with --dry-run: plan this many nodes (default: WORLD_SIZE / LOCAL_WORLD_SIZE under "
                     "torchrun, else 1; a run takes its layout from torchrun's --nnodes)")

    def check(self) -> None:
        """The flags' own refusals (the rest is Config.check's and planning.py's)."""
        if self.keep < 1:
            raise OptionError(f"--keep {self.keep} must be >= 1: the newest checkpoint is always kept")
        if self.resume_from is not None and (not self.resume or not CHECKPOINT_NAME.fullmatch(self.resume_from)):
            raise OptionError(f"--resume-from {self.resume_from}: give a checkpoint-N folder of the run, with --resume "
                              f"RUN_DIR")
        if self.nodes is not None and (not self.dry_run or self.nodes < 1):
            raise OptionError(f"--nodes {self.nodes}: a number >= 1, with --dry-run (a run takes its layout from "
                              f"torchrun's --nnodes)")


FLAGS = dataclasses.fields(Flags)
FIELDS = {f.name: f for f in dataclasses.fields(Config)}
KNOBS = tuple(f for f in FIELDS.values() if not f.metadata.get("structure"))  # the fields a flag overrides


def flag(name: str) -> str:
    """The flag of a field: its `flag=`, or made from its name (kl_start -> --kl-start)."""
    return (FIELDS[name].metadata.get("flag") if name in FIELDS else None) or f"--{name.replace('_', '-')}"


def parse(argv, presets: dict) -> tuple[Flags, dict]:
    """The command line: the run's own flags, and the configuration fields it gives (the
    overrides of the preset's values), as {field: value}."""
    p = argparse.ArgumentParser(prog="train.py", description="LoGRA RL training (see train.py's docstring)")
    for f in FLAGS:
        if f.type is bool:
            p.add_argument(flag(f.name), dest=f.name, action="store_true", help=f.metadata["help"])
            continue
        choices = f.metadata["choices"](presets) if callable(f.metadata["choices"]) else f.metadata["choices"]
        p.add_argument(flag(f.name), dest=f.name, type=f.type, default=f.default, choices=choices,
                       metavar=f.metadata["metavar"], help=f.metadata["help"])
    knobs = p.add_argument_group("configuration", "each overrides the --model preset's value (default: the preset's)")
    for f in KNOBS:
        words = f.metadata["words"]
        if words:  # --NAME WORD, the bare --NAME its first word and --no-NAME its second (a bool's flags)
            knobs.add_argument(flag(f.name), dest=f.name, nargs="?", const=list(words)[0], default=None,
                               metavar="|".join(words), help=f.metadata["help"])
            knobs.add_argument(f"--no-{flag(f.name)[2:]}", dest=f.name, action="store_const", const=list(words)[1],
                               help=argparse.SUPPRESS)
        elif f.type is bool:
            knobs.add_argument(flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                               help=f.metadata["help"])
        else:
            knobs.add_argument(flag(f.name), dest=f.name, type=f.type, default=None, choices=f.metadata["choices"],
                               help=f.metadata["help"])
    args = vars(p.parse_args(argv))
    flags = Flags(**{f.name: args.pop(f.name) for f in FLAGS})
    return flags, {k: v for k, v in args.items() if v is not None}


def resolve(flags: Flags, overrides: dict, presets: dict) -> Config:
    """The preset `flags.model` with the command line's `overrides`. An option of another task
    than the run's (the math task's data in a Reasoning Gym run, a checkpoint of the tiny
    task) is dropped unless the command line gave it, which Config.check then refuses; the
    micro-batch is at most the batch; the engine's outputs are checked after every sync on
    GPUs, never on CPUs, unless --check-outputs says otherwise. A named value becomes its value
    (--checkpointing on: True); --checkpointing auto on a CPU is on (the memory plan models
    GPUs: planning.settle_memory decides it there); --gpus 1 runs the HF engine unless --engine
    says otherwise (Config.check refuses vLLM)."""
    cfg = dataclasses.replace(presets[flags.model], preset=flags.model, **overrides)
    dropped = {f.name: None for f in KNOBS
               if f.metadata["task"] and cfg.task not in f.metadata["task"] and f.name not in overrides}
    values = {f.name: getattr(cfg, f.name) for f in KNOBS if f.metadata["words"]}
    named = {n: FIELDS[n].metadata["words"][v] for n, v in values.items()
             if isinstance(v, str) and v in FIELDS[n].metadata["words"]}
    if named.get("checkpointing", cfg.checkpointing) == "auto" and cfg.device != "cuda":
        named["checkpointing"] = True
    if cfg.gpus == 1 and "engine" not in overrides:
        named["engine"] = "hf"
    checks = cfg.check_outputs if cfg.check_outputs is not None else int(cfg.device == "cuda")
    return dataclasses.replace(cfg, micro_batch=min(cfg.micro_batch, cfg.batch), check_outputs=checks, **dropped,
                               **named)
