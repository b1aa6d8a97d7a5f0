"""f8dist.integrations.torchtitan against torchtitan 0.3.0 itself: its model_registry, its build
sequence (meta, to_empty, init_weights), its optimizers container, its config loader, and (2 ranks)
its FSDP apply function.

Skipped when torchtitan is not installed, unless F8DIST_REQUIRE_TORCHTITAN=1 (set by .ci/run, which
installs the extra): then a missing torchtitan fails the run instead of skipping it.
"""

import dataclasses
import logging
import os
import subprocess
import sys

import pytest
import torch

REQUIRE_ENV = "F8DIST_REQUIRE_TORCHTITAN"
try:
    import torchtitan  # noqa: F401
except ImportError as e:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but torchtitan does not import ({e}); install the extra: "
                    "pip install torch==2.13.0 && pip install -e \".[dev,torchtitan]\"",
                    pytrace=False)
    pytest.skip(f"torchtitan is not installed ({e}); pip install -e \".[torchtitan]\"",
                allow_module_level=True)

from torchtitan.components.optimizer import default_adamw  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.models.common.attention import (  # noqa: E402
    FlexAttention,
    ScaledDotProductAttention,
)
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.llama3 import llama3_configs, model_registry  # noqa: E402

import f8dist  # noqa: E402
import f8dist.integrations.torchtitan as tt  # noqa: E402
from f8dist.integrations.torchtitan_assets import ASSETS_ENV, BOS, EOS, make_assets  # noqa: E402
from f8dist.parallel.fsdp import Float8AllGatherWeight  # noqa: E402
from f8dist.core.numerics import sqnr  # noqa: E402
from tests.distributed.harness import REPO_ROOT, launch, result  # noqa: E402
from tests.nn.test_grouped import run_experts  # noqa: E402

RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed"]
BLOCK_RECIPES = ["mxfp8", "blockwise"]  # block scales ([Note: block scales] in f8dist/config/cells.py)
N_LINEARS = 6 * 5  # debugmodel: 6 blocks of wqkv, wo, w1, w2, w3 (lm_head filtered)


@pytest.fixture(autouse=True)
def _assets_in_a_temporary_directory(tmp_path_factory, monkeypatch):
    """The config functions make their assets ([Note: torchtitan assets]): not in ~/.cache here."""
    monkeypatch.setenv(ASSETS_ENV, str(tmp_path_factory.getbasetemp() / "torchtitan_assets"))


def _converter(recipe="tensorwise", **kwargs):
    return tt.Float8LinearConverter.Config(recipe_name=recipe, filter_fqns=["lm_head"], **kwargs)


