"""A chat task's files (task_data.chat_task): a bad data file or a model folder without a usable
tokenizer is refused with one line (a TaskError: train.py prints `train.py: error: ...` and
exits 2) that names the file, and for a data file the line or row, before any model or engine
is loaded. The fixtures are tests/tiny_math.py's tokenizer and data files, without its model."""

import builtins
import json
import os
import pathlib
import shutil

import pytest

import tiny_math
from infra import task_data, tasks


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The tiny-math tokenizer (in a folder with a Qwen2 config.json, as a checkpoint has) and
    its data files in DAPO-Math-17k's and MATH-500's formats."""
    from transformers import Qwen2Config

    out = tmp_path_factory.mktemp("tiny-math")
    model = out / "model"
    model.mkdir()
    tiny_math.make_tokenizer(str(model))
    Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(model)
    train, heldout = tiny_math.problems(0)
    train_path, eval_path = tiny_math.write_data(str(out), train, heldout)
    return {"model": str(model), "train": train_path, "eval": eval_path}


def _rows(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def math_task(model, train, eval_data):
    return task_data.chat_task("math", str(model), seed=0, eval_problems=8, train_data=str(train), eval_data=str(eval_data))


def refusal(call, *args, names) -> str:
    """The message of the TaskError that `call(*args)` raises: one line that names `names`."""
    with pytest.raises(tasks.TaskError) as caught:
        call(*args)
    message = str(caught.value)
    assert "\n" not in message and str(names) in message, message
    assert caught.value.exit_code == 2 and caught.value.line() == f"train.py: error: {message}"
    return message


def test_the_tiny_math_files_pass(made, tmp_path):
    """The checks refuse none of the paper's formats: jsonl, a folder of parquet files, a .json
    array, and JSON lines in a .json file (as the datasets library reads them)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    task = math_task(made["model"], made["train"], made["eval"])
    assert len(task.train) == 80 and len(task.heldout) == 8 and task.eos is not None
    rows = _rows(made["train"])
    (tmp_path / "data").mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:50]), tmp_path / "data" / "part-0.parquet")
    pq.write_table(pa.Table.from_pylist(rows[50:]), tmp_path / "data" / "part-1.parquet")
    (tmp_path / "eval.json").write_text(json.dumps(_rows(made["eval"])))
    shutil.copy(made["eval"], tmp_path / "lines.json")
    for eval_data in (tmp_path / "eval.json", tmp_path / "lines.json"):
        again = math_task(made["model"], tmp_path / "data", eval_data)
        assert again.train == task.train and again.heldout == task.heldout


# -----------------------------------------------------------------------------
# Data files

