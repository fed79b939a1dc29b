"""
infra/sparse_delta.py: the exact sparse bf16 delta (`--sync delta`, any optimizer; sync.py
departure 2) and an engine that takes it.

Not in the paper: the sync that RL trainers without factors use (PULSE, arXiv:2602.03839: most
bf16 weights do not change in one RL step). Per target, the positions and new bf16 values of
the elements whose bf16 value an update changed (`changed_elements`, gathered over row shards
by `gather_changes`), the positions as a bitmap or as LEB128 gaps, whichever is smaller
(`encode_index`), or the whole bf16 weight where that is no larger (infra/wire.py's
`sparse_delta`: a delta never sends more than a full bf16 sync). It is exact, since it sends
what changed after the bf16 cast, and needs no master on the engine (`SparseEngineWeights`);
its cost moves to the trainer, which keeps a bf16 copy of its rows of what the engines hold
(infra/engine_sync.py's `delta`). Each delta carries the checksum of the weights it applies to:
one made for other weights than the engine holds is refused, also when its update number fits.
Which is smaller, factors or deltas, depends on the share of elements a step changes
(bench/README.md, `syncs`). Tests: tests/test_sync.py,
test_sparse_deltas_keep_engines_without_a_master_equal_to_the_trainer,
test_a_delta_never_sends_more_than_the_full_weight,
test_bad_sparse_deltas_are_refused_and_change_nothing, test_position_codes_against_numpy_and_python.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from infra.engine_weights import StreamedEngineWeights


@dataclass
class Sparse:
    """The elements of one bf16 target weight (d, k) that an update changed: flat row-major
    `positions` (int64 (n,), increasing) and their new bf16 `values` (n,). `base`: the
    checksum (sync.checksum) of the weight they apply to, which the engine checks first.
    `positions=None`: the dense form, every element in row-major order (`values` (d k,)),
    which `sparse_delta` sends where the changed elements would cost as many bytes or more."""

    shape: tuple
    positions: torch.Tensor | None
    values: torch.Tensor
    base: tuple


def changed_elements(before: torch.Tensor, after: torch.Tensor, row_offset: int = 0):
    """(positions, values) of the elements of bf16 `after` (c, k) whose bits differ from bf16
    `before` (c, k), rows `row_offset`.. of the whole weight: positions are flat row-major
    indices into the whole (d, k) weight, so that row shards' changes concatenate in row order."""
    if before.shape != after.shape or before.dtype != torch.bfloat16 or after.dtype != torch.bfloat16:
        raise ValueError(f"changed_elements compares two bf16 tensors of one shape, got {before.dtype} "
                         f"{tuple(before.shape)} and {after.dtype} {tuple(after.shape)}")
    changed = before.contiguous().view(torch.int16) != after.contiguous().view(torch.int16)  # (c, k) bits differ
    local = changed.flatten().nonzero().squeeze(1)  # (n,) row-major within the rows
    return local + row_offset * after.shape[1], after.flatten()[local]


def gather_changes(positions: torch.Tensor, values: torch.Tensor, group=None):
    """Every process's `changed_elements` of one weight, in rank order (row shards in row order,
    so positions stay increasing): one all_gather of the counts, one each of the padded positions
    and values. Without a process group (or a group of one): the arguments."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return positions, values
    world = dist.get_world_size(group)
    count = torch.tensor([positions.numel()], dtype=torch.int64, device=positions.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    counts = torch.cat(counts).tolist()
    most = max(counts)
    if most == 0:  # nothing changed on any rank (every rank sees the same counts)
        return positions, values
    pos = torch.zeros(most, dtype=torch.int64, device=positions.device)
    val = torch.zeros(most, dtype=torch.bfloat16, device=values.device)
    pos[:positions.numel()], val[:values.numel()] = positions, values
    all_pos = [torch.empty_like(pos) for _ in range(world)]
    all_val = [torch.empty_like(val) for _ in range(world)]
    dist.all_gather(all_pos, pos, group=group)
    dist.all_gather(all_val, val, group=group)
    return (torch.cat([p[:n] for p, n in zip(all_pos, counts)]),
            torch.cat([v[:n] for v, n in zip(all_val, counts)]))


# The positions of a sparse delta on the wire, per weight the smaller of two codes:
#   bitmap  one bit per element (element 8 j + i is bit i of byte j): d k / 8 bytes
#   gaps    each position's distance to the previous one minus 1 (the first's to -1), an
#           unsigned LEB128 varint: 7 bits a byte, low bits first, the high bit set on every
#           byte but a value's last: 1 byte below 128, 2 below 16384, ...
# At the few percent of elements an RL step changes, gaps are mostly one byte each. Where the
# code and the changed values would take as many bytes as the whole bf16 weight or more (LoRA's
# first merge changes every element), `sparse_delta` sends the weight itself ("dense"). Both codes
# are made and read CODE_CHUNK positions (or bytes) at a time, so that their int64 work stays
# bounded (at most 80 bytes for each of CODE_CHUNK bytes: infra/memory_plan.py counts it)
# beside the int64 positions themselves.
BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)  # bit i of a bitmap byte: 2^i
CODE_CHUNK = 2**20


def _gaps(positions: torch.Tensor):
    """CODE_CHUNK-position chunks of the gaps code's values (each position's distance to the
    previous one minus 1, the first's to -1): int64, all >= 0 for increasing positions >= 0."""
    for c in range(0, positions.numel(), CODE_CHUNK):
        p = positions[c:c + CODE_CHUNK].to(torch.int64)
        before = positions[c - 1:c].to(torch.int64) if c else p.new_full((1,), -1)
        yield torch.diff(p, prepend=before) - 1  # (c,)