def _sdpa(model_config):
    """FlexAttention has no CPU backward: swap its configs for SDPA (causal)."""
    for _, _, parent, attr in list(model_config.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return model_config


def _build(spec):
    """The Trainer's build sequence without parallelism: meta, to_empty, init_weights."""
    with torch.device("meta"):
        model = _sdpa(spec.model).build()
    model.verify_module_protocol()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def _float8_configs(model_config):
    return {fqn: c for fqn, c, _, _ in model_config.traverse(Linear.Config)
            if isinstance(c, tt.Float8Linear.Config)}


@pytest.mark.parametrize("recipe", RECIPES + BLOCK_RECIPES)
def test_model_registry_converts_the_linears_it_is_asked_to(recipe):
    spec = model_registry("debugmodel", converters=[_converter(recipe)])
    plain = {fqn for fqn, _, _, _ in model_registry("debugmodel").model.traverse(Linear.Config)}
    converted = _float8_configs(spec.model)
    assert len(converted) == N_LINEARS
    assert set(converted) == plain - {"lm_head"}
    assert type(spec.model.lm_head) is Linear.Config
    assert all(c.recipe_name == recipe and c.fqn == fqn for fqn, c in converted.items())


def test_converted_configs_keep_every_field_of_the_linear():
    model_config = llama3_configs["debugmodel"](attn_backend="flex")
    before = {fqn: c for fqn, c, _, _ in model_config.traverse(Linear.Config)}
    tt.Float8LinearConverter(_converter()).convert(model_config)
    after = _float8_configs(model_config)
    for fqn, c in after.items():
        for f in dataclasses.fields(before[fqn]):  # dims, bias, param_init, sharding_config
            assert getattr(c, f.name) is getattr(before[fqn], f.name), (fqn, f.name)


TOKENS = torch.randint(0, 2048, (2, 32), generator=torch.Generator(torch.get_default_device()).manual_seed(0))
W1 = "layers.0.feed_forward.w1"


def _two_blocks(spec):
    """The debug model cut to its first two blocks (for the tests that run it)."""
    spec.model.layers = spec.model.layers[:2]
    return spec


@pytest.fixture(scope="module")
def reference():
    """The plain debug model's state dict, and its two-block version's logits and one
    grad_weight on TOKENS."""
    state = _build(model_registry("debugmodel")).state_dict()
    model = _build(_two_blocks(model_registry("debugmodel")))
    out = model(TOKENS)  # [2, 32, vocab]
    out.logsumexp(-1).mean().backward()
    return state, out.detach(), model.get_submodule(W1).weight.grad


@pytest.mark.parametrize("recipe", RECIPES)
def test_meta_build_and_init_weights(recipe, reference):
    ref_sd = reference[0]
    model = _build(model_registry("debugmodel", converters=[_converter(recipe)]))
    float8 = {n: m for n, m in model.named_modules() if isinstance(m, tt.Float8Linear)}
    assert len(float8) == N_LINEARS
    assert all(m.fqn == name for name, m in float8.items())  # FQNs known to the layers
    assert all(isinstance(m, f8dist.Float8Linear) for m in float8.values())

    # init_weights ran the original param_init with the same RNG stream: the weights of the
    # plain model, bit for bit; delayed buffers are fresh (to_empty left them uninitialized)
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in ref_sd.items())
    delayed_keys = sorted(set(sd) - set(ref_sd))
    if recipe == "delayed":
        assert len(delayed_keys) == N_LINEARS * 3 * 3  # 3 operands x (amax, history, scale)
        for k in delayed_keys:
            assert torch.equal(sd[k], torch.ones_like(sd[k]) if ".fp8_scale_" in k
                               else torch.zeros_like(sd[k])), k
    else:
        assert delayed_keys == []


def test_meta_build_then_a_plain_checkpoint_loaded_with_assign(reference):
    """The other way a meta-built model gets values: load_state_dict(sd, assign=True). The
    delayed buffers the plain checkpoint lacks come fresh on the weights' device (they stayed on
    meta: no step recorded, a saved checkpoint held meta tensors)."""
    with torch.device("meta"):
        model = _sdpa(model_registry("debugmodel", converters=[_converter("delayed")]).model).build()
    model.load_state_dict({k: v.clone() for k, v in reference[0].items()}, assign=True)
    sd = model.state_dict()
    delayed_keys = sorted(set(sd) - set(reference[0]))
    assert len(delayed_keys) == N_LINEARS * 3 * 3
    for k in delayed_keys:
        assert torch.equal(sd[k], torch.ones(sd[k].shape) if ".fp8_scale_" in k
                           else torch.zeros(sd[k].shape)), k
    f8dist.sync_float8_amax_and_scale_history(model)  # a sync of fresh buffers changes nothing


@pytest.mark.parametrize("recipe", RECIPES + BLOCK_RECIPES)
def test_forward_and_backward_near_the_plain_model(recipe, reference):
    _, ref_out, ref_grad = reference
    model = _build(_two_blocks(model_registry("debugmodel", converters=[_converter(recipe)])))
    out = model(TOKENS)  # [2, 32, vocab]
    assert sqnr(ref_out, out) > 40
    out.logsumexp(-1).mean().backward()
    assert sqnr(ref_grad, model.get_submodule(W1).weight.grad) > 15


def test_float8_all_gather_weight_is_built_on_meta_and_initialized(reference):
    model = _build(model_registry("debugmodel", converters=[
        _converter(enable_fsdp_float8_all_gather=True)]))
    float8 = [m for m in model.modules() if isinstance(m, tt.Float8Linear)]
    assert len(float8) == N_LINEARS
    assert all(isinstance(m.weight, Float8AllGatherWeight) for m in float8)
    # initialized through the wrapper; checkpoints hold plain high-precision weights, the plain
    # model's (FusedQKVLinear splits wqkv into wq, wk, wv)
    ref_sd, sd = reference[0], model.state_dict()
    assert sorted(sd) == sorted(ref_sd)
    assert all(type(v) is torch.Tensor and torch.equal(v, ref_sd[k]) for k, v in sd.items())


def _step(model, optimizers):
    out = model(TOKENS)
    out.logsumexp(-1).mean().backward()
    optimizers.step()
    optimizers.zero_grad()


