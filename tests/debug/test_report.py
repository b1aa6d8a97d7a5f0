"""f8dist.debug report, plot, logger and the high-precision suggestion."""

import builtins
import json
import os

import pytest
import torch
import torch.nn as nn

import f8dist
from f8dist.core.cast import CastSite
from f8dist.debug import Float8StatsLogger, format_table, plot_history, record, suggest_module_filter
from f8dist.debug.stats import CastStats


def make_model(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 16))
    config = f8dist.Float8LinearConfig(emulate=True)
    return model, config


def converted(seed=0):
    model, config = make_model(seed)
    return f8dist.convert_to_float8_training(model, config=config)


def train_step(model, x):
    model(x).sum().backward()


def test_table_has_one_row_per_site_with_its_figures():
    model = converted()
    with record(model) as rec:
        train_step(model, torch.randn(8, 32))
    stats = rec.stats()
    text = rec.table()
    lines = text.splitlines()
    assert lines[0] == "float8 casts, step 0"
    assert len(lines) == 4 + len(stats)  # title, header, rule, rows, footnote on the reuse
    assert "reuses the float8 bytes of the output/input or grad_input/grad_output" in lines[-1]
    for line, (site, s) in zip(lines[3:], stats.items()):
        cells = line.split()
        assert cells[:3] == [site.fqn, site.gemm, site.operand]
        assert cells[-1] == f"{s.sqnr_db:.1f}"
    assert format_table({}) == "float8 casts: no casts recorded"


def test_suggestion_keeps_the_worst_layer_in_high_precision():
    with torch.device("cpu"):  # the statistics below are of these CPU random numbers
        model = converted()
        x = torch.randn(8, 32)
    with torch.no_grad():
        model[2].weight[0, 0] = 1e4  # one outlier: the tensorwise weight scale crushes the rest
    with record(model) as rec:
        train_step(model, x)
    # the outlier's energy keeps the SQNR high: the underflow gives it away (U(-1/8, 1/8) weights
    # below 2**-10 / (448 / 1e4), about a sixth of them, flush to zero)
    stats = rec.stats()
    weight = next(s for site, s in stats.items() if (site.fqn, site.operand) == ("2", "weight"))
    assert weight.sqnr_db > 40 and 0.1 < weight.underflow_frac < 0.25
    keep = suggest_module_filter(stats, min_sqnr_db=15.0, max_underflow_frac=0.1)
    assert keep.high_precision_fqns == ["2"]
    fresh, config = make_model()
    f8dist.convert_to_float8_training(fresh, config=config, module_filter_fn=keep)
    assert [type(m).__name__ for m in fresh if isinstance(m, nn.Linear)] == [
        "Float8Linear", "Linear", "Float8Linear"]
    # no criterion met: nothing kept
    assert suggest_module_filter(stats, min_sqnr_db=-1.0, max_underflow_frac=0.5
                                 ).high_precision_fqns == []


def _stats(sqnr_error_sq, saturated, underflow=0):
    return CastStats(float8_dtype=torch.float8_e4m3fn, casts=1, numel=1000, nonzero=1000,
                     saturated=saturated, underflow=underflow, signal_sq=1.0, error_sq=sqnr_error_sq,
                     amax=1.0, scale_max=448.0, scale_min=448.0)


def test_suggestion_by_saturation_and_max_layers():
    stats = {
        CastSite("a", "output", "input"): _stats(1e-3, 0),  # 30 dB
        CastSite("b", "output", "input"): _stats(1e-3, 5),  # 30 dB, 0.5% saturated
        CastSite("c", "output", "input"): _stats(1e-1, 0),  # 10 dB
        CastSite("c", "output", "weight"): _stats(1e-4, 0),
        CastSite("d", "grad_input", "grad_output"): _stats(1e-4, 0, underflow=50),  # 5% to 0
    }
    assert suggest_module_filter(stats).high_precision_fqns == ["c", "b", "d"]
    assert suggest_module_filter(stats, max_layers=1).high_precision_fqns == ["c"]
    assert suggest_module_filter(stats, min_sqnr_db=None, max_underflow_frac=None
                                 ).high_precision_fqns == ["b"]
    assert suggest_module_filter(stats, min_sqnr_db=None, max_saturated_frac=None
                                 ).high_precision_fqns == ["d"]
    with pytest.raises(ValueError, match="record a few training steps"):
        suggest_module_filter({})


def test_logger_records_every_n_steps(tmp_path):
    model = converted()
    printed = []
    logger = Float8StatsLogger(model, every=2, out_dir=str(tmp_path), print_fn=printed.append)
    x = torch.randn(8, 32)
    for i in range(5):
        with logger.step(i):
            train_step(model, x)
    logger.close()
    assert logger.recorder.steps == [0, 2, 4]
    assert [p.splitlines()[0] for p in printed if p.startswith("float8")] == [
        f"float8 casts, step {i}" for i in (0, 2, 4)]
    lines = [json.loads(l) for l in (tmp_path / "float8_stats.jsonl").read_text().splitlines()]
    n_sites = len(logger.recorder.stats())
    assert len(lines) == 3 * n_sites
    assert {l["step"] for l in lines} == {0, 2, 4}
    assert (tmp_path / "float8_stats.txt").read_text().startswith("float8 casts, step 4")
    with pytest.raises(ValueError, match="positive int"):
        Float8StatsLogger(model, every=0)


def test_plot_writes_png(tmp_path):
    model = converted()
    rec = record(model)
    for i in range(3):
        rec.set_step(i)
        with rec:
            train_step(model, torch.randn(8, 32))
    path = rec.plot(str(tmp_path / "stats.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_what_to_install(monkeypatch, tmp_path):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_history({0: {}}, str(tmp_path / "x.png"))
    assert not os.path.exists(tmp_path / "x.png")
