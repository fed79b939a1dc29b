"""How the bench scripts report: Markdown tables, their publication in the READMEs, charts.

A measured table lives in bench/README.md (or README.md) between two markers,

    <!-- bench:NAME -->
    Produced by `python bench/SCRIPT.py --markdown` on DATE (UTC); machine: ...

    | the | table |
    <!-- /bench:NAME -->

and the script that measures it rewrites that block when run with `--markdown`, so a figure
is refreshed by running its script again, never by editing prose. Only the text between the
two marker lines changes; everything else in the file stays byte for byte as it was.

    table(header, rows) -> str      a Markdown table, exactly as the scripts print it
    row(cells) -> str               one line of such a table (for scripts that print as they go)
    publish(name, markdown)         replace the block NAME in README.md and bench/README.md, and
                                    record what it cost (bench/results/costs.json: the seconds since
                                    the script imported this module, its command, date and machine;
                                    bench/run.py lists them)
    check(*names)                   fail now, before a long run, if a block cannot be published
    parse_args(parser, *names)      a script's arguments with --markdown, the blocks checked

Charts use metrics.pyplot (the project's one matplotlib import). Besides the standard library
this module needs only infra/checkpoint.py, for its atomic write.
"""

import datetime
import json
import os
import platform
import shlex
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
from infra import checkpoint  # noqa: E402  (infra/checkpoint.py: write_atomic)
# The files a block may live in. A name may appear in either or both; every file that has the
# markers gets the new block.
READMES = (os.path.join(ROOT, "README.md"), os.path.join(BENCH, "README.md"))
COSTS = os.path.join(BENCH, "results", "costs.json")  # {block: its last regeneration's cost}
STARTED = time.time()  # the script imports this module first: a block's cost is counted from here


# --- Markdown tables -----------------------------------------------------------------------

def row(cells) -> str:
    """One table line: `| a | b |`; an empty cell is written `| |`."""
    return "|" + "".join(f" {cell} |" if str(cell) else " |" for cell in cells)


def table(header, rows) -> str:
    """The header line, the `|---|` separator and one line per row, joined by newlines.
    A row may have fewer cells than the header (a method that could not be measured)."""
    lines = [row(header), "|" + "---|" * len(header)]
    lines += [row(cells) for cells in rows]
    return "\n".join(lines)


# --- Where and on what a table was measured -------------------------------------------------

def command() -> str:
    """The command line as it was typed, from sys.argv, with the script named by its path from
    the repository root (`python bench/x.py --flag`), wherever it was started from. An
    OMP_NUM_THREADS setting is shown in front of it, since it changes the figures."""
    script = os.path.abspath(sys.argv[0])
    if script.startswith(ROOT + os.sep):
        script = os.path.relpath(script, ROOT)
    words = ["python", script] + sys.argv[1:]
    env = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if "OMP_NUM_THREADS" in os.environ else ""
    return env + shlex.join(words)


def cpu_model() -> str:
    """The CPU's name from /proc/cpuinfo (Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_flags() -> str:
    """The CPU's AVX-512 and AMX flags from /proc/cpuinfo (the suite's machine-dependent premises,
    tests/README.md, turn on them), or that it has none."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "CPU flags unknown"
    wide = sorted(f for f in set(flags) if f.startswith(("avx512", "amx")))
    return "AVX-512/AMX: " + " ".join(wide) if wide else "no AVX-512, no AMX"


