"""A stand-in with vLLM's fused parameter names and shapes (qkv_proj, gate_up_proj), for sync tests.

It is not runnable; it holds weights the way a vLLM Qwen2 model does with tensor parallel
size 1: `model.layers.i.self_attn.qkv_proj.weight` = [q; k; v] rows and
`model.layers.i.mlp.gate_up_proj.weight` = [gate; up] rows, with `output_sizes` as vLLM sets.
"""

import torch
import torch.nn as nn


class Fused(nn.Module):
    def __init__(self, weight, output_sizes):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.output_sizes = list(output_sizes)
        self.tp_size = 1


def vllm_standin(hf_model=None, *, config=None, device=None, dtype=torch.bfloat16):
    """From a HF Qwen2 model (weights copied), or from a config (empty weights, e.g. on meta)."""
    cfg = hf_model.config if hf_model is not None else config
    h, inter = cfg.hidden_size, cfg.intermediate_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList()
    for i in range(cfg.num_hidden_layers):
        if hf_model is not None:
            src = hf_model.model.layers[i]
            a, m = src.self_attn, src.mlp
            qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach().to(dtype)
            o = a.o_proj.weight.detach().to(dtype).clone()  # never share storage with hf_model
            gu = torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach().to(dtype)
            down = m.down_proj.weight.detach().to(dtype).clone()
        else:
            qkv = torch.empty(q + 2 * kv, h, device=device, dtype=dtype)
            o = torch.empty(h, q, device=device, dtype=dtype)
            gu = torch.empty(2 * inter, h, device=device, dtype=dtype)
            down = torch.empty(h, inter, device=device, dtype=dtype)
        layer = nn.Module()
        layer.self_attn = nn.Module()
        layer.self_attn.qkv_proj = Fused(qkv, [q, kv, kv])
        layer.self_attn.o_proj = Fused(o, [h])
        layer.mlp = nn.Module()
        layer.mlp.gate_up_proj = Fused(gu, [inter, inter])
        layer.mlp.down_proj = Fused(down, [h])
        root.model.layers.append(layer)
    return root
