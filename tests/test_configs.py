"""Quantization configs: names, validation, dict / JSON round trips, per-module mappings."""

import json

import pytest

import cquant
from cquant import configs

ALL_CONFIGS = [
    cquant.Int8WeightOnlyConfig(),
    cquant.Int8DynamicActivationInt8WeightConfig(),
    cquant.Float8DynamicActivationFloat8WeightConfig(cquant.PerRow()),
    cquant.Float8DynamicActivationFloat8WeightConfig(cquant.PerTensor()),
    cquant.Float8WeightOnlyConfig(),
    cquant.Float8WeightOnlyConfig("float8_e5m2"),
    cquant.FPXWeightOnlyConfig(3, 2),
    cquant.FPXWeightOnlyConfig(2, 3),
    cquant.FPXWeightOnlyConfig(2, 2),
    cquant.FPXWeightOnlyConfig(2, 1),
    cquant.FPXWeightOnlyConfig(1, 1),
]


@pytest.mark.parametrize("name, expected", [
    ("int8wo", "int8wo"), ("int8_weight_only", "int8wo"), ("int8dq", "int8dq"),
    ("fp8dqrow", "fp8dqrow"), ("float8dq_e4m3_row", "fp8dqrow"),
    ("float8dq", "fp8dq"), ("float8dq_e4m3_tensor", "fp8dq"), ("fp8dq", "fp8dq"),
    ("fp8wo", "fp8wo"), ("float8wo_e4m3", "fp8wo"), ("float8wo_e5m2", "fp8wo_e5m2"),
    ("fp6_e3m2", "fp6_e3m2"), ("fp6_e2m3", "fp6_e2m3"), ("fp5_e2m2", "fp5_e2m2"), ("fp4_e2m1", "fp4_e2m1"),
    ("fpx_e3m3", "fp7_e3m3"), ("FP3_E1M1", "fp3_e1m1"), (" int8wo ", "int8wo"),
])
def test_names(name, expected):
    cfg = cquant.config_from_name(name)
    assert cfg.name == expected
    assert cquant.config_from_name(cfg.name) == cfg


def test_scheme_names_cover_the_documented_list():
    for name in cquant.SCHEME_NAMES:
        assert cquant.config_from_name(name).name == name


@pytest.mark.parametrize("cfg", ALL_CONFIGS, ids=lambda c: c.name)
def test_dict_and_json_round_trip(cfg):
    d = cfg.to_dict()
    assert d["version"] == configs.CONFIG_VERSION and d["type"] == type(cfg).__name__
    assert cquant.config_from_dict(d) == cfg
    assert cquant.config_from_json(json.dumps(d)) == cfg
    assert cquant.config_from_json(cfg.to_json()) == cfg


def test_schemes():
    s = cquant.Float8DynamicActivationFloat8WeightConfig(cquant.PerTensor()).scheme()
    assert (s.weight_format.name, s.weight_granularity, s.act_format.name, s.act_granularity) == \
        ("fp8_e4m3", "tensor", "fp8_e4m3", "tensor")
    s = cquant.Int8WeightOnlyConfig().scheme()
    assert s.act_format is None and not s.dynamic and s.code_dtype == "int8"
    s = cquant.FPXWeightOnlyConfig(3, 2).scheme()
    assert s.weight_format.bits == 6 and s.code_dtype == "uint8"
    # 6-bit codes packed: 3072 codes = 2304 bytes a row
    assert s.row_bytes(3072) == 2304


def test_granularity_forms():
    F = cquant.Float8DynamicActivationFloat8WeightConfig
    assert F("row") == F(cquant.PerRow()) == F([cquant.PerRow(), cquant.PerRow()])
    assert F("tensor").name == "fp8dq"
    with pytest.raises(ValueError, match="must match"):
        F((cquant.PerRow(), cquant.PerTensor()))
    with pytest.raises(TypeError, match="instance"):
        F(cquant.PerRow)
    with pytest.raises(TypeError, match="PerRow"):
        F(3)


