"""The built-in networks: the papers' CNN, FedDUAL's LeNet, torchvision's ResNet-18 and ViTs (with LoRA), each
``adapt -> body -> head`` (:class:`~common.models.adapter.AdaptedNet`)."""

from __future__ import annotations

import torch
from torch import nn

from common.models.adapter import AdaptedNet, InputAdapter, seeded
from common.models.lora import add_lora, split_attention
from common.models.pretrained import load_pretrained

FROZEN_SEED = 0
BATCH_NORMS = ("running", "batch")

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
        with seeded(seed):
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
        with seeded(FROZEN_SEED if lora_rank else seed):
            net = VisionTransformer(image_size=size, **arch)
        if pretrained_weights:
            load_pretrained(net, pretrained_weights, what)
        features = net.hidden_dim
        net.heads = nn.Identity()
        split_attention(net)
        self.body = net
        with seeded(seed):
            self.head = nn.Linear(features, num_classes)
            if lora_rank:
                add_lora(self.body, lora_rank, float(lora_alpha), lora_targets)


VIT_B16 = dict(patch_size=16, num_layers=12, num_heads=12, hidden_dim=768, mlp_dim=3072)
# A ViT for CPU runs at 32x32: 8x8 = 64 patches of 4x4 (+ class token), 6 blocks of width 192,
# 4 heads of 48, MLP 384 (2x). About 1.8 M parameters.
VIT_SMALL = dict(patch_size=4, num_layers=6, num_heads=4, hidden_dim=192, mlp_dim=384)
