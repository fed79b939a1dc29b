"""
infra/checksum.py: sync.py's checksum, (sum_i x_i, sum_i x_i (i mod 65521 + 1)) over a tensor's
16-bit words x_i in int64, computed in blocks of CHECK_WORDS words (a bounded int64 work beside
the weight, where sync.word_checksums' word by word reference holds three int64 copies of it) and
read from the device once for many tensors (`checksums`). The payloads' checks (infra/wire.py),
the engines' fingerprints (`EngineWeights(..., checksums=checksums)`) and the trainer's
under FSDP2 (`checksum_rows` at a shard's row offset: the sums add up over row shards) use it.
Integer sums: equal to the reference in any order (tests/test_sync.py,
test_checksum_against_a_word_by_word_recomputation).
"""

import torch

from sync import CHECK_MOD

CHECK_WORDS = 2**20  # 16-bit words per checksum block (about 32 MiB of int64 work at most)


def checksum(t: torch.Tensor) -> tuple[int, int]:
    """(sum of x, sum of x * (i mod 65521 + 1)) over the raw 16-bit words x of `t`, in int64.

    Rows are processed in chunks; both sums add up over row blocks, so the checksum of a
    row-sharded weight is the sum of its shards' (with their global row offset).
    """
    return tuple(checksum_tensor(t).tolist())


def checksum_tensor(t: torch.Tensor) -> torch.Tensor:
    """`checksum` as an int64 (2,) tensor on `t`'s device, not read to the host: the checksums
    of many tensors are read at once (`checksums`)."""
    if t.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=t.device)
    return checksum_rows(t.detach().reshape(t.shape[0], -1) if t.dim() else t.reshape(1, 1), 0)


def checksums(tensors) -> list[tuple[int, int]]:
    """`checksum` of each tensor, with one host read for all of them (one per device)."""
    sums = [checksum_tensor(t) for t in tensors]  # (2,) each
    if not sums:
        return []
    read = torch.stack(sums).tolist() if len({s.device for s in sums}) == 1 else [s.tolist() for s in sums]
    return [tuple(pair) for pair in read]


def checksum_rows(rows: torch.Tensor, row_offset: int) -> torch.Tensor:
    # Word i's weight is (i mod M) + 1, so s2 = sum_j (j + 1) c_j with c_j the sum of the words
    # whose global position is j mod M: the words viewed as rows of M, summed down the columns
    # (one pass, no per-word index), with the part before the first whole row and after the
    # last added on their own. Integer sums: the same value in any order, on any machine.
    words = rows.contiguous().view(torch.int16).reshape(-1)  # raw 16-bit words, flat
    first = (row_offset * (words.numel() // max(rows.shape[0], 1))) % CHECK_MOD  # residue of word 0
    cols = torch.zeros(CHECK_MOD, dtype=torch.int64, device=rows.device)
    head = min(words.numel(), (CHECK_MOD - first) % CHECK_MOD)  # words before residue 0
    cols[first:first + head] += words[:head]
    body = words[head:]
    whole = body.numel() // CHECK_MOD
    step = max(1, CHECK_WORDS // CHECK_MOD)  # rows of M words per block: CHECK_WORDS bounds the int64 work
    for start in range(0, whole, step):
        stop = min(start + step, whole)
        cols += body[start * CHECK_MOD:stop * CHECK_MOD].view(-1, CHECK_MOD).sum(0, dtype=torch.int64)
    tail = body[whole * CHECK_MOD:]
    cols[:tail.numel()] += tail
    s1 = cols.sum()
    s2 = cols.mul_(torch.arange(1, CHECK_MOD + 1, device=rows.device, dtype=torch.int64)).sum()
    return torch.stack([s1, s2])  # (2,) int64, on the rows' device
