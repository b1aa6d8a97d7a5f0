import pytest
import torch

from f8dist.models import ModelArgs, Transformer

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)


def _model(seed=0, args=ARGS):
    model = Transformer(args)
    model.init_weights(seed=seed)
    return model


def test_shapes_and_names():
    model = _model()
    tokens = torch.randint(0, 256, (3, 16))
    assert model(tokens).shape == (3, 16, 256)
    names = dict(model.named_modules())
    for fqn in ("tok_embeddings", "layers.1.attention_norm", "layers.1.attention.wq",
                "layers.1.attention.wk", "layers.1.attention.wv", "layers.1.attention.wo",
                "layers.1.ffn_norm", "layers.1.feed_forward.w1", "layers.1.feed_forward.w2",
                "layers.1.feed_forward.w3", "norm", "output"):
        assert fqn in names, fqn
    assert model.layers["1"].attention.wk.out_features == 2 * ARGS.head_dim  # 2 kv heads


def test_default_linears_are_float8_aligned():
    model = Transformer(ModelArgs())
    for fqn, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            assert mod.in_features % 16 == 0 and mod.out_features % 16 == 0, fqn


def test_causal_future_tokens_do_not_change_past_logits():
    model = _model()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator(torch.get_default_device()).manual_seed(1))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 7) % 256
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.equal(a[:, 10:], b[:, 10:])


def test_init_is_deterministic_per_seed_and_leaves_global_rng_alone():
    a, b, c = Transformer(ARGS), Transformer(ARGS), Transformer(ARGS)
    state = torch.get_rng_state()
    for model, seed in ((a, 3), (b, 3), (c, 4)):
        model.init_weights(seed=seed)
    assert torch.equal(state, torch.get_rng_state())
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name


def test_sharded_heads_run_with_local_head_count():
    # What TP's colwise sharding does to one rank: half the q/k/v rows, half the wo columns.
    model = _model()
    attn = model.layers["0"].attention
    x = torch.randn(2, 16, ARGS.dim)
    hd = ARGS.head_dim
    full_out = 0
    for rank in range(2):
        shard = type(attn).__new__(type(attn))
        torch.nn.Module.__init__(shard)
        shard.head_dim = hd
        q_rows = slice(rank * 2 * hd, (rank + 1) * 2 * hd)
        kv_rows = slice(rank * hd, (rank + 1) * hd)
        shard.wq = torch.nn.Linear(ARGS.dim, 2 * hd, bias=False)
        shard.wk = torch.nn.Linear(ARGS.dim, hd, bias=False)
        shard.wv = torch.nn.Linear(ARGS.dim, hd, bias=False)
        shard.wo = torch.nn.Linear(2 * hd, ARGS.dim, bias=False)
        shard.sdpa = attn.sdpa
        with torch.no_grad():
            shard.wq.weight.copy_(attn.wq.weight[q_rows])
            shard.wk.weight.copy_(attn.wk.weight[kv_rows])
            shard.wv.weight.copy_(attn.wv.weight[kv_rows])
            shard.wo.weight.copy_(attn.wo.weight[:, q_rows])
        full_out = full_out + shard(x, model.rope)
    torch.testing.assert_close(full_out, attn(x, model.rope), rtol=1e-5, atol=1e-6)


def test_too_long_sequence_is_a_clear_error():
    with pytest.raises(ValueError, match="max_seq_len"):
        _model()(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("bad, match", [
    (dict(dim=30, n_heads=4), "divisible by n_heads"),
    (dict(n_heads=4, n_kv_heads=3), "must divide n_heads"),
    (dict(dim=12, n_heads=4), "even"),
])
def test_bad_args_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        ModelArgs(**bad)


def test_recompute_norm_output_that_cannot_take_effect_raises():
    """recompute_norm_output recomputes a norm's output from what f8dist's RMSNorm keeps; where the
    norm gives nothing to recompute from (a norm with hooks, as a sequence-parallel style's; another
    norm class) the option would do nothing: the forward says so. Without grad, or without the
    option, the same block runs."""
    import torch.nn as nn

    from f8dist import Float8LinearConfig, convert_to_float8_training
    from f8dist.models.llama import TransformerBlock, precompute_rope

    args = ModelArgs(dim=64, n_heads=4, max_seq_len=8)
    rope = precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta)
    x = torch.randn(2, 8, 64)
    config = Float8LinearConfig.from_recipe_name("rowwise").replace(recompute_norm_output=True)
    for change, words in [
        (lambda b: b.attention_norm.register_forward_hook(lambda *a: None), "runs hooks"),
        (lambda b: setattr(b, "ffn_norm", nn.RMSNorm(64)), "is RMSNorm, not f8dist"),
    ]:
        block = TransformerBlock(0, args)
        convert_to_float8_training(block, config=config)
        change(block)
        with pytest.raises(ValueError, match=f"recompute_norm_output: .*{words}.*drop"):
            block(x, rope)
        with torch.no_grad():
            block(x, rope)
    block = TransformerBlock(0, args)
    convert_to_float8_training(block, config=config.replace(recompute_norm_output=False))
    block.attention_norm.register_forward_hook(lambda *a: None)
    block(x, rope).sum().backward()
