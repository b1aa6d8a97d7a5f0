"""The rules of a Float8LinearConfig (f8dist/config/rules.py). The rules' messages are tested
with the options they constrain (tests/config/test_config.py, tests/models/test_norm.py)."""

import dataclasses
import warnings

import pytest

from f8dist import Float8GemmConfig, Float8LinearConfig
from f8dist.config.rules import RULES

FIELDS = [f.name for f in dataclasses.fields(Float8LinearConfig)]


@pytest.mark.parametrize("name", FIELDS)
def test_every_field_is_type_checked_naming_the_field_and_the_value(name):
    # issue 34 item 5: one type check from the dataclass fields, so emulate=1 or pad_inner_dim="no"
    # raise here instead of passing as truthy values
    if name == "sp_grad_weight":  # a name field: its strings or members
        with pytest.raises(ValueError, match=r"Float8LinearConfig\.sp_grad_weight must be one of"):
            Float8LinearConfig(sp_grad_weight=1)
        return
    with pytest.raises(TypeError, match=rf"^Float8LinearConfig\.{name} must be a \w+, got 1$"):
        Float8LinearConfig(**{name: 1})


def test_a_gemm_config_is_type_checked_too():
    with pytest.raises(TypeError, match=r"^Float8GemmConfig\.use_fast_accum must be a bool, got 1$"):
        Float8GemmConfig(use_fast_accum=1)


def test_each_rule_is_named_after_the_option_it_checks():
    assert RULES and set(RULES) <= set(FIELDS)


def test_the_deprecation_warning_points_at_the_callers_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Float8LinearConfig(force_recompute_fp8_weight_in_bwd=True)
    assert [w.category for w in caught] == [DeprecationWarning]
    assert caught[0].filename == __file__, caught[0].filename


def test_float8_all_gather_of_nvfp4_weights_is_accepted():
    # its 16x16 blocks serve both gemms and the wire carries the tensor scale (the parity:
    # tests/sim/parallel/fsdp/test_nvfp4.py)
    config = Float8LinearConfig.from_recipe_name("nvfp4").replace(enable_fsdp_float8_all_gather=True)
    assert config.enable_fsdp_float8_all_gather


def test_random_hadamard_takes_both_grad_weight_operands_and_no_other_cast():
    # [Note: random Hadamard transform] in f8dist/core/scaling.py: the product is unchanged
    # only when both operands are transformed along the tokens, the grad_weight gemm's
    # contraction dim
    config = Float8LinearConfig.from_recipe_name("nvfp4")
    rht = config.cast_config_input_for_grad_weight
    assert rht.random_hadamard
    plain = dataclasses.replace(rht, random_hadamard=False)
    for fields, words in [
        (dict(cast_config_input_for_grad_weight=plain),
         "grad_weight gemm transforms grad_output: random_hadamard=True, input: "
         "random_hadamard=False"),
        (dict(cast_config_input=dataclasses.replace(config.cast_config_input,
                                                    random_hadamard=True)),
         "output gemm transforms input: random_hadamard=True.*set random_hadamard=True on both "
         "of cast_config_input_for_grad_weight and cast_config_grad_output_for_grad_weight"),
    ]:
        with pytest.raises(ValueError, match=words):
            config.replace(**fields)