def test_post_optimizer_build_fn_syncs_delayed_scales_before_each_step():
    float8 = _converter("delayed")
    spec = tt.with_float8_hooks(_two_blocks(model_registry("debugmodel", converters=[float8])))
    model = _build(spec)
    optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
    spec.post_optimizer_build_fn(optimizers, [model], None)
    wo = model.get_submodule("layers.1.attention.wo")
    for step in range(2):
        _step(model, optimizers)  # the hook syncs before the optimizer step
        history = wo.fp8_amax_history_input  # [history_len]
        assert history[step].item() > 0  # each step's amax entered the history
        assert wo.fp8_amax_input.item() == 0  # and nothing is pending after the sync
    # without the hooks nothing syncs: the histories stay empty, the amaxes pending
    bare = _two_blocks(model_registry("debugmodel", converters=[float8]))
    model = _build(bare)
    optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
    _step(model, optimizers)
    _step(model, optimizers)
    wo = model.get_submodule("layers.1.attention.wo")
    assert not wo.fp8_amax_history_input.any() and wo.fp8_amax_input.item() > 0


def test_with_float8_hooks_chains_the_model_specs_own_function():
    calls = []
    spec = dataclasses.replace(
        _two_blocks(model_registry("debugmodel", converters=[_converter("delayed")])),
        post_optimizer_build_fn=lambda *args: calls.append(args),
    )
    chained = tt.with_float8_hooks(spec)
    assert spec.post_optimizer_build_fn is not chained.post_optimizer_build_fn
    model = _build(chained)
    optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
    chained.post_optimizer_build_fn(optimizers, [model], "dims")
    assert calls == [(optimizers, [model], "dims")]
    _step(model, optimizers)
    _step(model, optimizers)  # the delayed sync hook is there too


def test_auto_filter_small_kn():
    auto = tt.Float8LinearConverter.Config(filter_fqns=["auto_filter_small_kn", "lm_head"])
    # the debug model's linears (dim 256) are too small to gain from float8
    assert _float8_configs(model_registry("debugmodel", converters=[auto]).model) == {}
    # LLaMA 3 8B's gain (config only: nothing is built)
    big = model_registry("8B", converters=[auto]).model
    converted = _float8_configs(big)
    assert len(converted) == 32 * 5 and "lm_head" not in converted
    accept = f8dist.auto_filter_for_recipe("tensorwise")
    assert all(accept(c, fqn) for fqn, c in converted.items())


def test_dims_not_multiple_of_16_and_a_root_linear(caplog):
    odd = Linear.Config(in_features=24, out_features=32)
    with caplog.at_level(logging.WARNING, logger="f8dist.integrations.torchtitan"):
        kept = tt.Float8LinearConverter(tt.Float8LinearConverter.Config()).convert(odd)
    assert kept is odd and "in_features=24 (multiple of 16)" in caplog.text
    padded = tt.Float8LinearConverter(
        tt.Float8LinearConverter.Config(pad_inner_dim=True)).convert(odd)
    assert isinstance(padded, tt.Float8Linear.Config) and padded.pad_inner_dim
    lin = padded.build()
    assert lin(torch.randn(16, 24)).shape == (16, 32)
    # 96 is a multiple of 16 and 32, not of DeepSeek's 128x128 weight blocks
    block = Linear.Config(in_features=128, out_features=96)
    assert tt.Float8LinearConverter(_converter("blockwise")).convert(block) is block
    assert isinstance(tt.Float8LinearConverter(_converter("mxfp8")).convert(block),
                      tt.Float8Linear.Config)


def test_bad_configs_say_what_to_change():
    with pytest.raises(ValueError, match="tensorwise weight cast"):
        tt.Float8LinearConverter(_converter("rowwise", enable_fsdp_float8_all_gather=True))
    with pytest.raises(ValueError, match="set enable_fsdp_float8_all_gather=True"):
        tt.Float8LinearConverter(_converter(precompute_float8_dynamic_scale_for_fsdp=True))
    with pytest.raises(ValueError, match="amax history"):
        tt.Float8LinearConverter(_converter("delayed", enable_fsdp_float8_all_gather=True,
                                            precompute_float8_dynamic_scale_for_fsdp=True))
    with pytest.raises(ValueError, match="known recipes"):
        tt.Float8LinearConverter(_converter("fp8"))


