"""How the base SmolLM2-135M-Instruct scores under the strict integer grader, prompt by prompt:
the exploration that chose bench/real_model.py's two tasks and their prompts (a prompt change,
never a grader change) so that the base policy is neither hopeless nor done, 0.05 <= pass@1 <=
0.6 under `tasks.grade_number`.

    python bench/strict_prompts.py --checkpoint /tmp/models/smollm2            # about 25 minutes
    python bench/strict_prompts.py --checkpoint /tmp/models/smollm2 --markdown # and bench/README.md
    python bench/strict_prompts.py --checkpoint /tmp/models/smollm2 --rollouts # the rollouts' sampling

The words task (one-step arithmetic in words): each wording is the question with an instruction
added to it (or not), or the question after two worked examples as earlier chat turns
(--shots). The steps task (two-step word problems answered in steps): its templates after their
two worked examples, at two ranges of numbers. Every prompt goes through the math task's own
prompt, the paper's system prompt in the checkpoint's chat template (tasks.MathTask), and is
sampled as train.py's `smollm2-cpu` preset evaluates: temperature 0.7, top-p 0.7, 4 samples a
problem, at most 64 new tokens (words) or 256 (steps). The problems are the first of the task's
validation split (never its test split). Reported per prompt: pass@1 under `grade_number` and
under math-verify (`tasks.grade`, which also pays for an expression equal to the answer), the
share of responses with a `\\boxed{}`, the generated tokens per response, and the first 3
responses with their strict grades. `--rollouts`: the two chosen prompts only, sampled both as
the evaluation does and as train.py's rollouts are (temperature 1, top-p 1), on the first 50
validation problems of each task: whether the rollouts, not only the evaluation, find right
answers to learn from. The checkpoint: `python bench/real_model.py --checkpoint DIR
--convert-only`.
"""

import argparse
import dataclasses
import functools
import os
import statistics
import sys

import torch

import report  # bench/report.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]
import real_model  # noqa: E402  (bench/real_model.py: the tasks, their splits and worked examples)
from infra import tasks  # noqa: E402

WORDS = real_model.TASKS["words"]
WORDINGS = {  # name: (how a question "What is 7 times 8?" is put, the worked examples before it)
    "as asked": ("{q}", ()),
    "a number": ("{q} Give the answer as a single number.", ()),
    "boxed number": ("{q} Put only the final number in \\boxed{{}}.", ()),
    "compute, boxed": ("{q} Compute it, then write the result as a number inside \\boxed{{}}, like \\boxed{{12}}.", ()),
    "an example after": ("{q}\n\nAnswer as in this example.\nQuestion: What is 2 plus 3?\nAnswer: \\boxed{{5}}", ()),
    "an example before": ("Question: What is 2 plus 3?\nAnswer: \\boxed{{5}}\n\nQuestion: {q}\nAnswer:", ()),
    "end with the box": ("{q} End your reply with the answer in \\boxed{{}}, e.g. \\boxed{{42}} if the answer were 42.",
                         ()),
    "a final line": ("{q} Think briefly, then finish with the line: The final answer is \\boxed{{your number}}.", ()),
    "two earlier turns (chosen)": ("{q}", WORDS.shots),
}
STEPS = real_model.TASKS["steps"]
RANGES = {  # name: the steps task's problems at that range of numbers
    "a, b to 9; c to 30": dict(small=range(2, 10), extra=range(2, 31), held=41),
    "a, b to 5; c to 9 (chosen)": dict(small=real_model.SMALL, extra=real_model.EXTRA, held=16),
}
PROBLEMS = {"words": 50, "steps": 20}  # the first of the validation split
NEW_TOKENS = {"words": 64, "steps": 256}
SAMPLES, TEMPERATURE, TOP_P = 4, 0.7, 0.7
SCORED = ("pass@1, grade_number", "pass@1, math-verify", "boxed", "tokens a response", "0.05 <= strict <= 0.6")


@torch.no_grad()
def sample(model, tokenizer, prompts, seed, new_tokens, temperature=TEMPERATURE, top_p=TOP_P):
    """`SAMPLES` responses to each prompt (token id lists), as text, and their lengths in tokens."""
    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left-padded (B, P)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids.repeat_interleave(SAMPLES, 0), attention_mask=attention.repeat_interleave(
        SAMPLES, 0), do_sample=True, temperature=temperature, top_p=top_p, max_new_tokens=new_tokens,
        pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)[:, width:]  # (B S, <= new_tokens)
    texts, lengths = [], []
    for row in out.tolist():
        ended = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        texts.append(tokenizer.decode(row[:ended], skip_special_tokens=True))
        lengths.append(ended)
    return texts, lengths


