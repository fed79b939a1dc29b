"""
infra/task_data.py: a chat task's files read and checked: its tokenizer, its stop ids, the math
task's data sets, and the task made from them (`chat_task`).

What it is
----------
`chat_task(task, model_path, ...)` reads a chat checkpoint's tokenizer (`load_tokenizer`) and
the ids that end a response (`generation_stop_ids`), and for the math task its DAPO-Math-17k-
and MATH-500-format data (`load_math_data`, through `read_rows`: local files or the local
Hugging Face cache; nothing is downloaded here), and builds tasks.py's `MathTask` or `GymTask`.
Errors are tasks.py's `TaskError`, one line that says what to do (which option, which download).

What is refused
---------------
All of it before a model or an engine is loaded, so a bad file stops the run in seconds, not
after vLLM's start. Each refusal names the file, and for a data file its line (.jsonl, .json)
or row (.parquet), counted from 1.
- Data files (`read_rows`, `dapo_row`, `math500_row`): a file that cannot be read (no
  permission, a damaged disk), a truncated or otherwise unreadable parquet file, text that is
  not UTF-8, a line that is not JSON or a JSON value that is not an object (a row), a file
  with no rows, a file of another kind than .parquet, .jsonl or .json, and rows without their
  data set's fields (DAPO-Math-17k: a non-empty prompt[0].content and reward_model.ground_truth;
  MATH-500: a non-empty problem and answer; --shots: a non-empty problem and solution).
- The tokenizer (`load_tokenizer`): a model folder without tokenizer files (transformers 5
  then builds an empty tokenizer from config.json instead of raising, and vLLM later stops on
  an empty prompt), or tokenizer files that do not load (tasks.ChatTask then checks what it
  can prompt with); a generation_config.json that does not read.

Departures, numbered
--------------------
1. DAPO-Math-17k repeats each problem many times and wraps it in its own answer-format lines
   ('Answer: ...'); the problems are deduplicated and those lines dropped, since the prompt
   asks for \\boxed{} as the paper's evaluation does.
"""

import errno
import glob
import json
import os

from infra.tasks import ChatTask, GymTask, MathTask, TaskError, gym_mixture, one_line

DAPO_PREFIX = "Solve the following math problem step by step."
DAPO_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'


def chat_task(task: str, model_path: str, *, seed: int, eval_problems: int, train_data=None, eval_data=None,
              gym_tasks=None, gym_level=0, max_prompt_tokens=None, grader=None, shots=None) -> ChatTask:
    """A chat checkpoint's task: the math task from this node's tokenizer and data files, or
    Reasoning Gym's problems made from the seed (at most `max_prompt_tokens` a prompt).

    Every check of the tokenizer and the data files is made here (the module docstring lists
    them), before a model or an engine is loaded; nothing is written, so a run can call it
    before its run folder exists."""
    tokenizer = load_tokenizer(model_path)
    kw = dict(seed=seed, stop_ids=generation_stop_ids(model_path, tokenizer))
    if task == "reasoning-gym":
        return GymTask(tokenizer, gym_mixture(gym_tasks), level=gym_level, **kw, heldout=eval_problems,
                       max_prompt_tokens=max_prompt_tokens)
    train_set, heldout = load_math_data(train_data, eval_data)
    return MathTask(tokenizer, train_set, heldout[:eval_problems], **kw, grader=grader,
                    shots=load_shots(shots) if shots else ())


def generation_stop_ids(path: str, tokenizer) -> list[int]:
    """The token ids that end a response: the checkpoint's generation_config.json `eos_token_id`
    (an id or a list: Llama 3 Instruct ends turns with <|eot_id|> and text with <|end_of_text|>)
    and the tokenizer's EOS. vLLM reads the same by default; the engine is given them all the
    same, so that what ends a response is this project's choice, whatever the engine."""
    from transformers import GenerationConfig

    try:
        ids = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError as e:  # no generation_config.json: the tokenizer's EOS alone
        if os.path.isfile(os.path.join(path, "generation_config.json")):  # there, but not JSON: not ignored
            raise TaskError(f"{path}/generation_config.json cannot be read ({one_line(e)}): fix it, or remove it "
                            f"to end responses on the tokenizer's EOS alone") from e
        ids = None
    except ValueError as e:
        raise TaskError(f"{path}/generation_config.json cannot be read ({one_line(e)})") from e
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise TaskError(f"{path}: neither generation_config.json nor the tokenizer names an EOS token, so no "
                        f"response could end")
    return sorted(set(int(i) for i in ids))


# What a Hugging Face tokenizer is loaded from: tokenizer.json (a fast tokenizer), or a slow
# tokenizer's vocabulary (SentencePiece's tokenizer.model or spiece.model, BPE's vocab.json
# and merges.txt, WordPiece's vocab.txt, tiktoken's *.tiktoken, Mistral's tekken.json).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
                   "vocab.txt", "*.tiktoken", "tekken.json")


