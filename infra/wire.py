"""
infra/wire.py: sync.py's payloads as one flat uint8 buffer, which travels over any
torch.distributed backend (gloo, NCCL, vLLM's weight channel: infra/vllm_channel.py) as one
message, and its checksums.

The buffer: MAGIC, the header's length (8 bytes, little-endian), a JSON header (the format's
VERSION, the payload's kind, update, seed, rank and projection rule, one entry per layer with
its shape, dtype, offset, bytes and checksum), then each layer's bytes aligned to ALIGN. A
sparse delta's layer (infra/sparse_delta.py) is its position code, then its bf16 values, each
aligned. `decode` checks every size and checksum before it returns, so a corrupted buffer is
refused before an engine changes anything (tests/test_sync.py,
test_bad_payloads_are_rejected_and_change_nothing); a payload of projection 1 (a release
before the projections had versions) is refused in one line.

The checksums are sync.py's fingerprint's (infra/checksum.py), read from the device once for
all of a payload's tensors.
"""

import json

import torch
import torch.distributed as dist

from infra.checksum import checksum, checksums
from infra.sparse_delta import Sparse, _code_bytes, decode_index, encode_index
from sync import Payload

MAGIC = b"LOGRASYN"
VERSION = 1
ALIGN = 16
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _aligned(nbytes: int) -> int:
    return nbytes + -nbytes % ALIGN


def sparse_delta(shape, positions: torch.Tensor, values: torch.Tensor, base, whole) -> Sparse:
    """One target's delta as it goes on the wire: its changed elements (`positions`, `values`:
    every rank's, `gather_changes`), or the dense form, the whole bf16 weight `whole()` (d, k),
    where the changed elements' blob (position code and values) would take as many bytes as
    the dense blob or more: a delta never sends more than a full bf16 sync of the same weight
    (its header aside). `whole` is called only then; on row shards it gathers the weight, and
    every rank calls it, since every rank holds the same gathered positions."""
    numel = shape[0] * shape[1]
    if _aligned(_code_bytes(positions, numel)) + _aligned(2 * positions.numel()) >= _aligned(2 * numel):
        return Sparse(tuple(shape), None, whole().detach().to(torch.bfloat16).flatten(), base)  # (d k,)
    return Sparse(tuple(shape), positions, values, base)


def encode(payload: Payload) -> torch.Tensor:
    """One flat uint8 buffer: magic, header length, JSON header, aligned tensor bytes."""
    entries, blobs, offset = [], [], 0
    for name, t in payload.layers.items():
        if isinstance(t, Sparse) != (payload.kind == "sparse"):
            raise ValueError(f"{name}: a {payload.kind} payload holds "
                             f"{'Sparse deltas' if payload.kind == 'sparse' else 'tensors'}, got {type(t).__name__}")
        if isinstance(t, Sparse):  # the position code, aligned, then the values: one blob
            entry, blob = _sparse_blob(name, t)
            entries.append({**entry, "offset": offset})
            blobs.append(blob)
            offset += blob.numel()
            continue
        dtype = next((k for k, v in DTYPES.items() if v == t.dtype), None)
        if dtype is None or t.dim() != 2:
            raise ValueError(f"{name}: factors must be 2-D {list(DTYPES)} tensors, got {t.dtype} {tuple(t.shape)}")
        raw = t.detach().contiguous().flatten().view(torch.uint8)
        entries.append({"name": name, "shape": list(t.shape), "dtype": dtype, "offset": offset,
                        "nbytes": raw.numel(), "check": t})  # the tensor until its checksum is read, below
        blobs.append(raw)
        pad = -raw.numel() % ALIGN
        if pad:
            blobs.append(torch.zeros(pad, dtype=torch.uint8, device=raw.device))
        offset += raw.numel() + pad
    dense = [e for e in entries if isinstance(e["check"], torch.Tensor)]
    for e, pair in zip(dense, checksums([e["check"] for e in dense])):  # one host read for the payload
        e["check"] = list(pair)
    header = json.dumps({"version": VERSION, "kind": payload.kind, "update": int(payload.update),
                         "base_seed": int(payload.base_seed), "rank": int(payload.rank),
                         "projection": int(payload.projection),
                         "layers": entries, "data_bytes": offset}).encode()
    header += b" " * (-(len(MAGIC) + 8 + len(header)) % ALIGN)
    device = blobs[0].device if blobs else "cpu"
    prefix = torch.frombuffer(bytearray(MAGIC + len(header).to_bytes(8, "little") + header), dtype=torch.uint8)
    return torch.cat([prefix.to(device)] + blobs)


