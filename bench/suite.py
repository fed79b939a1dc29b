"""The test suite's time here, tier by tier, from a fresh clone of this repository's HEAD: the
README's test command (the fast tier) and the rest of the full suite (the slow tier), one after
the other, in the environment that runs this script (its set-up excluded: `bash .ci/setup test`
first), as .ci/run runs them.

    python bench/suite.py [--markdown]

Printed per tier: the command, pytest's own summary (tests passed, deselected) and its time,
and the wall time around it; the full suite is the two together. A tier that fails stops the
script (no block is written).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import report  # bench/report.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIERS = (("fast (the README's test command)", ["python", "-m", "pytest", "-q", "tests"]),
         ("slow (the rest of --full)", ["python", "-m", "pytest", "-q", "tests", "--full", "-m", "slow"]))


def run_tier(clone: str, argv: list[str]) -> tuple[str, float, float]:
    """(pytest's summary line, its seconds, the wall seconds) of one tier in `clone`."""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, *argv[1:]], cwd=clone, capture_output=True, text=True,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    wall = time.monotonic() - t0
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    if out.returncode != 0:
        sys.exit(f"suite: {' '.join(argv)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-2000:]}")
    seconds = re.search(r" in ([\d.]+)s", summary)
    return re.sub(r"\s*\(\d+:\d\d:\d\d\)$", "", summary.strip("= ")), float(seconds.group(1)) if seconds else wall, wall


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = report.parse_args(p, "suite_time")
    with tempfile.TemporaryDirectory() as folder:
        clone = os.path.join(folder, "logra")
        subprocess.run(["git", "clone", "--quiet", ROOT, clone], check=True)
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True, text=True,
                              check=True).stdout.strip()
        rows, total = [], 0.0
        for tier, argv in TIERS:
            summary, seconds, wall = run_tier(clone, argv)
            total += seconds
            rows.append([tier, f"`{' '.join(argv)}`", summary, f"{seconds:.0f} s ({seconds / 60:.1f} min)",
                         f"{wall:.0f} s"])
            print(report.row(rows[-1]), flush=True)
    rows.append(["full suite", "`python -m pytest -q tests --full`", "both tiers", f"{total:.0f} s "
                 f"({total / 60:.1f} min)", ""])
    table = report.table(["tier", "command", "pytest says", "pytest's time", "wall"], rows)
    note = (f"A fresh clone of {head}, the set-up excluded (`bash .ci/setup test`, done before); the CPU: "
            f"{report.cpu_flags()} (tests/README.md: the tests whose premise is the machine's).")
    print(table)
    if args.markdown:
        report.publish("suite_time", note + "\n\n" + table)


if __name__ == "__main__":
    main()