def _lines(*rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def _parquet_bytes(made, tmp_path, rows=None) -> bytes:
    """A valid parquet file of the tiny-math training rows (the first `rows` of them)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(_rows(made["train"])).slice(0, rows), tmp_path / "whole.parquet")
    return (tmp_path / "whole.parquet").read_bytes()


DAPO = {"prompt": [{"role": "user", "content": "What is $1+2$?"}], "reward_model": {"ground_truth": "3"}}
MATH500 = {"problem": "What is $1+2$?", "answer": "3"}


@pytest.mark.parametrize("name, content, expected", [
    ("train.jsonl", _lines(DAPO, DAPO, b'{"prompt": [{"content": "1+1"}], "reward_model": '), "line 3: not valid JSON"),
    ("train.jsonl", _lines(DAPO, b"", b"[1, 2]"), "line 3: a JSON array where a row"),
    ("train.jsonl", _lines(DAPO, b'{"prompt": "caf\xe9"}'), "line 2: not UTF-8 text (byte 0xe9"),
    ("train.jsonl", b"", "no rows in the file (0 bytes)"),
    ("train.jsonl", b"\n  \n", "no rows in the file"),
    ("train.jsonl", _lines(DAPO, {"prompt": DAPO["prompt"]}), "line 2: a row needs DAPO-Math-17k's fields prompt[0]"),
    ("train.jsonl", _lines({"prompt": [{"content": None}], "reward_model": {"ground_truth": "1"}}),
     "line 1: a row needs DAPO-Math-17k's fields prompt[0].content and reward_model.ground_truth; its "),
    ("train.jsonl", _lines(dict(DAPO, reward_model={"ground_truth": None})),
     "line 1: reward_model.ground_truth is null"),
    ("train.json", b'[{"prompt": 1},\n oops]', "line 2: not valid JSON"),
    ("train.json", b'["a row?"]', "item 1: a JSON string where a row"),
    ("train.csv", b"prompt,answer\n", "not a .parquet, .jsonl or .json file"),
    ("train.parquet", b"", "not a readable parquet file (ArrowInvalid"),
    ("train.parquet", "truncated", "not a readable parquet file (ArrowInvalid"),
    ("train.parquet", "no rows", "no rows in the file"),
])
def test_a_bad_training_file_is_refused_in_one_line(made, tmp_path, name, content, expected):
    path = tmp_path / name
    if content == "truncated":  # a valid file cut short, as an interrupted copy leaves it
        content = _parquet_bytes(made, tmp_path)[:-100]
    elif content == "no rows":
        content = _parquet_bytes(made, tmp_path, rows=0)
    path.write_bytes(content)
    message = refusal(math_task, made["model"], path, made["eval"], names=f"--train-data {path}")
    assert expected in message, message


@pytest.mark.parametrize("row, expected", [
    ({"problem": "1+1"}, "line 2: a row needs MATH-500's fields problem and answer; this one has no answer"),
    ({"problem": "", "answer": "2"}, "line 2: a row needs MATH-500's fields problem and answer; its problem"),
    ({"problem": "1+1", "answer": ["2"]}, 'line 2: answer is ["2"], not a non-empty string'),
])
def test_an_evaluation_row_without_its_fields_names_its_line(made, tmp_path, row, expected):
    path = tmp_path / "eval.jsonl"
    path.write_bytes(_lines(MATH500, row))
    message = refusal(math_task, made["model"], made["train"], path, names=f"--eval-data {path}")
    assert expected in message, message


def test_a_folder_without_data_files_is_refused(made, tmp_path):
    """A folder is searched for data files; a folder named like one (Spark writes x.parquet/
    folders) is searched too, not opened as a file."""
    (tmp_path / "data" / "rows.jsonl").mkdir(parents=True)
    message = refusal(math_task, made["model"], tmp_path / "data", made["eval"], names=tmp_path / "data")
    assert "no .parquet, .jsonl or .json file" in message


@pytest.mark.parametrize("name", ["train.jsonl", "train.parquet"])
def test_an_unreadable_file_is_refused(made, tmp_path, monkeypatch, name):
    """Permission denied. Root reads a file of mode 000, so there the denial is simulated."""
    path = tmp_path / name
    if name.endswith(".jsonl"):
        shutil.copy(made["train"], path)
    else:
        path.write_bytes(_parquet_bytes(made, tmp_path))
    path.chmod(0)
    if os.geteuid() == 0:
        import pyarrow.parquet as pq

        def denied(real):
            def call(file, *args, **kwargs):
                if str(file) == str(path):
                    raise PermissionError(13, "Permission denied", str(path))
                return real(file, *args, **kwargs)
            return call

        monkeypatch.setattr(builtins, "open", denied(builtins.open))
        monkeypatch.setattr(pq, "read_table", denied(pq.read_table))
    try:
        message = refusal(math_task, made["model"], path, made["eval"], names=f"--train-data {path}")
    finally:
        path.chmod(0o644)
    assert "cannot be read (PermissionError" in message and "make it readable for this user" in message, message


# -----------------------------------------------------------------------------
# The model folder's tokenizer

def _copy(made, tmp_path) -> str:
    folder = tmp_path / "model"
    shutil.copytree(made["model"], folder)
    return str(folder)


def _save_tokenizer(folder, model, **special):
    """A fast tokenizer of `model` (a tokenizers model) with the tiny-math chat template."""
    from tokenizers import Tokenizer, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **special)
    tok.chat_template = tiny_math.CHAT_TEMPLATE
    tok.save_pretrained(folder)


def test_a_model_folder_without_tokenizer_files(made, tmp_path):
    """transformers 5 builds an empty tokenizer from config.json alone rather than raising."""
    folder = _copy(made, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        os.remove(os.path.join(folder, name))
    message = refusal(math_task, folder, made["train"], made["eval"], names=f"--model-path {folder}")
    assert "no tokenizer files there" in message and "tokenizer.json" in message


def test_the_reasoning_gym_task_checks_the_tokenizer_too(made, tmp_path):
    folder = _copy(made, tmp_path)
    os.remove(os.path.join(folder, "tokenizer.json"))

    def gym_task(path):
        return task_data.chat_task("reasoning-gym", path, seed=0, eval_problems=2, gym_tasks="chain_sum")

    assert "no tokenizer files there" in refusal(gym_task, folder, names=f"--model-path {folder}")


def test_a_damaged_tokenizer_json(made, tmp_path):
    folder = _copy(made, tmp_path)
    path = pathlib.Path(folder, "tokenizer.json")
    path.write_text(path.read_text()[: len(path.read_text()) // 2])  # cut short, as an interrupted copy
    message = refusal(math_task, folder, made["train"], made["eval"], names=f"--model-path {folder}")
    assert "its tokenizer files do not load (JSONDecodeError: " in message


def test_a_tokenizer_that_encodes_to_nothing(made, tmp_path):
    """An empty vocabulary encodes every question to no ids; one of only an unknown token to
    that token repeated. vLLM would start and then refuse the prompts."""
    from tokenizers import models

    special = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"])
    for model, expected in ((models.BPE(vocab={}, merges=[]), "to no tokens"),
                            (models.WordLevel(vocab={"[UNK]": 0}, unk_token="[UNK]"), "to [0, 0, 0")):
        folder = tmp_path / type(model).__name__
        _save_tokenizer(folder, model, **special)
        message = refusal(math_task, folder, made["train"], made["eval"], names=folder)
        assert f"encodes {tasks.ChatTask.PROBE!r} {expected}" in message and "vocabulary" in message, message


def test_a_tokenizer_without_an_eos_token(made, tmp_path):
    """The generation config names an EOS (so generation_stop_ids passes), the tokenizer none:
    rollouts are padded with the tokenizer's."""
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(made["model"]).backend_tokenizer.model  # tiny-math's BPE
    folder = tmp_path / "model"
    _save_tokenizer(folder, vocab, pad_token="<|endoftext|>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    message = refusal(math_task, folder, made["train"], made["eval"], names=folder)
    assert "names no EOS token" in message


def test_a_chat_template_that_renders_nothing(made, tmp_path):
    folder = _copy(made, tmp_path)
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}{% endfor %}")
    message = refusal(math_task, folder, made["train"], made["eval"], names=folder)
    assert "renders a prompt of 'What is $1+1$?' to no tokens" in message


def test_a_damaged_generation_config(made, tmp_path):
    """A generation_config.json that is there but not JSON is refused, not read as missing."""
    folder = _copy(made, tmp_path)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        f.write('{"eos_token_id": [1,')
    message = refusal(math_task, folder, made["train"], made["eval"], names=f"{folder}/generation_config.json")
    assert "cannot be read" in message


def test_the_number_grader_is_the_tasks_own_when_asked(made, tmp_path):
    """chat_task(..., grader="number"): the math task's `correct`, which both the rollouts'
    reward and the held-out evaluation call, is tasks.grade_number; by default it is
    math-verify's, which also pays for the sum's operands restated in the box. Data whose gold
    answers are not all integers is refused under the number grader, in one line."""
    strict = task_data.chat_task("math", made["model"], seed=0, eval_problems=8, train_data=made["train"],
                                 eval_data=made["eval"], grader="number")
    paper = math_task(made["model"], made["train"], made["eval"])
    problem = strict.heldout[0]
    question, gold = problem
    a, b = (int(x) for x in question.split("$")[1].split("+"))  # "What is $a+b$?"
    assert int(gold) == a + b

    def ids(text):
        return strict.tokenizer.encode(text, add_special_tokens=False)

    assert strict.correct(problem, ids(f"so \\boxed{{{a + b}}}")) and paper.correct(problem, ids(f"\\boxed{{{a + b}}}"))
    assert paper.correct(problem, ids(f"\\boxed{{{a}+{b}}}")) and not strict.correct(problem, ids(f"\\boxed{{{a}+{b}}}"))
    rows = _rows(made["eval"])
    rows[0]["answer"] = "\\frac{1}{2}"
    bad = tmp_path / "eval.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    refusal(lambda: task_data.chat_task("math", made["model"], seed=0, eval_problems=8, train_data=made["train"],
                                        eval_data=str(bad), grader="number"), names="--grader number")


