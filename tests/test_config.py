"""Configuration: defaults, presets, overrides, and one clear error per bad value."""

from __future__ import annotations

import tomllib

import pytest

from common.config import ConfigError
from hybridfl.config_table import REFERENCE, page_with_tables, pyproject_with_table
from hybridfl.launch.bundle import PROJECT_DIR
from server_app.config import RunConfig, load_config, option_owners, option_specs
from server_app.presets import CONFIG_DIR, read_preset
from strategies import STRATEGIES, FedBuff, build_strategy


def test_pyproject_run_config_mirrors_schema_defaults():
    pyproject = tomllib.loads((PROJECT_DIR / "pyproject.toml").read_text())
    defaults = {**RunConfig().to_dict(), **{k: s.default for k, s in option_specs().items()}}
    assert pyproject["tool"]["flwr"]["app"]["config"] == defaults


def test_the_reference_and_pyproject_tables_are_generated_from_the_config_dataclasses():
    """`python -m hybridfl.config_table --write` leaves both files unchanged: every key is documented."""
    page, pyproject = (PROJECT_DIR / REFERENCE).read_text(), (PROJECT_DIR / "pyproject.toml").read_text()
    assert page_with_tables(page) == page, "run: python -m hybridfl.config_table --write"
    assert pyproject_with_table(pyproject) == pyproject, "run: python -m hybridfl.config_table --write"
    for key in [*RunConfig.specs(), *option_specs()]:
        assert f"| `{key}` |" in page


def test_method_options_live_with_their_strategy_and_keep_their_names_from_yaml_to_code():
    cfg = load_config({"strategy": "fedbuff", "buffer-size": 7, "server-lr": 0.5})
    assert "buffer-size" not in RunConfig.specs() and cfg.options["buffer-size"] == 7
    s = build_strategy(cfg.strategy, cfg.options)
    assert isinstance(s, FedBuff) and s.config.buffer_size == 7 and s.config.server_lr == 0.5
    assert s.describe() == {"strategy": "fedbuff", "buffer-size": 7, "server-lr": 0.5, "staleness-weight": "none",
                            "staleness-exponent": 0.5, "weighting": "uniform", "aggregation": "mean",
                            "trim-fraction": 0.1, "update-norm-bound": 0.0, "update-norm-multiple": 0.0}  # atlas-size
    # is Feddle's; the defences against hostile devices (strategies/robust.py) are every averaging method's
    assert option_owners()["buffer-size"] == ["ca2fl", "fedbuff", "feddle"]  # Feddle: its fallback's K
    assert option_owners()["proximal-mu"] == ["objective proximal"]


def test_a_method_key_the_run_does_not_use_is_refused_naming_its_owners():
    """`strategy="fedbuff" search-lr=0.1` would run FedBuff as if nothing was said: refused, at start, with who uses
    the key; at its default such a key changes nothing and passes (a resolved configuration lists every key)."""
    with pytest.raises(ConfigError, match="'search-lr' = 0.1 .*an option of feddle, not of strategy 'fedbuff'"):
        load_config({"strategy": "fedbuff", "search-lr": 0.1})
    with pytest.raises(ConfigError, match="'proximal-mu' = 0.5 .*an option of objective proximal.*'cross-entropy'"):
        load_config({"strategy": "fedavg", "proximal-mu": 0.5})
    with pytest.raises(ConfigError, match="'global-models' = 3"):  # a preset's key, then another method
        load_config({"preset": "fedmerge-digits", "strategy": "fedavg", "global-models": 3})
    assert load_config({"strategy": "fedbuff", "atlas-size": 20}).strategy == "fedbuff"  # the default
    assert load_config({"strategy": "fedavg", "local-objective": "proximal", "proximal-mu": 0.5}).local_objective \
        == "proximal"


def test_options_built_in_code_are_checked_like_configured_ones():
    with pytest.raises(ConfigError, match="'buffer-size' = 0"):
        FedBuff(buffer_size=0)
    with pytest.raises(ConfigError, match="'weighting' = 'random'.*'examples', 'uniform'"):
        FedBuff(weighting="random")
    with pytest.raises(TypeError):
        FedBuff(atlas_size=3)  # not FedBuff's option


