"""The seed papers' networks' refusals and edges, word for word (session 43, mutation testing of
hetfl.models.paper_cnns): each names the model, the input shape it cannot take and the smallest it can."""

from __future__ import annotations

import pytest

from hetfl.models.base import ModelError
from hetfl.models.paper_cnns import FedBRCNN, FedPACCNN, FedUVCNN, FedUVResNet18, FedUVResNet50, _fedpac_side

PAPER_MODELS = {"fedpac_cnn": FedPACCNN, "feduv_cnn": FedUVCNN, "fedbr_cnn": FedBRCNN,
                "feduv_resnet18": FedUVResNet18, "feduv_resnet50": FedUVResNet50}


@pytest.mark.parametrize("name", sorted(PAPER_MODELS))
def test_feature_vectors_are_refused_naming_the_model(name):
    with pytest.raises(ModelError) as refused:
        PAPER_MODELS[name]((10,), 3)
    assert str(refused.value) == f"input_shape = (10,): {name} needs images (C, H, W); use mlp for feature vectors"


@pytest.mark.parametrize("name", ["feduv_cnn", "feduv_resnet18", "feduv_resnet50"])
def test_an_output_dimension_below_one_is_refused_by_its_key(name):
    with pytest.raises(ModelError) as refused:
        PAPER_MODELS[name]((3, 32, 32), 3, out_dim=0)
    assert str(refused.value) == "model.options.out_dim = 0: must be a positive integer"


@pytest.mark.parametrize(("channels", "convs", "smallest"), [(1, 2, 12), (3, 3, 16)])
def test_fedpac_cnn_takes_images_down_to_its_smallest_side_on_either_axis(channels, convs, smallest):
    """The smallest side that leaves one pixel after the convolutions and poolings (12 with two convs, 16 with
    three), checked on each axis alone: an image one pixel too narrow or too short is refused."""
    assert _fedpac_side(smallest, convs) == 1 and _fedpac_side(smallest - 1, convs) == 0
    assert FedPACCNN((channels, smallest, smallest), 3).convs == convs
    for shape in ((channels, smallest - 1, smallest), (channels, smallest, smallest - 1)):
        with pytest.raises(ModelError) as refused:
            FedPACCNN(shape, 3)
        assert str(refused.value) == (f"input_shape = {shape}: fedpac_cnn with {convs} convs needs images of at "
                                      f"least {smallest} px a side")


def test_feduv_cnn_takes_images_down_to_21_pixels_on_either_axis():
    FedUVCNN((3, 21, 21), 3)
    for shape in ((3, 20, 21), (3, 21, 20)):
        with pytest.raises(ModelError) as refused:
            FedUVCNN(shape, 3)
        assert str(refused.value) == f"input_shape = {shape}: feduv_cnn needs images of at least 21 px a side"
