import pytest

import hot_compile
from hot_compile import HotConfig
from hot_compile.config import PAPER_RECIPE, split_options


def test_defaults_leave_bits_to_the_device_and_scale_per_slice():
    cfg = HotConfig()
    assert (cfg.policy, cfg.gx_bits, cfg.gw_bits, cfg.rank) == ("balanced", "auto", "auto", 16)
    assert (cfg.gx_quantizer, cfg.weight_quantizer, cfg.gw_quantizer) == ("per_token", "per_channel", "per_channel")
    assert cfg.exact_loss_head


def test_paper_recipe_is_one_option_away():
    cfg = HotConfig(**PAPER_RECIPE)
    assert (cfg.gx_bits, cfg.rank, cfg.gx_quantizer, cfg.weight_quantizer, cfg.gw_quantizer) == (
        4, 8, "per_tensor", "sawb", "per_tensor",
    )  # fmt: skip
    assert not cfg.exact_loss_head
    assert split_options({"policy": "hot", **PAPER_RECIPE})[0] == cfg.replace(policy="hot")


def test_frozen():
    with pytest.raises(Exception):
        HotConfig().rank = 4


@pytest.mark.parametrize(
    "key,value,accepted",
    [
        ("policy", "fast", "'hot'"),
        ("gx_bits", 1, "2..8"),
        ("gw_bits", 9, "2..8"),
        ("gx_bits", 4.0, "2..8"),
        ("gx_bits", "int8", "'auto'"),
        ("gw_bits", "int8", "'auto'"),
        ("gw_quantizer", "per_token", "'per_channel'"),
        ("exact_loss_head", "no", "True or False"),
        ("rank", 0, "1..16"),
        ("rank", 17, "1..16"),
        ("rank", True, "1..16"),
        ("gx_quantizer", "per_channel", "'per_token'"),
        ("weight_quantizer", "nearest", "'per_channel'"),
        ("include", "", "globs"),
        ("exclude", ["blocks.[0"], "globs"),
        ("exclude", 3, "glob"),
        ("strict", "yes", "True or False"),
        ("hadamard", 1, "True or False"),
        ("max_slowdown", -0.1, ">= 0"),
        ("device_profile", "tpu", "'gpu-h100'"),
        ("overrides", {"fc1": {"strict": True}}, "keys among"),
        ("overrides", {"fc1": {"rank": 99}}, "1..16"),
        ("overrides", {"fc[1": {"rank": 4}}, "globs"),
        ("overrides", [("fc1",)], "pairs"),
    ],
)
def test_bad_values_name_key_and_accepted(key, value, accepted):
    with pytest.raises(ValueError, match=key) as err:
        HotConfig(**{key: value})
    assert accepted in str(err.value)


def test_globs_normalized_to_tuples_and_select():
    cfg = HotConfig(include="blocks.*", exclude=["blocks.0.*", "*.head"])
    assert cfg.include == ("blocks.*",) and cfg.exclude == ("blocks.0.*", "*.head")
    assert cfg.selects("blocks.1.fc1")
    assert not cfg.selects("blocks.0.fc1")
    assert not cfg.selects("stem")


def test_split_options_routes_keys():
    cfg, inductor = split_options({"rank": 4, "epilogue_fusion": False, "max-autotune": False})
    assert cfg.rank == 4
    assert inductor == {"epilogue_fusion": False, "max_autotune": False}


def test_unknown_option_names_key_and_accepted():
    with pytest.raises(ValueError, match="'rnak'.*rank"):
        split_options({"rnak": 4})


def test_backend_factory_validates():
    with pytest.raises(ValueError, match="HotConfig"):
        hot_compile.backend({"rank": 4})
    with pytest.raises(ValueError, match="no_such_option"):
        hot_compile.backend(HotConfig(), no_such_option=1)


def test_joint_pass_uuid_tracks_config():
    a, b = hot_compile.joint_pass(HotConfig()), hot_compile.joint_pass(HotConfig(gx_bits=4))
    assert a.uuid() != b.uuid()
    assert a.uuid() == hot_compile.joint_pass(HotConfig()).uuid()


def test_overrides_apply_in_order_later_wins():
    cfg = HotConfig(overrides={"blocks.*": {"rank": 8, "policy": "speed"}, "blocks.0.*": {"policy": "off"}})
    assert cfg.for_module("blocks.0.fc1").policy == "off"
    assert cfg.for_module("blocks.0.fc1").rank == 8
    assert cfg.for_module("blocks.1.fc1").policy == "speed"
    assert cfg.for_module("head") is cfg
    assert hash(cfg) == hash(HotConfig(overrides=[("blocks.*", {"policy": "speed", "rank": 8}), ("blocks.0.*", {"policy": "off"})]))
