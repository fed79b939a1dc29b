"""A tiny Hugging Face Qwen2 built from a config (no download), shared by the tests, and the
method files' Use blocks that the tests run on it (`use_block`).

Sizes are chosen distinct so that no target shape (d, k) can be confused with another
tensor: hidden 48, intermediate 80, 4 heads of 12 (q/o 48x48), 2 KV heads (k/v 24x48),
vocab 96. Token counts in tests avoid 24, 48 and 80.
"""

import textwrap

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

HIDDEN, INTERMEDIATE, VOCAB = 48, 80, 96


def tiny_config(**overrides) -> Qwen2Config:
    kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, tie_word_embeddings=False, rms_norm_eps=1e-6)
    kw.update(overrides)
    return Qwen2Config(**kw)


def tiny_qwen2(dtype=torch.float32, seed=0, **overrides) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = tiny_config(**overrides)
    model = Qwen2ForCausalLM(cfg).to(dtype)
    # Non-zero q/k/v biases, so that bias handling is exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
    model.eval()  # no dropout; tests switch to train() where they need it
    return model


def tiny_batch(batch=2, length=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g)


def use_block(doc: str) -> str:
    """A module docstring's Use block: the indented lines directly after the lines `Use` and
    `---`, up to the first line that is not indented (blank lines inside kept), dedented."""
    lines = doc.splitlines()
    start = next(i for i in range(len(lines) - 1) if lines[i] == "Use" and lines[i + 1] == "---") + 2
    end = next((i for i in range(start, len(lines)) if lines[i] and not lines[i].startswith("    ")), len(lines))
    assert start < end and lines[start].startswith("    "), "the block must follow the underline directly"
    return textwrap.dedent("\n".join(lines[start:end]))
