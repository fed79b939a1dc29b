"""The reader's cost of one LoGRA update, counted: the lines of the method files a reader must read
to follow it (issue 71, item 5).

    python bench/reading.py                        # the reference path: per method file, the functions it runs
    python bench/reading.py --source               # and those lines themselves, '>' on the ones executed
    python bench/reading.py --train                # and train.py's one update, its infra/ lines apart
    python bench/reading.py --tree 38d926b --train --markdown   # beside 38d926b: bench/README.md's table

The reference path is the README's one-call form in a plain loop through the method files alone:
a Qwen2 built from a config (2 layers of width 64, random weights at std 0.2, 32 tokens), 8 rows
of 4 prompt and 6 response tokens, and then, traced: `kl_control.LoGRAOptimizer(model,
RowAdam(sketch.attach(model, seed=0)))`, ppo.py's loss (response_logprobs, policy_loss),
`loss.backward()`, `opt.step(ids, mask)`, `opt.zero_grad()`. `--train` runs `python train.py`
in this process for one update of its tiny preset (batch 8, no evaluation; the base policy copied
from tests/data as tests/conftest.py does, so that no warm-up runs) and counts only what runs
inside train.run's loop of updates: not the set-up, the base evaluation or the summary.
`--tree REV` measures REV too (`git archive` into a temporary folder, this script run there with
`--root`), so the table shows it beside this tree; the first REV sets the target.

The tracer is sys.settrace's: a frame is traced line by line only if its code lives in a method
file (sketch, rowadam, kl_control, sync, ppo, train.py; with --train also infra/), so torch,
transformers and the rest of site-packages count for nothing.

Counting rule. *Lines to read*, per file: the union of (1) the whole span of every function that
ran at least once, from its first decorator (or its `def`) to its last line (ast's end_lineno),
its docstring, blank lines and comments included; a comprehension or generator expression counts
as the function around it, a nested function by its own span (the union counts a line once), a
class only through its methods that ran (not its `class` line, docstring or other methods);
code run at import (module and class bodies) counts for nothing; and (2) the module docstring of
every file one of whose functions ran. *Executed*: the distinct lines that raised a line event.
"""

import argparse
import ast
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
METHOD = ("sketch.py", "rowadam.py", "kl_control.py", "sync.py", "ppo.py", "train.py")
TRAIN = ["--batch", "8", "--eval-problems", "16", "--eval-every", "0", "--no-eval-base", "--updates", "1"]


@contextlib.contextmanager
def traced(files, window=None):
    """sys.settrace's hook around the block; yields `ran`, {code object: the lines it executed},
    for code in `files` alone. `window`, (file, function, first, last): record only while that
    function's frame last stood on a line in [first, last] (train.py's loop of updates)."""
    files, known, ran, on = {os.path.realpath(f) for f in files}, {}, {}, [window is None]

    def hook(frame, event, arg):  # a call: trace the new frame line by line, or not at all
        code = frame.f_code
        if code.co_filename not in known:
            path = os.path.realpath(code.co_filename)
            known[code.co_filename] = path if path in files else None
        if known[code.co_filename] is None:
            return None
        lines, gate = ran.setdefault(code, set()), window and (known[code.co_filename], code.co_name) == window[:2]

        def local(frame, event, arg):
            if event == "line":
                if gate:
                    on[0] = window[2] <= frame.f_lineno <= window[3]
                if on[0]:
                    lines.add(frame.f_lineno)
            return local
        return local

    before = sys.gettrace(), threading.gettrace()
    threading.settrace(hook)
    sys.settrace(hook)
    try:
        yield ran
    finally:
        sys.settrace(before[0])
        threading.settrace(before[1])


def docstring(node) -> set:
    """The lines of `node`'s docstring (a module or a function), or none."""
    body = getattr(node, "body", None)
    first = body[0] if isinstance(body, list) and body else None  # a lambda's body is no list
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return set(range(first.lineno, first.end_lineno + 1))
    return set()


