"""
infra/checkpoint.py: sharded checkpoints that verify themselves before a resume loads them.

What it is
----------
A run's state (weights, optimizer state, a few counters: whatever dict of tensors and plain
values the caller builds) is saved with torch.distributed.checkpoint (DCP), every rank
writing its own shards, then sealed by a manifest of every file's size and sha256. A resume
checks the pointer, the manifest and every file before anything is loaded, and refuses with
the name of the file at fault and the newest checkpoint that does verify. The same code runs
in one process (no process group) and on N ranks.

    run_dir/config.json          the run's options (the caller writes and checks them)
    run_dir/latest               the bare name of the newest complete checkpoint: "checkpoint-40"
    run_dir/checkpoint-40/       DCP's files: each rank's shards `__<rank>_0.distcp`, rank 0's
        __0_0.distcp ...         index `.metadata`, and manifest.json: the bytes and sha256 of
        .metadata                every file, the project version, and the sha256 of the
        manifest.json            manifest itself (one canonical layout, so any changed byte shows),
                                 and the world size and layout of ranks that wrote it
    run_dir/checkpoint-39/       older checkpoints: the newest `keep` (default 2) are kept

The API: `save(run_dir, state, update, rank=, world=, keep=, layout=)`, `resume_path(run_dir,
resume_from, rank=, world=)` (the verified checkpoint to load, or CheckpointError), `load(path,
state)` (fills the template `state` in place), `truncate_rows(path, update)` (a resume's
metrics log rewound to its checkpoint, a torn last line dropped) and `write_atomic(path, data)`. Errors are
`CheckpointError`, whose message is one line that says what to do.

Order of a save, and why it is safe
-----------------------------------
1. the shards of `checkpoint-<update>/`, each fsynced by DCP (a folder of that name left by an
   abandoned run or a save cut short is removed first: no stale file survives in it);
2. every rank hashes the files it wrote; rank 0 gathers the hashes;
3. rank 0 writes manifest.json and the new `latest` under temporary names (fsync), then
   renames both into place back to back, and fsyncs the two folders.
A crash before the renames leaves the previous checkpoint in charge, never a half-written one;
one between them (or a power loss that keeps only one rename) is refused by the resume with
the command that resumes from the other. Then all but the `keep` newest checkpoints go, each
manifest first, so a removal cut short never leaves a folder that looks complete.

A save that cannot be written (a full disk, a file that cannot be created) raises one
CheckpointError on every rank (DCP reports any rank's failed write to all; rank 0's manifest
and pointer are broadcast), naming the file, the error and the free space; rank 0 removes
what the save left, and the previous checkpoint and `latest`, never touched, still verify.

Departures, numbered
--------------------
1. A resume never falls back by itself to an older checkpoint: that would redo updates the
   user believes done. It names the newest one that verifies and how to resume from it.
2. Each rank hashes only the files it wrote (at 7B over 4 ranks, 7.6 GB each): verification
   costs what a load of the same bytes costs, split across ranks, and the verdict is agreed
   with one all_gather so that one rank's damaged shard stops every rank.
"""

import contextlib
import hashlib
import json
import os
import re
import shutil
import warnings

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from infra.errors import RunError, os_advice, os_cause

PROJECT_VERSION = "0.1.0"  # pyproject.toml's version: every manifest records it, a resume requires it
HASH_CHUNK_BYTES = 16 * 2**20  # files are hashed through one reused 16 MiB buffer, never read whole
CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")


class CheckpointError(RunError):
    """A checkpoint that cannot be saved or resumed; the message is one line that says what to do."""


# -----------------------------------------------------------------------------
# Save

