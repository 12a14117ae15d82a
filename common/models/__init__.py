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

from common.models.adapter import NORMALIZATIONS, AdaptedNet, InputAdapter
from common.models.lora import SplitAttention, add_lora, split_attention
from common.models.networks import CNN, VIT_B16, VIT_SMALL, LeNet, ResNet18, ViT
from common.models.pretrained import PretrainedWeightsError, load_pretrained
from common.models.registry import (
    DEFAULT_INPUT_SIZE,
    MODELS,
    ModelName,
    ModelSpec,
    build_from_config,
    build_model,
    check_on_data,
    model_config,
)

__all__ = ["CNN", "DEFAULT_INPUT_SIZE", "MODELS", "NORMALIZATIONS", "VIT_B16", "VIT_SMALL", "AdaptedNet",
           "InputAdapter", "LeNet", "ModelName", "ModelSpec", "PretrainedWeightsError", "ResNet18", "SplitAttention",
           "ViT", "add_lora", "build_from_config", "build_model", "check_on_data", "load_pretrained", "model_config",
           "split_attention"]