def functions(tree) -> list:
    """Every function and lambda of a parsed file: (name, first line (its first decorator's), last line, node)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            found.append((getattr(node, "name", "<lambda>"), first, node.end_lineno, node))
    return found


def function_of(code, found):
    """The function whose span a code object's lines count in: its own, or for a comprehension
    or generator expression the innermost one around it; None for import-time code."""
    if code.co_name.startswith("<") and code.co_name != "<lambda>":
        around = [f for f in found if f[1] <= code.co_firstlineno <= f[2]]
        return max(around, key=lambda f: f[1], default=None)
    return next((f for f in found if f[1] == code.co_firstlineno and f[0] == code.co_name), None)


def count(ran: dict, root: str) -> dict:
    """{file (from root): its figures} from `traced`'s `ran`, by the counting rule."""
    by_file = {}
    for code, lines in ran.items():
        if lines:
            by_file.setdefault(os.path.realpath(code.co_filename), []).append((code, lines))
    figures = {}
    for path, codes in sorted(by_file.items()):
        text = open(path).read()
        tree = ast.parse(text)
        found, ran_functions = functions(tree), {}
        for code, lines in codes:
            f = function_of(code, found)
            if f is None:
                continue  # a module or class body, run at import
            name = code.co_qualname.split(".<locals>.<")[0] if f[0] != code.co_name else code.co_qualname
            entry = ran_functions.setdefault(f[1], dict(name=name, first=f[1], last=f[2], executed=set(),
                                                        docstring=sorted(docstring(f[3]))))
            entry["executed"] |= lines
        if not ran_functions:
            continue
        module_doc = docstring(tree)
        read, docs = set(module_doc), set()
        for entry in ran_functions.values():
            read |= set(range(entry["first"], entry["last"] + 1))
            docs |= set(entry["docstring"])
            entry["executed"] = sorted(entry["executed"])
        figures[os.path.relpath(path, os.path.realpath(root))] = dict(
            functions=sorted(ran_functions.values(), key=lambda e: e["first"]), read=len(read),
            docstrings=len(docs - module_doc), module_docstring=len(module_doc),
            executed=len({n for e in ran_functions.values() for n in e["executed"]}), lines=len(text.splitlines()),
            read_lines=sorted(read))
    return figures


def reference(root: str = ROOT) -> dict:
    """The reference path's figures (module docstring): one update of the one-call form, traced."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, root)
    import kl_control
    import ppo
    import sketch
    from rowadam import RowAdam

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, initializer_range=0.2)).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32, (8, 10), generator=g)  # 4 prompt tokens, 6 response tokens a row
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 4:] = True
    advantages = torch.randn(8, generator=g)
    with traced([os.path.join(root, f) for f in METHOD]) as ran:
        opt = kl_control.LoGRAOptimizer(model, RowAdam(sketch.attach(model, seed=0)))
        logp = ppo.response_logprobs(model(input_ids=ids).logits, ids)
        loss, _ = ppo.policy_loss(logp, advantages, mask, num_tokens=int(mask.sum()))
        loss.backward()
        opt.step(ids, mask)
        opt.zero_grad()
    return count(ran, root)


def update_loop(path: str) -> tuple:
    """The loop of updates of train.py (`for update in ...`) as a window of `traced`."""
    for f in ast.walk(ast.parse(open(path).read())):
        if isinstance(f, ast.FunctionDef):
            for loop in ast.walk(f):
                if isinstance(loop, ast.For) and getattr(loop.target, "id", None) == "update":
                    return os.path.realpath(path), f.name, loop.lineno, loop.end_lineno
    raise LookupError(f"{path}: no loop `for update in ...`, the one update to count")


def train_update(root: str = ROOT) -> dict:
    """The figures of train.py's one update (module docstring), method files and infra/."""
    sys.path.insert(0, root)
    import train
    from infra import policy, tasks

    window = update_loop(os.path.join(root, "train.py"))
    files = [os.path.join(root, f) for f in METHOD]
    files += [os.path.join(root, "infra", f) for f in os.listdir(os.path.join(root, "infra")) if f.endswith(".py")]
    out = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = train.PRESETS["tiny"]  # tests/conftest.py's `runs`: the tiny preset's base policy for seed 0
        warmup = dict(steps=cfg.warmup_steps, batch=cfg.warmup_batch, lr=cfg.warmup_lr, unboxed=cfg.warmup_unboxed)
        cached = policy.base_policy_path(cfg.model, tasks.Arithmetic(0, cfg.eval_problems), os.path.join(tmp, "run"),
                                         preset="tiny", seed=0, warmup=warmup)
        shutil.copyfile(os.path.join(root, "tests", "data", "base-tiny-seed0.pt"), cached)
        os.environ["HF_HUB_OFFLINE"] = "1"
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), traced(files, window) as ran:
            train.main([*TRAIN, "--run-dir", os.path.join(tmp, "run")])
    if "base policy: loaded" not in out.getvalue():
        raise RuntimeError(f"train.py warmed its base policy up instead of loading tests/data's:\n{out.getvalue()}")
    return count(ran, root)


def measure(root: str, train: bool) -> dict:
    """{"reference": figures, "train": figures (with `train`), "seconds": {part: wall time}}."""
    result = {"seconds": {}}
    for part, run in [("reference", reference)] + [("train", train_update)] * train:
        t0 = time.time()
        result[part] = run(root)
        result["seconds"][part] = round(time.time() - t0, 1)
    return result


def git(*words) -> str:
    return subprocess.run(["git", "-C", ROOT, *words], capture_output=True, text=True, check=True).stdout.strip()


