"""The model registry: the model keys (:class:`ModelSpec`), what each name builds, and the one way server and
nodes build the run's model (:func:`build_from_config`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from common.config import COUNT, POSITIVE, OneOf, Range, from_keys, option, options_dict, specs_of
from common.errors import ConfigError
from common.models.adapter import NORMALIZATIONS, AdaptedNet, seeded
from common.models.networks import CNN, CNN_NORMS, VIT_B16, VIT_SMALL, LeNet, ResNet18, ViT
from common.user_code import build_user_model, is_import_path


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
    with seeded(seed):
        return CNN(in_channels, image_size, num_classes, width=cnn_width, input_size=input_size, norm=cnn_norm)


def _lenet(in_channels: int, image_size: int, num_classes: int, *, seed: int, pretrained_weights: str,
           input_size: int, normalize: str, **_: object) -> LeNet:
    if pretrained_weights or normalize not in ("", "none"):
        raise ValueError("model 'lenet' is trained from scratch on unnormalised inputs: pretrained_weights and "
                         "normalize are not supported")
    with seeded(seed):
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