def load_tokenizer(path: str):
    """The checkpoint's tokenizer. A local folder must hold a tokenizer's files: transformers 5
    builds an empty tokenizer from config.json alone instead of raising (ChatTask checks the
    loaded tokenizer itself)."""
    from transformers import AutoTokenizer

    local = os.path.isdir(path)
    if local and not any(glob.glob(os.path.join(glob.escape(path), name)) for name in TOKENIZER_FILES):
        raise TaskError(f"--model-path {path}: no tokenizer files there (a Hugging Face tokenizer needs "
                        f"tokenizer.json, or its vocabulary files such as tokenizer.model or vocab.json and "
                        f"merges.txt, and tokenizer_config.json): copy them from the checkpoint's source (hf download "
                        f"REPO --local-dir {path})")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        if local:  # the files are there, so a download would not help: they are damaged
            raise TaskError(f"--model-path {path}: its tokenizer files do not load ({one_line(e)}): copy "
                            f"tokenizer.json and tokenizer_config.json again from the checkpoint's source") from e
        raise TaskError(f"could not load the tokenizer of {path} ({type(e).__name__}). Download the checkpoint once "
                        f"with network access (hf download {path}) or pass --model-path DIR") from e


def load_math_data(train_source: str, eval_source: str):
    """(train problems, eval problems) as (problem, gold) pairs, from DAPO-Math-17k-format and
    MATH-500-format rows (departure 1); says how to get them if missing."""
    dapo = read_rows(train_source, "training data", "--train-data", dapo_row)
    heldout = read_rows(eval_source, "evaluation data", "--eval-data", math500_row)
    seen, train = set(), []
    for problem, gold in dapo:  # DAPO repeats each problem: the first copy is kept
        if problem not in seen:
            seen.add(problem)
            train.append((problem, gold))
    return train, heldout


def load_shots(path: str) -> list[tuple[str, str]]:
    """The worked examples of --shots: (problem, solution) pairs from a local .jsonl/.json file
    (or folder) of {"problem": ..., "solution": ...} rows, in the file's order. They go before
    every problem as earlier chat turns (tasks.ChatTask), so a missing one is refused here."""
    if not os.path.exists(path):
        raise TaskError(f"--shots {path}: no such file; give a .jsonl file of {{\"problem\", \"solution\"}} rows")
    return read_rows(path, "worked examples", "--shots", shot_row)


def shot_row(row: dict) -> tuple[str, str]:
    """(problem, solution) of a worked example; ValueError says what the row lacks."""
    for field in ("problem", "solution"):
        if not isinstance(row.get(field), str) or not row[field].strip():
            raise ValueError(f"a worked example needs the fields problem and solution, non-empty strings; its {field} "
                             f"is {json.dumps(row.get(field), default=str)[:60]}")
    return row["problem"], row["solution"]


