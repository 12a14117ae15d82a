"""Models: the input adapter, body/head, LoRA on the ViTs, seeds, pretrained weights, training.

Fast on CPU: training and most checks use the CNN, ResNet-18 at 32x32 and vit-small; ViT-B/16
and ResNet-18 at 224 are built once each, only for their structure and parameter counts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from common.models import MODELS, VIT_SMALL, InputAdapter, PretrainedWeightsError, build_model, split_attention
from common.params import ParamSpec
from common.splits import ArrayDataset
from common.training import LocalRecipe, evaluate, train

SMALL = {"cnn": {}, "lenet": {}, "resnet18": {"input_size": 32}, "vit-small": {}}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models gain nothing from more threads; on a shared 2-vCPU machine two OpenMP threads
    made a vit-small step up to 30x slower than one (spin-waiting under contention)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def frozen(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


@pytest.fixture(scope="module")
def vit_b16():
    return build_model("vit-b16", 3, 32, 100, seed=0)


@pytest.fixture(scope="module")
def vit_small():
    return build_model("vit-small", 1, 28, 10, seed=0)


# --- the input adapter ------------------------------------------------------------------------


def test_adapter_channels_resize_and_normalisation():
    x = torch.rand(2, 1, 28, 28)
    up = InputAdapter(3, 32, "none")(x)
    assert up.shape == (2, 3, 32, 32)
    ref = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False, antialias=False)
    for c in range(3):
        torch.testing.assert_close(up[:, c : c + 1], ref)  # 1 -> 3 by repetition
    rgb = torch.rand(2, 3, 32, 32)
    torch.testing.assert_close(InputAdapter(1, 32, "none")(rgb), rgb.mean(1, keepdim=True))  # 3 -> 1 by mean
    assert torch.equal(InputAdapter(3, 32, "none")(rgb), rgb)  # nothing to do: unchanged
    norm = InputAdapter(3, 32, "imagenet")(rgb)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    torch.testing.assert_close(norm, (rgb - mean) / std)
    wide = InputAdapter(3, 16, "none")(torch.rand(2, 3, 20, 24))  # non-square inputs become square
    assert wide.shape == (2, 3, 16, 16)
    with pytest.raises(ValueError, match="cannot map 2 input channels"):
        InputAdapter(3, 32)(torch.rand(1, 2, 32, 32))


@pytest.mark.parametrize("name", sorted(SMALL))
@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32), (3, 20, 20), (1, 8, 8)])
def test_forward_shapes_any_data_any_model(name, shape):
    model = build_model(name, 1, 28, 7, seed=0, **SMALL[name])  # built for 1x28x28; fed any shape
    model.eval()
    x = torch.rand(3, *shape)
    with torch.no_grad():
        out = model(x)
        feats = model.features(x)
    assert out.shape == (3, 7)
    assert feats.shape == (3, model.head.in_features)
    torch.testing.assert_close(model.head(feats), out)  # body output feeds the head


@pytest.mark.parametrize("name", sorted(SMALL))
def test_adapter_stays_out_of_parameters_and_checkpoints(name):
    model = build_model(name, 3, 32, 5, seed=0, **SMALL[name])
    assert list(model.adapt.parameters()) == []
    assert not any(k.startswith("adapt") for k in model.state_dict())
    assert all(n.startswith(("body.", "head.")) for n, _ in model.named_parameters())
    assert isinstance(model.head, nn.Linear) and model.head.out_features == 5
    names = [n for n, _ in model.named_parameters()]
    assert names[-2:] == ["head.weight", "head.bias"]


def test_cnn_unchanged():
    """Same names, shapes and values as the CNN before the adapter existed (seeded, then built)."""
    model = build_model("cnn", 1, 8, 4, seed=3)
    assert [n for n, _ in model.named_parameters()] == [
        "body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias", "body.4.weight", "body.4.bias",
        "body.8.weight", "body.8.bias", "head.weight", "head.bias"]
    torch.manual_seed(3)
    ref = [nn.Conv2d(1, 32, 3, padding=1), nn.Conv2d(32, 64, 3, padding=1), nn.Conv2d(64, 64, 3, padding=1),
           nn.Linear(64 * 4 * 4, 128), nn.Linear(128, 4)]
    ref_params = [p for m in ref for p in m.parameters()]
    for (n, p), q in zip(model.named_parameters(), ref_params):
        assert torch.equal(p, q), n
    assert set(model.state_dict()) == {n for n, _ in model.named_parameters()}
    assert build_model("cnn", 1, 28, 10, seed=0, input_size=32).body[8].in_features == 64 * 16 * 16


def test_lenet_is_feddual_codes_network():
    """164,116 parameters for 10 classes (the code's Keras summary), Glorot kernels and zero biases, the
    120-unit dense layer on the channel axis of the 4x4x6 map; other input sizes are resized to 28."""
    model = build_model("lenet", 1, 28, 10, seed=0)
    assert sum(p.numel() for p in model.parameters()) == 164_116
    shapes = [tuple(p.shape) for _, p in model.named_parameters()]
    assert shapes == [(6, 1, 5, 5), (6,), (6, 6, 5, 5), (6,), (120, 6), (120,), (84, 1920), (84,), (10, 84), (10,)]
    assert all(torch.equal(p, torch.zeros_like(p)) for n, p in model.named_parameters() if n.endswith("bias"))
    w = model.head.weight
    assert w.abs().max() <= (6 / (84 + 10)) ** 0.5 and w.std() > 0.5 * (2 / (84 + 10)) ** 0.5  # Glorot uniform
    x = torch.rand(2, 1, 28, 28)
    maps = model.body[:6](model.adapt(x))  # after the second pooling: 6 x 4 x 4
    dense = torch.tanh(maps.permute(0, 2, 3, 1) @ model.body[7].weight.T + model.body[7].bias)
    torch.testing.assert_close(model.body[:10](model.adapt(x)), dense.reshape(2, -1))
    assert model.adapt.size == 28 and build_model("lenet", 1, 8, 10, seed=0).adapt.size == 28
    with pytest.raises(ValueError, match="input_size >= 14"):
        build_model("lenet", 1, 28, 10, seed=0, input_size=12)


# --- structure and parameter counts -------------------------------------------------------------


def test_resnet18_structure_full_fine_tuning():
    model = build_model("resnet18", 1, 28, 10, seed=0, batch_norm="running")  # default input 224
    assert model.adapt.size == 224 and model.adapt.channels == 3 and model.adapt.normalize == "imagenet"
    assert sum(p.numel() for p in model.parameters()) == 11_181_642  # torchvision 11_689_512 - fc(1000) + fc(10)
    assert ParamSpec.of(model).numel == 11_181_642  # all trainable
    assert isinstance(model.body.fc, nn.Identity) and model.head.in_features == 512
    assert "body.bn1.running_mean" in model.state_dict()  # BN statistics: buffers, not parameters


def test_resnet18_batch_statistics_option():
    """batch_norm="batch": no running statistics, so the parameters alone are the whole model."""
    a = build_model("resnet18", 3, 32, 10, seed=1, input_size=32, batch_norm="batch")
    assert not any("running" in k or "num_batches" in k for k in a.state_dict())
    b = build_model("resnet18", 3, 32, 10, seed=0, input_size=32, batch_norm="batch")
    spec = ParamSpec.of(a)
    spec.load_into(b, spec.flatten(a))
    x = torch.rand(8, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(a.eval()(x), b.eval()(x))
    with pytest.raises(ValueError, match="batch_norm"):
        build_model("resnet18", 3, 32, 10, seed=0, input_size=32, batch_norm="group")


def test_vit_b16_lora_only_adapters_and_head_travel(vit_b16):
    assert vit_b16.adapt.size == 224
    spec = ParamSpec.of(vit_b16)
    assert all(".lora_" in n or n.startswith("head.") for n in spec.names)
    # LoRA rank 4 on q and v of 12 blocks: 12 * 2 * (4*768 + 768*4); head 768*100 + 100
    assert spec.numel == 12 * 2 * 2 * 4 * 768 + 768 * 100 + 100 == 224_356
    total = sum(p.numel() for p in vit_b16.parameters())
    assert total == 86_567_656 - 769_000 + 76_900 + 147_456  # torchvision vit_b_16 - head(1000) + head(100) + LoRA
    assert spec.numel / total < 0.003  # measured 0.26 %
    layer = vit_b16.body.encoder.layers.encoder_layer_0.self_attention
    assert hasattr(layer.q, "lora_A") and hasattr(layer.v, "lora_A")
    assert not hasattr(layer.k, "lora_A") and not hasattr(layer.out_proj, "lora_A")
    assert layer.q.scaling["default"] == 2.0  # alpha 8 / rank 4
    assert not any(isinstance(m, nn.MultiheadAttention) for m in vit_b16.modules())


def test_vit_small_lora(vit_small):
    spec = ParamSpec.of(vit_small)
    assert all(".lora_" in n or n.startswith("head.") for n in spec.names)
    assert spec.numel == 6 * 2 * 2 * 4 * 192 + 192 * 10 + 10 == 20_362
    total = sum(p.numel() for p in vit_small.parameters())
    assert total == 1_824_970 and spec.numel / total < 0.012  # measured 1.1 %
    lora_b = [p for n, p in vit_small.named_parameters() if ".lora_B." in n]
    assert lora_b and all(torch.count_nonzero(p) == 0 for p in lora_b)  # LoRA starts as the base model


def test_lora_options():
    full = build_model("vit-small", 3, 32, 10, seed=0, lora_rank=0)
    assert ParamSpec.of(full).numel == sum(p.numel() for p in full.parameters())  # rank 0: full fine-tuning
    every = build_model("vit-small", 3, 32, 10, seed=0, lora_rank=2, lora_alpha=2, lora_targets="q,k,v,out_proj,mlp")
    attn = 6 * 4 * 2 * (2 * 192)
    mlp = 6 * 2 * (2 * 192 + 2 * 384)
    assert ParamSpec.of(every).numel == attn + mlp + 1930
    with pytest.raises(ValueError, match="lora_targets"):
        build_model("vit-small", 3, 32, 10, seed=0, lora_targets="qkv")
    with pytest.raises(ValueError, match="multiple of the patch size"):
        build_model("vit-small", 3, 32, 10, seed=0, input_size=30)
    with pytest.raises(TypeError, match="unknown model options"):
        build_model("vit-small", 3, 32, 10, seed=0, rank=4)
    with pytest.raises(ValueError, match="pretrained_weights"):
        build_model("cnn", 3, 32, 10, seed=0, pretrained_weights="x.pth")
    # run-config values may arrive as strings; LoRA options are ignored by models without LoRA
    assert build_model("vit-small", 3, 32, 10, seed=0, lora_rank="4", input_size="32").adapt.size == 32
    assert ParamSpec.of(build_model("cnn", 1, 8, 4, seed=0, lora_rank=4)).numel > 0
    assert set(MODELS) == {"cnn", "lenet", "resnet18", "vit-b16", "vit-small"}


def test_split_attention_is_the_same_function():
    from torchvision.models import VisionTransformer

    torch.manual_seed(0)
    net = VisionTransformer(image_size=32, num_classes=5, **VIT_SMALL).eval()
    x = torch.rand(4, 3, 32, 32)
    with torch.no_grad():
        before = net(x)
        split_attention(net)
        after = net(x)
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


# --- seeds ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SMALL))
def test_same_seed_same_model(name):
    state = torch.random.get_rng_state()
    a = build_model(name, 3, 32, 10, seed=5, **SMALL[name])
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is left alone
    b = build_model(name, 3, 32, 10, seed=5, **SMALL[name])
    c = build_model(name, 3, 32, 10, seed=6, **SMALL[name])
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    assert not torch.equal(ParamSpec.of(a).flatten(a), ParamSpec.of(c).flatten(c))


def test_vit_frozen_backbone_does_not_depend_on_seed():
    """A node builds with any seed and loads the trainable parameters: it gets the same model."""
    server = build_model("vit-small", 3, 32, 10, seed=7)
    node = build_model("vit-small", 3, 32, 10, seed=0)
    for (n, p), (_, q) in zip(frozen(server).items(), frozen(node).items()):
        assert torch.equal(p, q), n
    spec = ParamSpec.of(server)
    spec.load_into(node, spec.flatten(server))
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(server.eval()(x), node.eval()(x))


# --- pretrained weights ----------------------------------------------------------------------------


def test_resnet18_pretrained_weights(tmp_path):
    from torchvision.models import resnet18

    torch.manual_seed(123)
    ref = resnet18(weights=None)
    with torch.no_grad():
        ref.bn1.running_mean.uniform_()  # buffers load too
    path = tmp_path / "resnet18.pth"
    torch.save(ref.state_dict(), path)
    model = build_model("resnet18", 3, 32, 10, seed=0, input_size=32, pretrained_weights=str(path),
                        batch_norm="running")
    body = model.body.state_dict()
    for k, v in ref.state_dict().items():
        if not k.startswith("fc."):
            assert torch.equal(body[k], v), k
    assert model.head.weight.shape == (10, 512)  # a new head
    plain = build_model("resnet18", 3, 32, 10, seed=0, input_size=32)
    assert torch.equal(model.head.weight, plain.head.weight)  # the head comes from the seed
    assert not torch.equal(model.body.conv1.weight, plain.body.conv1.weight)


def test_pretrained_weights_errors(tmp_path):
    missing = tmp_path / "nope.pth"
    with pytest.raises(PretrainedWeightsError, match="nope.pth"):
        build_model("resnet18", 3, 32, 10, seed=0, input_size=32, pretrained_weights=str(missing))
    wrong = tmp_path / "wrong.pth"
    torch.save({"conv1.weight": torch.zeros(64, 3, 7, 7), "foo": torch.zeros(1)}, wrong)
    with pytest.raises(PretrainedWeightsError, match=r"wrong\.pth.*missing keys.*unexpected keys: foo"):
        build_model("resnet18", 3, 32, 10, seed=0, input_size=32, pretrained_weights=str(wrong))
    junk = tmp_path / "junk.pth"
    junk.write_text("not a checkpoint")
    with pytest.raises(PretrainedWeightsError, match="junk.pth"):
        build_model("resnet18", 3, 32, 10, seed=0, input_size=32, pretrained_weights=str(junk))


def test_vit_pretrained_weights_and_position_interpolation(tmp_path):
    from torchvision.models import VisionTransformer

    torch.manual_seed(9)
    ref = VisionTransformer(image_size=32, **VIT_SMALL)  # a torchvision-format ViT checkpoint
    path = tmp_path / "vit.pth"
    torch.save(ref.state_dict(), path)
    model = build_model("vit-small", 3, 32, 10, seed=0, pretrained_weights=str(path))
    q = model.body.encoder.layers.encoder_layer_0.self_attention.q.base_layer.weight
    in_proj = ref.encoder.layers.encoder_layer_0.self_attention.in_proj_weight
    assert torch.equal(q, in_proj[:192])
    assert torch.equal(model.body.conv_proj.weight, ref.conv_proj.weight)
    bigger = build_model("vit-small", 3, 32, 10, seed=0, input_size=48, pretrained_weights=str(path))
    assert bigger.body.encoder.pos_embedding.shape == (1, 12 * 12 + 1, 192)  # interpolated from 8x8
    assert bigger(torch.rand(1, 3, 32, 32)).shape == (1, 10)


# --- training ---------------------------------------------------------------------------------


def test_lora_model_trains_only_trainable_parameters():
    rng = np.random.default_rng(0)
    num_classes, n = 4, 64
    means = rng.uniform(0, 1, size=(num_classes, 1, 16, 16)).astype(np.float32)
    y = np.arange(n) % num_classes
    x = np.clip(means[y] + rng.normal(0, 0.1, size=(n, 1, 16, 16)), 0, 1).astype(np.float32)
    data = ArrayDataset(x, y.astype(np.int64), num_classes)
    model = build_model("vit-small", 1, 16, num_classes, seed=0)
    before_train, before_frozen = trainable(model), frozen(model)
    loss0 = evaluate(model, data)["loss"]
    train(model, data, LocalRecipe(local_epochs=3, batch_size=16, lr=0.01), seed=0)
    loss1 = evaluate(model, data)["loss"]
    assert loss1 < loss0
    for n, p in frozen(model).items():
        assert torch.equal(p, before_frozen[n]), n
    after = trainable(model)
    assert all(not torch.equal(after[n], before_train[n]) for n in after)  # every adapter and the head moved


def test_cnn_width_sets_the_channels_and_travels_from_the_run_config():
    from common.models import build_from_config
    from server_app.config import load_config

    narrow = build_from_config(load_config({"cnn-width": 16}).to_dict(), (1, 28, 28), 10, seed=0)
    assert [m.out_channels for m in narrow.body if isinstance(m, torch.nn.Conv2d)] == [16, 32, 32]
    assert narrow.head.in_features == 64
    wide = build_model("cnn", 1, 28, 10, seed=0)
    assert sum(p.numel() for p in narrow.parameters()) < sum(p.numel() for p in wide.parameters()) / 3


def test_cnn_group_norm_makes_each_convolution_scale_free_and_travels_from_the_run_config():
    from common.config import ConfigError
    from common.models import build_from_config
    from server_app.config import load_config

    x = torch.rand(16, 1, 28, 28)
    for norm, scale_free in (("none", False), ("group", True)):
        model = build_from_config(load_config({"cnn-width": 8, "cnn-norm": norm}).to_dict(), (1, 28, 28), 10, seed=0)
        norms = [m for m in model.body if isinstance(m, torch.nn.GroupNorm)]
        assert [(m.num_groups, m.num_channels) for m in norms] == ([] if norm == "none" else [(2, 8), (4, 16), (4, 16)])
        with torch.no_grad():
            before = model(x)
            for m in model.body:
                if isinstance(m, torch.nn.Conv2d):  # shrink every convolution, as a merge of random inits does
                    m.weight.mul_(0.2)
                    m.bias.mul_(0.2)
            after = model(x)
        kept = (after.std(0) / before.std(0)).mean().item()  # what of the input-dependent signal survives
        assert (abs(kept - 1) < 0.05) if scale_free else (kept < 0.05), (norm, kept)
    with pytest.raises(ConfigError, match="cnn-norm"):
        load_config({"cnn-norm": "batch"})
