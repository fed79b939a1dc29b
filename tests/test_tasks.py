"""The tasks (tasks.py): the grader on the paper's answer formats, DAPO's prompt lines, the
tiny arithmetic task, and the supervised warm-up that makes its base policy."""

import pytest
import torch

import tasks
from tiny import tiny_qwen2


@pytest.mark.parametrize("prediction, gold, right", [
    ("so the answer is \\boxed{34}.", "34", True),
    ("\\boxed{\\frac12}", "\\frac{1}{2}", True),
    ("\\boxed{0.5}", "\\frac{1}{2}", True),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac34", True),
    ("first \\boxed{2}, finally \\boxed{\\boxed{7}}", "7", True),
    ("\\boxed{[1,3)}", "[1,3)", True),
    ("\\boxed{[1,3]}", "[1,3)", False),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", True),
    ("\\boxed{10}", "10\\text{ cm}", True),
    ("\\boxed{6}", "5", False),
    ("no final answer here", "5", False),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", True),
])
def test_grader_on_math_answers(prediction, gold, right):
    assert tasks.grade(prediction, gold) is right


def test_dapo_prompt_extraction():
    content = ("Solve the following math problem step by step. The last line of your response should be of "
               "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
               "What is $1+1$?\n\nRemember to put your answer on its own line after \"Answer:\".")
    assert tasks.dapo_problem(content) == "What is $1+1$?"
    assert tasks.dapo_problem("  Plain problem.  ") == "Plain problem."


def test_missing_data_raises_a_task_error(tmp_path):
    with pytest.raises(tasks.TaskError, match="no .parquet, .jsonl or .json file"):
        tasks.read_rows(str(tmp_path), "training data", "--train-data")
    (tmp_path / "rows.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    with pytest.raises(tasks.TaskError, match="prompt\\[0\\].content"):
        tasks.load_math_data(str(tmp_path / "rows.jsonl"), str(tmp_path / "rows.jsonl"))


def test_arithmetic_draws_no_heldout_problem_and_grades_exactly():
    task = tasks.Arithmetic(seed=3, heldout=64)
    drawn = [task.train_problem(i) for i in range(2000)]
    assert not set(drawn) & set(task.heldout)
    assert drawn == [tasks.Arithmetic(seed=3, heldout=64).train_problem(i) for i in range(2000)]  # pure in the index
    p = (37, "+", 45)
    assert task.prompt_ids([p])[0] == [task.bos] + task.encode("37+45=")
    assert task.decode(task.encode("\\boxed{82}")) == "\\boxed{82}"
    assert task.correct(p, task.encode("\\boxed{82}") + [task.eos])
    assert not task.correct(p, task.encode("82"))  # right sum, no box: the format RL has to learn
    assert not task.correct(p, task.encode("\\boxed{83}"))
    assert not task.correct(p, task.encode("\\boxed{82}9"))  # the box must close the response


def test_warmup_teaches_the_sums():
    """A short warm-up lowers the supervised loss on held-out sums, and is deterministic."""
    task = tasks.Arithmetic(seed=0, heldout=32)

    def heldout_loss(model):
        seqs = [[task.bos] + task.encode(task.prompt(p) + f"\\boxed{{{task.answer(p)}}}") + [task.eos]
                for p in task.heldout]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [task.pad] * (width - len(s)) for s in seqs])
        labels = ids.clone()
        labels[:, :task.PROMPT_TOKENS] = -100
        labels[ids == task.pad] = -100
        with torch.no_grad():
            return model(input_ids=ids, labels=labels).loss.item()

    models = [tiny_qwen2(seed=0, vocab_size=task.vocab_size) for _ in range(2)]
    before = heldout_loss(models[0])
    for model in models:
        tasks.warmup(model, task, steps=60, batch=32, lr=3e-3, unboxed=0.0, seed=0)
    assert heldout_loss(models[0]) < 0.7 * before
    assert all(torch.equal(a, b) for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values()))
    assert not models[0].training