CONFIGS = {
    "llama3_debugmodel_float8_tensorwise": ("tensorwise", False),
    "llama3_debugmodel_float8_rowwise": ("rowwise", False),
    "llama3_debugmodel_float8_rowwise_with_gw_hp": ("rowwise_with_gw_hp", False),
    "llama3_debugmodel_float8_delayed": ("delayed", False),
    "llama3_debugmodel_float8_tensorwise_fsdp_all_gather": ("tensorwise", True),
    "llama3_debugmodel_float8_mxfp8": ("mxfp8", False),
    "llama3_debugmodel_float8_blockwise": ("blockwise", False),
}


def test_config_functions_select_the_debug_model_with_each_recipe():
    manager = ConfigManager()
    for name, (recipe, all_gather) in CONFIGS.items():
        # what `python -m torchtitan.train --module f8dist.integrations.torchtitan --config NAME`
        # loads
        config = manager.parse_args(["--module", "f8dist.integrations.torchtitan",
                                     "--config", name])
        spec = config.model_spec
        assert (spec.name, spec.flavor) == ("llama3", "debugmodel")
        converted = _float8_configs(spec.model)
        assert len(converted) == N_LINEARS, name
        for c in converted.values():
            assert c.recipe_name == recipe
            assert c.enable_fsdp_float8_all_gather == all_gather
            assert c.precompute_float8_dynamic_scale_for_fsdp == all_gather
        assert spec.post_optimizer_build_fn.__qualname__ == "with_float8_hooks.<locals>.chained"


def test_config_functions_read_assets_f8dist_makes_not_a_torchtitan_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./tests/assets here: torchtitan's own paths would not resolve
    config = ConfigManager().parse_args(["--module", "f8dist.integrations.torchtitan",
                                         "--config", "llama3_debugmodel_float8_tensorwise"])
    paths = make_assets()
    assert config.hf_assets_path == paths["tokenizer"] and config.dataloader.dataset_path == paths["dataset"]
    assert config.dump_folder == paths["outputs"] and not os.path.relpath(paths["outputs"]).startswith("outputs")
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    tokenizer = HuggingFaceTokenizer(tokenizer_path=config.hf_assets_path)
    ids = tokenizer.encode("def f(x):\n    return x", add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id == 256 and ids[-1] == tokenizer.eos_id == 257
    assert tokenizer.decode(ids[1:-1]) == "def f(x):\n    return x"  # bytes round-trip
    assert tokenizer.get_vocab_size() == 258 <= config.model_spec.model.vocab_size
    assert tokenizer.bos_token == BOS and tokenizer.eos_token == EOS
    sample, _ = next(iter(HuggingFaceTextDataset("c4_test", config.dataloader.dataset_path, tokenizer,
                                                 seq_len=64)))
    assert sample["input"].shape == (64,) and int(sample["input"].max()) < 258
    assert os.listdir(tmp_path) == []  # nothing written where it ran (it left ./outputs)


def test_readme_command_says_what_it_needs_in_one_line(tmp_path):
    # the README's command on a machine without CUDA: it ended in "torch._C has no attribute
    # '_cuda_setDevice'" (under torchrun) or a KeyError on LOCAL_RANK, and left ./outputs
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO_ROOT),
               **{ASSETS_ENV: str(tmp_path / "assets")})
    out = subprocess.run([sys.executable, "-m", "torchtitan.train", "--module", "f8dist.integrations.torchtitan",
                          "--config", "llama3_debugmodel_float8_tensorwise"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 1
    assert out.stderr.splitlines()[-1] == (
        "f8dist: torchtitan's Trainer needs CUDA (it sets the CUDA device before anything else) and "
        "this machine has none; on a CPU, train with scripts/train.py (docs/training.md)"), out.stderr[-3000:]
    assert "Traceback" not in out.stderr and os.listdir(tmp_path) == []


def test_without_torchrun_the_config_says_so(monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__spec__=types.SimpleNamespace(
        name="torchtitan.train")))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit, match="runs under torchrun .* torchrun --nproc_per_node=1 -m torchtitan.train"):
        tt.llama3_debugmodel_float8_tensorwise()


def test_filter_fqns_as_one_string_is_one_fqn():
    spec = model_registry("debugmodel", converters=[
        tt.Float8LinearConverter.Config(recipe_name="tensorwise", filter_fqns="lm_head")])
    # a string was iterated by character: every FQN holds an "l" or "m", nothing was converted
    assert len(_float8_configs(spec.model)) == N_LINEARS
    with pytest.raises(TypeError, match="filter_fqns must be FQN strings"):
        tt.Float8LinearConverter(tt.Float8LinearConverter.Config(filter_fqns=[3]))