@pytest.mark.parametrize("make, exc, match", [
    (lambda: cquant.FPXWeightOnlyConfig(4, 3), ValueError, "3 <= 1 \\+ ebits"),
    (lambda: cquant.FPXWeightOnlyConfig(0, 3), ValueError, "ebits >= 1"),
    (lambda: cquant.FPXWeightOnlyConfig(3.0, 2), TypeError, "ebits must be an int"),
    (lambda: cquant.Int8WeightOnlyConfig(version=2), ValueError, "version = 2 is not supported"),
    (lambda: cquant.Int8WeightOnlyConfig(version="1"), TypeError, "version must be an int"),
    (lambda: cquant.Float8WeightOnlyConfig("int8"), ValueError, "weight_dtype"),
    (lambda: cquant.config_from_name("int3wo"), ValueError, "unknown quantization scheme 'int3wo'"),
    (lambda: cquant.config_from_name("fp5_e3m2"), ValueError, "fp5 does not have 1 \\+ 3 \\+ 2 bits"),
    (lambda: cquant.config_from_name(8), TypeError, "must be a string"),
    (lambda: cquant.config_from_dict({"type": "Nope"}), ValueError, "type 'Nope'"),
    (lambda: cquant.config_from_dict({"type": "FqnToConfig", "fqn_to_config": []}), TypeError,
     "fqn_to_config must be a dict"),
    (lambda: cquant.config_from_dict({"type": "Int8WeightOnlyConfig", "group_size": 32}), ValueError, "group_size"),
    (lambda: cquant.FqnToConfig({"re:(": "int8wo"}), ValueError, "not a valid regex"),
    (lambda: cquant.FqnToConfig({"a": 3}), TypeError, "fqn_to_config\\['a'\\]"),
    (lambda: cquant.FqnToConfig({"a": {"b": "int8wo"}}), TypeError, "cannot be nested"),
    (lambda: cquant.FqnToConfig([("a", "int8wo")]), TypeError, "must be a dict"),
])
def test_bad_configs_raise(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_fqn_to_config_resolution():
    m = cquant.FqnToConfig({
        "blocks.0.attn.to_q": "fp8dqrow",
        "re:blocks\\.\\d+\\.attn\\..*": "int8dq",
        "re:.*ff.*": None,
        "_default": "int8wo",
    })
    assert m.config_for("blocks.0.attn.to_q")[0].name == "fp8dqrow"  # exact beats regex
    assert m.config_for("blocks.3.attn.to_k") == (cquant.Int8DynamicActivationInt8WeightConfig(),
                                                  "re:blocks\\.\\d+\\.attn\\..*")
    assert m.config_for("blocks.3.ff.net.0") == (None, "re:.*ff.*")
    assert m.config_for("proj_out")[0].name == "int8wo"
    # regexes match the whole name
    assert m.config_for("x.blocks.0.attn.to_k")[0].name == "int8wo"
    assert cquant.FqnToConfig({"a": "int8wo"}).config_for("b") == (None, None)
    d = m.to_dict()
    assert cquant.config_from_dict(d) == m and cquant.config_from_json(json.dumps(d)) == m


def test_as_config_accepts_plain_mappings():
    cfg = configs.as_config({"_default": "fp6_e3m2", "proj_out": None})
    assert isinstance(cfg, cquant.FqnToConfig)
    assert cfg.config_for("anything")[0] == cquant.FPXWeightOnlyConfig(3, 2)
    with pytest.raises(TypeError, match="config must be"):
        configs.as_config(1.5)


def test_refusals():
    s = cquant.config_from_name("fp8dqrow").scheme()
    assert s.refusal(3072, 3072) is None
    assert "below 16" in s.refusal(8, 64)
    assert "in_features=97" in s.refusal(97, 64)
    assert s.refusal(64, 33) is None  # any out_features
    assert s.min_compute_capability == 89
    assert cquant.config_from_name("int8dq").scheme().min_compute_capability == 80
    assert cquant.config_from_name("fp6_e3m2").scheme().min_compute_capability == 80


@pytest.mark.parametrize("name, kwargs, match", [
    ("int4wo_g64_g32", {}, "repeats a suffix"),  # became int4wo_g32
    ("int8wo_r8_r16", {}, "repeats a suffix"),
    ("int4wo_g64", {"group_size": 32}, "names group_size=64, but the keywords say group_size=32"),
    ("fp6_e2m3", {"ebits": 3}, "names ebits=2, but the keywords say ebits=3"),  # became fp7_e3m3
    ("int8wo_r8", {"lowrank_rank": 16}, "names lowrank_rank=8"),
])
def test_a_name_and_keywords_that_disagree_are_refused(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        configs.config_from_name(name, **kwargs)


def test_keywords_set_what_the_name_leaves_open():
    assert configs.config_from_name("int4wo", group_size=64).group_size == 64
    assert configs.config_from_name("int4wo_g64", group_size=64).group_size == 64  # the same value twice
    assert configs.config_from_name("fp6_e2m3", lowrank_rank=8).scheme().name == "fp6_e2m3_r8"
    with pytest.raises(TypeError, match="takes a cquant Scheme"):
        configs.config_for_scheme(None)


def test_scheme_names_is_one_rule_for_every_front_end():
    from cquant.schemes import scheme_names

    assert scheme_names(["int8_weight_only", "fp6_e3m2"], "x") == ["int8wo", "fp6_e3m2"]
    assert scheme_names("float8dq_e4m3_row", "x") == ["fp8dqrow"]
    for names, message in (([], "--q names no scheme"), ("", "--q is empty"),
                           (["a", ""], "--q has an empty scheme name"),
                           (["int8wo", "int8wo"], "--q names int8wo twice; expected each scheme once"),
                           (["int4wo_g128", "int4wo", "int4_weight_only"],
                            "--q names int4wo 3 times (as 'int4wo_g128' and 'int4wo' and 'int4_weight_only')"),
                           (["nope"], "--q: unknown quantization scheme 'nope'")):
        with pytest.raises(ValueError) as e:
            scheme_names(names, "--q")
        assert str(e.value).startswith(message), (names, str(e.value))
    with pytest.raises(TypeError, match=r"^--q: a scheme name must be a string"):
        scheme_names([8], "--q")
    assert scheme_names(["none", "int8wo"], "x", canonical=lambda n: n if n == "none" else scheme_names(n, "y")[0])
