"""
infra/tasks.py: what the policy is asked and how its answers are graded.

What it is
----------
Three tasks with one interface: `train_problem(index)` (a pure function of the run's seed and
the index, so every rank and every resume draws the same problems), `prompt_ids(problems)`,
`correct(problem, response_ids)` (True/False, or a score in [0, 1]), `heldout` (the evaluation
problems), `eos` and `pad`.

- `MathTask`: the paper's task (Table 1's setup, arXiv:2610.06647): DAPO-Math-17k problems for
  training and MATH-500 for evaluation, the Qwen-Math system prompt "Please reason step by
  step, and put your final answer within \\boxed{}." through the tokenizer's chat template
  (`ChatTask`), graded with math-verify (`grade`), or with `--grader number` by `grade_number`:
  right only when the last boxed answer is exactly the integer asked for, for data whose
  answers are plain integers (an expression restating the question's operands passes
  math-verify, which equates it with its value). Its data and its tokenizer are read by
  task_data.py (`task_data.chat_task` builds a chat task from a checkpoint's files).
- `GymTask`: the task of the paper's 27B long run, a Reasoning Gym "Hard" mixture (the paper
  does not list its own; `GYM_HARD` says how this one is chosen): problems made by the
  `reasoning-gym` package's generators (`gym_mixture`; each task at a level of its curriculum,
  `gym_dataset`), scored by their own verifiers, through the same chat template with the
  package's system prompt.
- `Arithmetic`: two-digit additions ("37+45=" -> "\\boxed{82}"), a character tokenizer made
  here, graded exactly; the tiny CPU task. `warmup` trains a model on it by supervised
  learning to make a base policy that is sometimes right, as the paper starts RL from a
  pretrained model: a share of its examples (`unboxed`) answer without the box the grader
  requires, so the base policy often fails the format, as pretrained models do, and the
  format is what RL has to learn.

Errors are `TaskError`, one line that says what to do (which option, which download).

What is refused
---------------
A tokenizer the chat tasks cannot prompt through (`ChatTask`): one that names no EOS token,
that encodes a probe question to no tokens (or to one id repeated, as a vocabulary of only an
unknown token does), that has no chat template, or whose template renders a prompt to no
tokens; a Reasoning Gym mixture that names no task of the package, or whose problems never fit
the prompt budget. The data files and the tokenizer's files are checked as they are read
(task_data.py), all before a model or an engine is loaded.

Departures, numbered
--------------------
1. math-verify reads the gold answer wrapped in $...$ (bare LaTeX such as [1,3) or \\sqrt{2}
   is otherwise not parsed as LaTeX); the paper grades with math-verify's parse and verify.
2. DAPO-Math-17k's problems are deduplicated and its answer-format lines dropped (task_data.py,
   its departure 1).
3. A Reasoning Gym scorer that raises on a malformed answer (prime_factorization's on words)
   scores it 0, as a wrong answer, rather than stopping the run.
"""

import hashlib
import math
import random
import re

import torch

from infra.errors import RunError


class TaskError(RunError):
    """Missing or malformed task data; the message is one line that says what to do."""


CHAT_TASKS = ("math", "reasoning-gym")  # the tasks of a chat checkpoint (the tiny one: "arithmetic")


# -----------------------------------------------------------------------------
# The paper's task: DAPO-Math-17k, MATH-500, math-verify

SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."


