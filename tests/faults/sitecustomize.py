"""Fault injection for the healing tests: on PYTHONPATH, Python imports this file in every
process it starts, and it acts only in an engine process (`python infra/vllm_serve.py SPEC`) when
LOGRA_TEST_FAULT is set:

    LOGRA_TEST_FAULT="start"                 the engine kills itself as it starts, every time
    LOGRA_TEST_FAULT="noimport"              `import vllm` fails in the engine process
    LOGRA_TEST_FAULT="generate:3,apply:5"    SIGKILL on receiving its 3rd 'generate' command
                                             (or 5th 'apply': a sync), each at most once a run
    LOGRA_TEST_FAULT="0/generate:3,1/apply:5"  the same, each for one rank's engine only (the
                                             engine whose log is engine-<rank>.log)
    LOGRA_TEST_FAULT="apply:5@vllm"          SIGKILL vLLM's own processes (engine core, worker:
                                             this process's descendants) instead, as the OOM
                                             killer would; the engine process lives on
    LOGRA_TEST_FAULT="stale-kernels"         vLLM's CPU GEMMs are never re-packed after a sync
                                             (vllm_serve._refresh_cpu_kernels does nothing): the
                                             engine's `.weight`s, and so its fingerprints, follow
                                             the trainer, its outputs stay the checkpoint's
    LOGRA_TEST_FAULT_DIR=DIR                 where "this fault has fired" is written (default:
                                             the log's folder), so that the restarted engine
                                             does not fire it again

The kill is SIGKILL of the engine process alone (vLLM's engine-core and worker processes live
on) or of vLLM's processes alone; the trainer must notice wherever it waits. "stale-kernels"
acts in every process of the run, wherever infra.vllm_serve is imported by that name: only in
vLLM's worker (forked from the engine process, or spawned with its environment), since the
engine process runs it as __main__.
"""

import importlib.util
import json
import os
import signal
import sys


class _StaleKernels:
    """A finder that hands out infra.vllm_serve with `_refresh_cpu_kernels` a no-op."""

    def find_spec(self, name, path=None, target=None):
        if name != "infra.vllm_serve":
            return None
        sys.meta_path.remove(self)  # the module's own spec, found without this finder
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module._refresh_cpu_kernels = lambda layers: None
            print("faults: vLLM's CPU kernels are never re-packed", flush=True)

        spec.loader.exec_module = exec_module
        return spec


def _engine_log():
    if len(sys.argv) == 2 and sys.argv[0].endswith("vllm_serve.py"):
        try:
            return json.loads(sys.argv[1]).get("log", "")
        except ValueError:
            return None
    return None


def _descendants(pid):
    children = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(p))
        except OSError:
            pass
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _install(faults, fired_dir):
    from multiprocessing.connection import Connection

    counts, recv = {}, Connection.recv

    def counting_recv(self):
        message = recv(self)
        if isinstance(message, tuple) and len(message) == 2 and isinstance(message[0], str):
            command = message[0]
            counts[command] = counts.get(command, 0) + 1
            mark = os.path.join(fired_dir, f"fired-{os.path.basename(_log)}-{command}-{counts[command]}")
            count, target = faults.get(command, (None, None))
            if count == counts[command] and not os.path.exists(mark):
                open(mark, "w").close()
                print(f"faults: SIGKILL of {target} on {command} #{counts[command]}", flush=True)
                for pid in _descendants(os.getpid()) if target == "vllm" else [os.getpid()]:
                    os.kill(pid, signal.SIGKILL)
        return message

    Connection.recv = counting_recv


_log = _engine_log()
_spec = os.environ.get("LOGRA_TEST_FAULT")
if _spec == "stale-kernels":
    sys.meta_path.insert(0, _StaleKernels())
    _spec = ""
if _log is not None and _spec:
    if _spec == "start":
        print("faults: SIGKILL at start", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if _spec == "noimport":
        class _NoVLLM:
            def find_spec(self, name, path=None, target=None):
                if name == "vllm" or name.startswith("vllm."):
                    raise ImportError(f"faults: no module named {name!r} here")
                return None

        sys.meta_path.insert(0, _NoVLLM())
        _spec = ""
    _faults = {}
    for _item in filter(None, _spec.split(",")):
        _rank, _, _what = _item.rpartition("/")
        if not _rank or _log.endswith(f"engine-{_rank}.log"):
            _command, _count = _what.split(":")
            _count, _, _target = _count.partition("@")
            _faults[_command] = (int(_count), _target or "engine")
    _install(_faults, os.environ.get("LOGRA_TEST_FAULT_DIR", os.path.dirname(_log)))
