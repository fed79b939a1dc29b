"""bench/reading.py: its counts on a small module counted by hand, the window around train.py's
loop of updates, and the reference path on this tree consistent with the files it names."""

import ast
import importlib.util
import os
import sys

from subproc import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import reading  # noqa: E402  bench/reading.py

KNOWN = '''"""Module doc,
three lines,
here."""


def runs(x):
    """Doc of two
    lines."""
    y = [i for i in range(x)]
    return len(y)


def never():
    return 0


def deco(f):
    return f


class K:
    """Class doc."""

    @deco
    def method(self, x):
        # a comment
        return x + 1

    def other(self):
        return 2


def outer():
    def inner():
        return 1
    return inner
'''

LOOP = '''def helper(n):
    return n


def run():
    helper(0)
    for update in range(2):
        helper(update)
    return helper(9)
'''


def load(tmp_path, name, source):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # import-time code (deco, the class body) runs here, untraced
    return str(path), module


def test_the_counts_of_a_known_module_are_those_counted_by_hand(tmp_path):
    path, known = load(tmp_path, "known", KNOWN)
    _, other = load(tmp_path, "other", LOOP)  # not among the traced files: counts for nothing
    with reading.traced([path]) as ran:
        known.runs(3)
        known.K().method(1)
        known.outer()
        other.run()
    figures = reading.count(ran, str(tmp_path))
    assert list(figures) == ["known.py"]
    f = figures["known.py"]
    # By hand: runs is lines 6-10 (its docstring 7-8; its list comprehension counts in it),
    # K.method 24-27 (from its decorator; not the class line, its docstring or `other`),
    # outer 33-36 (inner never ran: no span of its own), the module docstring 1-3; never,
    # deco (import time only) and K.other are not read.
    assert [(e["name"], e["first"], e["last"], e["executed"]) for e in f["functions"]] == [
        ("runs", 6, 10, [9, 10]), ("K.method", 24, 27, [27]), ("outer", 33, 36, [34, 36])]
    assert f["read"] == 3 + 5 + 4 + 4 == len(f["read_lines"])
    assert f["read_lines"] == [1, 2, 3, 6, 7, 8, 9, 10, 24, 25, 26, 27, 33, 34, 35, 36]
    assert (f["docstrings"], f["module_docstring"], f["executed"], f["lines"]) == (2, 3, 5, 36)


def test_the_window_counts_only_the_loop_of_updates(tmp_path):
    path, loop = load(tmp_path, "loop", LOOP)
    window = reading.update_loop(path)
    assert window[1:] == ("run", 7, 8)
    with reading.traced([path], window) as ran:
        loop.run()
    f = reading.count(ran, str(tmp_path))["loop.py"]
    # helper ran before, inside and after the loop: only the calls inside count; of run, the
    # loop's own lines (7, 8); no module docstring.
    assert [(e["name"], e["executed"]) for e in f["functions"]] == [("helper", [2]), ("run", [7, 8])]
    assert (f["read"], f["executed"], f["module_docstring"]) == (2 + 5, 3, 0)


def test_the_reference_path_reads_the_method_files_it_names():
    figures = reading.reference(ROOT)
    assert {"sketch.py", "rowadam.py", "kl_control.py"} <= set(figures) <= set(reading.METHOD)
    for name, f in figures.items():
        assert f["read"] > 0 and f["executed"] > 0 and f["functions"], name
        source = open(os.path.join(ROOT, name)).read()
        text, doc = source.splitlines(), ast.parse(source).body[0]  # every method file opens with its docstring
        assert f["lines"] == len(text) and f["module_docstring"] == doc.end_lineno - doc.lineno + 1 > 0
        spans = set()
        for e in f["functions"]:
            assert 1 <= e["first"] <= e["last"] <= len(text), (name, e)
            assert text[e["first"] - 1].lstrip().startswith(("def ", "@", "async def ")) or "lambda" in text[
                e["first"] - 1], (name, e)
            for n in e["executed"]:  # a real line of code inside the span it is counted in
                assert e["first"] <= n <= e["last"], (name, e["name"], n)
                assert text[n - 1].strip() and not text[n - 1].lstrip().startswith("#"), (name, n)
            spans |= set(range(e["first"], e["last"] + 1))
        assert set(f["read_lines"]) == spans | set(range(doc.lineno, doc.end_lineno + 1)), name
        assert f["read"] == len(f["read_lines"]) >= f["executed"] == len({n for e in f["functions"]
                                                                          for n in e["executed"]})
    # issue 71's budget: at most a third of 38d926b's 2,143 lines (bench/README.md, `reading`)
    assert sum(f["read"] for f in figures.values()) <= 714, {name: f["read"] for name, f in figures.items()}
