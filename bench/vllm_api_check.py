"""Which vLLM releases the project works with, read from their wheels without installing them:
every vLLM module, class, function and keyword argument the project uses (`USES`, the one list
of them), looked up in each wheel's source, versions x symbols.

    pip download --no-deps vllm==0.23.0 -d WHEELS      # a wheel per version (no install; its deps not needed)
    python bench/vllm_api_check.py WHEELS/vllm-*.whl [--markdown]

A wheel is a zip: its `vllm/**.py` files are parsed (ast), never imported, so that a wheel built
for CUDA 13 and torch 2.14 is read on a CPU machine with torch 2.13. A symbol is followed
through the re-exports vLLM uses (`from x import Y` at module level, also under `if
TYPE_CHECKING:`, and the lazy `MODULE_ATTRS = {"Y": ".x:Y"}` table of `vllm/__init__.py`). A
call is checked against what the callee accepts: a function's parameters; a class's
`__init__`, or its fields when it is a dataclass or a msgspec Struct (annotated names, those
without a default required); a `**kwargs` that `LLM` forwards to `EngineArgs` is checked
against EngineArgs' fields. Each cell says `ok`, `missing` (the name is not found), `no X`
(a keyword the project passes is not accepted) or `needs X` (a parameter the project does not
pass has no default). What this cannot see: attributes of objects made at run time (the worker
extension's `self.model_runner.model`), values (`logprobs_mode="processed_logprobs"`), behaviour.

Block `vllm_api` in bench/README.md: the table for the wheels given. pyproject's `gpu` extra
states the range whose every cell is `ok`.
"""

import argparse
import ast
import dataclasses
import os
import re
import sys
import zipfile

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)


@dataclasses.dataclass(frozen=True)
class Use:
    """A vLLM symbol the project uses: its dotted path (module, then attributes), the keywords
    the project passes when it calls it, and where in the project."""
    path: str
    keywords: tuple = ()
    where: str = ""
    forwards: str = ""  # the class whose fields a **kwargs of this callable is forwarded to
    positional: int = 0  # arguments the project passes by position, first


# Every vLLM name the project touches (infra/vllm_serve.py, infra/vllm_channel.py), once.
USES = (
    Use("vllm.LLM", ("model", "dtype", "max_model_len", "seed", "enable_prefix_caching", "gpu_memory_utilization",
                     "max_num_seqs", "max_num_batched_tokens", "worker_extension_cls", "skip_tokenizer_init",
                     "enforce_eager", "logprobs_mode"), "vllm_serve.serve", "vllm.engine.arg_utils.EngineArgs"),
    Use("vllm.LLM.generate", ("use_tqdm",), "vllm_serve.serve", positional=2),
    Use("vllm.LLM.collective_rpc", ("args",), "vllm_serve.serve", positional=1),
    Use("vllm.LLM.reset_prefix_cache", (), "vllm_serve.serve"),
    Use("vllm.LLM.get_tokenizer", (), "vllm_serve.serve"),
    Use("vllm.SamplingParams", ("temperature", "top_p", "max_tokens", "logprobs", "seed", "stop_token_ids",
                                "detokenize"), "vllm_serve.serve"),
    Use("vllm.inputs.TokensPrompt", ("prompt_token_ids",), "vllm_serve.serve"),
    Use("vllm.distributed.utils.StatelessProcessGroup", ("rank", "world_size", "store"), "vllm_channel.WeightChannel"),
    Use("vllm.distributed.device_communicators.pynccl.PyNcclCommunicator", ("device",),
        "vllm_channel.WeightChannel", positional=1),
    Use("vllm.distributed.device_communicators.pynccl.PyNcclCommunicator.broadcast", ("src", "stream"),
        "vllm_channel.WeightChannel.broadcast", positional=1),
    Use("vllm.distributed.device_communicators.pynccl_wrapper.NCCLLibrary.ncclCommAbort", (),
        "vllm_channel.WeightChannel.abort", positional=1),
    Use("vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm", ("remove_weight",),
        "vllm_serve._refresh_cpu_kernels", positional=1),
)


class WheelError(RuntimeError):
    """A file that is not a vLLM wheel; the message names it."""