def test_a_key_declared_twice_differently_is_refused(monkeypatch):
    from dataclasses import dataclass

    from common.config import option
    from strategies.base import Strategy

    @dataclass(frozen=True)
    class Clash:
        buffer_size: int = option(99, None, "another meaning")

    class Clashing(Strategy):
        Config = Clash

    monkeypatch.setitem(STRATEGIES, "clashing", Clashing)
    with pytest.raises(ValueError, match="'buffer-size' is declared twice"):
        option_specs()


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
    import server_app.presets as C

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
        ("num-roundz", 3, "a known key; did you mean 'num-rounds'?"),
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
        ("local-objective", "hinge", "'cross-entropy'"),
        ("buffer-size", 0, "[1, inf]"),
        ("staleness-weight", "linear", "'polynomial'"),
        ("fallback-init", 1, "true or false"),
        ("model", "resnet1000", "'cnn'"),
        ("partitioner", "random", "'dirichlet'"),
        ("optimizer", "lbfgs", "'adam'"),
        ("preset", "no-such-preset", "`hybridfl presets` lists all"),
    ],
)
def test_bad_value_names_key_value_and_what_is_allowed(key, value, allowed):
    with pytest.raises(ConfigError) as info:
        load_config({key: value})
    msg = str(info.value)
    assert info.value.key == key
    assert f"'{key}'" in msg and repr(value) in msg and allowed in msg


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="clients-per-round.*at most num-clients = 4"):
        load_config({"num-clients": 4, "clients-per-round": 5})
    with pytest.raises(ConfigError, match="'delay-sigma' = 5.0.*barrier"):
        load_config({"loop": "flower", "delay-sigma": 5.0})
    with pytest.raises(ConfigError, match="'clock' = 'wall'"):
        load_config({"loop": "flower", "clock": "wall"})


def test_bad_key_inside_a_preset_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr("server_app.presets.CONFIG_DIR", tmp_path)
    (tmp_path / "broken.yaml").write_text("num-rounds: 3\nlearning-rate: 0.1\n")
    with pytest.raises(ConfigError, match="'learning-rate'"):
        load_config({"preset": "broken"})



def test_command_line_overrides_take_toml_values_or_bare_strings():
    """`make demo ARGS='preset="x"'` reaches the script as preset=x (make's shell drops the quotes)."""
    from hybridfl.launch.job import parse_overrides

    assert parse_overrides(['preset="fedbuff-digits"', "num-rounds=5", "lr=0.1", "fallback-init=false",
                            "data-root=/data/x"]) == {"preset": "fedbuff-digits", "num-rounds": 5, "lr": 0.1,
                                                      "fallback-init": False, "data-root": "/data/x"}
    assert load_config(parse_overrides(["preset=fedbuff-digits"])).strategy == "fedbuff"
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_overrides(["num-rounds"])


def test_another_method_on_a_preset_leaves_out_the_preset_s_options_but_not_the_user_s():
    """feddle-digits with strategy=fedbuff: Feddle's options that the preset set (atlas-size, search-lr,
    server-epochs) are left out, not refused as keys the user never typed; the same option typed by the user with
    that strategy is still refused, and the preset's own method keeps them."""
    preset = read_preset("feddle-digits")
    assert preset["strategy"] == "feddle" and {"atlas-size", "search-lr"} <= set(preset)
    cfg = load_config({"preset": "feddle-digits", "strategy": "fedbuff"})
    defaults = option_specs()
    assert cfg.strategy == "fedbuff" and cfg.options["atlas-size"] == defaults["atlas-size"].default
    assert cfg.central_size == preset.get("central-size", cfg.central_size)  # run keys stay
    with pytest.raises(ConfigError, match="'atlas-size' is an option of feddle, not of strategy 'fedbuff'"):
        load_config({"preset": "feddle-digits", "strategy": "fedbuff", "atlas-size": 12})
    assert load_config({"preset": "feddle-digits"}).options["atlas-size"] == preset["atlas-size"]
