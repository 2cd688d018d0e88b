"""Config loading, overrides and validation errors that name the key."""

import pytest

from dflash.config import ConfigError, load_config, parse_override


def test_default_is_the_embedded_tiny_config():
    config = load_config()
    assert config.target.path == "embedded:tiny"
    assert config.drafter.size == "tiny"
    assert config.store.bucket_edges == (64, 192, 320, 512, 1024)


def test_repo_configs_load():
    for name in ("configs/tiny.toml", "configs/qwen3.6-27b.toml"):
        load_config(name)
    real = load_config("configs/qwen3.6-27b.toml")
    assert real.drafter.size == "qwen3.6-27b" and real.data.max_length == 4096


def test_overrides_parse_toml_values():
    config = load_config(None, ["train.lr=3e-4", "store.codec=bf16", "store.bucket_edges=[64, 512, 1024]",
                                "train.log_grad_norm=true", "train.epochs=2"])
    assert config.train.lr == pytest.approx(3e-4)
    assert config.store.codec == "bf16"
    assert config.store.bucket_edges == (64, 512, 1024)
    assert config.train.log_grad_norm is True and config.train.epochs == 2


def test_int_widens_to_float():
    assert load_config(None, ["train.lr=1"]).train.lr == 1.0


def test_overrides_from_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[train]\nlr = 1e-4\n[store]\npath = "/x/store"\n')
    config = load_config(path, ["train.epochs=3"])
    assert (config.train.lr, config.train.epochs, config.store.path) == (1e-4, 3, "/x/store")
    assert config.data.max_length == 4096  # dataclass default, not the tiny file


@pytest.mark.parametrize("override, key", [
    ("train.nope=1", "train.nope"),
    ("train.lr=fast", "train.lr"),
    ("store.codec=zip", "store.codec"),
    ("train.epochs=0", "train.epochs"),
    ("store.bucket_edges=[64, 32]", "store.bucket_edges"),
    ("data.max_length=4096", "data.max_length"),
    ("train.log_grad_norm=1", "train.log_grad_norm"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_unknown_section_and_malformed_override(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[trian]\nlr = 1\n")
    with pytest.raises(ConfigError, match="trian"):
        load_config(path)
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override("lr=3")
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")


def test_choices_and_rules_are_read_from_each_fields_own_setting():
    """A key's meaning, choices and positivity are written once, on its field; the choices are the
    owning modules' own tuples."""
    from dflash import config
    from dflash.data import samples
    from dflash.model import masks
    from dflash.store import codecs
    from dflash.store import schema as store_format
    from dflash.train import metrics

    fields = dict(config.key_fields(load_config()))
    assert fields["store.codec"].metadata["choices"] == codecs.CODECS
    assert fields["store.labels"].metadata["choices"] == store_format.LABEL_CHOICES
    assert fields["data.overlong"].metadata["choices"] == samples.OVERLONG_POLICIES
    assert fields["train.wandb"].metadata["choices"] == metrics.WANDB_MODES
    assert fields["train.attention"].metadata["choices"] == ("auto", *masks.BACKENDS)
    with pytest.raises(ConfigError, match="store.codec must be one of bf16, fp8, got 'zstd'"):
        load_config(None, ["store.codec=zstd"])
    with pytest.raises(ConfigError, match="train.keep_last must be > 0, got 0"):
        load_config(None, ["train.keep_last=0"])


def test_a_list_of_tables_is_typed_validated_and_shown(tmp_path):
    """`data.mix`: each table becomes the field's table dataclass, its keys checked like any key (named
    with the table's index), and `config show` prints it back as TOML that loads to the same value."""
    from dflash.config import MixSource, show_value

    path = tmp_path / "c.toml"
    path.write_text('[data]\nmix = [{source = "a.jsonl", weight = 3}, {source = "embedded:code-docs", name = "docs"}]\n')
    config = load_config(path)
    assert config.data.mix == (MixSource("a.jsonl", 3.0, ""), MixSource("embedded:code-docs", 1.0, "docs"))
    shown = show_value(config.data.mix)
    assert load_config(None, [f"data.mix={shown}"]).data.mix == config.data.mix
    for override, key in [('data.mix=[{source = "a", weigth = 1}]', r"data\.mix\[0\]\.weigth"),
                          ('data.mix=[{source = "a"}, {source = "b", weight = 0}]', r"data\.mix\[1\]\.weight"),
                          ('data.mix=[{source = "a", weight = "x"}]', r"data\.mix\[0\]\.weight"),
                          ('data.mix=["a"]', r"data\.mix\[0\] must be a table")]:
        with pytest.raises(ConfigError, match=key):
            load_config(None, [override])
