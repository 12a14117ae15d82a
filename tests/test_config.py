"""Configuration: defaults, presets, overrides, and one clear error per bad value."""

from __future__ import annotations

import tomllib

import pytest

from common.config import CONFIG_DIR, ConfigError, RunConfig, load_config, read_preset
from scripts.flower import PROJECT_DIR


def test_pyproject_run_config_mirrors_schema_defaults():
    pyproject = tomllib.loads((PROJECT_DIR / "pyproject.toml").read_text())
    assert pyproject["tool"]["flwr"]["app"]["config"] == RunConfig().to_dict()


def test_preset_overrides_defaults_and_user_overrides_preset():
    preset = read_preset("fedavg-digits")
    assert preset["local-epochs"] != RunConfig().local_epochs  # the layer below is really overridden
    cfg = load_config({})
    assert cfg.preset == "fedavg-digits" and cfg.local_epochs == preset["local-epochs"]
    assert load_config({"local-epochs": 5}).local_epochs == 5


def test_int_given_for_float_is_accepted():
    assert load_config({"lr": 1}).lr == 1.0 and isinstance(load_config({"lr": 1}).lr, float)


@pytest.mark.parametrize("name", sorted(p.relative_to(CONFIG_DIR).with_suffix("").as_posix()
                                         for p in CONFIG_DIR.rglob("*.yaml")))
def test_every_preset_loads(name):
    assert load_config({"preset": name}).preset == name


def test_a_preset_builds_on_its_bases_in_order_and_a_cycle_is_an_error(tmp_path, monkeypatch):
    import common.config as C

    monkeypatch.setattr(C, "CONFIG_DIR", tmp_path)
    (tmp_path / "fam").mkdir()
    (tmp_path / "fam" / "protocol.yaml").write_text("lr: 0.5\nlocal-epochs: 3\nseed: 1\n")
    (tmp_path / "fam" / "method.yaml").write_text("base: fam/protocol\nlr: 0.25\n")
    (tmp_path / "leaf.yaml").write_text("base: [fam/method, fam/protocol]\nseed: 7\n")
    # the later base wins over the earlier, the file's own keys over both
    assert C.read_preset("leaf") == {"lr": 0.5, "local-epochs": 3, "seed": 7}
    assert C.read_preset("fam/method") == {"lr": 0.25, "local-epochs": 3, "seed": 1}
    assert load_config({"preset": "fam/method", "seed": 2}).lr == 0.25
    (tmp_path / "fam" / "protocol.yaml").write_text("base: leaf\n")
    with pytest.raises(ConfigError, match="cycle leaf -> fam/method -> fam/protocol -> leaf"):
        C.read_preset("leaf")
    with pytest.raises(ConfigError, match="'preset' = '../x'"):
        load_config({"preset": "../x"})


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("num-roundz", 3, "a known key"),
        ("lr", "fast", "a number"),
        ("num-rounds", 2.5, "an integer"),
        ("num-rounds", True, "an integer"),
        ("lr", 0.0, "(0, inf]"),
        ("lr", float("nan"), "a finite number"),
        ("dirichlet-alpha", -1.0, "(0, inf]"),
        ("test-fraction", 1.0, "(0, 0.9]"),
        ("num-clients", 0, "[1, inf]"),
        ("dataset", "cifar11", "'digits'"),
        ("strategy", "fedfoo", "'fedavg'"),
        ("model", "resnet1000", "'cnn'"),
        ("partitioner", "random", "'dirichlet'"),
        ("optimizer", "lbfgs", "'adam'"),
        ("preset", "no-such-preset", "'fedavg-digits'"),
    ],
)
def test_bad_value_names_key_value_and_what_is_allowed(key, value, allowed):
    with pytest.raises(ConfigError) as info:
        load_config({key: value})
    msg = str(info.value)
    assert info.value.key == key
    assert f"'{key}'" in msg and repr(value) in msg and allowed in msg


def test_cross_field_check():
    with pytest.raises(ConfigError, match="clients-per-round.*at most num-clients = 4"):
        load_config({"num-clients": 4, "clients-per-round": 5})


def test_bad_key_inside_a_preset_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr("common.config.CONFIG_DIR", tmp_path)
    (tmp_path / "broken.yaml").write_text("num-rounds: 3\nlearning-rate: 0.1\n")
    with pytest.raises(ConfigError, match="'learning-rate'"):
        load_config({"preset": "broken"})


def test_readme_documents_every_key():
    readme = (PROJECT_DIR / "README.md").read_text()
    missing = [k for k in RunConfig.keys() if f"| `{k}` |" not in readme]
    assert missing == []
