"""LoRA on a torchvision ViT: its attention split into q/k/v linears (:class:`SplitAttention`), then peft's
adapters on the chosen ones (the package's docstring says why the split)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

LORA_TARGETS = ("q", "k", "v", "out_proj", "mlp")


class SplitAttention(nn.Module):
    """``nn.MultiheadAttention`` (batch_first, self-attention as torchvision's ViT calls it) with
    separate ``q``, ``k``, ``v`` and ``out_proj`` ``nn.Linear`` layers, so LoRA can target them."""

    def __init__(self, dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"hidden size {dim} is not divisible by {num_heads} heads")
        self.num_heads, self.dropout = num_heads, dropout
        self.q = nn.Linear(dim, dim, bias=bias)
        self.k = nn.Linear(dim, dim, bias=bias)
        self.v = nn.Linear(dim, dim, bias=bias)
        self.out_proj = nn.Linear(dim, dim, bias=bias)

    @staticmethod
    def from_mha(mha: nn.MultiheadAttention) -> SplitAttention:
        if not mha._qkv_same_embed_dim or not mha.batch_first:
            raise ValueError("only batch_first self-attention with equal q/k/v sizes can be split")
        has_bias = mha.in_proj_bias is not None
        att = SplitAttention(mha.embed_dim, mha.num_heads, mha.dropout, bias=has_bias)
        with torch.no_grad():
            for i, lin in enumerate((att.q, att.k, att.v)):
                lin.weight.copy_(mha.in_proj_weight.chunk(3)[i])
                if has_bias:
                    lin.bias.copy_(mha.in_proj_bias.chunk(3)[i])
            att.out_proj.weight.copy_(mha.out_proj.weight)
            if has_bias:
                att.out_proj.bias.copy_(mha.out_proj.bias)
        return att

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                need_weights: bool = False, **_: object) -> tuple[torch.Tensor, None]:
        if need_weights:
            # torchvision's encoder never asks for them; scaled_dot_product_attention does not return them
            raise ValueError("SplitAttention returns outputs only: need_weights=True is not supported")
        n, t, d = query.shape
        h = self.num_heads

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(n, -1, h, d // h).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q(query)), heads(self.k(key)), heads(self.v(value)),
                                             dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(out.transpose(1, 2).reshape(n, t, d)), None


def split_attention(net: nn.Module) -> None:
    """Replace every ``nn.MultiheadAttention`` in `net` by an equivalent :class:`SplitAttention`."""
    for module in list(net.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.MultiheadAttention):
                setattr(module, child_name, SplitAttention.from_mha(child))


def _lora_regex(targets: str) -> str:
    names = [t.strip() for t in targets.split(",") if t.strip()]
    bad = [t for t in names if t not in LORA_TARGETS]
    if bad or not names:
        raise ValueError(f"lora_targets {targets!r}: expected a comma-separated subset of {', '.join(LORA_TARGETS)}")
    parts = []
    attn = [t for t in LORA_TARGETS[:4] if t in names]
    if attn:
        parts.append(r".*\.self_attention\.(" + "|".join(attn) + ")")
    if "mlp" in names:
        parts.append(r".*\.mlp\.(0|3)")  # torchvision's MLPBlock: Linear(0), GELU, Dropout, Linear(3), Dropout
    return "|".join(parts)


def add_lora(body: nn.Module, rank: int, alpha: float, targets: str) -> None:
    """Freeze `body` and inject peft LoRA adapters (in place, no wrapper: names stay ``body.*``)."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none", target_modules=_lora_regex(targets))
    for p in body.parameters():
        p.requires_grad_(False)
    inject_adapter_in_model(config, body)
    for name, p in body.named_parameters():
        p.requires_grad_(".lora_" in name)
