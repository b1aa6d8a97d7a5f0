"""f8dist/policy/checkpoint.py: DCP checkpoints load across float8 recipes (one process; train.py's
--resume with another --float8 is tests/scripts/test_train_checkpoints.py)."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from f8dist import Float8LinearConfig, convert_to_float8_training, sync_float8_amax_and_scale_history
from f8dist.policy.checkpoint import Float8LoadPlanner


def _model(recipe=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    if recipe is None:
        return model
    return convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))


def _train_one_step(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(8, 32, generator=g)).sum().backward()
    sync_float8_amax_and_scale_history(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)


@pytest.mark.parametrize("saved", [None, "tensorwise", "rowwise"])
def test_a_checkpoint_without_delayed_state_loads_into_a_delayed_model(tmp_path, saved):
    source = _model(saved)
    _train_one_step(source)
    dcp.save({"model": source.state_dict()}, checkpoint_id=str(tmp_path))

    model = _model("delayed")
    _train_one_step(model, seed=2)  # histories and scales that must not survive the load
    assert model[0].delayed.synced
    sd = {"model": model.state_dict()}
    with pytest.raises(CheckpointException, match="Missing key .* model.0.fp8_amax"):  # DCP's default planner
        dcp.load(sd, checkpoint_id=str(tmp_path))

    sd = {"model": model.state_dict()}
    planner = Float8LoadPlanner()
    dcp.load(sd, checkpoint_id=str(tmp_path), planner=planner)
    model.load_state_dict(sd["model"])
    assert planner.restart_missing(model) == ["0", "2"]
    assert len(planner.missing_delayed_state) == 2 * 3 * 3 and planner.unused_delayed_state == []
    for name, v in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], v), name
    fresh = _model("delayed").state_dict()
    for name, v in model.state_dict().items():
        if "fp8_" in name:  # restarted: the next step is a first step
            assert torch.equal(v, fresh[name]), name
    assert not model[0].delayed.synced and not model[2].delayed.synced


def test_a_delayed_checkpoint_loads_into_a_tensorwise_model(tmp_path):
    source = _model("delayed")
    _train_one_step(source)
    dcp.save({"model": source.state_dict()}, checkpoint_id=str(tmp_path))
    model = _model("tensorwise")
    sd = {"model": model.state_dict()}
    planner = Float8LoadPlanner()
    dcp.load(sd, checkpoint_id=str(tmp_path), planner=planner)
    model.load_state_dict(sd["model"])
    assert planner.restart_missing(model) == []
    assert len(planner.unused_delayed_state) == 2 * 3 * 3
    assert all(torch.equal(model.state_dict()[k], v) for k, v in source.state_dict().items() if "fp8_" not in k)


def test_other_missing_keys_still_raise(tmp_path):
    dcp.save({"model": {"0.weight": torch.zeros(32, 32)}}, checkpoint_id=str(tmp_path))
    with pytest.raises(CheckpointException, match="Missing key .* model.0.bias"):
        dcp.load({"model": _model("delayed").state_dict()}, checkpoint_id=str(tmp_path),
                 planner=Float8LoadPlanner())
