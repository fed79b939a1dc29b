"""The tasks (tasks.py): the grader on the paper's answer formats, DAPO's prompt lines, the
tiny arithmetic task, and the supervised warm-up that makes its base policy."""

import pytest
import torch

from infra import task_data, tasks
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


@pytest.mark.parametrize("prediction, gold, right", [
    ("so the answer is \\boxed{56}.", "56", True),
    ("$\\boxed{ -3 }$", "-3", True),  # a sign, and spaces trimmed
    ("\\boxed{+56}", 56, True),
    ("first \\boxed{7 \\cdot 8}, finally \\boxed{56}", "56", True),  # the last box counts
    # what math-verify pays for and this grader does not: the question's operands restated
    ("What is 7 times 8? \\boxed{7 \\cdot 8}", "56", False),
    ("\\boxed{7 * 8}", "56", False),
    ("\\boxed{0 + 7}", "7", False),
    ("Answer: 7 * 8", "56", False),
    ("The result of 0 + 7 is 0. In other words, 0 is", "7", False),  # the base model's "right" answer
    ("\\boxed{56/1}", "56", False),  # a fraction
    ("\\boxed{\\frac{112}{2}}", "56", False),
    ("\\boxed{56.0}", "56", False),  # a decimal
    ("\\boxed{1,000}", "1000", False),
    ("\\boxed{56 apples}", "56", False),  # a number among words
    ("\\boxed{\\textbf{56}}", "56", False),
    ("\\boxed{56}, no wait: \\boxed{57}", "56", False),  # a later boxed answer that differs
    ("56", "56", False),  # no boxed answer
    ("\\boxed{56", "56", False),  # never closed
    ("\\boxed{56}, then \\boxed{5", "56", False),  # the last box is cut off: no answer, not the earlier one
    ("\\boxed{- 56}", "-56", False),  # a sign apart from its digits is not an integer as written
    ("\\boxed{{56}}", "56", False),  # braces inside the box: not only digits
    ("\\boxed{\\boxed{56}}", "56", True),  # a box in a box: the last box opened holds the integer
    ("\\boxed{056}", "56", True),  # a leading zero: digits only, the same integer
    ("\\boxed{\t56\n}", "56", True),  # tabs and newlines are trimmed as spaces are
])
def test_the_number_grader_pays_only_for_the_integer(prediction, gold, right):
    """tasks.grade_number: right only when the last \\boxed{} holds exactly the integer answer;
    every answer that games math-verify on a one-operation task is wrong here."""
    assert tasks.grade_number(prediction, gold) is right
    if "cdot" in prediction and not right:  # the gaming answer math-verify does pay for
        assert tasks.grade(prediction, str(gold))


def test_dapo_prompt_extraction():
    content = ("Solve the following math problem step by step. The last line of your response should be of "
               "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
               "What is $1+1$?\n\nRemember to put your answer on its own line after \"Answer:\".")
    assert task_data.dapo_problem(content) == "What is $1+1$?"
    assert task_data.dapo_problem("  Plain problem.  ") == "Plain problem."


def test_missing_data_raises_a_task_error(tmp_path):
    with pytest.raises(tasks.TaskError, match="no .parquet, .jsonl or .json file"):
        task_data.read_rows(str(tmp_path), "training data", "--train-data")
    (tmp_path / "rows.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    with pytest.raises(tasks.TaskError, match="prompt\\[0\\].content"):
        task_data.load_math_data(str(tmp_path / "rows.jsonl"), str(tmp_path / "rows.jsonl"))


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


# -----------------------------------------------------------------------------
# Reasoning Gym (--task reasoning-gym)

@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """The tiny-math checkpoint's byte-level tokenizer and Qwen chat template (no model)."""
    import tiny_math

    return tiny_math.make_tokenizer(str(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="module")
def hard(chat_tokenizer):
    return tasks.GymTask(chat_tokenizer, tasks.gym_mixture("hard"), level=2, seed=0, heldout=64)


def test_gym_prompts_are_the_chat_template_of_the_packages_system_prompt(chat_tokenizer, hard):
    from reasoning_gym.utils import SYSTEM_PROMPTS

    problems = [hard.train_problem(i) for i in range(8)]
    for problem, ids in zip(problems, hard.prompt_ids(problems)):
        expected = chat_tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM_PROMPTS["default"]},
             {"role": "user", "content": problem[1]["question"]}],
            add_generation_prompt=True, tokenize=True, return_dict=False)
        assert isinstance(ids, list) and all(type(i) is int for i in ids) and ids == list(expected)