def _sparse_blob(name: str, t: Sparse):
    """A `Sparse` as its header entry and its bytes: the position code padded to ALIGN, then the
    bf16 values padded to ALIGN; the checksum covers both."""
    d, k = t.shape
    dense = t.positions is None  # every element, in row-major order: no position code
    want = (d * k,) if dense else tuple(t.positions.shape)
    if t.values.dtype != torch.bfloat16 or t.values.dim() != 1 or tuple(t.values.shape) != want:
        raise ValueError(f"{name}: a sparse delta holds (n,) positions and (n,) bf16 values, or (d k,) bf16 values "
                         f"and no positions, got {None if dense else tuple(t.positions.shape)} and {t.values.dtype} "
                         f"{tuple(t.values.shape)}")
    if dense:
        encoding, index = "dense", torch.empty(0, dtype=torch.uint8, device=t.values.device)
    else:
        encoding, index = encode_index(t.positions, d * k)
    values = t.values.contiguous().view(torch.uint8)  # (2 n,)
    blob = torch.cat([index, index.new_zeros(-index.numel() % ALIGN), values.to(index.device),
                      index.new_zeros(-values.numel() % ALIGN)])
    entry = {"name": name, "shape": [d, k], "encoding": encoding, "count": t.values.numel(),
             "index_bytes": index.numel(), "nbytes": blob.numel(), "check": list(checksum(blob.view(-1, ALIGN) if blob.numel() else blob)),
             "base": [int(b) for b in t.base]}
    return entry, blob


def _sparse_entry(e: dict, data: torch.Tensor, expect: int, data_bytes: int) -> Sparse:
    """The `Sparse` of a header entry from `_sparse_blob`, every size and the checksum checked."""
    shape, count, index_bytes = e.get("shape"), e.get("count"), e.get("index_bytes")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(s, int) and s > 0 for s in shape)
            and isinstance(count, int) and 0 <= count <= shape[0] * shape[1] and isinstance(index_bytes, int)
            and index_bytes >= 0 and isinstance(e.get("base"), list) and len(e["base"]) == 2
            and all(isinstance(e.get(k), int) for k in ("offset", "nbytes")) and isinstance(e.get("name"), str)
            and e.get("encoding") in ("bitmap", "gaps", "dense") and isinstance(e.get("check"), list)
            and (e.get("encoding") != "dense" or (count == shape[0] * shape[1] and index_bytes == 0))):
        raise ValueError(f"malformed sparse layer entry {e}")
    values_at = index_bytes + (-index_bytes % ALIGN)
    nbytes = values_at + 2 * count + (-2 * count % ALIGN)
    if e["offset"] != expect or e["nbytes"] != nbytes or e["offset"] + nbytes > data_bytes:
        raise ValueError(f"{e['name']}: offset/size {e['offset']}/{e['nbytes']} inconsistent with {count} "
                         f"values and {index_bytes} bytes of positions")
    blob = data[e["offset"]:e["offset"] + nbytes]
    if list(checksum(blob.view(-1, ALIGN) if nbytes else blob)) != e["check"]:
        raise ValueError(f"{e['name']}: checksum mismatch, the payload is corrupted")
    positions = None if e["encoding"] == "dense" else \
        decode_index(e["encoding"], blob[:index_bytes], count, shape[0] * shape[1])
    values = blob[values_at:values_at + 2 * count].view(torch.bfloat16)
    return Sparse(tuple(shape), positions, values, tuple(e["base"]))


