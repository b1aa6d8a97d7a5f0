"""torch.compile(fullgraph=True) of float8 TP + SP equals eager bit for bit (2 ranks); the
comparison runs in tests/distributed/tp_compile.py."""

from tests.distributed.harness import launch, result


PROGRAM = launch("tp_compile", 2, timeout=300)


def test_compiled_tp_sp_equals_eager():
    r = result(PROGRAM)
    assert r["checked"] == [
        f"{recipe}:{name}"
        for recipe in ("tensorwise", "rowwise")
        for name in ("out", "grad:0.weight", "grad:1.weight")
    ]
