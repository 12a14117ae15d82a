"""Models. Every model is ``adapt`` -> ``body`` -> ``head``:

* ``adapt``: an :class:`InputAdapter`, parameter-free, that maps whatever images arrive
  (N, C, H, W) in [0, 1] to what the network expects (channels, size, normalisation), so any
  dataset (and the server's out-of-domain data) feeds any model;
* ``body``: the feature extractor; its output is what the head sees;
* ``head``: the final ``nn.Linear`` classifier (Feddle-OOD's surrogate works on body/head).

``forward(x) = head(body(adapt(x)))``; ``features(x) = body(adapt(x))`` takes raw data too.
The adapter has no parameters and no persistent buffers, so ``named_parameters()`` (and with it
:class:`common.params.ParamSpec` and the wire format) and ``state_dict()`` are those of body and head.

Registry (:data:`MODELS`) and default input sizes (``input_size=0`` picks the default):

=========  ==========================================  ===============  =====================
name       network                                     default input    trainable
=========  ==========================================  ===============  =====================
cnn        the papers' CNN (from scratch)               the data's own   all
lenet      FedDUAL's LeNet (from scratch, its code)     28               all
resnet18   torchvision ResNet-18, new ``fc`` head       224 (papers)     all (full fine-tuning)
vit-b16    torchvision ViT-B/16, new head               224 (papers)     LoRA adapters + head
vit-small  torchvision ViT, 6 layers, hidden 192        32               LoRA adapters + head
=========  ==========================================  ===============  =====================

vit-small (our choice, for CPU runs): patch 4 (8x8 = 64 patches + class token at 32x32),
6 blocks, 4 heads, hidden 192, MLP 384: 1.8 M parameters; with LoRA rank 4 on q,v 20,362 train
(10 classes). The torchvision nets take 3 channels and ImageNet normalisation (``normalize``).

LoRA (ViT models) is injected with ``peft`` (``inject_adapter_in_model``: in place, no
``PeftModel`` wrapper, so names stay ``body.*``/``head.*``). torchvision's ViT uses
``nn.MultiheadAttention``, whose q/k/v projections are one fused ``in_proj_weight`` parameter, not
``nn.Linear`` layers, so peft cannot put an adapter on q or v alone. peft does wrap ``out_proj``,
but MHA's forward reads ``out_proj.weight`` directly and never calls it: that adapter is silently
bypassed (no effect, no gradient). Targeting the whole MHA module (peft's experimental MHA support)
adapts the fused q|k|v with ONE rank-r pair plus out_proj. We therefore replace every ``nn.MultiheadAttention``
with :class:`SplitAttention`: the same computation with
separate ``q``, ``k``, ``v`` and ``out_proj`` ``nn.Linear`` layers, weights copied from ``in_proj``
(so pretrained weights load unchanged, before the split). peft then targets ordinary linears.
Default ``lora_targets="q,v"``: one adapter on the query and one on the value projection of every
encoder block (Hu et al.'s LoRA default; Feddle does not say which matrices). Rank 4 and
``lora_alpha=8`` by default: Feddle App. D's "rank 4, adaptation scale 8" read as alpha = 8, i.e.
peft's scaling alpha / r = 2 (set ``lora_alpha=32`` for a scaling of 8). ``lora_rank=0`` turns
LoRA off: full fine-tuning of the whole ViT.

ResNet-18's BatchNorm running statistics are buffers, not parameters: they do not travel
(see :class:`ResNet18` and its ``batch_norm`` option).

Seeds: everything that trains is initialised from ``seed``. Frozen weights (the ViT backbone
under LoRA) never travel, so they must be the same on every node whatever seed a node builds
with: they come from ``pretrained_weights`` or, without a file, from the fixed seed
:data:`FROZEN_SEED`.

Pretrained weights: ``pretrained_weights`` is the path of a local torchvision-format state_dict
(e.g. ``resnet18-f37072fd.pth``); nothing is ever downloaded. It is loaded (``weights_only=True``)
into the torchvision network before its head is replaced; a missing file or a state_dict whose
keys or shapes do not fit raises :class:`PretrainedWeightsError` naming the file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from common.config import COUNT, POSITIVE, OneOf, Range, from_keys, option, options_dict, specs_of
from common.errors import ConfigError
from common.user_code import build_user_model, is_import_path

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# normalize option -> (mean, std) per channel, or None
NORMALIZATIONS: dict[str, tuple[tuple[float, ...], tuple[float, ...]] | None] = {
    "none": None,
    "imagenet": (IMAGENET_MEAN, IMAGENET_STD),  # torchvision's ImageNet checkpoints
    "half": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),  # Google's / VPT's ImageNet-21k ViT checkpoints
}
FROZEN_SEED = 0
LORA_TARGETS = ("q", "k", "v", "out_proj", "mlp")
BATCH_NORMS = ("running", "batch")


class PretrainedWeightsError(ValueError):
    """A pretrained-weights file that is missing or does not fit the network."""


# ---------------------------------------------------------------------------------------------
# The input adapter and the adapt -> body -> head composition


class InputAdapter(nn.Module):
    """Maps (N, C, H, W) images in [0, 1] to the network's channels, size and normalisation.

    Channels: 1 -> C by repetition, C -> 1 by the mean, equal counts unchanged (others: error).
    Size: bilinear ``F.interpolate`` (``align_corners=False``, no antialias) to ``size`` x ``size``
    when the input is not that size already. Normalisation: ``(x - mean) / std`` per channel.
    Parameter-free; mean/std are non-persistent buffers (they move with ``.to()`` but are not in
    ``state_dict()``). Channel reduction runs before the resize and repetition after it.
    """

    def __init__(self, channels: int, size: int, normalize: str = "none") -> None:
        super().__init__()
        if normalize not in NORMALIZATIONS:
            raise ValueError(f"unknown normalize {normalize!r}; known: {sorted(NORMALIZATIONS)}")
        self.channels, self.size, self.normalize = int(channels), int(size), normalize
        stats = NORMALIZATIONS[normalize]
        if stats is not None and channels != len(stats[0]):
            if channels != 1:
                raise ValueError(f"normalize={normalize!r} has {len(stats[0])} channels, the network {channels}")
            stats = ((sum(stats[0]) / 3,), (sum(stats[1]) / 3,))
        self.register_buffer("mean", None if stats is None else torch.tensor(stats[0]).view(1, -1, 1, 1),
                             persistent=False)
        self.register_buffer("std", None if stats is None else torch.tensor(stats[1]).view(1, -1, 1, 1),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(f"expected images (N, C, H, W), got shape {tuple(x.shape)}")
        c = x.shape[1]
        if c != self.channels:
            if self.channels == 1:
                x = x.mean(dim=1, keepdim=True)
            elif c != 1:
                raise ValueError(f"cannot map {c} input channels to the network's {self.channels}")
        if x.shape[-2:] != (self.size, self.size):
            x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False, antialias=False)
        if x.shape[1] != self.channels:
            x = x.expand(-1, self.channels, -1, -1)
        if self.mean is not None:
            x = (x - self.mean) / self.std
        return x

    def extra_repr(self) -> str:
        return f"channels={self.channels}, size={self.size}, normalize={self.normalize!r}"


class AdaptedNet(nn.Module):
    """``head(body(adapt(x)))``. ``adapt`` is registered first and has no parameters, so the
    parameter names are ``body.*`` then ``head.*``."""

    adapt: InputAdapter
    body: nn.Module
    head: nn.Linear

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """What the head sees, from raw images (any channels and size)."""
        return self.body(self.adapt(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.adapt(x)))


@contextmanager
def _seeded(seed: int):
    """Run the block with torch's CPU generator seeded with `seed`; restore it afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


