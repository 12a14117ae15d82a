"""Pretrained weights: a local torchvision-format state_dict loaded into a torchvision network (nothing is ever
downloaded; the package's docstring)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn


class PretrainedWeightsError(ValueError):
    """A pretrained-weights file that is missing or does not fit the network."""


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