def save(run_dir: str, state: dict, update: int, *, rank: int, world: int, keep: int = 2, layout=None):
    """`state` (a dict DCP can save: tensors, DTensors, plain values) as `checkpoint-<update>`,
    sealed by its manifest and made the newest by `latest`; then only the `keep` newest
    checkpoints are kept. Every rank calls it with its own state (the module docstring's "Order of a
    save, and why it is safe"). `layout`: plain values the manifest records beside `world`
    (how the ranks were laid out over nodes)."""
    import torch.distributed.checkpoint as dcp

    if keep < 1:
        raise CheckpointError(f"keep {keep}: the newest checkpoint is always kept, so keep must be >= 1")
    name = f"checkpoint-{update}"
    path = os.path.join(run_dir, name)
    if rank == 0 and os.path.exists(path):
        remove(path)
    if dist.is_initialized():
        dist.barrier()  # no rank writes into the folder before a stale one is gone
    try:
        with _single_process_quiet():
            dcp.save(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # DCP raises on every rank when any rank's write fails
        failed = {r: exc for r, (exc, _) in e.failures.items()} if isinstance(e, CheckpointException) else {rank: e}
        writes = sorted((r, exc) for r, exc in failed.items() if _write_error(exc))
        if not writes:  # not the disk: a rank that died mid-save, say; the caller's crash to handle
            raise
        r, exc = writes[0]
        raise _save_failed(run_dir, name, rank, f"rank {r} writing {_last_written(path, r, world, exc)}: "
                                                f"{_words(exc)}", exc) from None
    # dcp.save returns on every rank once every rank's files and rank 0's .metadata are written.
    mine = {f: {"bytes": os.path.getsize(os.path.join(path, f)), "sha256": file_sha256(os.path.join(path, f)),
                "rank": rank} for f in sorted(os.listdir(path)) if file_rank(f, world) == rank}
    everyone = [mine]
    if dist.is_initialized():
        everyone = [None] * world if rank == 0 else None
        dist.gather_object(mine, everyone, dst=0)
    problem, cause = None, None
    if rank == 0:
        try:
            _commit(run_dir, name, update, world, layout, everyone)
        except Exception as e:  # the manifest or the pointer could not be written: nothing was renamed
            problem, cause = f"rank 0 writing {getattr(e, 'filename', None) or name}: {_words(e)}", e
    if dist.is_initialized():  # the others learn rank 0's outcome, so that none trains on alone
        box = [problem, cause.errno if isinstance(cause, OSError) else None]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
        cause = OSError(box[1], "") if box[1] is not None else None
    if problem is not None:
        raise _save_failed(run_dir, name, rank, problem, cause)
    if rank != 0:
        return
    # Kept: this checkpoint and the keep - 1 newest before it. Newer ones than this exist only
    # after a resume from an older checkpoint: the run has left them behind.
    older = [c for c in checkpoints(run_dir) if checkpoint_number(c) < update][:keep - 1]
    for c in checkpoints(run_dir):
        if c != name and c not in older:
            remove(os.path.join(run_dir, c))


def _commit(run_dir, name, update, world, layout, everyone):
    """Rank 0 seals a written checkpoint: its manifest, then `latest` (save's steps 3)."""
    path = os.path.join(run_dir, name)
    files = {f: entry for entries in everyone for f, entry in entries.items()}
    manifest, pointer = os.path.join(path, "manifest.json"), os.path.join(run_dir, "latest")
    # Both files on disk under temporary names first, then two renames back to back: a kill
    # between them has microseconds to land in. Should a power loss keep only one rename,
    # either one is refused by the resume with advice, never loaded wrong (read_pointer).
    body = {"version": PROJECT_VERSION, "update": update, "world": world, "files": files}
    if layout is not None:
        body["layout"] = layout
    staged = []
    try:
        staged.append(stage(manifest, manifest_bytes(body)))
        staged.append(stage(pointer, name.encode()))
    except OSError:
        for tmp in [*staged, f"{manifest}.tmp{os.getpid()}", f"{pointer}.tmp{os.getpid()}"]:
            if os.path.exists(tmp):
                os.remove(tmp)
        raise
    os.replace(staged[0], manifest)
    os.replace(staged[1], pointer)
    _fsync_folder(path)
    _fsync_folder(run_dir)


def _save_failed(run_dir, name, rank, what, cause=None) -> "CheckpointError":
    """The error of a save that could not be written, after rank 0 removed what it left (the
    previous checkpoint and `latest` were never touched): one line, with the free space, and
    advice for the cause (`cause`: the OSError, when there is one)."""
    previous = read_pointer(run_dir, checkpoints(run_dir))[0] if os.path.exists(os.path.join(run_dir, "latest")) \
        else None
    if rank == 0 and previous != name:  # (a failure after both renames leaves it in charge: it stays)
        remove(os.path.join(run_dir, name))
    try:
        free = f"{shutil.disk_usage(run_dir).free / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    kept = f"{previous} and latest are as they were" if previous else "no earlier checkpoint exists"
    advice = os_advice(cause) if isinstance(cause, OSError) else "free some space"
    error = CheckpointError(f"saving {name} failed ({what}); {free} on the file system of {run_dir}; {kept}: "
                            f"{advice}, then run the same command again to continue")
    error.agreed = True  # every rank raises it (train.py prints it once per node)
    return error


def _last_written(path, rank, world, exc) -> str:
    """The file a failed write was writing: the error's own, or the newest of the rank's files."""
    if getattr(exc, "filename", None):
        return os.path.relpath(exc.filename, os.path.dirname(path))
    try:
        mine = [f for f in os.listdir(path) if file_rank(f, world) == rank]
        newest = max(mine, key=lambda f: os.path.getmtime(os.path.join(path, f)))
        return f"{os.path.basename(path)}/{newest}"
    except (OSError, ValueError):  # no folder, or no file of its yet
        return f"its files in {os.path.basename(path)}/"


def _write_error(e: BaseException) -> bool:
    """A failed write: an OSError (ENOSPC, EFBIG, EACCES, ...), or torch.save's zip writer
    reporting one as a RuntimeError ("unexpected pos", "file write failed")."""
    return isinstance(e, OSError) or any(w in str(e) for w in ("unexpected pos", "PytorchStreamWriter failed"))


def _words(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}"


def remove(path: str):
    """A checkpoint folder, its manifest first: a removal cut short never leaves a folder that
    looks complete."""
    if os.path.exists(os.path.join(path, "manifest.json")):
        os.remove(os.path.join(path, "manifest.json"))
    shutil.rmtree(path, ignore_errors=True)


# -----------------------------------------------------------------------------
# Resume: verify, then load

def resume_path(run_dir: str, resume_from, *, rank: int, world: int, option: str = None) -> str:
    """The path of the checkpoint to resume, verified on every rank before anything is loaded:
    the one `latest` names, or `resume_from` (a kept `checkpoint-N`), or, when `latest` is
    missing, the newest checkpoint that verifies (the one `latest` named, as a save writes the
    manifest just before the pointer: the caller says so in its log). One that does not
    verify raises CheckpointError naming the file at fault and the newest other checkpoint
    that verifies, with the arguments that resume from it (departure 1). `option`: how the
    command named the directory, for the message (default "--resume RUN_DIR")."""
    option = option or f"--resume {run_dir}"
    kept = checkpoints(run_dir)
    if not resume_from and not os.path.lexists(os.path.join(run_dir, "latest")):
        good = next((c for c in kept if check_checkpoint(run_dir, c, rank, world) is None), None)
        if good:
            return os.path.join(run_dir, good)
        name, problem = None, "latest is missing and no checkpoint verifies"
    elif resume_from:
        name, problem = resume_from, None if resume_from in kept else f"{run_dir} holds no {resume_from}"
    else:
        name, problem = read_pointer(run_dir, kept)
    if problem is None:
        problem = check_checkpoint(run_dir, name, rank, world)
    if problem is None:
        return os.path.join(run_dir, name)
    others = [c for c in kept if c != name]
    good = next((c for c in others if check_checkpoint(run_dir, c, rank, world) is None), None)
    fresh = f"remove it to start anew (rm -r {run_dir}), or pass another --run-dir"
    if good:
        advice = f"{good} verifies: resume from it with --resume {run_dir} --resume-from {good}"
    else:
        advice = ("no other checkpoint verifies" if others else "no other checkpoint is kept (see --keep)") + \
            f": nothing here can be continued; {fresh}"
    raise CheckpointError(f"{option}: {problem}; {advice}")


def load(path: str, state: dict):
    """Fill the template `state` (the same keys, shapes and shardings as the saved one) in
    place from a verified checkpoint (resume_path)."""
    import torch.distributed.checkpoint as dcp

    with _single_process_quiet():
        dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())