def test_importing_f8dist_never_imports_torchtitan():
    # one interpreter for both checks (each start imports torch): the first leaves torchtitan
    # unimported, so the second sees the machine it would see on its own
    code = ("import sys, f8dist, f8dist.integrations; assert 'torchtitan' not in sys.modules\n"
            # without torchtitan the integration says how to install it
            "sys.modules['torchtitan'] = None\n"
            "try:\n    import f8dist.integrations.torchtitan\n"
            "except ImportError as e:\n    assert '.[torchtitan]' in str(e), e\n"
            "else:\n    raise SystemExit('imported without torchtitan')")
    subprocess.run([sys.executable, "-c", code], check=True)


FSDP_TWO_RANKS = launch("torchtitan_fsdp", 2, timeout=300)


def test_fsdp_two_ranks_losses_bytes_and_collectives():
    r = result(FSDP_TWO_RANKS)
    bf16 = r["bf16"]
    assert bf16["losses"][-1] < 0.8 * bf16["losses"][0]  # it trains
    for variant in ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed",
                    "tensorwise_fp8_all_gather"):
        losses = r[variant]["losses"]
        # within 1% of bf16 at every step; float8 did run (not bit-identical to bf16)
        for ours, ref in zip(losses, bf16["losses"]):
            assert abs(ours - ref) < 0.01 * ref, (variant, losses, bf16["losses"])
        assert losses != bf16["losses"], variant

    # forward all-gather bytes: every parameter's padded shard x world, 1 byte for float8
    # all-gather weights, 2 (bf16) for the others; the same at every step
    for variant in ("bf16", "tensorwise", "tensorwise_fp8_all_gather"):
        expected = r[variant]["expected_forward_all_gather_bytes"]
        for fwd in r[variant]["forward"]:
            assert fwd["all_gather"]["output_bytes"] == expected, variant
    fp8_ag = r["tensorwise_fp8_all_gather"]
    assert r["tensorwise"]["expected_forward_all_gather_bytes"] == bf16[
        "expected_forward_all_gather_bytes"]
    assert fp8_ag["expected_forward_all_gather_bytes"] < 0.6 * bf16[
        "expected_forward_all_gather_bytes"]

    # precompute: one all-reduce after each optimizer step, of one float32 amax per float8
    # weight, and from the second step on no amax all-reduce in the forward
    for step in fp8_ag["optimizer_step"]:
        assert step == {"all_reduce": {"calls": 1, "input_bytes": 4 * N_LINEARS,
                                       "output_bytes": 4 * N_LINEARS}}
    assert fp8_ag["forward"][0]["all_reduce"]["calls"] == N_LINEARS  # before any precompute
    assert all("all_reduce" not in fwd for fwd in fp8_ag["forward"][1:])
    # delayed: the sync before each step, one all-reduce of input, weight, grad_output (amax and
    # out-of-range flag, 8 bytes each); the first sync also checks the ranks hold the same layers
    # (one 16-byte all-reduce, [Note: the amax group])
    payload = 8 * 3 * N_LINEARS
    first, *later = r["delayed"]["optimizer_step"]
    assert first == {"all_reduce": {"calls": 2, "input_bytes": 16 + payload,
                                    "output_bytes": 16 + payload}}
    for step in later:
        assert step == {"all_reduce": {"calls": 1, "input_bytes": payload, "output_bytes": payload}}
    for variant in ("bf16", "tensorwise", "rowwise", "rowwise_with_gw_hp"):
        assert r[variant]["optimizer_step"] == [{}] * len(bf16["losses"]), variant


# -- grouped experts (deepseek_v3 debug model) -----------------------------------------------------

EXPERTS = "layers.1.moe.routed_experts.inner_experts"


def _deepseek(*converters):
    """The deepseek_v3 debug model cut to its first two blocks (a dense one, a MoE one)."""
    from torchtitan.models.deepseek_v3 import model_registry as deepseek_registry

    return _build(_two_blocks(deepseek_registry("debugmodel", converters=list(converters))))