class Wheel:
    """The `vllm/**.py` sources of one wheel, parsed on demand."""

    def __init__(self, path: str):
        self.path = path
        try:
            with zipfile.ZipFile(path) as z:
                self.files = {n: z.read(n) for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")}
        except (zipfile.BadZipFile, OSError) as e:
            raise WheelError(f"{path} cannot be read as a wheel ({e})") from None
        if "vllm/__init__.py" not in self.files:
            raise WheelError(f"{path} holds no vllm package")
        found = re.search(r"vllm(_cpu)?-([0-9][^-]*)-", os.path.basename(path))
        self.version = (("cpu " if found.group(1) else "") + found.group(2)) if found else os.path.basename(path)
        self._trees = {}

    def module(self, dotted: str):
        """The parsed module `dotted` (a.b: a/b.py or a/b/__init__.py), or None."""
        for name in (dotted.replace(".", "/") + ".py", dotted.replace(".", "/") + "/__init__.py"):
            if name in self.files:
                if name not in self._trees:
                    self._trees[name] = ast.parse(self.files[name])
                return self._trees[name]
        return None

    def lookup(self, dotted: str, depth: int = 0):
        """The ast node (ClassDef or FunctionDef) that `dotted` names, through re-exports; None."""
        parts = dotted.split(".")
        for cut in range(len(parts) - 1, 0, -1):  # the longest module prefix
            tree = self.module(".".join(parts[:cut]))
            if tree is not None:
                node = self._in_module(".".join(parts[:cut]), tree, parts[cut], depth)
                for attr in parts[cut + 1:]:
                    node = _member(node, attr)
                return node
        return None

    def _in_module(self, module: str, tree, name: str, depth: int):
        if depth > 8:
            return None
        for node in _top_level(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return node
        for node in _top_level(tree):  # `from x import name`, `from .x import name as name`
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return self.lookup(f"{_absolute(module, node)}.{alias.name}", depth + 1)
        for node in _top_level(tree):  # vllm/__init__.py's lazy table: {"LLM": ".entrypoints.llm:LLM"}
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
                for key, value in zip(node.value.keys, node.value.values):
                    if isinstance(key, ast.Constant) and key.value == name and isinstance(value, ast.Constant) \
                            and isinstance(value.value, str) and ":" in value.value:
                        where, attr = value.value.split(":")
                        base = module if where.startswith(".") else ""
                        return self.lookup(f"{base}{where}.{attr}" if base else f"{where}.{attr}", depth + 1)
        return None


def _top_level(tree):
    """A module's statements, with those under `if TYPE_CHECKING:` / `try:` blocks."""
    for node in tree.body:
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            yield from node.body
            yield from getattr(node, "orelse", [])


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The module an ImportFrom in `module` (a package's __init__ counts as the package) names."""
    if not node.level:
        return node.module
    base = module.split(".")
    base = base[:len(base) - node.level + 1] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def _member(node, name: str):
    if not isinstance(node, ast.ClassDef):
        return None
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
            return item
    return None


def accepted(node) -> tuple[list, list, bool]:
    """(parameter names in order, required ones in order, takes **kwargs) of a function, or of a
    class's call (its __init__, or a dataclass's or msgspec Struct's fields)."""
    if isinstance(node, ast.ClassDef):
        init = _member(node, "__init__")
        if init is None:  # a dataclass, msgspec Struct or TypedDict: its annotated fields
            typed = any(ast.unparse(b).endswith("TypedDict") for b in node.bases)
            total = not any(k.arg == "total" and ast.unparse(k.value) == "False" for k in node.keywords)
            names, required = [], []
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) \
                        and "ClassVar" not in ast.unparse(item.annotation):
                    names.append(item.target.id)
                    note = ast.unparse(item.annotation)  # a TypedDict's base may be another TypedDict: NotRequired
                    if note.startswith("Required[") or (not note.startswith("NotRequired[") and item.value is None
                                                        and (total or not typed)):
                        required.append(item.target.id)
            return names, required, False
        node = init
    a = node.args
    positional = [p for p in a.posonlyargs + a.args if p.arg not in ("self", "cls")]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    names = [p.arg for p in positional + a.kwonlyargs]
    required = [p.arg for p, d in zip(positional, defaults) if d is None]
    required += [p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    return names, required, a.kwarg is not None


def check(wheel: Wheel, use: Use) -> str:
    """`ok`, `missing`, `no X, Y` or `needs X` for one use in one wheel."""
    node = wheel.lookup(use.path)
    if node is None:
        return "missing"
    names, required, kwargs = accepted(node)
    given = set(names[:use.positional]) | set(use.keywords)  # by position: the first parameters
    needed = [r for r in required if r not in given]
    if kwargs and use.forwards:  # LLM(**kwargs) -> EngineArgs(**kwargs)
        target = wheel.lookup(use.forwards)
        names = names + (accepted(target)[0] if target is not None else [])
    absent = [k for k in use.keywords if k not in names] if not (kwargs and not use.forwards) else []
    if absent:
        return "no " + ", ".join(absent)
    return "needs " + ", ".join(needed) if needed else "ok"


def table(wheels: list[Wheel]) -> tuple[list[str], list[list[str]]]:
    """(header, rows): a row per use, a column per wheel (in version order)."""
    wheels = sorted(wheels, key=lambda w: [int(x) for x in re.findall(r"\d+", w.version)] + [w.version])
    header = ["symbol (keywords the project passes)"] + [w.version for w in wheels]
    rows = []
    for use in USES:
        label = f"`{use.path.removeprefix('vllm.')}`" + (f" ({', '.join(use.keywords)})" if use.keywords else "")
        rows.append([label] + [check(w, use) for w in wheels])
    rows.append(["every use"] + ["ok" if all(r[i + 1] == "ok" for r in rows) else "FAIL" for i in range(len(wheels))])
    return header, rows


def main():
    sys.path.insert(0, BENCH)
    import report

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("wheels", nargs="+", help="vLLM wheels (pip download --no-deps vllm==X)")
    args = report.parse_args(p, "vllm_api")
    try:
        wheels = [Wheel(w) for w in args.wheels]
    except WheelError as e:
        sys.exit(f"vllm_api_check.py: {e}")
    header, rows = table(wheels)
    markdown = report.table(header, rows)
    print(markdown)
    if args.markdown:
        report.publish("vllm_api", markdown)


if __name__ == "__main__":
    main()