def saved_keys(path: str) -> set:
    """The flattened keys (`optimizer.update`, ...) of what a checkpoint holds, from DCP's index."""
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)


def read_pointer(run_dir: str, kept: list[str]):
    """(the checkpoint `latest` names, None), or (it, what is wrong with the pointer).

    `latest` holds the bare name, as scripts read it. A damaged pointer is caught all the same:
    it must name the newest checkpoint that holds a manifest, since a save writes the manifest
    just before it moves the pointer. Another name (a changed or lost byte) is refused, and so
    is an older one (a changed digit, or a crash between the two writes). Surrounding
    whitespace is allowed (a pointer written by hand), as it can never make one name another.
    """
    with open(os.path.join(run_dir, "latest"), "rb") as f:
        name = f.read().decode("ascii", errors="replace").strip()
    if name not in kept:
        return name, (f"latest names {name!r}, which is not a checkpoint folder in {run_dir}: latest is damaged, "
                      f"or the folder was removed")
    newer = [c for c in kept if checkpoint_number(c) > checkpoint_number(name)
             and os.path.exists(os.path.join(run_dir, c, "manifest.json"))]
    if newer:
        return name, (f"latest names {name} but {newer[0]} is newer and has a manifest: latest is damaged, "
                      f"or the run stopped between the two writes")
    return name, None