def test_worked_examples_come_before_every_problem_as_earlier_turns(made, tmp_path):
    """chat_task(..., shots=FILE): the prompt of every problem, training and held out alike, is
    the chat template of the system prompt, each worked example as a user turn and an
    assistant turn in the file's order, then the problem (rendered here from the tokenizer
    itself); without --shots the paper's prompt. A file that is missing, empty, or whose row
    lacks a solution is refused in one line naming it."""
    from transformers import AutoTokenizer

    shots = [("What is $2+3$?", "2 plus 3 is 5, so \\boxed{5}."), ("What is $4+4$?", "4 plus 4 is 8, so \\boxed{8}.")]
    path = tmp_path / "shots.jsonl"
    path.write_text("".join(json.dumps({"problem": q, "solution": a}) + "\n" for q, a in shots))
    task = task_data.chat_task("math", made["model"], seed=0, eval_problems=4, train_data=made["train"],
                               eval_data=made["eval"], shots=str(path))
    tok = AutoTokenizer.from_pretrained(made["model"])
    for problem in (task.heldout[0], task.train_problem(0)):
        turns = [{"role": "system", "content": tasks.SYSTEM_PROMPT}]
        for q, a in shots:
            turns += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        turns.append({"role": "user", "content": problem[0]})
        expected = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        assert tok.decode(task.prompt_ids([problem])[0]) == expected
        assert expected.index(shots[1][1]) < expected.index(problem[0])
    task.system_role = False  # a template without a system role (Gemma's): the prompt opens the first user turn
    assert [m["role"] for m in task.messages("Q")] == ["user", "assistant", "user", "assistant", "user"]
    assert task.messages("Q")[0]["content"] == f"{tasks.SYSTEM_PROMPT}\n\n{shots[0][0]}"
    plain = math_task(made["model"], made["train"], made["eval"])
    assert shots[0][1] not in tok.decode(plain.prompt_ids([task.heldout[0]])[0])

    def with_shots(file):
        return lambda: task_data.chat_task("math", made["model"], seed=0, eval_problems=4, train_data=made["train"],
                                           eval_data=made["eval"], shots=str(file))

    assert "no such file" in refusal(with_shots(tmp_path / "none.jsonl"), names="--shots")
    (tmp_path / "empty.jsonl").write_text("")
    assert "no rows" in refusal(with_shots(tmp_path / "empty.jsonl"), names="--shots")
    (tmp_path / "half.jsonl").write_text(json.dumps({"problem": "What is $1+1$?"}) + "\n")
    assert "its solution is null" in refusal(with_shots(tmp_path / "half.jsonl"), names="--shots")