def score(model, tokenizer, problems, shots, task_key, seed, name, **sampling):
    """One prompt's table row and its first 3 responses, `problems` as (question, gold) pairs
    (`sampling`: the temperature and top-p, else the evaluation's)."""
    task = tasks.MathTask(tokenizer, [], problems, seed=0, grader="number", shots=shots)
    texts, lengths = sample(model, tokenizer, task.prompt_ids(problems), seed, NEW_TOKENS[task_key], **sampling)
    golds = [gold for _, gold in problems for _ in range(SAMPLES)]
    right = [tasks.grade_number(t, g) for t, g in zip(texts, golds)]
    strict = statistics.mean(right)
    lenient = statistics.mean(tasks.grade(t, g) for t, g in zip(texts, golds))
    boxed = statistics.mean(tasks.last_boxed(t) is not None for t in texts)
    row = [f"{strict:.3f}", f"{lenient:.3f}", f"{boxed:.2f}", f"{statistics.mean(lengths):.1f}",
           "yes" if 0.05 <= strict <= 0.6 else "no"]
    shown = [f"- {name}, gold {g}, {'right' if r else 'wrong'}: `{' '.join(t.split())[:200]}`"
             for t, g, r in list(zip(texts, golds, right))[:3]]
    return row, shown


ROLLOUT_PROBLEMS = 50  # --rollouts: the first of each task's validation split


def rollouts(model, tokenizer, seed) -> str:
    """--rollouts: the two chosen prompts sampled as train.py's rollouts are (its preset's
    temperature, top-p 1: the paper's sampling) beside the evaluation's sampling, on the same
    validation problems. Until a rollout is paid, every reward is the same and so is the running
    baseline, so every advantage is 0: the evaluation's pass@1 says whether there is something
    to learn, this says whether the rollouts can find it."""
    import train

    temperature = train.PRESETS[real_model.PRESET].temperature
    rows, samples = [], []
    for task in (WORDS, STEPS):
        problems = [(q, str(answer)) for q, answer in real_model.task_split(task)[1][:ROLLOUT_PROBLEMS]]
        for name, t, p in (("the evaluation's", TEMPERATURE, TOP_P), ("the rollouts'", temperature, 1.0)):
            row, shown = score(model, tokenizer, problems, task.shots, task.key, seed, f"{task.key}, {name}",
                               temperature=t, top_p=p)
            rows.append([task.key, f"{name}: temperature {t:g}, top-p {p:g}", *row])
            samples += shown
            print(report.row(rows[-1]), flush=True)
    return "\n".join([
        f"SmolLM2-135M-Instruct, base weights, each task's chosen prompt (after its two worked examples) on the first "
        f"{ROLLOUT_PROBLEMS} of its validation problems, {SAMPLES} samples a problem, sampled as train.py evaluates "
        f"and as its `{real_model.PRESET}` preset's rollouts are; seed {seed}.", "",
        report.table(["task", "sampling", *SCORED], rows), "", "The first responses of each:", "", *samples])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="real_model.py's checkpoint (its --convert-only makes it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rollouts", action="store_true", help="only the chosen prompts, at the evaluation's and at "
                   "the rollouts' sampling (about 50 minutes here)")
    args = report.parse_args(p, "strict_prompts", "strict_prompts_rollouts",
                             which=lambda a: ["strict_prompts_rollouts"] if a.rollouts else ["strict_prompts"])
    torch.set_num_threads(2)
    from transformers import AutoModelForCausalLM

    from infra import task_data

    tokenizer = task_data.load_tokenizer(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    if args.rollouts:
        out = rollouts(model, tokenizer, args.seed)
        print("\n" + out)
        if args.markdown:
            report.publish("strict_prompts_rollouts", out)
        return
    words, steps, samples = [], [], []
    validation = real_model.task_split(WORDS)[1][:PROBLEMS["words"]]  # (question, answer)
    for name, (wording, shots) in WORDINGS.items():
        problems = [(wording.format(q=q), str(answer)) for q, answer in validation]
        row, shown = score(model, tokenizer, problems, shots, "words", args.seed, name)
        words.append([name, "`" + wording.format(q="What is 7 times 8?").replace("\n", "\\n") + "`"
                      + (f" after {len(shots)} worked examples" if shots else ""), *row])
        samples += shown
        print(report.row(words[-1]), flush=True)
    for name, numbers in RANGES.items():
        task = dataclasses.replace(STEPS, problems=functools.partial(real_model.steps_problems, **numbers))
        problems = [(q, str(answer)) for q, answer in real_model.task_split(task)[1][:PROBLEMS["steps"]]]
        row, shown = score(model, tokenizer, problems, STEPS.shots, "steps", args.seed, name)
        steps.append([name, f"`{problems[0][0]}`", *row])
        samples += shown
        print(report.row(steps[-1]), flush=True)
    out = "\n".join([
        f"SmolLM2-135M-Instruct ({args.checkpoint}), base weights, {SAMPLES} samples a problem at temperature "
        f"{TEMPERATURE}, top-p {TOP_P}, the paper's system prompt in the chat template; seed {args.seed}.", "",
        f"The words task, the first {PROBLEMS['words']} of its validation problems, at most {NEW_TOKENS['words']} "
        f"new tokens:", "", report.table(["wording", "the question, as asked", *SCORED], words), "",
        f"The steps task after its two worked examples, the first {PROBLEMS['steps']} validation problems of each "
        f"range, at most {NEW_TOKENS['steps']} new tokens:", "",
        report.table(["numbers", "the first problem", *SCORED], steps), "",
        "The first responses of each prompt:", "", *samples])
    print("\n" + out)
    if args.markdown:
        report.publish("strict_prompts", out)


if __name__ == "__main__":
    main()