def measure_tree(rev: str, train: bool) -> dict:
    """REV's figures: its files from `git archive`, this script run there with --root."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", ROOT, "archive", rev], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1")
        ran = subprocess.run([sys.executable, os.path.abspath(__file__), "--root", tmp] + ["--train"] * train,
                             capture_output=True, text=True, env=env, cwd=tmp)
        if ran.returncode:
            raise RuntimeError(f"measuring {rev} failed:\n{ran.stdout}\n{ran.stderr}")
        return json.loads(ran.stdout.splitlines()[-1])


def listing(figures: dict, source: bool) -> None:
    """Per file, the functions that ran (span, lines executed); with `source` the lines to read."""
    for f, v in figures.items():
        print(f"{f}: {v['read']} lines to read, {v['executed']} executed, module docstring {v['module_docstring']}")
        for e in v["functions"]:
            print(f"    {e['name']:44} {e['first']:5}-{e['last']:<5} {len(e['executed'])} executed")
        executed = {n for e in v["functions"] for n in e["executed"]}
        text = open(os.path.join(ROOT, f)).read().splitlines() if source else []
        for n in v["read_lines"] if source else []:
            print(f"  {'>' if n in executed else ' '} {n:5} {text[n - 1]}")


def rows(results: dict, part: str) -> list:
    """Table rows: a file's row for every tree side by side, then each tree's totals (method
    files; infra/ apart)."""
    order = lambda f: (f.startswith("infra"), METHOD.index(f) if f in METHOD else 0, f)
    cells = lambda v: [len(v["functions"]), v["read"], v["docstrings"], v["module_docstring"], v["executed"]]
    out = [[f"`{f}`", label, *cells(res[part][f]), res[part][f]["lines"]] if f in res[part] else
           [f"`{f}`", label, "not run"] for f in sorted({f for r in results.values() for f in r[part]}, key=order)
           for label, res in results.items()]
    for group in ("method files", "infra/") if part == "train" else ("method files",):
        for label, res in results.items():
            figures = [v for f, v in res[part].items() if f.startswith("infra") == (group == "infra/")]
            out.append([f"**{group}**", label, *(f"**{sum(c)}**" for c in zip(*map(cells, figures))),
                        sum(v["lines"] for v in figures)])
    return out


def tables(results: dict, here: str, train: bool) -> str:
    """The Markdown: the reference path's table, the target, train.py's table."""
    import report
    header = ["file", "tree", "functions run", "lines to read", "of which function docstrings", "module docstring",
              "lines executed", "lines in file"]
    took = lambda part: ", ".join(f"{label} {r['seconds'][part]} s" for label, r in results.items())
    total = lambda r: sum(v["read"] for v in r["reference"].values())
    text = ("The lines a reader must read to follow one LoGRA update (the rule: bench/reading.py's docstring): per "
            "file, the whole span of every function that ran (its docstring, blanks and comments included; a class "
            "only through its methods that ran) and the module docstring; lines executed: the distinct lines that "
            "ran. The reference path: the README's one-call form (LoGRAOptimizer, ppo.py's loss, backward, step, "
            f"zero_grad) on a 2-layer width-64 Qwen2 from a config, batch 8, one update ({took('reference')}).\n\n"
            + report.table(header, rows(results, "reference")))
    if len(results) > 1:
        first, base = next(iter(results.items()))
        text += (f"\n\nTarget (issue 71): the reference path at most a third of {first}'s {total(base)} lines, "
                 f"{total(base) // 3}; {here}: {total(results[here])}"
                 f" ({'met' if total(results[here]) <= total(base) // 3 else 'not met'}).")
    if train:
        text += ("\n\ntrain.py's update by the same rule: one update of `python train.py " + " ".join(TRAIN) + "` (the "
                 "tiny preset: LoGRA, factor sync, its HF engine, one process; the base policy from tests/data), "
                 f"counted inside train.run's loop of updates only, infra/ apart ({took('train')}).\n\n"
                 + report.table(header, rows(results, "train")))
    return text


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", action="store_true", help="also train.py's one update of its tiny preset (infra/ apart)")
    p.add_argument("--tree", action="append", default=[], metavar="REV",
                   help="also measure REV (the first one sets the target)")
    p.add_argument("--source", action="store_true", help="print the lines to read ('>': executed)")
    p.add_argument("--root", help=argparse.SUPPRESS)  # --tree's subprocess: measure the tree there, print JSON
    if "--root" in sys.argv:  # report.py would put this tree's infra/ before that tree's: not imported
        args = p.parse_args()
        print(json.dumps(measure(os.path.realpath(args.root), args.train)))
        return
    import report  # bench/report.py: its import starts the block's cost clock
    args = report.parse_args(p, "reading")
    results = {f"`{git('rev-parse', '--short', rev)}`": measure_tree(rev, args.train) for rev in args.tree}
    mine = measure(ROOT, args.train)
    dirty = git("status", "--porcelain", "--", *{f for part in ("reference", "train") for f in mine.get(part, {})})
    here = f"this tree ({git('rev-parse', '--short', 'HEAD')}{' + changes' if dirty else ''})"
    results[here] = mine
    for part in ("reference", "train") if args.train else ("reference",):
        print(f"\n{dict(reference='the reference path', train='train.py: its loop of updates')[part]}, {here}:")
        listing(mine[part], args.source)
    print("\n" + tables(results, here, args.train))
    if args.markdown:
        report.publish("reading", tables(results, here, args.train))


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    main()
