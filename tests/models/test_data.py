import pytest
import torch

from f8dist.models.data import ByteBatches, corpus_bytes, decode, encode


def test_corpus_is_python_source_and_splits_are_disjoint():
    train, val = corpus_bytes("train"), corpus_bytes("val")
    assert train.dtype == torch.uint8 and len(train) > 8 * len(val) > 0
    assert "def " in decode(train[:20000])
    with pytest.raises(ValueError, match="unknown split"):
        corpus_bytes("test")


def test_tokenizer_roundtrip():
    text = "def f(x):\n    return 'é'\n"
    assert decode(encode(text)) == text
    assert int(encode(text).max()) < 256


def test_batches_are_deterministic_per_seed():
    a, b, c = (ByteBatches(seq_len=16, batch_size=4, seed=s) for s in (0, 0, 1))
    for _ in range(3):
        (xa, ya), (xb, yb), (xc, _) = next(a), next(b), next(c)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert not torch.equal(xa, xc)
        assert torch.equal(xa[:, 1:], ya[:, :-1])


def test_dp_ranks_split_the_global_batch():
    whole = next(ByteBatches(seq_len=16, batch_size=4, seed=5))[0]
    parts = [next(ByteBatches(seq_len=16, batch_size=4, seed=5, dp_rank=r, dp_size=2))[0]
             for r in range(2)]
    assert torch.equal(torch.cat(parts), whole)
    with pytest.raises(ValueError, match="divisible"):
        ByteBatches(seq_len=16, batch_size=3, seed=0, dp_size=2)


def test_state_dict_resumes_the_stream():
    a = ByteBatches(seq_len=16, batch_size=2, seed=0)
    next(a), next(a)
    b = ByteBatches(seq_len=16, batch_size=2, seed=0)
    b.load_state_dict(a.state_dict())
    assert torch.equal(next(a)[0], next(b)[0])