class ChatTask:
    """Prompts through the checkpoint's own chat template: a system prompt, then the problem.

    A template without a system role (Gemma's refuses it) gets the system prompt folded into
    the user turn, before the problem; a tokenizer without a chat template is refused (a base
    model's plain-text format is not guessed), as is one without an EOS token or whose
    vocabulary encodes a question to nothing (`PROBE`). `stop_ids`: the token ids that end a response
    (task_data.generation_stop_ids: the checkpoint's generation config, where Llama 3 lists several).
    A subclass gives `system`, `train_problem`, `question(problem)` and `correct`; `shots`,
    worked examples as (question, solution) pairs, go before every question as earlier user and
    assistant turns (a few-shot prompt: a small model copies the form of its own earlier turns,
    where an example inside the question is answered or copied instead, bench/README.md's
    `strict_prompts`)."""

    system = ""
    shots = ()  # (question, solution) pairs: the earlier turns of every prompt
    PROBE = "What is $1+1$?"  # a question any tokenizer of a chat model encodes to several distinct ids

    def __init__(self, tokenizer, stop_ids=None):
        self.tokenizer = tokenizer
        self.pad, self.eos = tokenizer.pad_token_id, tokenizer.eos_token_id
        self.stop_ids = stop_ids if stop_ids is not None else [tokenizer.eos_token_id]
        name = tokenizer.name_or_path
        # train.py pads rollouts with the EOS id, and the vLLM engine pads with it when the
        # tokenizer has no pad token: without one the first update would fail, not start.
        if self.eos is None:
            raise TaskError(f"the tokenizer of {name} names no EOS token: set eos_token in its tokenizer_config.json "
                            f"(the token that ends the model's turn, e.g. <|im_end|> for Qwen)")
        # A tokenizer built without its vocabulary loads without an error (transformers 5) and
        # encodes text to nothing; vLLM would only refuse the empty prompts after its start.
        probe = tokenizer.encode(self.PROBE, add_special_tokens=False)
        if not probe or (len(probe) > 1 and len(set(probe)) == 1):
            raise TaskError(f"the tokenizer of {name} encodes {self.PROBE!r} to {probe or 'no tokens'}: its vocabulary "
                            f"is missing or empty; copy tokenizer.json (or its vocabulary files) again from the "
                            f"checkpoint's source")
        if not getattr(tokenizer, "chat_template", None):
            raise TaskError(f"the tokenizer of {name} has no chat template: use an instruct (chat) "
                            f"checkpoint, or set tokenizer.chat_template in its tokenizer_config.json")
        from jinja2.exceptions import TemplateError

        # A template that refuses the system role raises (Gemma's); one that drops it renders
        # without it (some Phi-3 revisions): either way the instruction goes into the user turn.
        self.system_role = True
        try:
            kept = self.system in self._template(self.PROBE, tokenize=False)
        except TemplateError:
            kept = False
        if not kept:
            self.system_role = False
            try:
                self._template(self.PROBE, tokenize=False)
            except TemplateError as e:
                raise TaskError(f"the chat template of {name} fails on a system and a user turn, "
                                f"and on a user turn alone ({one_line(e)})") from e
        if not self._template(self.PROBE):  # vLLM refuses an empty prompt ("The decoder prompt cannot be empty")
            raise TaskError(f"the chat template of {name} renders a prompt of {self.PROBE!r} to no tokens: fix "
                            f"chat_template in its tokenizer_config.json (or chat_template.jinja)")

    def messages(self, problem: str) -> list[dict]:
        turns = [{"role": role, "content": text} for shot in self.shots
                 for role, text in zip(("user", "assistant"), shot)] + [{"role": "user", "content": problem}]
        if self.system_role:
            return [{"role": "system", "content": self.system}, *turns]
        return [{"role": "user", "content": f"{self.system}\n\n{turns[0]['content']}"}, *turns[1:]]

    def _template(self, problem: str, tokenize=True):
        out = self.tokenizer.apply_chat_template(self.messages(problem), add_generation_prompt=True,
                                                 tokenize=tokenize, return_dict=False)
        return [int(i) for i in out] if tokenize else out

    def decode(self, response_ids) -> str:
        """A response as its grader reads it (special tokens dropped)."""
        return self.tokenizer.decode(response_ids, skip_special_tokens=True)

    def prompt_ids(self, problems) -> list[list[int]]:
        """Token ids of the chat prompt. `return_dict=False`: since transformers 5,
        `tokenize=True` alone returns a BatchEncoding (a dict), not the list of ids."""
        return [self._template(self.question(p)) for p in problems]


