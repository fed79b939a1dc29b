"""Premises some tests take from the machine rather than the code, checked where they run.

A test whose premise fails here skips and says why (`pytest -rs`, the suite's default, prints it
in the summary), rather than fail on a CPU it was not written for. tests/README.md lists every
machine-dependent test and what it does on a CPU that lacks its premise.

`split_rows_skip`: train.py's runs on one process and on two ranks end bitwise equal only where
the CPU's matmul gives a row the same bits whichever batch it sits in: the engine samples and the
KL probe scores 8 responses in one process and 4 on each rank, so their fp32 and bf16 matmuls see
other numbers of rows. MKL keeps rows apart at one thread (the runs' OMP_NUM_THREADS=1) from 4
rows on, as checked on an AMD EPYC with AVX2 (and these runs passed bitwise on the AVX-512 Xeons
the suite was written on); a BLAS that blocks rows otherwise would move the last
bit of KL1, then alpha and the weights.

`head_rows_skip`: the same property for one matmul, the output layer on the first rows of a batch
against the whole batch at the calling process's thread count (infra/probe_decoder.scored_logits against
the probe's own logits).
"""

import functools

import torch


def _rows_differ(k: int, n: int, rows: int, whole: int, dtype) -> bool:
    """Whether F.linear on `rows` rows differs in any bit from the same rows inside `whole` rows."""
    g = torch.Generator().manual_seed(k * 1000 + n)
    x = torch.randn(whole, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    return not torch.equal(torch.nn.functional.linear(x[:rows], w), torch.nn.functional.linear(x, w)[:rows])


@functools.lru_cache(maxsize=None)
def split_rows_skip(widths: tuple, rows: tuple = tuple(range(4, 257)), threads: int = 1) -> str | None:
    """None where every fp32 and bf16 F.linear of `widths` ((in, out) pairs) gives the same bits
    to its first m rows alone as inside 2m rows, for every m in `rows`, at `threads` threads;
    else the first case that differs, as a skip reason."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for k, n in widths:
                for m in rows:
                    if _rows_differ(k, n, m, 2 * m, dtype):
                        return (f"this CPU's matmul rounds a row by its batch ({dtype}, {k} -> {n}, {m} of {2 * m} "
                                f"rows, {threads} thread(s)): one process and two ranks cannot end bitwise equal")
    finally:
        torch.set_num_threads(before)
    return None


# The tiny preset's matmuls (train.PRESETS["tiny"]: hidden 64, MLP 176, one 32-wide KV head, the
# arithmetic task's 18 tokens): (in, out) of q/o, k/v, gate/up, down and the output layer.
TINY_WIDTHS = ((64, 64), (64, 32), (64, 176), (176, 64), (64, 18))


def head_rows_skip(k: int, n: int, rows: int, whole: int) -> str | None:
    """None where the output layer's fp32 matmul (k -> n) on `rows` rows gives the bits those rows
    get inside `whole` rows at this process's thread count; else why not, as a skip reason."""
    if _rows_differ(k, n, rows, whole, torch.float32):
        return (f"this CPU's matmul rounds a row by its batch (float32, {k} -> {n}, {rows} of {whole} rows, "
                f"{torch.get_num_threads()} threads): the kept logits cannot equal a recomputation on fewer rows")
    return None