# ---------------------------------------------------------------------------------------------
# CNN


CNN_NORMS = ("none", "group")


class CNN(AdaptedNet):
    """The papers' CNN: three convolutions, one pooling layer, two fully connected layers.

    Feddle (App. D) states only the layer counts; widths (32, 64, 64, 128) and 3x3 kernels are
    our choice (docs/methods.md). The input size is free: the flattened size follows it.
    ``input_size`` (0 = `image_size`, the data's own) is the size the CNN is built for; the adapter
    resizes other inputs to it (Feddle: 32x32). Channels follow the data; no input normalisation.
    ``norm = "group"`` puts a GroupNorm (groups of 4 channels) after each convolution: scale-free layers, no
    buffers, so a merge of independently initialised models (FedMerge) keeps its signal (docs/methods.md).
    """

    def __init__(self, in_channels: int, image_size: int, num_classes: int, width: int = 32,
                 input_size: int = 0, norm: str = "none") -> None:
        super().__init__()
        if norm not in CNN_NORMS:
            raise ValueError(f"cnn: norm must be one of {CNN_NORMS}, got {norm!r}")
        size = input_size or image_size
        self.adapt = InputAdapter(in_channels, size, "none")
        pooled = size // 2

        def conv(c_in: int, c_out: int) -> list[nn.Module]:
            normed = [nn.GroupNorm(max(1, c_out // 4), c_out)] if norm == "group" else []
            return [nn.Conv2d(c_in, c_out, 3, padding=1), *normed, nn.ReLU()]

        self.body = nn.Sequential(
            *conv(in_channels, width),
            *conv(width, 2 * width),
            *conv(2 * width, 2 * width),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * width * pooled * pooled, 4 * width),
            nn.ReLU(),
        )
        self.head = nn.Linear(4 * width, num_classes)


class LeNet(AdaptedNet):
    """FedDUAL's "LeNet" for Fashion-MNIST, as its reference code builds it (spec feddual-and-mixing.md A.3):
    conv 5x5 (6, tanh) -> avg-pool 2 -> conv 5x5 (6, tanh) -> avg-pool 2 -> dense 120 (tanh) applied to
    the channel axis of the 4x4x6 map (the code applies it before flattening) -> flatten 1920 -> dense 84
    (tanh) -> dense `num_classes`: 164,116 parameters for 10 classes. Initialised as Keras does (Glorot
    uniform kernels, zero biases). Valid convolutions need 28x28 inputs: the adapter resizes others.
    """

    def __init__(self, in_channels: int, num_classes: int, input_size: int = 28) -> None:
        super().__init__()
        if (input_size - 4) // 2 - 4 < 1:
            raise ValueError(f"lenet needs input_size >= 14 (two valid 5x5 convolutions), got {input_size}")
        side = ((input_size - 4) // 2 - 4) // 2
        self.adapt = InputAdapter(in_channels, input_size, "none")
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5), nn.Tanh(), nn.AvgPool2d(2),
            nn.Conv2d(6, 6, 5), nn.Tanh(), nn.AvgPool2d(2),
            _ChannelsLast(), nn.Linear(6, 120), nn.Tanh(),  # Dense(120) on the channel axis, as the code
            nn.Flatten(), nn.Linear(120 * side * side, 84), nn.Tanh(),
        )
        self.head = nn.Linear(84, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)


class _ChannelsLast(nn.Module):
    """(N, C, H, W) -> (N, H, W, C): a Keras Dense layer before Flatten acts on the last (channel) axis."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(0, 2, 3, 1)


# ---------------------------------------------------------------------------------------------
# Pretrained weights


def _head_key(key: str) -> bool:
    return key.startswith(("fc.", "heads."))


def load_pretrained(net: nn.Module, path: str, what: str) -> None:
    """Load the torchvision-format state_dict at `path` into `net` (strict keys; the head's shape
    may differ, it is replaced anyway). ViT position embeddings are interpolated to the net's size."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise PretrainedWeightsError(f"pretrained weights for {what}: no such file {str(file)!r}")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:
        raise PretrainedWeightsError(f"pretrained weights for {what}: cannot read {str(file)!r} as a "
                                     f"torch state_dict ({type(err).__name__}: {err})") from err
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise PretrainedWeightsError(f"pretrained weights for {what}: {str(file)!r} does not hold a state_dict "
                                     "(a mapping of names to tensors, as saved by torch.save(model.state_dict()))")
    state = dict(state)
    own = net.state_dict()
    pos = "encoder.pos_embedding"
    if pos in state and pos in own and state[pos].shape != own[pos].shape and state[pos].dim() == 3:
        from torchvision.models.vision_transformer import interpolate_embeddings

        state = dict(interpolate_embeddings(net.image_size, net.patch_size, state))  # type: ignore[arg-type]
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [f"{k}: file {tuple(state[k].shape)} vs net {tuple(own[k].shape)}" for k in sorted(set(own) & set(state))
              if state[k].shape != own[k].shape and not _head_key(k)]
    if missing or unexpected or shapes:
        def few(items: list[str]) -> str:
            return ", ".join(items[:5]) + (f" ... ({len(items)} in all)" if len(items) > 5 else "")
        problems = [f"missing keys: {few(missing)}" if missing else "",
                    f"unexpected keys: {few(unexpected)}" if unexpected else "",
                    f"shape mismatches: {few(shapes)}" if shapes else ""]
        raise PretrainedWeightsError(f"pretrained weights {str(file)!r} do not fit torchvision's {what} ("
                                     + "; ".join(p for p in problems if p)
                                     + "); expected a torchvision-format state_dict")
    for k in own:  # the head is replaced after loading: a head of another size is simply skipped
        if _head_key(k) and state[k].shape != own[k].shape:
            state[k] = own[k]
    net.load_state_dict(state, strict=True)


# ---------------------------------------------------------------------------------------------
# ResNet-18


class ResNet18(AdaptedNet):
    """torchvision ResNet-18 (3 channels, ImageNet normalisation), full fine-tuning.

    ``body`` is the torchvision network with ``fc = Identity`` (output: the 512 pooled, flattened
    features; parameter names ``body.conv1.weight``, ... as in torchvision); ``head`` a new
    ``Linear(512, num_classes)``. Default input 224 (Feddle); ``input_size=32`` for CPU runs.

    BatchNorm (``batch_norm``): "running" (torchvision's, the default) keeps running statistics in
    buffers, which are in ``state_dict()`` but are NOT parameters, so they do not travel with the
    flat trainable parameters: a node that rebuilds the model and loads only the parameters
    evaluates with the initial (or pretrained) statistics. "batch" drops the running statistics
    (``track_running_stats=False``): BatchNorm always normalises with the current batch's
    statistics, in eval mode too, so the parameters are the whole model (evaluate in large batches).
    Either way a training batch of ONE sample fails at 32x32 input (layer4 is 1x1 spatially).
    """

    def __init__(self, in_channels: int, image_size: int, num_classes: int, *, seed: int,
                 pretrained_weights: str = "", input_size: int = 0, normalize: str = "",
                 batch_norm: str = "running") -> None:
        super().__init__()
        from torchvision.models import resnet18

        if batch_norm not in BATCH_NORMS:
            raise ValueError(f"resnet18: batch_norm must be one of {BATCH_NORMS}, got {batch_norm!r}")
        self.adapt = InputAdapter(3, input_size or 224, normalize or "imagenet")
        with _seeded(seed):
            net = resnet18(weights=None)
            if pretrained_weights:
                load_pretrained(net, pretrained_weights, "resnet18")
            if batch_norm == "batch":
                for m in net.modules():
                    if isinstance(m, nn.BatchNorm2d):
                        m.track_running_stats = False
                        m.running_mean = m.running_var = m.num_batches_tracked = None
            features = net.fc.in_features
            net.fc = nn.Identity()
            self.body = net
            self.head = nn.Linear(features, num_classes)


# ---------------------------------------------------------------------------------------------
# Vision transformers with LoRA


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


class ViT(AdaptedNet):
    """A torchvision VisionTransformer, attention split into q/k/v linears, LoRA on `lora_targets`.

    ``body`` is the transformer with ``heads = Identity`` (output: the class token after the final
    LayerNorm, ``hidden_dim`` features); ``head`` a new ``Linear(hidden_dim, num_classes)``.
    With ``lora_rank > 0`` only the adapters and the head train; ``lora_rank = 0``: everything trains.
    """

    def __init__(self, in_channels: int, image_size: int, num_classes: int, *, seed: int, arch: dict,
                 default_size: int, what: str, pretrained_weights: str = "", input_size: int = 0,
                 normalize: str = "", lora_rank: int = 4, lora_alpha: float = 8.0, lora_targets: str = "q,v") -> None:
        super().__init__()
        from torchvision.models import VisionTransformer

        size = input_size or default_size
        if size % arch["patch_size"]:
            raise ValueError(f"{what}: input size {size} is not a multiple of the patch size {arch['patch_size']}")
        if lora_rank < 0:
            raise ValueError(f"{what}: lora_rank must be >= 0 (0 = full fine-tuning), got {lora_rank}")
        self.adapt = InputAdapter(3, size, normalize or "imagenet")
        with _seeded(FROZEN_SEED if lora_rank else seed):
            net = VisionTransformer(image_size=size, **arch)
        if pretrained_weights:
            load_pretrained(net, pretrained_weights, what)
        features = net.hidden_dim
        net.heads = nn.Identity()
        split_attention(net)
        self.body = net
        with _seeded(seed):
            self.head = nn.Linear(features, num_classes)
            if lora_rank:
                add_lora(self.body, lora_rank, float(lora_alpha), lora_targets)


VIT_B16 = dict(patch_size=16, num_layers=12, num_heads=12, hidden_dim=768, mlp_dim=3072)
# A ViT for CPU runs at 32x32: 8x8 = 64 patches of 4x4 (+ class token), 6 blocks of width 192,
# 4 heads of 48, MLP 384 (2x). About 1.8 M parameters.
VIT_SMALL = dict(patch_size=4, num_layers=6, num_heads=4, hidden_dim=192, mlp_dim=384)


def _vit_b16(in_channels: int, image_size: int, num_classes: int, *, batch_norm: str, cnn_width: int,
             cnn_norm: str, **options) -> ViT:
    return ViT(in_channels, image_size, num_classes, arch=VIT_B16, default_size=224, what="vit_b_16", **options)


def _vit_small(in_channels: int, image_size: int, num_classes: int, *, batch_norm: str, cnn_width: int,
               cnn_norm: str, **options) -> ViT:
    return ViT(in_channels, image_size, num_classes, arch=VIT_SMALL, default_size=32, what="vit-small", **options)


def _cnn(in_channels: int, image_size: int, num_classes: int, *, seed: int, pretrained_weights: str,
         input_size: int, normalize: str, cnn_width: int, cnn_norm: str, **_: object) -> CNN:
    if pretrained_weights:
        raise ValueError("model 'cnn' is trained from scratch: pretrained_weights is not supported")
    if normalize not in ("", "none"):
        raise ValueError("model 'cnn' takes its inputs unnormalised: normalize must be '' or 'none'")
    with _seeded(seed):
        return CNN(in_channels, image_size, num_classes, width=cnn_width, input_size=input_size, norm=cnn_norm)


def _lenet(in_channels: int, image_size: int, num_classes: int, *, seed: int, pretrained_weights: str,
           input_size: int, normalize: str, **_: object) -> LeNet:
    if pretrained_weights or normalize not in ("", "none"):
        raise ValueError("model 'lenet' is trained from scratch on unnormalised inputs: pretrained_weights and "
                         "normalize are not supported")
    with _seeded(seed):
        return LeNet(in_channels, num_classes, input_size or DEFAULT_INPUT_SIZE["lenet"])


def _resnet18(in_channels: int, image_size: int, num_classes: int, **options) -> ResNet18:
    options = {k: v for k, v in options.items() if not k.startswith(("lora_", "cnn_"))}  # no LoRA: full fine-tuning
    return ResNet18(in_channels, image_size, num_classes, **options)


# name -> builder(in_channels, image_size, num_classes, *, seed, **every ModelSpec option)
MODELS: dict[str, Callable[..., AdaptedNet]] = {"cnn": _cnn, "lenet": _lenet, "resnet18": _resnet18,
                                                "vit-b16": _vit_b16, "vit-small": _vit_small}
DEFAULT_INPUT_SIZE: dict[str, int | None] = {"cnn": None, "lenet": 28, "resnet18": 224, "vit-b16": 224, "vit-small": 32}


@dataclass(frozen=True)
class ModelName(OneOf):
    """A built-in model, or a user's model factory ``module:function``."""

    def ok(self, v: str) -> bool:
        return v in set(self.allowed()) or is_import_path(v)

    def describe(self) -> str:
        return super().describe() + ", or your own model factory 'module:function'"

    def short(self) -> str:
        return super().short() + ", or `module:function` (your own)"


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The model keys: what the server and every node build the same model from. Travel in every message's
    config; a model ignores the options it has no use for (the LoRA ones without LoRA)."""

    model: str = option("cnn", ModelName(tuple(MODELS)), "see [Models](data-and-models.md#models); "
                        "`module:function`: your own model factory (see [Your own task](../tutorials/own-task.md))")
    pretrained_weights: str = option("", None, "resnet18 / vit-b16: a local torchvision-format `state_dict` "
                                     "(present on every node); `\"\"` = random init", "path")
    input_size: int = option(0, Range(0), "model input size; 0 = the model's default (cnn: the data's own, "
                             "resnet18 / vit-b16: 224, vit-small: 32)")
    lora_rank: int = option(4, Range(0), "ViTs: LoRA rank (Feddle: 4); 0 = full fine-tuning")
    lora_alpha: float = option(8.0, POSITIVE, "ViTs: LoRA alpha; scaling = alpha / rank (Feddle's \"adaptation "
                               "scale 8\" read as alpha = 8)")
    lora_targets: str = option("q,v", None, "ViTs: comma-separated layers that get adapters",
                               "subset of `q,k,v,out_proj,mlp`")
    normalize: str = option("", OneOf(("", *NORMALIZATIONS)),
                            "input normalisation; `\"\"` = the model's default (none for cnn, ImageNet otherwise)")
    batch_norm: str = option("batch", OneOf(("batch", "running")),
                             "resnet18: normalise with batch statistics always, or keep running statistics (they "
                             "are buffers and do not travel, so federated runs use `batch`)")
    cnn_width: int = option(32, COUNT, "cnn: channels of the first convolution (2× in the other two, 4× in the "
                            "hidden layer; the papers do not state widths)")
    cnn_norm: str = option("none", OneOf(CNN_NORMS),
                           "cnn: a GroupNorm after each convolution (`group`), so merges of independently "
                           "initialised models keep their scale (FedMerge on FMNIST)")


_OPTIONS = {spec.name: spec for spec in specs_of(ModelSpec).values() if spec.name != "model"}


def build_model(name: str, in_channels: int, image_size: int, num_classes: int, seed: int,
                **options: object) -> AdaptedNet:
    """Model `name` for data of `in_channels` x `image_size` x `image_size` and `num_classes`,
    initialised deterministically from `seed` (the global RNG is left as it was).

    `options` are :class:`ModelSpec`'s fields (those not given take its defaults): ``pretrained_weights``
    (not for cnn), ``input_size`` (0 = :data:`DEFAULT_INPUT_SIZE`), ``normalize`` (:data:`NORMALIZATIONS`),
    ``lora_rank``, ``lora_alpha``, ``lora_targets`` (ViTs), ``batch_norm`` (resnet18, see :class:`ResNet18`),
    ``cnn_width`` and ``cnn_norm`` (see :class:`CNN`). Options a model does not use are ignored, except
    ``pretrained_weights`` and ``normalize`` for the CNN (an error).
    """
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"unknown model options {unknown}; known: {sorted(_OPTIONS)}")
    options = {k: spec.default for k, spec in _OPTIONS.items()} | {
        k: _OPTIONS[k].type(v) for k, v in options.items()}  # run-config values may be str/int
    if options["input_size"] < 0:
        raise ValueError(f"input_size must be >= 0 (0 = the model's default), got {options['input_size']}")
    with torch.random.fork_rng(devices=[]):
        return MODELS[name](in_channels, image_size, num_classes, seed=seed, **options)


def model_config(config: Mapping[str, object]) -> dict[str, object]:
    """The model keys of a run's or a message's config, to send to nodes (a run config holds them all)."""
    return options_dict(from_keys(ModelSpec, config))


def check_on_data(model: nn.Module, x: np.ndarray, num_classes: int, name: str) -> None:
    """Run `model` (eval mode, no gradient) on the first rows of the data `x`: a model that cannot take the data's
    inputs, or whose output is not one score per class, is a config error naming ``model``, found at start on the
    server rather than at the first evaluation, or on every client."""
    batch = torch.from_numpy(np.ascontiguousarray(x[:4]))
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(batch.to(device))
    except Exception as err:  # noqa: BLE001 - whatever the user's model raises, the key is named
        raise ConfigError("model", name, f"a model that takes this data's inputs; on a batch of shape "
                          f"{tuple(batch.shape)} it raised {type(err).__name__}: {err}") from None
    finally:
        model.train(was_training)
    expected = (len(batch), num_classes)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError("model", name, f"a model with one score per class: {expected} for {len(batch)} samples of "
                          f"{num_classes} classes; it returned {got}")


def build_from_config(config: Mapping[str, object], input_shape: tuple[int, ...], num_classes: int,
                      seed: int) -> nn.Module:
    """The run's model for samples of `input_shape` — what server and nodes both call: a user's factory
    (``model = "module:function"``, common/user_code.py), or :func:`build_model` with the name and options of
    :func:`model_config` (images ``(C, H, W)`` only)."""
    chosen = from_keys(ModelSpec, config)
    name = chosen.model
    if is_import_path(name):
        return build_user_model(name, input_shape, num_classes, seed)
    if len(input_shape) != 3:
        raise ConfigError("model", name, f"your own model factory 'module:function' for inputs of shape "
                          f"{tuple(input_shape)}: the built-in models take images (C, H, W)")
    return build_model(name, input_shape[0], input_shape[1], num_classes, seed,
                       **{k: getattr(chosen, k) for k in _OPTIONS})