def _varint_sizes(gaps: torch.Tensor) -> torch.Tensor:
    """The bytes of each gap's LEB128 varint (1 to 9 for gaps below 2^63)."""
    sizes = torch.ones_like(gaps)  # (c,)
    for b in range(1, 9):
        sizes += gaps >= 128 ** b
    return sizes


def _gap_bytes(positions: torch.Tensor, numel: int) -> int:
    """The bytes of the gaps code of increasing positions in [0, numel) (raises otherwise)."""
    gap_bytes = 0
    for gaps in _gaps(positions):
        if int(gaps.min()) < 0:
            raise ValueError("a sparse delta's positions must be increasing and >= 0")
        gap_bytes += int(_varint_sizes(gaps).sum())
    if positions.numel() and int(positions[-1]) >= numel:
        raise ValueError(f"a position {int(positions[-1])} outside the weight's {numel} elements")
    return gap_bytes


def _code_bytes(positions: torch.Tensor, numel: int) -> int:
    """The bytes of the smaller position code (encode_index's)."""
    return min(_gap_bytes(positions, numel), -(-numel // 8))


def encode_index(positions: torch.Tensor, numel: int) -> tuple[str, torch.Tensor]:
    """("bitmap" | "gaps", uint8 bytes) of increasing positions in [0, numel): the smaller code,
    the gaps on a tie. Two passes over the positions (the gaps' sizes, then the chosen code),
    so that nothing but the code itself grows with the number of positions."""
    device, n, bitmap_bytes = positions.device, positions.numel(), -(-numel // 8)
    gap_bytes = _gap_bytes(positions, numel)
    if gap_bytes > bitmap_bytes:  # the bitmap: bit p % 8 of byte p // 8, distinct bits added
        code = torch.zeros(bitmap_bytes, dtype=torch.uint8, device=device)
        bits = BITS.to(device)
        for c in range(0, n, CODE_CHUNK):
            p = positions[c:c + CODE_CHUNK].to(torch.int64)  # (c,)
            code.index_add_(0, p >> 3, bits[p & 7])
        return "bitmap", code
    code, at = torch.empty(gap_bytes, dtype=torch.uint8, device=device), 0
    for gaps in _gaps(positions):
        sizes = _varint_sizes(gaps)
        starts = torch.cumsum(sizes, 0) - sizes + at  # (c,) the first byte of each varint
        for j in range(int(sizes.max())):
            has = sizes > j  # varints with a j-th byte
            more = (sizes[has] > j + 1).to(torch.int64) << 7  # the continuation bit
            code[starts[has] + j] = (((gaps[has] >> (7 * j)) & 0x7F) | more).to(torch.uint8)
        at += int(sizes.sum())
    return "gaps", code


def decode_index(encoding: str, data: torch.Tensor, count: int, numel: int) -> torch.Tensor:
    """The increasing int64 positions (count,) of `encode_index`'s bytes; raises on a code that
    is malformed, holds another number of positions, or points outside [0, numel). Read
    CODE_CHUNK bytes at a time (whole varints for the gaps)."""
    positions = torch.empty(count, dtype=torch.int64, device=data.device)
    found = 0
    if encoding == "bitmap":
        if data.numel() != -(-numel // 8):
            raise ValueError(f"a bitmap of {numel} elements has {-(-numel // 8)} bytes, got {data.numel()}")
        bits = BITS.to(data.device)
        for lo in range(0, data.numel(), CODE_CHUNK):
            p = ((data[lo:lo + CODE_CHUNK, None] & bits) != 0).flatten().nonzero().squeeze(1)  # (c,)
            p += 8 * lo
            if found + p.numel() > count:
                raise ValueError(f"the position code holds more than the {count} positions the header says")
            positions[found:found + p.numel()] = p
            found += p.numel()
    elif encoding == "gaps":
        last = (data & 0x80) == 0  # (m,) the last byte of each varint
        if data.numel() and not bool(last[-1]):
            raise ValueError("the position code ends inside a varint (truncated)")
        ends = last.nonzero().squeeze(1)  # (n,) where each varint ends
        found, previous, lo = ends.numel(), -1, 0
        if found != count:
            raise ValueError(f"the position code holds {found} positions, the header says {count}")
        c = 0
        while c < count:  # the varints that end within the next CODE_CHUNK bytes (at least one)
            stop = max(c + 1, int(torch.searchsorted(ends, lo + CODE_CHUNK)))
            e = ends[c:stop]  # (v,)
            hi = int(e[-1]) + 1
            u, l = data[lo:hi].to(torch.int64), last[lo:hi]  # (b,)
            value = torch.cumsum(l, 0) - l.to(torch.int64)  # (b,) which varint of the chunk each byte is in
            starts = torch.cat([e.new_zeros(1), e[:-1] + 1 - lo])  # (v,)
            j = torch.arange(hi - lo, device=u.device) - starts[value]  # (b,) the byte's place in its varint
            if int(j.max()) > 8:
                raise ValueError("a position gap of more than 9 bytes")
            gaps = torch.zeros(e.numel(), dtype=torch.int64, device=u.device)
            gaps.scatter_add_(0, value, (u & 0x7F) << (7 * j))
            if int(gaps.max()) >= numel:  # also keeps the sum below from overflowing
                raise ValueError(f"a position gap {int(gaps.max())} beyond the weight's {numel} elements")
            positions[c:stop] = torch.cumsum(gaps + 1, 0) + previous  # position = previous + gap + 1
            previous = int(positions[stop - 1])
            if previous >= numel:
                raise ValueError(f"a position {previous} outside the weight's {numel} elements")
            c, lo = stop, hi
    else:
        raise ValueError(f"unknown position code {encoding!r}")
    if found != count:
        raise ValueError(f"the position code holds {found} positions, the header says {count}")
    if count and not 0 <= int(positions[-1]) < numel:
        raise ValueError(f"a position {int(positions[-1])} outside the weight's {numel} elements")
    return positions


class SparseEngineWeights(StreamedEngineWeights):
    """infra/engine_weights.py's engine without the residual, and so without a master: it takes sparse deltas
    (the bf16 elements an update changed, written as they are) and full payloads (fp32 ones
    rounded to bf16), and refuses factors, which it could not merge exactly."""

    exact = False
    takes = "sparse"

    def _check(self, payload, kind):
        if payload.kind == "delta" and kind == "sparse":
            raise ValueError("this engine keeps no fp32 master (exact=False): it takes sparse deltas and full "
                             "weights, not factors, which it could not merge exactly")
        super()._check(payload, kind)
        for name, t in payload.layers.items():
            if kind == "sparse" and self.checksums([self.slots[name].weight])[0] != tuple(t.base):
                raise ValueError(f"{name}: the delta of update {payload.update} was made for other weights than the "
                                 f"engine holds (a skipped or repeated update?): resync with a full payload")

    def _write(self, payload) -> None:
        for name, t in payload.layers.items():  # the changed bf16 elements, written as they are
            weight = self.slots[name].weight.view(-1)  # (d k,) a view: the model's own storage
            if t.positions is None:  # the dense form: every element
                weight.copy_(t.values)
            else:
                weight.index_copy_(0, t.positions.to(weight.device), t.values.to(weight.device))

    def master(self, name: str) -> torch.Tensor:
        return self.slots[name].weight.float()  # no master: the bf16 weight

    def _load(self, slot, w: torch.Tensor) -> None:
        slot.weight.copy_(w)  # no master: the bf16 weight, rounded to nearest even from fp32
