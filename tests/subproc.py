"""What the tests that start train.py or an engine in a subprocess share: the repository root,
the environment such a process gets (one thread, offline, not part of a torchrun world), two
torchrun "nodes" on this machine, the processes an engine left, and a run's checkpoint read back."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env(**extra) -> dict:
    e = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
             TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # torchrun's restarts meet at a fresh store (README)
    e.pop("WORLD_SIZE", None)
    e.pop("LOCAL_WORLD_SIZE", None)
    e.update(extra)
    return e


FAULTS = os.path.join(ROOT, "tests", "faults")  # its sitecustomize.py kills engines on cue (LOGRA_TEST_FAULT)


def faults(spec) -> dict:
    """The environment of a run whose engines die as `spec` says (tests/faults/sitecustomize.py)."""
    return env(PYTHONPATH=os.pathsep.join([ROOT, FAULTS]), LOGRA_TEST_FAULT=spec)


def two_nodes(args, port, out_dir, *, own_mount=None, timeout=300, environ=None):
    """Run train.py as two torchrun nodes of one rank each; [(returncode, stdout, stderr)] per
    node. `own_mount`: node 1 sees a fresh, empty tmpfs at that folder (its own mount
    namespace), as a node that does not share the file system would. `environ`: the nodes'
    environment (default: env())."""
    procs, logs = [], []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}",
               os.path.join(ROOT, "train.py"), *args]
        if node == 1 and own_mount:
            cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                   'mount -t tmpfs none "$0" && exec "$@"', str(own_mount), *cmd]
        # files, not pipes: a node blocked on a full pipe would stall the other in a collective
        logs.append((open(out_dir / f"node{node}-{port}.out", "w+"), open(out_dir / f"node{node}-{port}.err", "w+")))
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=environ or env(), stdout=logs[-1][0], stderr=logs[-1][1]))
    results = []
    try:
        for p, (out, err) in zip(procs, logs):
            p.wait(timeout=timeout)
            out.seek(0)
            err.seek(0)
            results.append((p.returncode, out.read(), err.read()))
    finally:
        for p in procs:  # torchrun passes a SIGTERM on to its workers; a SIGKILL would orphan them
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
        for out, err in logs:
            out.close()
            err.close()
    return results


def engine_processes(marker: str) -> list[int]:
    """Live processes whose command line or environment mentions `marker` (a run's unique
    folder): an engine process and vLLM's engine-core and worker processes inherit the
    engine's environment, which names its log file."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if int(pid) != os.getpid() and not zombie and (marker.encode() in cmd or marker.encode() in environ):
            found.append(int(pid))
    return found


def read_checkpoint(run_dir, name=None):
    """A run's checkpoint (default: the one `latest` names), gathered into one dict by torch's
    own converter."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    name = name or open(os.path.join(run_dir, "latest")).read().strip()
    out = os.path.join(run_dir, name + ".pt")
    dcp_to_torch_save(os.path.join(run_dir, name), out)
    state = torch.load(out, weights_only=False)
    os.remove(out)
    return state


def model_state(run_dir):
    return read_checkpoint(run_dir)["model"]
