"""Config loading: YAML, --set overrides, unknown keys, type conversion, presets."""

from pathlib import Path

import pytest

from megaformer.config import Config, dump_config, from_dict, load_config, to_dict
from megaformer.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", ["tiny", "transformer_base", "transformer_big"])
def test_presets_load(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert isinstance(cfg, Config)


def test_paper_values_of_the_presets():
    base = load_config(CONFIGS / "transformer_base.yaml")
    big = load_config(CONFIGS / "transformer_big.yaml")
    assert (base.model.d_model, base.model.d_ff, base.model.num_heads) == (512, 2048, 8)
    assert (big.model.d_model, big.model.d_ff, big.model.num_heads) == (1024, 4096, 16)
    for cfg in (base, big):
        assert cfg.model.encoder_layers == cfg.model.decoder_layers == 6
        assert cfg.model.norm == "post"
        assert cfg.train.label_smoothing == 0.1
        assert (cfg.train.adam_beta1, cfg.train.adam_beta2, cfg.train.adam_eps) == (0.9, 0.98, 1e-9)
        assert cfg.train.warmup_steps == 4000 and cfg.train.tokens_per_step == 25000
        assert cfg.data.vocab_size == 37000
        assert (cfg.decode.beam, cfg.decode.lenpen, cfg.decode.max_len_a, cfg.decode.max_len_b) == (4, 0.6, 1.0, 50)
    assert (base.model.dropout, big.model.dropout) == (0.1, 0.3)
    assert (base.train.max_steps, big.train.max_steps) == (100000, 300000)
    assert (base.decode.average_last, big.decode.average_last) == (5, 20)


def test_overrides_convert_types():
    cfg = load_config(
        CONFIGS / "tiny.yaml",
        [
            "model.num_heads=8",
            "train.lr_scale=2",
            "parallel.sequence_parallel=true",
            "train.tokens_per_step=2.5e4",
            "train.adam_eps=1e-8",
        ],
    )
    assert cfg.model.num_heads == 8 and isinstance(cfg.model.num_heads, int)
    assert cfg.train.lr_scale == 2.0 and isinstance(cfg.train.lr_scale, float)
    assert cfg.parallel.sequence_parallel is True
    assert cfg.train.tokens_per_step == 25000
    assert cfg.train.adam_eps == 1e-8


@pytest.mark.parametrize(
    "override, words",
    [
        ("model.num_head=4", ["model.num_head", "num_heads"]),
        ("modle.d_model=4", ["modle"]),
        ("model.d_model=abc", ["model.d_model", "int"]),
        ("model.norm=middle", ["model.norm", "post", "pre"]),
        ("train.precision=fp8", ["train.precision", "bf16"]),
        ("model.dropout=1.5", ["model.dropout"]),
        ("model.num_heads", ["KEY=VALUE"]),
        ("train.compile=maybe", ["train.compile"]),
    ],
)
def test_bad_overrides_name_the_key(override, words):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / "tiny.yaml", [override])
    for w in words:
        assert w in str(err.value)


def test_unknown_key_in_yaml_names_file_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  d_model: 64\n  dff: 128\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown config key 'model.dff'"):
        load_config(path)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_round_trip(tmp_path):
    cfg = load_config(CONFIGS / "transformer_big.yaml", ["parallel.tp=4"])
    dump_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert to_dict(again) == to_dict(cfg)
    assert to_dict(from_dict(to_dict(cfg))) == to_dict(cfg)


def test_sequence_parallel_needs_lengths_padded_alike_at_every_layout():
    """SP pads lengths to a multiple of tp; with exact masks every layout must pad the same way (or be refused)."""
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / "tiny.yaml", ["parallel.tp=2", "parallel.sequence_parallel=true"])
    assert "parallel.pad_to_multiple" in str(err.value) and "tp=2" in str(err.value)
    with pytest.raises(ConfigError, match="now 2"):
        load_config(
            CONFIGS / "tiny.yaml", ["parallel.tp=4", "parallel.sequence_parallel=true", "parallel.pad_to_multiple=2"]
        )
    for ok in (["parallel.pad_to_multiple=8"], ["parallel.dropout_rng=fast"]):
        cfg = load_config(CONFIGS / "tiny.yaml", ["parallel.tp=4", "parallel.sequence_parallel=true", *ok])
        assert cfg.parallel.sequence_parallel
    with pytest.raises(ConfigError, match="parallel.pad_to_multiple"):
        load_config(CONFIGS / "tiny.yaml", ["parallel.pad_to_multiple=0"])


def test_settings_without_effect_are_named_with_why():
    """Each setting a run would accept and ignore is named; the defaults and settings that act name none."""
    from megaformer.train.unused import settings_without_effect

    quiet = load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pad_to_multiple=2"])
    assert settings_without_effect(quiet, 8000) == [] and settings_without_effect(Config(), 1000) == []
    sets = [
        "parallel.sequence_parallel=true",
        "train.warmup_fraction=0.5",
        "train.zero_overlap_comm=true",
        "train.profile_steps=3",
        "data.vocab_size=4000",
    ]
    idle = settings_without_effect(load_config(None, [*sets, "train.precision=bf16"]), 1000)
    assert [i.split(" ", 1)[0] for i in idle] == sets, idle
    assert "tp=1" in idle[0] and "train.max_minutes" in idle[1] and "BF16 optimizer" in idle[2], idle
    assert "zero_stage=0" in settings_without_effect(load_config(None, [sets[2], "train.zero_stage=0"]), 8000)[0]
    # ZeRO-1 in fp32 or fp16 reduces through DeepSpeed's ZeRO optimizer, which overlaps: not idle
    acting = ["train.warmup_fraction=0.5", "train.max_minutes=5", "train.zero_overlap_comm=true"]
    assert (
        settings_without_effect(load_config(None, [*acting, "train.profile_from=4", "train.profile_steps=3"]), 8000)
        == []
    )