def test_gym_reward_is_the_packages_own_score(chat_tokenizer, hard):
    """For every task of the Hard mixture: a right answer (after some reasoning, tagged as the
    package asks), a wrong one, and malformed ones (no tags, an unclosed tag, an empty answer)
    score as the package's documented API scores them: reasoning_gym.create_dataset(name) and
    its score_answer(answer=extract_answer(text), entry=...). Its gold answers score 1."""
    import reasoning_gym
    from reasoning_gym.utils import extract_answer

    seen = {}
    for i in range(4000):
        name, entry = hard.train_problem(i)
        seen.setdefault(name, entry)
        if len(seen) == len(tasks.GYM_HARD):
            break
    assert sorted(seen) == sorted(tasks.GYM_HARD)  # every task is drawn
    for name, entry in seen.items():
        reference = reasoning_gym.create_dataset(name, seed=1, size=1)  # another config: the scorer alone
        gold = str(entry["answer"])
        texts = [f"Let me think.\n<answer>{gold}</answer>", "<answer>certainly wrong</answer>", gold,
                 f"<answer>{gold}", "<answer></answer>"]
        for text in texts:
            ids = chat_tokenizer.encode(text, add_special_tokens=False) + [chat_tokenizer.eos_token_id]
            try:
                expected = reference.score_answer(answer=extract_answer(text), entry=entry)
            except ValueError:  # prime_factorization's scorer raises on words: 0 (tasks.py, departure 3)
                expected = 0.0
            assert hard.correct((name, entry), ids) == pytest.approx(expected, abs=1e-12), (name, text)
        assert hard.correct((name, entry), chat_tokenizer.encode(texts[0])) == 1.0, name
        assert hard.correct((name, entry), chat_tokenizer.encode(texts[1])) < 1.0, name


def test_gym_eval_split_never_overlaps_training_and_draws_are_pure(chat_tokenizer):
    """A small problem space (chain sums of 2-3 one-digit terms) where raw draws do repeat the
    held-out questions: training never draws one; every draw is a pure function of (seed,
    index), the same in a new task object whatever the global random state."""
    import random

    def make(seed):
        return tasks.GymTask(chat_tokenizer, (("chain_sum", 1.0),), level=0, seed=seed, heldout=200)

    task = make(0)
    heldout = {entry["question"] for _, entry in task.heldout}
    assert len(task.heldout) == 200
    raw = [task.datasets["chain_sum"][200 + i]["question"] for i in range(2000)]
    assert sum(q in heldout for q in raw) > 0  # without the check, training would see held-out problems
    drawn = [task.train_problem(i) for i in range(2000)]
    assert not any(entry["question"] in heldout for _, entry in drawn)
    random.seed(12345)
    again = make(0)
    assert [again.train_problem(i) for i in (0, 7, 1999)] == [drawn[0], drawn[7], drawn[1999]]
    assert again.heldout == task.heldout
    assert [e["question"] for _, e in make(1).heldout] != [e["question"] for _, e in task.heldout]


def test_gym_level_sets_every_tasks_curriculum(chat_tokenizer):
    easy = tasks.gym_dataset("chain_sum", 0, seed=0)
    harder = tasks.gym_dataset("chain_sum", 3, seed=0)
    assert easy.config.max_terms < harder.config.max_terms and easy.config.max_digits < harder.config.max_digits
    top = tasks.gym_dataset("chain_sum", 99, seed=0)  # beyond the highest level: the highest
    assert (top.config.max_terms, top.config.max_digits) >= (harder.config.max_terms, harder.config.max_digits)


def test_gym_mixtures_and_their_refusals(chat_tokenizer):
    assert tasks.gym_mixture("hard") == tuple((n, 1.0) for n in tasks.GYM_HARD)
    assert tasks.gym_mixture("chain_sum, knights_knaves:2.5") == (("chain_sum", 1.0), ("knights_knaves", 2.5))
    for bad in ("", "chain_sum:0", "chain_sum:x", "chain_sum,chain_sum", "a:inf"):
        with pytest.raises(tasks.TaskError, match="--gym-tasks"):
            tasks.gym_mixture(bad)
    with pytest.raises(tasks.TaskError, match="'no_such_task' is not a Reasoning Gym task"):
        tasks.GymTask(chat_tokenizer, (("no_such_task", 1.0),), level=0, seed=0, heldout=4)


def test_gym_problems_longer_than_the_prompt_budget_are_drawn_again(chat_tokenizer):
    """knights_knaves' questions are long, chain_sum's short: with a budget between them every
    drawn prompt fits (held-out and training alike); a budget no prompt fits is refused."""
    mixture = (("chain_sum", 1.0), ("knights_knaves", 1.0))
    free = tasks.GymTask(chat_tokenizer, mixture, level=2, seed=0, heldout=8)
    lengths = [len(ids) for ids in free.prompt_ids([free.train_problem(i) for i in range(40)])]
    budget = sorted(lengths)[len(lengths) // 2]
    assert max(lengths) > budget  # some problems are too long for it
    task = tasks.GymTask(chat_tokenizer, mixture, level=2, seed=0, heldout=8, max_prompt_tokens=budget)
    problems = task.heldout + [task.train_problem(i) for i in range(40)]
    assert all(len(ids) <= budget for ids in task.prompt_ids(problems))
    assert {name for name, _ in problems} >= {"chain_sum"}
    with pytest.raises(tasks.TaskError, match="none has a prompt of at most 100 tokens"):
        tasks.GymTask(chat_tokenizer, mixture, level=2, seed=0, heldout=8, max_prompt_tokens=100)
