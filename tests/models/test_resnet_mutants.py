"""The CIFAR ResNets as their module docstring states them (session 43, mutation testing of hetfl.models.resnet):
the parameter counts, the blocks per stage, the sides each stage leaves of a 32x32 image (3x3 stem of stride 1,
no max pool, stride 2 at each later stage's first block), BatchNorm by default and GroupNorm(2) for ``gn``, the
refusals naming the model and the key."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetfl.models.base import ModelError
from hetfl.models.layers import BatchNorm2d
from hetfl.models.resnet import resnet18, resnet50


@pytest.mark.parametrize(("build", "params", "blocks", "feature"),
                         [(resnet18, 11_173_962, [2, 2, 2, 2], 512), (resnet50, 23_520_842, [3, 4, 6, 3], 2048)],
                         ids=["resnet18", "resnet50"])
def test_the_cifar_resnets_are_as_documented(build, params, blocks, feature):
    model = build((3, 32, 32), 10)
    assert sum(p.numel() for p in model.parameters()) == params
    stages = list(model.encoder)[3:7]
    assert [len(stage) for stage in stages] == blocks
    with torch.no_grad():
        h = model.encoder[:3](torch.zeros(2, 3, 32, 32))
        sides = [h.shape[-1]]
        for stage in stages:
            h = stage(h)
            sides.append(h.shape[-1])
    assert sides == [32, 32, 16, 8, 4] and h.shape[1] == feature == model.classifier.in_features
    assert {type(m) for m in model.modules() if isinstance(m, nn.BatchNorm2d | nn.GroupNorm)} == {BatchNorm2d}
    grouped = build((3, 32, 32), 10, norm="gn")
    norms = [m for m in grouped.modules() if isinstance(m, nn.BatchNorm2d | nn.GroupNorm)]
    assert norms and all(type(m) is nn.GroupNorm and m.num_groups == 2 for m in norms)
    assert sum(p.numel() for p in grouped.parameters()) == params


@pytest.mark.parametrize(("build", "name"), [(resnet18, "resnet18"), (resnet50, "resnet50")])
def test_the_resnets_refusals_name_the_model_and_the_key(build, name):
    with pytest.raises(ModelError) as refused:
        build((10,), 3)
    assert str(refused.value) == f"input_shape = (10,): {name} needs images (C, H, W); use mlp for feature vectors"
    with pytest.raises(ModelError) as refused:
        build((3, 32, 32), 3, gn_groups=0)
    assert str(refused.value) == "model.options.gn_groups = 0: must be a positive integer"