def check_checkpoint(run_dir: str, name: str, rank: int, world: int):
    """What is wrong with a checkpoint, the same answer on every rank, or None: its manifest
    intact and of this project version, then each rank's files against it (departure 2)."""
    path = os.path.join(run_dir, name)
    manifest, problem = read_manifest(path)
    if problem is None and manifest.get("version") != PROJECT_VERSION:
        problem = (f"{name} was written by LoGRA {manifest.get('version')} and this is LoGRA {PROJECT_VERSION}: "
                   f"resume it with LoGRA {manifest.get('version')}, whose code matches its state")
    if problem is None:
        problem = check_files(path, manifest, rank, world)
    if dist.is_initialized():
        problems = [None] * world
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p is not None), None)
    return problem


def read_manifest(path: str):
    """(manifest, None), or (None, what is wrong with it): missing, or damaged, i.e. its bytes
    are not the canonical layout of what they parse to with its own sha256."""
    where = f"{os.path.basename(path)}/manifest.json"
    try:
        with open(os.path.join(path, "manifest.json"), "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None, f"{where} is missing (its save did not finish)"
    try:
        body = json.loads(raw)
        body.pop("manifest_sha256")
        intact = manifest_bytes(body) == raw
    except (ValueError, AttributeError, KeyError, TypeError):  # not JSON, not an object, no checksum
        intact = False
    if not intact:
        return None, f"{where} is damaged (its bytes do not match its own sha256)"
    return body, None


def check_files(path: str, manifest: dict, rank: int, world: int):
    """What is wrong with this rank's share of a checkpoint's files, or None. Rank i checks the
    files written by ranks i, i + world, ...: at the world size of the save, its own shards."""
    folder = os.path.basename(path)
    for name, entry in sorted(manifest["files"].items()):
        if entry["rank"] % world != rank:
            continue
        where = f"{folder}/{name}"
        if not os.path.isfile(os.path.join(path, name)):
            return f"{where} is missing"
        size = os.path.getsize(os.path.join(path, name))
        if size != entry["bytes"]:  # truncated or grown: no need to read it
            return f"{where} holds {size} bytes where {folder}/manifest.json records {entry['bytes']}"
        if file_sha256(os.path.join(path, name)) != entry["sha256"]:
            return f"{where} does not match its sha256 in {folder}/manifest.json (damaged)"
    return None


# -----------------------------------------------------------------------------
# Files: names, hashes, the manifest's layout, atomic writes

def checkpoint_number(name: str) -> int:
    return int(CHECKPOINT_NAME.fullmatch(name).group(1))


def checkpoints(run_dir: str) -> list[str]:
    """The checkpoint folders of a run, newest first (complete or not)."""
    names = [n for n in os.listdir(run_dir) if CHECKPOINT_NAME.fullmatch(n) and os.path.isdir(os.path.join(run_dir, n))]
    return sorted(names, key=checkpoint_number, reverse=True)


def file_rank(name: str, world: int) -> int:
    """The rank that wrote a checkpoint file, and hashes and verifies it: DCP names rank i's
    shards `__<i>_<n>.distcp`; every other file (`.metadata`) is rank 0's. A name DCP might
    use in another version falls to rank 0: still hashed, only by one rank."""
    shard = re.match(r"__(\d+)_", name)
    return int(shard.group(1)) if shard and int(shard.group(1)) < world else 0


def file_sha256(path: str) -> str:
    """sha256 of a file, read in HASH_CHUNK_BYTES pieces into one buffer (a shard of a 7B
    checkpoint is gigabytes: never in memory at once)."""
    digest, buffer = hashlib.sha256(), bytearray(HASH_CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def manifest_bytes(body: dict) -> bytes:
    """manifest.json: the body and the sha256 of the body, in one canonical layout (sorted keys,
    one-space indent), so that any changed byte of the file changes what it parses to or stops
    it matching the layout: a damaged manifest is told apart from a damaged shard."""
    canonical = lambda obj: (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()  # noqa: E731
    return canonical(dict(body, manifest_sha256=hashlib.sha256(canonical(body)).hexdigest()))


def stage(path: str, data: bytes) -> str:
    """Write `data` to a temporary file next to `path` and onto the disk (fsync); return the
    temporary name. os.replace(it, path) then puts the file in place whole or not at all."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:  # a full disk, a signal: no temporary file is left behind
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError) and not e.filename:  # a failed write or fsync names no file: this one
            e.filename = tmp
        raise
    return tmp


def write_atomic(path: str, data: bytes):
    """`path` holds `data` whole, or what it held before: staged, renamed, the rename on disk.
    Raises the OSError of a write that failed, having removed its temporary file."""
    tmp = stage(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_folder(os.path.dirname(os.path.abspath(path)))


def truncate_rows(path: str, update: int):
    """On a resume from `update`: keep the rows of a JSON-lines log (metrics.jsonl) up to it,
    so that the updates run again (after the checkpoint, before the stop) are not logged
    twice. Written atomically. A torn last line (a power loss or a full disk during an append:
    no newline, or not JSON) is dropped and said in the returned note; a damaged line before
    the last is refused, naming it. Returns the note, or None."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            lines = f.readlines()
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({os_cause(e)})") from None
    rows, note = [], None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line) if line.endswith(b"\n") else None
            number = row["update"] if isinstance(row, dict) else None
        except (ValueError, KeyError, TypeError):
            number = None
        if not isinstance(number, int):
            if i == len(lines):  # what an append cut short leaves
                note = f"dropped the torn last line of {path} (line {i}, {len(line)} bytes)"
                continue
            raise CheckpointError(f"{path} line {i} is not a metrics row (damaged): repair or remove that line, "
                                  f"then run the same command again")
        if number <= update:
            rows.append(line)
    if note is None and len(rows) == sum(1 for line in lines if line.strip()):
        return None  # nothing to rewind: the file is left as it is
    try:
        write_atomic(path, b"".join(rows))
    except OSError as e:
        raise CheckpointError(f"rewinding {path} to update {update} failed ({os_cause(e)}): {os_advice(e)}, then "
                              f"run the same command again") from None
    return note


def _fsync_folder(folder: str):
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every save and load without a process group that it assumes a single
    process; that is what a one-process run is, so the warning is dropped."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
