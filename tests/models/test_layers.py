"""hetfl.models.layers.MaxPool2d: nn.MaxPool2d's values and gradients, bit for bit, with fewer copies under vmap."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap

from hetfl.models.layers import MaxPool2d, _foldable
from tests.helpers.ops import VIEWS, OpCounter

SETTINGS = [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=2, ceil_mode=True),
            dict(kernel_size=(2, 3), stride=(2, 1))]
IDS = ["k2", "k3s2p1", "k2ceil", "k2x3s2x1"]


def pools(settings: dict) -> tuple[nn.Module, nn.Module]:
    return nn.MaxPool2d(**settings), MaxPool2d(**settings)


def net(pool: nn.Module):
    """A client's loss: conv, ReLU, pool, conv, ReLU, pool, linear (the layers' order in cnn2 and simple_cnn)."""

    def loss(params: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
        w1, b1, w2, w3 = params
        h = pool(F.relu(F.conv2d(x, w1, b1)))  # with a bias, vmap hands the pooling a client-major view
        h = pool(F.relu(F.conv2d(h, w2)))  # without, the clients next to the channels
        return (h.flatten(1) @ w3[:, : h[0].numel()].T).logsumexp(1).mean()

    return loss


def client_params(clients: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(clients, 6, 3, 3, 3, generator=g), torch.randn(clients, 6, generator=g),
            torch.randn(clients, 8, 6, 3, 3, generator=g), torch.randn(clients, 10, 8 * 8 * 8, generator=g))


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_values_and_gradients_are_nn_maxpool2ds_bit_for_bit(settings):
    reference, ours = pools(settings)
    x = torch.randn(4, 3, 13, 13, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, out_ref = ours(x), reference(x_ref)
    assert torch.equal(out, out_ref)
    g = torch.randn_like(out)
    out.backward(g)
    out_ref.backward(g)
    assert torch.equal(x.grad, x_ref.grad)
    with torch.no_grad():  # evaluation: PyTorch's pooling itself
        assert torch.equal(ours(x), reference(x))
    unbatched = torch.randn(3, 9, 9)  # [C, H, W]
    assert torch.equal(ours(unbatched), reference(unbatched))


@pytest.mark.parametrize("settings", [dict(kernel_size=2, dilation=2), dict(kernel_size=2, return_indices=True)],
                         ids=["dilation", "indices"])
def test_dilation_and_returned_indices_are_pytorchs_own_pooling(settings):
    reference, ours = pools(settings)
    x = torch.randn(2, 3, 11, 11)
    got, want = ours(x), reference(x)
    for a, b in zip(got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_vmapped_client_gradients_are_those_of_pytorchs_batching_rule(settings):
    """Per-client weights (clients next to the channels after each convolution), and an input batched
    client-major (the first pooling of ``pool_first``): the same gradients, bit for bit."""
    reference, ours = pools(settings)
    params, x = client_params(3), torch.randn(3, 5, 3, 20, 20)
    want = vmap(grad(net(reference)))(params, x)
    got = vmap(grad(net(ours)))(params, x)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)

    def pool_first(pool):
        return lambda w, x: (pool(x) * w).sum()

    w, odd = torch.randn(3, 1, 3, 1, 1), torch.randn(3, 5, 3, 21, 21)  # odd sizes: ceil_mode matters
    for argnums in (0, 1):
        want = vmap(grad(pool_first(reference), argnums=argnums))(w, odd)
        assert torch.equal(vmap(grad(pool_first(ours), argnums=argnums))(w, odd), want)
    for channels in (3, 1):  # a client's input without a sample dim: [C, H, W]
        images = torch.randn(3, channels, 21, 21)
        want = vmap(grad(pool_first(reference), argnums=1))(w[:, 0, :channels], images)
        assert torch.equal(vmap(grad(pool_first(ours), argnums=1))(w[:, 0, :channels], images), want)


def test_an_input_shared_by_the_clients_gets_each_clients_gradient():
    """An input outside the vmapped dimension (every client pools the same tensor), differentiated per client."""
    reference, ours = pools(dict(kernel_size=2))
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 1, 1)

    def loss(pool):
        return lambda x, w: (pool(x) * w).square().sum()

    want = vmap(grad(loss(reference)), in_dims=(None, 0))(x, w)
    assert torch.equal(vmap(grad(loss(ours)), in_dims=(None, 0))(x, w), want)


def test_second_derivatives_through_the_pooling_are_pytorchs():
    """A gradient penalty differentiates the pooling's backward again (in the incoming gradient)."""
    reference, ours = pools(dict(kernel_size=2))
    w0, x = torch.randn(6, 3, 3, 3), torch.randn(2, 3, 10, 10)

    def penalty(pool):
        def f(w):
            inner = grad(lambda w: pool(F.conv2d(x, w)).square().sum())(w)
            return inner.square().sum()
        return f

    assert torch.equal(grad(penalty(ours))(w0), grad(penalty(reference))(w0))
    x = x[0]  # one image, [C, H, W]
    assert torch.equal(grad(penalty(ours))(w0), grad(penalty(reference))(w0))


def test_foldable_dims_are_those_that_flatten_as_a_view():
    t = torch.zeros(4, 3, 5)
    assert _foldable(t, 0) and _foldable(t, 1)
    assert not _foldable(t.transpose(0, 1), 0)  # a flatten would copy
    assert _foldable(torch.zeros(4, 1, 5).transpose(0, 1), 0)  # a dim of size 1 folds whatever its stride


def test_a_client_major_input_is_pooled_with_the_clients_folded_into_the_samples_without_a_copy():
    counter = OpCounter()
    with counter:
        vmap(MaxPool2d(2))(torch.randn(3, 4, 2, 8, 8))
    assert counter.ops["aten.clone"] == 0 and counter.ops["aten.max_pool2d_with_indices"] == 1


def copies(pool: nn.Module) -> Counter[str]:
    counter = OpCounter()
    with counter:
        vmap(grad(net(pool)))(client_params(4), torch.randn(4, 6, 3, 20, 20))
    return counter.ops


def test_vmapped_pooling_copies_no_activation():
    """PyTorch's batching rule folds the clients into the samples: the activation after each convolution
    is copied for the pooling, the pooled one again for the next convolution, and the backward pass
    does the same; pooling where the activation lies copies neither (what is left: the client-major
    client-major input of the first convolution, forward and backward, and the flattened features for
    the matrix product)."""
    reference, ours = pools(dict(kernel_size=2))
    before, after = copies(reference), copies(ours)
    assert before["aten.clone"] == 9 and after["aten.clone"] == 3

    def kernels(ops: Counter[str]) -> int:
        return sum(n for op, n in ops.items() if op not in VIEWS)

    assert kernels(after) == kernels(before) - 6