def memory_gib() -> float | None:
    """Physical memory in GiB: /proc/meminfo's MemTotal, else sysconf; None if neither works."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / 2**30  # the value is in kB
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def machine() -> str:
    """`CPU model, N cores, M GiB memory, torch V[, GPU name]` for this machine."""
    parts = [cpu_model(), f"{os.cpu_count()} cores"]
    mem = memory_gib()
    if mem is not None:
        parts.append(f"{mem:.1f} GiB memory")
    try:
        import torch
    except ImportError:
        parts.append("no torch")
    else:
        parts.append(f"torch {torch.__version__}")
        if torch.cuda.is_available():
            parts.append(f"GPU {torch.cuda.get_device_name()}")
    return ", ".join(parts)


def provenance() -> str:
    """The first line of every published block: command, date (UTC) and machine."""
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return f"Produced by `{command()}` on {today} (UTC); machine: {machine()}."


# --- Publication ------------------------------------------------------------------------

def markers(name: str) -> tuple[str, str]:
    """The opening and closing marker lines of block `name`."""
    return f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"


def replace_block(text: str, name: str, body: str, path: str) -> str | None:
    """`text` with the lines between the markers of `name` replaced by `body`, or None if
    `text` has no such markers. The marker lines themselves and everything outside them are
    kept exactly. Raises ValueError if the markers are there but not as one clean pair."""
    start, end = markers(name)
    lines = text.splitlines(keepends=True)
    opens = [i for i, line in enumerate(lines) if line.strip() == start]
    closes = [i for i, line in enumerate(lines) if line.strip() == end]
    if not opens and not closes:
        return None
    if len(opens) != 1 or len(closes) != 1:
        raise ValueError(f"{path}: block '{name}' needs one line '{start}' and one line '{end}'; "
                         f"found {len(opens)} and {len(closes)}")
    i, j = opens[0], closes[0]
    if j < i:
        raise ValueError(f"{path}: '{end}' comes before '{start}'")
    if any(line.strip().startswith(("<!-- bench:", "<!-- /bench:")) for line in body.split("\n")):
        raise ValueError(f"block '{name}': the Markdown to publish holds a marker line itself")
    newline = "\r\n" if lines[i].endswith("\r\n") else "\n"  # keep the file's line endings
    new = [line + newline for line in body.strip("\n").split("\n")]
    return "".join(lines[:i + 1] + new + lines[j:])


def updated_readmes(name: str, body: str) -> dict[str, str]:
    """{path: its new text} for every README holding block `name`, with `body` in the block.
    Reads only. Raises LookupError if no README has the markers, ValueError if one has them
    broken."""
    updates = {}
    for path in READMES:
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8", newline="") as f:  # newline="": keep \r\n as it is
            text = f.read()
        new = replace_block(text, name, body, path)
        if new is not None:
            updates[path] = new
    if not updates:
        start, end = markers(name)
        raise LookupError(f"no block '{name}' to publish into: neither "
                          f"{' nor '.join(os.path.relpath(p, ROOT) for p in READMES)} has the lines "
                          f"'{start}' and '{end}'; add them where the table belongs")
    return updates


def check(*names: str) -> None:
    """Raise now, as publish would later, if a block cannot be published: a script calls this
    before measuring, so that a run of minutes does not end in a missing marker."""
    for name in names:
        updated_readmes(name, "")


def parse_args(parser, *names: str, which=None):
    """The script's arguments, with `--markdown` added: publish the blocks `names` (or those
    `which(args)` picks) after measuring. With it, the blocks are checked at once (`check`)."""
    parser.add_argument("--markdown", action="store_true",
                        help=f"also write the tables into the READMEs (bench:{', bench:'.join(names)})")
    args = parser.parse_args()
    if args.markdown:
        check(*(which(args) if which else names))
    return args


def publish(name: str, markdown: str, seconds: float | None = None) -> list[str]:
    """Write `markdown` into the block `name` of every README that has its markers, below one
    line saying which command produced it, when and on what machine. Returns the paths it
    wrote. Raises LookupError if no README has the markers, ValueError if one has them broken;
    either way nothing is written (every file is checked before any is written). `seconds`:
    what the block's measurements cost, for a script that builds it from runs it kept and read
    back (`record_cost`)."""
    updates = updated_readmes(name, provenance() + "\n\n" + markdown.strip("\n"))
    for path, new in updates.items():
        checkpoint.write_atomic(path, new.encode("utf-8"))  # a reader never sees half a file
        print(f"published bench:{name} in {os.path.relpath(path, ROOT)}")
    record_cost(name, seconds)
    return list(updates)


def record_cost(name: str, seconds: float | None = None) -> None:
    """Write down what regenerating block `name` cost here: `seconds`, or without it the
    seconds since the script started (this module's import), with its command, the date and
    the machine. A script that reads back runs it kept passes their summed wall time: reading
    them is not what the block cost."""
    costs = json.load(open(COSTS)) if os.path.exists(COSTS) else {}
    spent = time.time() - STARTED if seconds is None else seconds
    costs[name] = {"seconds": round(spent), "command": command(), "machine": machine(),
                   "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")}
    checkpoint.write_atomic(COSTS, (json.dumps(costs, indent=1, sort_keys=True) + "\n").encode())