@pytest.fixture(scope="module")
def deepseek_reference():
    return _deepseek()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_grouped_experts_converter_on_the_deepseek_v3_debug_model(recipe, deepseek_reference):
    from torchtitan.models.common.moe import GroupedExperts

    ref = deepseek_reference
    ref.zero_grad(set_to_none=True)  # shared by the recipes
    model = _deepseek(tt.Float8GroupedExpertsConverter.Config(recipe_name=recipe))
    experts = {n: m for n, m in model.named_modules() if isinstance(m, GroupedExperts)}
    assert experts and all(isinstance(m, tt.Float8GroupedExperts) and m.fqn == n
                           for n, m in experts.items())
    assert experts[EXPERTS].specs["w2"]["output", "weight"].fqn == EXPERTS + ".w2"
    ref_sd, sd = ref.state_dict(), model.state_dict()  # torchtitan's keys, init bit for bit
    assert set(sd) == set(ref_sd) and all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)
    assert not any(isinstance(m, f8dist.Float8Linear) for m in model.modules())  # experts only

    # the experts alone: float8 grouped gemms against torchtitan's bf16 ones, an empty expert
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 256, generator=g)
    counts = torch.tensor([5, 0, 11, 3, 9, 0, 7, 5])
    outs = [run_experts(ref.get_submodule(EXPERTS), x, counts, ("w1_EFD", "w2_EDF")),
            run_experts(model.get_submodule(EXPERTS), x, counts, ("w1_EFD", "w2_EDF"))]
    for a, b in zip(*outs):
        assert sqnr(a, b) > 20
    assert torch.equal(outs[1][3][1], torch.zeros_like(outs[1][3][1]))
    # the whole model runs through them
    tokens = torch.randint(0, 2000, (1, 16), generator=g)
    assert sqnr(ref(tokens), model(tokens)) > 30


def test_grouped_experts_converter_refuses_delayed_and_keeps_filtered_experts():
    with pytest.raises(ValueError, match="does not keep; use a dynamic recipe"):
        tt.Float8GroupedExpertsConverter(tt.Float8GroupedExpertsConverter.Config(recipe_name="delayed"))
    model = _deepseek(tt.Float8GroupedExpertsConverter.Config(filter_fqns=["layers.1."]))
    assert not isinstance(model.get_submodule(EXPERTS), tt.Float8GroupedExperts)
    spec = tt.Float8GroupedExpertsConverter(tt.Float8GroupedExpertsConverter.Config(
        filter_fqns=["layers.1."])).convert(__import__(
            "torchtitan.models.deepseek_v3", fromlist=["model_registry"]).model_registry(
            "debugmodel").model)
    assert isinstance(spec.layers[2].moe.routed_experts.inner_experts,
                      tt.Float8GroupedExperts.Config)



def test_nvfp4_experts_converter_keeps_the_last_blocks_experts_in_high_precision():
    # [Note: a high-precision tail]: the tail is whole blocks, their experts with their linears
    from torchtitan.models.deepseek_v3 import model_registry as deepseek_registry

    def converted(recipe):
        spec = tt.Float8GroupedExpertsConverter(tt.Float8GroupedExpertsConverter.Config(
            recipe_name=recipe)).convert(deepseek_registry("debugmodel").model)
        return {i: isinstance(layer.moe.routed_experts.inner_experts, tt.Float8GroupedExperts.Config)
                for i, layer in enumerate(spec.layers) if getattr(layer, "moe", None) is not None}

    rowwise, nvfp4 = converted("rowwise"), converted("nvfp4")
    last = max(rowwise)
    assert all(rowwise.values()) and len(rowwise) > 1, rowwise
    assert nvfp4 == {i: i != last for i in rowwise}, nvfp4

def test_recipe_names_are_every_float8_recipe():
    """torchtitan's configs take the recipe names of Float8LinearRecipeName, the one list."""
    import typing
    from f8dist import Float8LinearRecipeName
    from f8dist.integrations.torchtitan import RecipeName
    assert typing.get_args(RecipeName) == tuple(r.value for r in Float8LinearRecipeName)


def test_nvfp4_converter_keeps_the_last_blocks_in_high_precision():
    # [Note: a high-precision tail]: debugmodel's 6 blocks, ceil(0.15 * 6) = 1 kept (torchtitan's
    # nvfp4_bf16_tail_fqns); float8 recipes keep none
    nvfp4 = _float8_configs(model_registry("debugmodel", converters=[_converter("nvfp4")]).model)
    assert sorted({fqn.split(".")[1] for fqn in nvfp4}) == ["0", "1", "2", "3", "4"]
    assert len(nvfp4) == N_LINEARS - 5
    rowwise = _float8_configs(model_registry("debugmodel", converters=[_converter("rowwise")]).model)
    assert len(rowwise) == N_LINEARS