class MathTask(ChatTask):
    """The paper's prompts (its system prompt, then the problem); a response is right when its
    grader accepts its final answer: math-verify (`grade`, the paper's) or, with
    `grader="number"`, `grade_number` (a boxed integer and nothing else). Problems are
    (problem, gold) pairs; `shots`: worked examples before each (ChatTask)."""

    system = SYSTEM_PROMPT

    def __init__(self, tokenizer, train, heldout, seed, stop_ids=None, grader=None, shots=()):
        self.shots = tuple(shots)  # before the template's checks, which then render them too
        super().__init__(tokenizer, stop_ids)
        if grader not in GRADERS:
            raise TaskError(f"grader {grader!r}: one of {', '.join(g for g in GRADERS if g)} (--grader)")
        if grader == "number":  # every gold answer an integer as written, or the grader could never pay
            bad = next((p for p in (*train, *heldout) if not INTEGER.fullmatch(str(p[1]).strip())), None)
            if bad is not None:
                raise TaskError(f"--grader number needs integer answers, and the problem {bad[0][:60]!r} has the "
                                f"answer {str(bad[1])[:40]!r}: use --grader math-verify for this data")
        self.train, self.heldout, self.seed = train, heldout, seed
        self.grade = GRADERS[grader]

    def train_problem(self, index: int):
        """An epoch-wise shuffle of the deduplicated training set, a pure function of the index."""
        epoch, i = divmod(index, len(self.train))
        order = list(range(len(self.train)))
        random.Random(f"math:{self.seed}:{epoch}").shuffle(order)
        return self.train[order[i]]

    @staticmethod
    def question(problem) -> str:
        return problem[0]

    def correct(self, problem, response_ids) -> bool:
        return self.grade(self.decode(response_ids), problem[1])


def grade(prediction: str, gold: str) -> bool:
    """math-verify: is the response's final answer equal to the gold answer?

    The gold answer is wrapped in $...$ so that bare LaTeX (`\\sqrt{2}`, `[1,3)`) is read as
    LaTeX (departure 1); the prediction is parsed as generated (its last \\boxed{} counts).
    """
    from math_verify import parse, verify

    try:
        return bool(verify(parse(f"${gold}$"), parse(prediction)))
    except Exception:  # a parse or sympy failure is a wrong answer, not a crash of the run
        return False


BOXED = "\\boxed{"
INTEGER = re.compile(r"[+-]?[0-9]+")  # an integer as written: an optional sign, then digits only