def decode(buffer: torch.Tensor) -> Payload:
    """Parse and check a buffer from `encode`; the factors are views into `buffer`."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError("a payload is a 1-D uint8 tensor")
    n = buffer.numel()
    if n < len(MAGIC) + 8 or bytes(buffer[:len(MAGIC)].cpu().tolist()) != MAGIC:
        raise ValueError("not a LoGRA payload (bad magic)")
    hlen = int.from_bytes(bytes(buffer[len(MAGIC):len(MAGIC) + 8].cpu().tolist()), "little")
    start = len(MAGIC) + 8 + hlen
    if start > n:
        raise ValueError(f"truncated payload: header claims {hlen} bytes, buffer has {n}")
    try:
        head = json.loads(bytes(buffer[len(MAGIC) + 8:start].cpu().tolist()))
        if head["version"] != VERSION or head["kind"] not in ("delta", "full", "sparse"):
            raise ValueError(f"unsupported payload version/kind {head['version']}/{head['kind']}")
        layers = head["layers"]
        update, base_seed, rank, data_bytes = (int(head[k]) for k in ("update", "base_seed", "rank", "data_bytes"))
        projection = int(head.get("projection", 1))  # a payload of a release before the versions: the CPU draw
    except (KeyError, TypeError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"malformed payload header: {e}") from None
    if projection == 1:
        raise ValueError("a payload of projection 1 (a release before the projections had versions) is refused: "
                         "the trainer and its engines must run one release of LoGRA")
    if start + data_bytes != n:
        raise ValueError(f"payload size mismatch: header says {start + data_bytes} bytes, got {n} (truncated?)")
    data = buffer[start:]
    factors, expect = {}, 0
    for e in layers:
        if head["kind"] == "sparse":
            if e.get("name") in factors:
                raise ValueError(f"duplicate layer {e.get('name')} in payload")
            factors[e["name"]] = _sparse_entry(e, data, expect, data_bytes)
            expect = e["offset"] + e["nbytes"]
            continue
        dtype = DTYPES.get(e.get("dtype"))
        shape = e.get("shape")
        if dtype is None or not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(s, int) and s > 0 for s in shape)):
            raise ValueError(f"malformed layer entry {e}")
        nbytes = shape[0] * shape[1] * dtype.itemsize
        if e["offset"] != expect or e["nbytes"] != nbytes or e["offset"] + nbytes > data_bytes:
            raise ValueError(f"{e['name']}: offset/size {e['offset']}/{e['nbytes']} inconsistent with {shape} {dtype}")
        t = data[e["offset"]:e["offset"] + nbytes].view(dtype).view(shape)
        if e["name"] in factors:
            raise ValueError(f"duplicate layer {e['name']} in payload")
        factors[e["name"]] = t
        expect = e["offset"] + nbytes + (-nbytes % ALIGN)
    if head["kind"] != "sparse":  # every tensor's checksum against its entry's: one host read for all
        for e, pair in zip(layers, checksums(factors.values())):
            if list(pair) != e["check"]:
                raise ValueError(f"{e['name']}: checksum mismatch, the payload is corrupted")
    return Payload(update, base_seed, rank, factors, kind=head["kind"], projection=projection)


# -----------------------------------------------------------------------------
# Transport over torch.distributed (gloo on CPU, NCCL on GPU)

def send(payload: Payload, group, dst: int, device=None) -> int:
    """Send one payload as (length, buffer); returns the bytes sent."""
    buf = encode(payload)
    if device is not None:
        buf = buf.to(device)
    dist.send(torch.tensor([buf.numel()], dtype=torch.int64, device=buf.device), dst, group=group)
    dist.send(buf, dst, group=group)
    return buf.numel()


def recv(group, src: int, device=None) -> Payload:
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src, group=group)
    buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(buf, src, group=group)
    return decode(buf)
