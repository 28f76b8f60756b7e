import dataclasses

import pytest

from directkv.errors import ConfigError
from directkv.specs import HARDWARE, MODELS, get_hardware, get_model


def test_llama_shapes_match_published_sizes():
    m = get_model("llama-3.1-8b")
    assert 8.0e9 < m.weight_params() < 8.1e9  # 8.03B
    assert m.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 131072
    assert m.gqa_ratio == 4


@pytest.mark.parametrize("name,lo,hi", [("opt-6.7b", 6.6e9, 6.9e9), ("opt-13b", 12.7e9, 13.1e9),
                                        ("opt-30b", 29.5e9, 30.5e9)])
def test_opt_sizes(name, lo, hi):
    assert lo < get_model(name).weight_params() < hi


def test_flops_per_token_is_about_twice_the_params():
    m = get_model("llama-3.1-8b")
    assert m.linear_flops_per_token() == pytest.approx(2 * m.weight_params(), rel=0.07)


@pytest.mark.parametrize("getter,registry,kind", [(get_model, MODELS, "model"), (get_hardware, HARDWARE, "hardware")])
def test_exact_names_only(getter, registry, kind):
    for name in registry:
        assert getter(name).name == name
    with pytest.raises(ConfigError) as e:
        getter("Llama-3.1-8B")  # no fuzzy matching, not even case
    msg = str(e.value)
    assert kind in msg and "\n" not in msg and all(n in msg for n in registry)


def test_specs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_model("tiny").num_layers = 3


def test_hardware_facts_from_design():
    h = get_hardware("h200-pcie5")
    assert (h.link_sm_read_gbps, h.link_ce_h2d_gbps, h.num_sms) == (51.4, 55.4, 132)
    assert h.measured_here and not get_hardware("gh200-c2c").measured_here
    assert get_hardware("gh200-c2c").link_sm_read_gbps > 6 * h.link_sm_read_gbps