def last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` of `text`, its braces matched (`\\boxed{\\frac{1}{2}}`
    holds `\\frac{1}{2}`), or None when there is none or the last one is never closed."""
    start = text.rfind(BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def grade_number(prediction: str, gold) -> bool:
    """A response is right only when its last `\\boxed{...}` holds exactly an integer (an optional
    sign and digits, spaces around them trimmed) equal to the integer `gold`. Wrong: no boxed
    answer, an expression (`7 \\cdot 8`, `0 + 7`, restated operands), a fraction or a decimal, a
    number among words, and an earlier right answer followed by a different boxed one.

    For the tasks whose answers are integers given plainly, where math-verify, which equates an
    expression with its value, would pay a policy for boxing the question's own operands."""
    inside = last_boxed(prediction)
    answer = None if inside is None else inside.strip()
    return answer is not None and INTEGER.fullmatch(answer) is not None and int(answer) == int(str(gold).strip())


GRADERS = {None: grade, "math-verify": grade, "number": grade_number}  # --grader; None: the paper's


def one_line(e: BaseException) -> str:
    """`Type: first line of the message` of an exception, for a refusal of one line (a parser's
    message can run over several lines)."""
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else ""
    text = text if len(text) <= 200 else text[:200] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# -----------------------------------------------------------------------------
# The 27B long run's task: Reasoning Gym's generators and verifiers

# The paper does not list its Reasoning-Gym "Hard" mixture. This one draws on the package's
# categories (its folders) at level 2 of the package's own curricula (0 is the easiest; most
# tasks define 4 or 5 levels), keeping the tasks that have a curriculum, whose gold answers
# their own scorer accepts (tests/test_tasks.py checks it), whose level-2 questions stay under
# 2,000 characters (a prompt well inside the paper's 4096-token context, 3072 of them for the
# response) and whose generators never took more than 0.4 s over 1,000 problems at random
# training indices (the slowest: puzzle24, polynomial_equations, ~0.3 s). Left out on those
# grounds, e.g.: propositional_logic and graph_color (their answer field is not an answer their
# scorer accepts), countdown and zebra_puzzles (0.2 s a problem on average), maze and
# circuit_logic (questions of 9,000-25,000 characters), and every cognition task:
# number_sequence's generator ran for minutes on one problem (in one call that a signal could
# not interrupt), the others' questions are longer or their answers do not score 1.
GYM_HARD = ("basic_arithmetic", "chain_sum", "leg_counting", "prime_factorization", "decimal_arithmetic",  # arithmetic
            "simple_equations", "complex_arithmetic", "polynomial_equations",  # algebra
            "letter_counting", "spell_backward", "cryptarithm", "base_conversion",  # algorithmic
            "knights_knaves", "syllogism", "self_reference", "aiw",  # logic
            "mini_sudoku", "puzzle24",  # games
            "family_relationships", "quantum_lock",  # graphs
            "advanced_geometry", "arc_1d")  # geometry, arc
GYM_MIXTURES = {"hard": GYM_HARD}
GYM_INDICES = 2**31  # each generator's problems: indices 0.. (its own seed + index seeds a problem)
GYM_EVAL_INDICES = 2**20  # held-out problems are drawn below, training problems above


def gym_mixture(spec: str) -> tuple:
    """((task, weight), ...) of `--gym-tasks`: a mixture's name (GYM_MIXTURES) or
    NAME[:WEIGHT],... (weight 1 when left out). Read without the package: check_gym_tasks
    checks the names against its registry."""
    if spec in GYM_MIXTURES:
        return tuple((name, 1.0) for name in GYM_MIXTURES[spec])
    mixture = []
    for part in spec.split(","):
        name, _, weight = part.strip().partition(":")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            w = float("nan")
        if not name or not (w > 0 and w != float("inf")) or name in dict(mixture):
            raise TaskError(f"--gym-tasks {spec}: give {' or '.join(GYM_MIXTURES)}, or distinct Reasoning Gym task "
                            f"names, each with an optional :WEIGHT > 0 (e.g. chain_sum,knights_knaves:2)")
        mixture.append((name, w))
    return tuple(mixture)


def check_gym_tasks(names) -> None:
    """Every name is one of the installed package's tasks (TaskError names the first that is not)."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        raise TaskError("--task reasoning-gym needs the reasoning-gym package: pip install -e '.[gym]'") from e
    for name in names:
        if name not in DATASETS:
            raise TaskError(f"--gym-tasks: {name!r} is not a Reasoning Gym task (its {len(DATASETS)} tasks: "
                            f"reasoning_gym.factory.DATASETS; e.g. {', '.join(sorted(DATASETS)[:4])})")


def gym_dataset(name: str, level: int, seed: int):
    """One Reasoning Gym generator: its curriculum at `level` (every attribute's level, clipped
    at the attribute's highest), or its defaults if it has no curriculum; seeded by (seed, name)."""
    check_gym_tasks([name])
    from reasoning_gym.factory import CURRICULA, DATASETS, create_curriculum

    dataset_cls, config_cls = DATASETS[name]
    task_seed = int.from_bytes(hashlib.sha256(f"gym:{seed}:{name}".encode()).digest()[:4], "little")
    if name in CURRICULA:
        curriculum = create_curriculum(name)
        curriculum.set_global_level(level)
        config = curriculum.generate_configuration({"seed": task_seed, "size": GYM_INDICES})
    else:
        config = config_cls(seed=task_seed, size=GYM_INDICES)
    return dataset_cls(config)


class GymTask(ChatTask):
    """Reasoning Gym (the `reasoning-gym` package): procedural problems from a mixture of its
    generators, each response scored by its generator's own verifier. Nothing is downloaded.

    The prompt is the package's default system prompt (reasoning_gym.utils.SYSTEM_PROMPTS,
    which asks for the answer in <answer></answer> tags), then the question; the answer is
    read with the package's extract_answer (the last <answer>...</answer>) and scored by the
    generator's score_answer, a number in [0, 1] (1 for a right answer; some tasks give partial
    credit or a format score), which is the reward (ppo.outcome_reward). Problems are
    (task name, entry) pairs, entry the generator's dict (question, answer, metadata).

    Every draw is a pure function of (seed, index): the task from the mixture's weights, then
    one of its generator's problems. Held-out problem k is drawn from the generators' indices
    below GYM_EVAL_INDICES, training problems from the indices above, and a training problem
    whose question is a held-out one's is drawn again, so the two never overlap. A problem
    whose prompt is longer than `max_prompt_tokens` (the context less the response's tokens)
    is drawn again too: a long run never stops on one long problem, and a mixture that cannot
    fit is refused (TaskError)."""

    DRAWS = 1000  # draws of one problem before a mixture is refused as not fitting

    def __init__(self, tokenizer, mixture, *, level: int, seed: int, heldout: int, max_prompt_tokens=None,
                 stop_ids=None):
        from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

        self.system, self.extract_answer = SYSTEM_PROMPTS["default"], extract_answer
        super().__init__(tokenizer, stop_ids)
        self.names, self.weights = zip(*mixture)
        self.seed, self.level, self.max_prompt_tokens = seed, level, max_prompt_tokens
        self.datasets = {name: gym_dataset(name, level, seed) for name in self.names}
        self._heldout_questions = set()
        self.heldout = [self._draw(f"gym-eval:{seed}:{k}", 0, GYM_EVAL_INDICES) for k in range(heldout)]
        self._heldout_questions = {entry["question"] for _, entry in self.heldout}

    def _draw(self, key: str, low: int, high: int):
        rng = random.Random(key)
        for _ in range(self.DRAWS):
            name = rng.choices(self.names, weights=self.weights)[0]
            entry = self.datasets[name][rng.randrange(low, high)]
            if entry["question"] in self._heldout_questions:
                continue
            if self.max_prompt_tokens is None or len(self._template(entry["question"])) <= self.max_prompt_tokens:
                return name, entry
        raise TaskError(f"--gym-tasks {','.join(self.names)} at --gym-level {self.level}: {self.DRAWS} problems drawn "
                        f"and none has a prompt of at most {self.max_prompt_tokens} tokens (--context less "
                        f"--max-new-tokens): raise --context, or give shorter tasks or a lower level")

    def train_problem(self, index: int):
        """The index-th training problem: a pure function of (seed, index)."""
        return self._draw(f"gym-train:{self.seed}:{index}", GYM_EVAL_INDICES, GYM_INDICES)

    @staticmethod
    def question(problem) -> str:
        return problem[1]["question"]

    def correct(self, problem, response_ids) -> float:
        name, entry = problem
        answer = self.extract_answer(self.decode(response_ids))
        try:
            score = float(self.datasets[name].score_answer(answer, entry))
        except Exception:  # a scorer that fails on a malformed answer: a wrong answer, not a crash (departure 3)
            return 0.0
        return min(max(score, 0.0), 1.0) if math.isfinite(score) else 0.0


# -----------------------------------------------------------------------------
# The tiny task: two-digit additions, and the warm-up that makes its base policy

class Arithmetic:
    """Problems "ab+cd=" (a, b in 0..99, 10,000 of them), answers "\\boxed{n}", graded exactly."""

    SPECIALS = ("<pad>", "<bos>", "<eos>", "\\boxed{")
    # "-" is no answer's character: it stays because the vocabulary's size sets the model's
    # initialisation, and the tiny preset's tuning and figures were made with it (dropping it,
    # and the operator's draw in train_problem, gave seed 0 a base policy of Pass@1 0.14, not 0.32).
    CHARS = "0123456789+-=}"
    PROMPT_TOKENS = 7  # <bos> and "ab+cd="
    PROBLEMS = 100 * 100  # every (a, "+", b): the held-out ones and the training ones
    # Part of the cache key of a warmed-up base policy (the caller's cache): changed
    # whenever the problems, the vocabulary or the warm-up change, so that no stale one is loaded.
    VERSION = 1

    def __init__(self, seed: int, heldout: int):
        self.vocab = list(self.SPECIALS) + list(self.CHARS)
        self.index = {t: i for i, t in enumerate(self.vocab)}
        self.pad, self.bos, self.eos = 0, 1, 2
        self.seed = seed
        # Held-out problems: a fixed sample of the 10,000, never drawn for training.
        rng = random.Random(f"heldout:{seed}")
        every = [(a, "+", b) for a in range(100) for b in range(100)]
        self.heldout = rng.sample(every, heldout)
        self._heldout_set = set(self.heldout)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            if text.startswith("\\boxed{", i):
                out.append(self.index["\\boxed{"])
                i += len("\\boxed{")
            else:
                out.append(self.index[text[i]])
                i += 1
        return out

    def decode(self, ids) -> str:
        return "".join(self.vocab[i] if i < len(self.vocab) else "?" for i in ids if i > self.eos)

    @staticmethod
    def prompt(problem) -> str:
        a, op, b = problem
        return f"{a:02d}{op}{b:02d}="

    question = prompt  # what the held-out evaluation's samples show (engine.evaluate), as the chat tasks'

    @staticmethod
    def answer(problem) -> int:
        a, _, b = problem
        return a + b

    def train_problem(self, index: int):
        """The index-th training problem: a pure function of (seed, index)."""
        rng = random.Random(f"train:{self.seed}:{index}")
        while True:
            p = (rng.randrange(100), rng.choice("+"), rng.randrange(100))  # the operator's draw: see CHARS
            if p not in self._heldout_set:
                return p

    def prompt_ids(self, problems) -> list[list[int]]:
        return [[self.bos] + self.encode(self.prompt(p)) for p in problems]

    def correct(self, problem, response_ids) -> bool:
        """The last \\boxed{...} of the response must hold exactly the answer."""
        text = self.decode(response_ids)
        start = text.rfind("\\boxed{")
        if start < 0 or not text.endswith("}"):
            return False
        return text[start + len("\\boxed{"):-1] == str(self.answer(problem))


def warmup(model, task: Arithmetic, *, steps: int, batch: int, lr: float, unboxed: float, seed: int, progress=None):
    """Supervised warm-up on correct answers, in place: AdamW (no weight decay) with a cosine
    learning rate from `lr` to 0 over `steps` batches of `batch` training problems drawn from
    negative indices (never the ones RL draws). A share `unboxed` of the answers lacks the box
    the grader requires (the module docstring says why). Leaves the model in eval mode.
    `progress()`, if given, is called after every step."""
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step in range(steps):
        first = -1 - step * batch
        problems = [task.train_problem(first - i) for i in range(batch)]
        coin = random.Random(f"warmup-format:{seed}:{step}")
        answers = [f"{task.answer(p)}" if coin.random() < unboxed else f"\\boxed{{{task.answer(p)}}}"
                   for p in problems]
        seqs = [[task.bos] + task.encode(task.prompt(p) + a) + [task.eos] for p, a in zip(problems, answers)]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [task.pad] * (width - len(s)) for s in seqs], device=device)  # (B, T)
        labels = ids.clone()
        labels[:, :task.PROMPT_TOKENS] = -100  # the prompt is given, not learned
        labels[ids == task.pad] = -100
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        for group in opt.param_groups:  # lr_t = lr * (1 + cos(pi t / steps)) / 2
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if progress is not None:
            progress()
    model.eval()