def _answer(value, field: str) -> str:
    """A gold answer as the grader reads it: a non-empty string, or a number written as one."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or not str(value).strip():
        raise ValueError(f"{field} is {json.dumps(value, default=str)[:60]}, not a non-empty string")
    return str(value)


def dapo_row(row: dict) -> tuple[str, str]:
    """(problem, gold) of a DAPO-Math-17k row; ValueError says what the row lacks."""
    need = "DAPO-Math-17k's fields prompt[0].content and reward_model.ground_truth"
    try:
        content, gold = row["prompt"][0]["content"], row["reward_model"]["ground_truth"]
    except (KeyError, IndexError, TypeError) as e:
        raise ValueError(f"a row needs {need} ({one_line(e)})") from e
    problem = dapo_problem(content) if isinstance(content, str) else ""
    if not problem:
        raise ValueError(f"a row needs {need}; its prompt[0].content holds no problem")
    return problem, _answer(gold, "reward_model.ground_truth")


def math500_row(row: dict) -> tuple[str, str]:
    """(problem, gold) of a MATH-500 row; ValueError says what the row lacks."""
    if "problem" not in row or "answer" not in row:
        missing = " and ".join(f for f in ("problem", "answer") if f not in row)
        raise ValueError(f"a row needs MATH-500's fields problem and answer; this one has no {missing}")
    if not isinstance(row["problem"], str) or not row["problem"].strip():
        raise ValueError("a row needs MATH-500's fields problem and answer; its problem is not a non-empty string")
    return row["problem"], _answer(row["answer"], "answer")


DATA_FILES = ("parquet", "jsonl", "json")  # in a folder, the first of these kinds found is read


def read_rows(source: str, what: str, option: str, convert=None) -> list:
    """The rows of a data set: a local file or folder (.parquet, .jsonl or .json), or a hub id
    whose files are already in the local Hugging Face cache (nothing is downloaded here).

    In a folder, the .parquet files are read if there are any, else the .jsonl, else the .json
    (the layouts of DAPO-Math-17k and MATH-500 as `hf download --local-dir` writes them).
    `convert(row)`, if given, maps each row (a dict) to what is returned, and raises ValueError
    for a row without the fields it needs; the refusal then names the row's file and line (or
    row). Each file must hold at least one row: an empty one is a failed copy more often than
    an intended part of the data set.
    """
    path = source
    if not os.path.exists(source):
        try:
            from huggingface_hub import snapshot_download

            path = snapshot_download(repo_id=source, repo_type="dataset", local_files_only=True)
        except Exception as e:  # not a hub id, or not in the cache
            raise TaskError(f"no {what} at {source} ({type(e).__name__}). Fetch it once with network access "
                            f"(hf download --repo-type dataset {source}) or pass {option} FILE_OR_FOLDER") from e
    files = [path]
    if os.path.isdir(path):
        for ext in DATA_FILES:  # files only: a folder named x.parquet (Spark's layout) is searched, not read
            files = sorted(f for f in glob.glob(os.path.join(glob.escape(path), "**", f"*.{ext}"), recursive=True)
                           if os.path.isfile(f))
            if files:
                break
        else:
            raise TaskError(f"{option} {source}: no .parquet, .jsonl or .json file in {path}")
    elif not path.endswith(tuple(f".{ext}" for ext in DATA_FILES)):
        raise TaskError(f"{option} {path}: not a .parquet, .jsonl or .json file (nor a folder of them)")
    rows = []
    for name in files:
        found = 0
        for where, row in _file_rows(name, option):
            if not isinstance(row, dict):
                raise TaskError(f"{option} {name} {where}: a JSON {_json_kind(row)} where a row (a JSON object, "
                                f"{{\"field\": value, ...}}) belongs")
            try:
                rows.append(row if convert is None else convert(row))
            except ValueError as e:
                raise TaskError(f"{option} {name} {where}: {e}") from e
            found += 1
        if not found:
            raise TaskError(f"{option} {name}: no rows in the file ({os.path.getsize(name)} bytes): copy it again, "
                            f"or remove it")
    return rows


def _file_rows(name: str, option: str):
    """(where, row) of each row of one data file: where is "line N" (.jsonl), "item N" (a .json
    array) or "row N" (.parquet), counted from 1. Every failure to read it is a TaskError."""
    try:
        if name.endswith(".parquet"):
            yield from _parquet_rows(name, option)
            return
        with open(name, "rb") as f:
            if name.endswith(".jsonl"):
                yield from _json_lines(name, f, option)
                return
            data = f.read()
    except OSError as e:  # no permission, a damaged disk, a file removed meanwhile
        raise _unreadable(option, name, e) from e
    try:
        text = data.decode("utf-8-sig")  # JSON is UTF-8; a leading byte-order mark is allowed
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise TaskError(f"{option} {name} line {line}: not UTF-8 text (byte {data[e.start]:#04x}): save the "
                        f"file as UTF-8") from e
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # JSON lines in a .json file (as the datasets library reads them)
            import io

            yield from _json_lines(name, io.BytesIO(data), option)
            return
        raise TaskError(f"{option} {name} line {e.lineno}: not valid JSON ({e.msg}, column {e.colno}): a .json "
                        f"file holds one array of rows, or one row") from e
    items = doc if isinstance(doc, list) else [doc]
    yield from ((f"item {i}", row) for i, row in enumerate(items, 1))


def _json_lines(name: str, f, option: str):
    """(line N, row) of each non-blank line of a JSON-lines file opened in binary mode: lines
    are decoded one at a time, so an error names its own line."""
    for n, raw in enumerate(f, 1):
        try:
            line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise TaskError(f"{option} {name} line {n}: not UTF-8 text (byte {raw[e.start]:#04x} at byte {e.start + 1} "
                            f"of the line): save the file as UTF-8") from e
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskError(f"{option} {name} line {n}: not valid JSON ({e.msg}, column {e.colno}): each line of a "
                            f"JSON-lines file is one row, a JSON object; fix or remove that line") from e
        yield f"line {n}", row


def _parquet_rows(name: str, option: str):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise TaskError(f"{name} is a parquet file: pip install pyarrow (in the gpu and test extras)") from e
    try:
        table = pq.read_table(name)
    except (pa.ArrowException, OSError) as e:  # ArrowInvalid for a truncated file ("magic bytes not found")
        if isinstance(e, OSError) and e.errno is not None:  # the file system's refusal, not the file's content
            raise _unreadable(option, name, e) from e
        raise TaskError(f"{option} {name}: not a readable parquet file ({one_line(e)}): a truncated or damaged "
                        f"copy? Fetch it again") from e
    yield from ((f"row {i}", row) for i, row in enumerate(table.to_pylist(), 1))


def _unreadable(option: str, name: str, e: OSError) -> TaskError:
    advice = ": make it readable for this user" if e.errno in (errno.EACCES, errno.EPERM) else ""
    return TaskError(f"{option} {name}: cannot be read ({one_line(e)}){advice}")


def _json_kind(value) -> str:
    """JSON's name for a parsed value's type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    return {list: "array", str: "string", int: "number", float: "number"}.get(type(value), type(value).__name__)


def dapo_problem(content: str) -> str:
    """The problem statement inside a DAPO-Math-17k prompt, without DAPO's answer-format lines."""
    text = content.strip()
    if text.startswith(DAPO_PREFIX):
        text = text.split("\n\n", 1)[-1]  # drops the instruction paragraph
    if text.endswith(DAPO_SUFFIX):
        text = text[: -len(DAPO_SUFFIX)]
    return text.strip()
