"""How the base SmolLM2-135M-Instruct scores on bench/real_model.py's one-step arithmetic under
the strict integer grader, question wording by question wording: the exploration that picks the
wording (a prompt change, never a grader change) so that the base policy is neither hopeless
nor done, 0.05 <= pass@1 <= 0.6 under `tasks.grade_number`.

    python bench/strict_prompts.py --checkpoint /tmp/models/smollm2            # about 5 minutes
    python bench/strict_prompts.py --checkpoint /tmp/models/smollm2 --markdown # and bench/README.md

Each wording is the task's question with an instruction added to it (or not). It goes through
the math task's own prompt, the paper's system prompt in the checkpoint's chat template
(tasks.MathTask). It is sampled as train.py's `smollm2-cpu` preset evaluates: temperature 0.7,
top-p 0.7, at most 64 new tokens. The problems are the first 50 of the task's 200 held-out
ones, with 4 samples each. Reported per wording: pass@1 under `grade_number` and under
math-verify (`tasks.grade`, which also pays for an expression equal to the answer), the
generated tokens per response, and the first 3 responses with their strict grades. The
checkpoint: `python bench/real_model.py --checkpoint DIR --convert-only`.
"""

import argparse
import os
import statistics
import sys

import torch

import report  # bench/report.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]
import real_model  # noqa: E402  (bench/real_model.py: the task's problems and split)
from infra import tasks  # noqa: E402

WORDINGS = {  # name: how a question "What is 7 times 8?" is put
    "as today": "{q}",
    "a number": "{q} Give the answer as a single number.",
    "boxed number": "{q} Put only the final number in \\boxed{{}}.",
    "compute, boxed": "{q} Compute it, then write the result as a number inside \\boxed{{}}, like \\boxed{{12}}.",
    "an example after": "{q}\n\nAnswer as in this example.\nQuestion: What is 2 plus 3?\nAnswer: \\boxed{{5}}",
    "an example before": "Question: What is 2 plus 3?\nAnswer: \\boxed{{5}}\n\nQuestion: {q}\nAnswer:",
    "end with the box": "{q} End your reply with the answer in \\boxed{{}}, e.g. \\boxed{{42}} if the answer were 42.",
    "a final line": "{q} Think briefly, then finish with the line: The final answer is \\boxed{{your number}}.",
}
PROBLEMS, SAMPLES, NEW_TOKENS, TEMPERATURE, TOP_P = 50, 4, 64, 0.7, 0.7


@torch.no_grad()
def sample(model, tokenizer, prompts, seed):
    """`SAMPLES` responses to each prompt (token id lists), as text, and their lengths in tokens."""
    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left-padded (B, P)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids.repeat_interleave(SAMPLES, 0), attention_mask=attention.repeat_interleave(
        SAMPLES, 0), do_sample=True, temperature=TEMPERATURE, top_p=TOP_P, max_new_tokens=NEW_TOKENS,
        pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)[:, width:]  # (B S, <= NEW_TOKENS)
    texts, lengths = [], []
    for row in out.tolist():
        ended = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        texts.append(tokenizer.decode(row[:ended], skip_special_tokens=True))
        lengths.append(ended)
    return texts, lengths


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="real_model.py's checkpoint (its --convert-only makes it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wordings", nargs="+", choices=list(WORDINGS), help="some wordings only (default: all)")
    args = report.parse_args(p, "strict_prompts")
    torch.set_num_threads(2)
    from transformers import AutoModelForCausalLM

    from infra import task_data

    tokenizer = task_data.load_tokenizer(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    heldout = real_model.task_split()[1][:PROBLEMS]  # (question, answer)
    rows, samples = [], []
    for name, wording in WORDINGS.items():
        if args.wordings and name not in args.wordings:
            continue
        problems = [(wording.format(q=q), str(answer)) for q, answer in heldout]
        task = tasks.MathTask(tokenizer, [], problems, seed=0, grader="number")
        texts, lengths = sample(model, tokenizer, task.prompt_ids(problems), args.seed)
        golds = [gold for _, gold in problems for _ in range(SAMPLES)]
        strict = [tasks.grade_number(t, g) for t, g in zip(texts, golds)]
        lenient = [tasks.grade(t, g) for t, g in zip(texts, golds)]
        shown = wording.format(q="What is 7 times 8?").replace("\n", "\\n")  # one table line: newlines as \n
        rows.append([name, f"`{shown}`", f"{statistics.mean(strict):.3f}",
                     f"{statistics.mean(lenient):.3f}", f"{statistics.mean(lengths):.1f}",
                     "yes" if 0.05 <= statistics.mean(strict) <= 0.6 else "no"])
        print(report.row(rows[-1]), flush=True)
        for t, g, right in list(zip(texts, golds, strict))[:3]:
            samples.append(f"- {name}, gold {g}, {'right' if right else 'wrong'}: `{' '.join(t.split())[:160]}`")
    header = ["wording", "the question, as asked", "pass@1, grade_number", "pass@1, math-verify",
              "tokens a response", "0.05 <= strict <= 0.6"]
    note = (f"SmolLM2-135M-Instruct ({args.checkpoint}), base weights, the first {PROBLEMS} of real_model.py's 200 "
            f"held-out problems x {SAMPLES} samples at temperature {TEMPERATURE}, top-p {TOP_P}, at most {NEW_TOKENS} "
            f"new tokens, the paper's system prompt in the chat template; seed {args.seed}.")
    out = note + "\n\n" + report.table(header, rows) + "\n\nThe first responses of each wording:\n\n" + "\n".join(samples)
    print("\n" + out)
    if args.markdown:
        report.publish("strict_prompts", out)


if __name__ == "__main__":
    main()
