"""The paper's task at toy scale, made on this machine: a checkpoint, a tokenizer, the data.

    python tests/tiny_math.py OUT_DIR     # writes OUT_DIR/{model,train.jsonl,eval.jsonl}

The math-task path of train.py (vLLM engines, chat prompts, math-verify grading, sharded
checkpoint load) reads exactly what a user downloads for the paper's runs, so this writes the
same kinds of files, small:

- `model/`: a Qwen2 checkpoint (`save_pretrained`, safetensors) with head_dim 32 (vLLM's CPU
  attention kernel refuses 16) and a byte-level BPE tokenizer trained here on the task's text,
  with Qwen's special tokens and chat template (`<|im_start|>role ... <|im_end|>`), so that
  `AutoTokenizer.from_pretrained` and vLLM load it like a Qwen2.5 checkpoint.
- `train.jsonl` in DAPO-Math-17k's row format (`prompt` = [{"role": "user", "content": ...}]
  with DAPO's instruction and answer-format lines, `reward_model.ground_truth`), and
  `eval.jsonl` in MATH-500's (`problem`, `answer`).

The problems are one-digit sums ("What is $3+4$?"). RL with a binary reward needs a policy
that is sometimes right, so the checkpoint gets a short supervised warm-up on boxed answers
and lands at partial accuracy; every random draw has an explicit seed.
"""

import json
import os
import random
import sys

import torch

SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of "
               "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.")
DAPO_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5's chat template, reduced to what the task uses (no tools).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def problems(seed: int):
    """All 100 one-digit sums, shuffled with `seed`: the first 80 train, the last 20 evaluate."""
    every = [(a, b) for a in range(10) for b in range(10)]
    random.Random(f"tiny-math:{seed}").shuffle(every)
    return every[:80], every[80:]


def question(a: int, b: int) -> str:
    return f"What is ${a}+{b}$?"


def make_tokenizer(out_dir: str):
    """A byte-level BPE over the task's text, saved as a Qwen2-style fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [SYSTEM, DAPO_PREFIX, DAPO_SUFFIX, "system", "user", "assistant"]
    corpus += [question(a, b) + f" \\boxed{{{a + b}}}" for a in range(10) for b in range(10)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS[1:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def make_model(tokenizer, *, seed: int, steps: int, train):
    """A 2-layer Qwen2 (hidden 64, 2 heads of 32), warmed up on boxed answers to `train`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)  # Hugging Face initialises from the global generator
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         tie_word_embeddings=False, rms_norm_eps=1e-6,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.pad_token_id)
    model = Qwen2ForCausalLM(config)
    seqs = []
    for a, b in train:
        prompt = tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question(a, b)}],
            add_generation_prompt=True, tokenize=True, return_dict=False)
        answer = tokenizer.encode(f"\\boxed{{{a + b}}}", add_special_tokens=False) + [tokenizer.eos_token_id]
        seqs.append((prompt, answer))
    width = max(len(p) + len(a) for p, a in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id)  # (B, T)
    labels = torch.full((len(seqs), width), -100)
    for i, (p, a) in enumerate(seqs):
        ids[i, :len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p):len(p) + len(a)] = torch.tensor(a)  # only the answer is learned
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        rows = torch.randint(0, len(seqs), (32,), generator=g)
        model(input_ids=ids[rows], labels=labels[rows]).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.eval()


def write_data(out_dir: str, train, heldout) -> tuple[str, str]:
    train_path, eval_path = os.path.join(out_dir, "train.jsonl"), os.path.join(out_dir, "eval.jsonl")
    with open(train_path, "w") as f:
        for i, (a, b) in enumerate(train):
            content = f"{DAPO_PREFIX}\n\n{question(a, b)}\n\n{DAPO_SUFFIX}"
            f.write(json.dumps({"data_source": "tiny-math", "prompt": [{"content": content, "role": "user"}],
                                "ability": "MATH", "reward_model": {"ground_truth": str(a + b), "style": "rule"},
                                "extra_info": {"index": str(i)}}) + "\n")
    with open(eval_path, "w") as f:
        for i, (a, b) in enumerate(heldout):
            f.write(json.dumps({"problem": question(a, b), "solution": f"$\\boxed{{{a + b}}}$",
                                "answer": str(a + b), "subject": "Arithmetic", "level": 1,
                                "unique_id": f"tiny/{i}.json"}) + "\n")
    return train_path, eval_path


def make(out_dir: str, *, seed: int = 0, steps: int = 150) -> dict:
    """Write the checkpoint, tokenizer and data; returns their paths."""
    model_dir = os.path.join(out_dir, "model")
    os.makedirs(model_dir, exist_ok=True)
    train, heldout = problems(seed)
    tokenizer = make_tokenizer(model_dir)
    make_model(tokenizer, seed=seed, steps=steps, train=train).save_pretrained(model_dir)
    train_path, eval_path = write_data(out_dir, train, heldout)
    return {"model": model_dir, "train": train_path, "eval": eval_path}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tests/tiny_math.py OUT_DIR")
    print(json.dumps(make(sys.argv[1]), indent=1))
