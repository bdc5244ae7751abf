"""hetfl.models.layers: nn.MaxPool2d's, nn.Linear's and nn.Conv2d's values and gradients, bit for bit, with fewer
copies and kernels under vmap (inside client_batching, where the vectorised executor runs its steps)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap

from hetfl.models import layers
from hetfl.models.layers import Conv2d, Linear, MaxPool2d, _foldable, client_batching
from tests.helpers.ops import VIEWS, OpCounter

SETTINGS = [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=2, ceil_mode=True),
            dict(kernel_size=(2, 3), stride=(2, 1))]
IDS = ["k2", "k3s2p1", "k2ceil", "k2x3s2x1"]


@pytest.fixture(autouse=True)
def batching(request):
    """Every test here runs inside client_batching (the vectorised executor's step), but those about outside it."""
    if "outside_client_batching" in request.node.name:
        yield
        return
    with client_batching():
        yield


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


def linears(bias: bool = True, seed: int = 0) -> tuple[nn.Linear, Linear]:
    torch.manual_seed(seed)
    reference = nn.Linear(40, 7, bias=bias)
    ours = Linear(40, 7, bias=bias)
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def forward_backward(layer: nn.Module, x: torch.Tensor, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """The output and the gradients of the input, weight and bias, under autocast to ``dtype`` if given."""
    x = x.detach().clone().requires_grad_()
    layer.zero_grad()
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = layer(x)
    out.float().sin().sum().backward()
    return [out, x.grad, *(p.grad for p in layer.parameters())]


class ProductThenBias(nn.Linear):
    """What Linear computes inside client_batching, written with PyTorch's ops: the product, then the
    bias in the product's precision."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        product = F.linear(x, self.weight)
        return product + self.bias.to(product.dtype)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_linear_values_and_gradients_are_the_product_then_the_bias(dtype):
    """Rows of vectors stored row- or column-major, under autocast too: the product, then the bias added in
    the product's precision (so in float32 nn.Linear's values and gradients bit for bit; under autocast the
    product is rounded before the bias is added, where addmm rounds once)."""
    reference, ours = linears()
    spelled = ProductThenBias(40, 7)
    spelled.load_state_dict(reference.state_dict())
    for x in (torch.randn(13, 40), torch.randn(40, 13).t()):
        got = forward_backward(ours, x, dtype)
        for want in (forward_backward(spelled, x, dtype), *([forward_backward(reference, x)] if dtype is None else [])):
            for a, b in zip(got, want, strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b)
        want = forward_backward(reference, x, dtype)
        assert [a.dtype for a in got] == [b.dtype for b in want]
        # the output: addmm's, but for the product's rounding (half a unit in its last place, at most)
        ulp = torch.finfo(got[0].dtype).eps * want[0].abs().max().item()
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=ulp)


def test_a_float64_linear_layer_stays_float64_under_autocast():
    reference, ours = linears()
    reference.double(), ours.double()
    x = torch.randn(13, 40, dtype=torch.float64)
    for got, want in zip(forward_backward(ours, x, torch.bfloat16), forward_backward(reference, x, torch.bfloat16),
                         strict=True):
        assert got.dtype == want.dtype == torch.float64 and torch.equal(got, want)


def test_linear_without_a_bias_or_on_other_shapes_is_f_linear():
    reference, ours = linears(bias=False)
    x = torch.randn(13, 40)
    assert all(torch.equal(a, b) for a, b in zip(forward_backward(ours, x), forward_backward(reference, x),
                                                 strict=True))
    reference, ours = linears()
    for x in (torch.randn(40), torch.randn(2, 5, 40)):  # one vector, tokens of sequences
        assert torch.equal(ours(x), reference(x))


def linear_loss(layer: nn.Module):
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(layer, params, (x,)).sin().sum()

    return loss


def per_client(clients: int = 5) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"weight": torch.randn(clients, 7, 40, generator=g), "bias": torch.randn(clients, 7, generator=g)}, \
        torch.randn(clients, 13, 40, generator=g)


@pytest.mark.parametrize("in_dims", [(0, 0), (None, 0), (0, None)], ids=["own", "shared-layer", "shared-input"])
def test_vmapped_linear_gradients_are_those_of_pytorchs_batching_rule(in_dims):
    """Per-client weights and inputs, one layer for all clients, one input for all: the gradients of the
    parameters and of the input equal PyTorch's bit for bit."""
    reference, ours = linears()
    params, x = per_client()
    params = params if in_dims[0] == 0 else {n: t[0] for n, t in params.items()}
    x = x if in_dims[1] == 0 else x[0]
    for argnums in (0, 1):
        want = vmap(grad(linear_loss(reference), argnums=argnums), in_dims=in_dims)(params, x)
        got = vmap(grad(linear_loss(ours), argnums=argnums), in_dims=in_dims)(params, x)
        for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("batched", ["weight", "bias"])
def test_a_layer_with_only_its_weight_or_its_bias_per_client(batched):
    """One of the two parameters per client, the other shared: PyTorch's gradients, bit for bit."""
    reference, ours = linears()
    params, x = per_client()
    in_dims = ({n: 0 if n == batched else None for n in params}, 0)
    params = {n: t if n == batched else t[0] for n, t in params.items()}
    for argnums in (0, 1):
        want = vmap(grad(linear_loss(reference), argnums=argnums), in_dims=in_dims)(params, x)
        got = vmap(grad(linear_loss(ours), argnums=argnums), in_dims=in_dims)(params, x)
        for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
            assert torch.equal(a, b)


def test_second_derivatives_through_the_linear_layer_are_pytorchs():
    """A gradient penalty in the input, per client: differentiates the layer's backward again."""
    reference, ours = linears()
    params, x = per_client()

    def penalty(layer):
        def f(params, x):
            inner = grad(lambda x: linear_loss(layer)(params, x))(x)
            return inner.square().sum()
        return f

    want = vmap(grad(penalty(reference)))(params, x)
    got = vmap(grad(penalty(ours)))(params, x)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6)


def test_a_vmapped_linear_layer_adds_its_bias_without_scaling_a_copy():
    """PyTorch's rule for addmm scales the bias by beta = 1 (a kernel per layer and step); ours adds it
    in place after the batched product: one kernel fewer, the rest the same."""
    params, x = per_client()

    def ops(layer: nn.Module) -> Counter[str]:
        with OpCounter() as counter:
            vmap(grad(linear_loss(layer)))(params, x)
        return Counter({op: n for op, n in counter.ops.items() if op not in VIEWS})

    reference, ours = linears()
    before, after = ops(reference), ops(ours)
    assert before["aten.mul"] == after["aten.mul"] + 1 and after["aten.bmm"] == before["aten.bmm"] == 2
    assert sum(before.values()) == sum(after.values()) + 1


def test_outside_client_batching_the_layers_are_pytorchs_own(monkeypatch):
    """A sequential step pays no autograd.Function per call and runs nn.Linear's addmm: outside
    client_batching the pooling's Function does not run and the linear layer is one addmm (under vmap
    too); inside, nested or not, the Function runs and the layer is a product then an add."""
    ran: Counter[str] = Counter()
    original = layers._MaxPool2d.apply
    monkeypatch.setattr(layers._MaxPool2d, "apply", lambda *a: (ran.update(["pool"]), original(*a))[1])
    params, x = per_client()

    def both() -> Counter[str]:
        with OpCounter() as counter:
            Linear(40, 7)(torch.randn(3, 40))
        MaxPool2d(2)(torch.randn(2, 3, 8, 8, requires_grad=True)).sum().backward()
        return counter.ops

    assert both()["aten.addmm"] == 1
    vmap(grad(linear_loss(Linear(40, 7))))(params, x)
    assert not ran
    with client_batching():
        with client_batching():
            pass
        ops = both()  # still inside after a nested one ended
    assert ran == {"pool": 1} and ops["aten.mm"] == ops["aten.add"] == 1 and not ops["aten.addmm"]
    assert both()["aten.addmm"] == 1 and ran == {"pool": 1}


def test_client_batching_belongs_to_its_thread():
    """Another thread (a Flower client's, a worker's) is outside the vectorised step's client_batching."""
    import threading

    seen: list[bool] = []
    thread = threading.Thread(target=lambda: seen.append(layers._client_batching()))
    with client_batching():
        thread.start()
        thread.join()
    assert seen == [False]


# ---------------------------------------------------------------- Conv2d: one ordinary convolution per client
CONVS = [dict(in_channels=4, out_channels=6, kernel_size=3),
         dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1, bias=False),
         dict(in_channels=4, out_channels=6, kernel_size=(3, 2), stride=(1, 2), padding=(2, 0), dilation=(2, 1)),
         dict(in_channels=4, out_channels=8, kernel_size=3, padding=1, groups=2),
         dict(in_channels=4, out_channels=4, kernel_size=3, padding=1, groups=4, bias=False)]
CONV_IDS = ["k3", "s2p1-nobias", "k3x2-dilated", "groups2", "depthwise"]


def conv_pair(settings: dict) -> tuple[nn.Conv2d, Conv2d]:
    torch.manual_seed(5)
    reference = nn.Conv2d(**settings)
    ours = Conv2d(**settings)
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def conv_loss(layer: nn.Module):
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(layer, params, (x,)).sin().sum()

    return loss


def client_convs(layer: nn.Module, clients: int = 3) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    params = {n: torch.randn(clients, *p.shape, generator=g) for n, p in layer.named_parameters()}
    return params, torch.randn(clients, 5, layer.in_channels, 9, 8, generator=g)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("settings", CONVS, ids=CONV_IDS)
def test_per_client_conv_values_and_gradients_are_nn_conv2ds_bit_for_bit(settings, dtype):
    """Unbatched (a client's own step): the kernels of nn.Conv2d, so its values and gradients, under autocast
    too."""
    reference, ours = conv_pair(settings)
    x = torch.randn(5, 4, 9, 8)
    with client_batching("per_client"):
        got = forward_backward(ours, x, dtype)
    for a, b in zip(got, forward_backward(reference, x, dtype), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("settings", CONVS, ids=CONV_IDS)
def test_per_client_convs_under_vmap_give_each_client_its_own_steps_gradients_bit_for_bit(settings):
    """The point of "per_client": each client's gradients are those of its own sequential step, bit for bit
    (a grouped convolution sums in another order), and equal PyTorch's grouped rule to rounding."""
    reference, ours = conv_pair(settings)
    params, x = client_convs(reference)
    with client_batching("per_client"):
        got = vmap(grad(conv_loss(ours), argnums=(0, 1)))(params, x)
    for c in range(x.shape[0]):
        own = grad(conv_loss(reference), argnums=(0, 1))({n: t[c] for n, t in params.items()}, x[c])
        for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(own), strict=True):
            assert torch.equal(a[c], b)
    grouped = vmap(grad(conv_loss(reference), argnums=(0, 1)))(params, x)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(grouped), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # gradients of order 10: float32 rounding


@pytest.mark.parametrize(("weight", "bias", "x"), [(None, None, 0), (0, 0, None), (0, None, 0), (None, 0, 0)],
                         ids=["shared-layer", "shared-input", "own-weight-shared-bias", "shared-weight-own-bias"])
def test_per_client_convs_where_some_tensors_are_shared_by_the_clients(weight, bias, x):
    """A layer every client shares (a global model in the payload), an input every client shares, one
    parameter per client and the other shared: each client's gradients of every tensor, as PyTorch's rule
    gives them."""
    reference, ours = conv_pair(CONVS[0])
    params, inputs = client_convs(reference)
    params = {"weight": params["weight"] if weight == 0 else params["weight"][0],
              "bias": params["bias"] if bias == 0 else params["bias"][0]}
    inputs = inputs if x == 0 else inputs[0]
    in_dims = ({"weight": weight, "bias": bias}, x)
    want = vmap(grad(conv_loss(reference), argnums=(0, 1)), in_dims=in_dims)(params, inputs)
    with client_batching("per_client"):
        got = vmap(grad(conv_loss(ours), argnums=(0, 1)), in_dims=in_dims)(params, inputs)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_second_derivatives_through_per_client_convs_are_pytorchs():
    """Differentiating the convolution's backward again (a gradient penalty, a Hessian-vector product), per
    client: PyTorch's double-backward formula; and exact in float64 (gradgradcheck)."""
    reference, ours = conv_pair(CONVS[3])
    params, x = client_convs(reference)

    def penalty(layer):
        def f(params, x):
            return grad(lambda x: conv_loss(layer)(params, x))(x).square().sum()
        return f

    want = vmap(grad(penalty(reference)))(params, x)
    with client_batching("per_client"):
        got = vmap(grad(penalty(ours)))(params, x)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)
    x64 = torch.randn(2, 4, 7, 6, dtype=torch.float64, requires_grad=True)
    w64 = torch.randn(8, 2, 3, 3, dtype=torch.float64, requires_grad=True)
    b64 = torch.randn(8, dtype=torch.float64, requires_grad=True)
    settings = ([2, 1], [1, 0], [1, 1], 2)
    conv = lambda x, w, b: layers._Conv2d.apply(x, w, b, settings)
    assert torch.autograd.gradgradcheck(conv, (x64, w64, b64))


class Convolutions(OpCounter):
    """Also the ``groups`` of each convolution, forward and backward, and the gradients each backward call
    computes (its output mask: input, weight, bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.groups: list[tuple[str, int]] = []
        self.masks: list[tuple[bool, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func.overloadpacket)
        if name == "aten.convolution":
            self.groups.append((name, args[8]))
        elif name == "aten.convolution_backward":
            self.groups.append((name, args[9]))
            self.masks.append(tuple(args[10]))
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_through_a_shared_frozen_layer_the_input_gradient_is_one_call():
    """A layer every client shares and nobody trains (a global model's encoder on the clients' batches): the
    clients' input gradients come from one ordinary call over all their samples, equal to PyTorch's rule."""
    reference, ours = conv_pair(CONVS[1])
    params, x = client_convs(reference)
    shared = {n: t[0] for n, t in params.items()}
    want = vmap(grad(conv_loss(reference), argnums=1), in_dims=(None, 0))(shared, x)
    with client_batching("per_client"), Convolutions() as counter:
        got = vmap(grad(conv_loss(ours), argnums=1), in_dims=(None, 0))(shared, x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert counter.groups == [("aten.convolution", 1), ("aten.convolution_backward", 1)]
    assert counter.masks == [(True, False, False)] and got.shape == x.shape
    # trained (a shared layer without a bias): each client's own weight gradient, per client
    want = vmap(grad(conv_loss(reference), argnums=(0, 1)), in_dims=(None, 0))(shared, x)
    with client_batching("per_client"):
        got = vmap(grad(conv_loss(ours), argnums=(0, 1)), in_dims=(None, 0))(shared, x)
    assert got[0]["weight"].shape == (x.shape[0], *shared["weight"].shape)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_frozen_bias_or_input_gets_no_gradient_computed():
    """Per client, the backward computes only the gradients asked for: none for a frozen bias (a fine-tuned
    encoder's), none for the images."""
    reference, ours = conv_pair(CONVS[0])
    params, x = client_convs(reference)

    def loss(weight, x):  # the bias frozen: a constant of the loss
        return conv_loss(ours)({"weight": weight, "bias": params["bias"][0]}, x)

    with client_batching("per_client"), Convolutions() as counter:
        vmap(grad(loss))(params["weight"], x)
    assert counter.masks == [(False, True, False)] * 3


@pytest.mark.parametrize("mode", ["grouped", "per_client"])
def test_the_conv_batching_mode_picks_one_grouped_or_one_ordinary_convolution_per_client(mode):
    reference, ours = conv_pair(CONVS[3])  # groups = 2
    params, x = client_convs(reference, clients=3)
    with client_batching(mode), Convolutions() as counter:
        vmap(grad(conv_loss(ours)))(params, x)
    if mode == "grouped":
        assert counter.groups == [("aten.convolution", 6), ("aten.convolution_backward", 6)]
    else:
        assert counter.groups == [("aten.convolution", 2)] * 3 + [("aten.convolution_backward", 2)] * 3


def test_convs_with_padding_by_name_or_not_zeros_are_pytorchs_own(monkeypatch):
    calls: list[int] = []
    original = layers._Conv2d.apply
    monkeypatch.setattr(layers._Conv2d, "apply", lambda *a: (calls.append(1), original(*a))[1])
    x = torch.randn(2, 4, 9, 8)
    with client_batching("per_client"):
        for settings in (dict(padding="same"), dict(padding=1, padding_mode="reflect")):
            reference, ours = conv_pair({**CONVS[0], **settings})
            assert torch.equal(ours(x), reference(x))
        assert not calls
        conv_pair(CONVS[0])[1](x)
    assert calls == [1]


def test_conv_batching_outside_per_client_mode_is_pytorchs_own_conv(monkeypatch):
    """In the grouped mode, and outside client_batching, no Function runs: nn.Conv2d's forward as it is."""
    calls: list[int] = []
    original = layers._Conv2d.apply
    monkeypatch.setattr(layers._Conv2d, "apply", lambda *a: (calls.append(1), original(*a))[1])
    reference, ours = conv_pair(CONVS[0])
    params, x = client_convs(reference)
    with client_batching("grouped"):
        vmap(grad(conv_loss(ours)))(params, x)
        assert not calls
        with client_batching("per_client"):
            vmap(grad(conv_loss(ours)))(params, x)
        assert len(calls) == 1 + 3  # the batched call, then one per client
        vmap(grad(conv_loss(ours)))(params, x)  # the outer mode is back
    ours(x[0])
    assert len(calls) == 4


def test_an_unknown_conv_batching_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"conv = 'loop': must be one of \('grouped', 'per_client'\)"), \
            client_batching("loop"):
        pass


# ---------------------------------------------------------------- the pooling's rule where host time counts
def test_without_the_pooling_layout_rule_the_pooling_is_pytorchs_under_vmap(monkeypatch):
    """``client_batching(pool_layout=False)`` (an eager vectorised step, bound by its host time): MaxPool2d
    runs PyTorch's batching rule, no autograd.Function (which functorch runs through Python machinery at
    every call under vmap and grad), with the same gradients bit for bit; the linear layer keeps its form.
    Nested, the inner setting holds inside and the outer one comes back after it."""
    ran: Counter[str] = Counter()
    original = layers._MaxPool2d.apply
    monkeypatch.setattr(layers._MaxPool2d, "apply", lambda *a: (ran.update(["pool"]), original(*a))[1])
    reference, ours = pools(dict(kernel_size=2))
    params, x = client_params(3), torch.randn(3, 5, 3, 20, 20)
    want = vmap(grad(net(reference)))(params, x)
    with client_batching(pool_layout=False):
        got = vmap(grad(net(ours)))(params, x)
        assert not ran
        with OpCounter() as counter:
            Linear(40, 7)(torch.randn(3, 40))
        assert counter.ops["aten.mm"] == 1 and not counter.ops["aten.addmm"]
        with client_batching():
            assert torch.equal(vmap(grad(net(ours)))(params, x)[0], want[0])
        assert ran["pool"] > 0
        ran.clear()
        vmap(grad(net(ours)))(params, x)
        assert not ran
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    vmap(grad(net(ours)))(params, x)  # the fixture's client_batching(): the layout rule again
    assert ran["pool"] > 0


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(5, 3), (4, 3, 2, 2)])
def test_inference_batchnorm_is_eval_mode_batchnorm_and_vmaps(shape, affine):
    """``inference_copy``'s BatchNorm: ``F.batch_norm(training=False)``'s values with the state's running
    statistics (not the batch's), for 1d and 2d inputs, with and without affine parameters; vmapped over
    per-client states like the layer it stands for, and the model itself left in training mode."""
    from torch.func import functional_call

    from hetfl.models.layers import InferenceBatchNorm, inference_copy

    norm = nn.BatchNorm1d(3, affine=affine) if len(shape) == 2 else nn.BatchNorm2d(3, affine=affine)
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5), norm) if len(shape) == 2 else nn.Sequential(norm)
    twin = inference_copy(model.train())
    assert model.training and not twin.training and isinstance(twin[-1], InferenceBatchNorm)
    gen = torch.Generator().manual_seed(0)
    states = [{k: torch.randn(v.shape, generator=gen).abs() + 0.5 if v.is_floating_point() else v
               for k, v in model.state_dict().items()} for _ in range(2)]
    x = torch.randn(shape, generator=gen)
    for state in states:
        model.load_state_dict(state)
        torch.testing.assert_close(functional_call(twin, state, (x,)), model.eval()(x))
        model.train()
    stacked = {k: torch.stack([s[k] for s in states]) for k in states[0]}
    batched = torch.func.vmap(lambda s: functional_call(twin, s, (x,)))(stacked)
    for i, state in enumerate(states):
        torch.testing.assert_close(batched[i], functional_call(twin, state, (x,)))
    plain = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    assert inference_copy(plain) is plain  # nothing depends on the mode: the model itself


def test_inference_copy_holds_the_models_tensors_by_name_on_the_meta_device_and_replaces_nested_batchnorms():
    """``inference_copy``'s twin: every parameter and buffer of the model under the same name, shape and dtype,
    none of them with storage (meta device: each call hands it its tensors); every BatchNorm with running
    statistics replaced, nested ones included (``block.1``), and one without running statistics left as it is
    (in eval mode it normalises by the batch, as the model's own layer does)."""
    from hetfl.models.layers import InferenceBatchNorm, inference_copy

    block = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    model = nn.Sequential(block, nn.BatchNorm2d(4, affine=False), nn.BatchNorm2d(4, track_running_stats=False))
    twin = inference_copy(model.train())
    want = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    got = {k: (tuple(v.shape), v.dtype) for k, v in [*twin.named_parameters(), *twin.named_buffers()]}
    assert got == want
    assert all(v.is_meta for v in twin.state_dict().values())
    assert isinstance(twin[0][1], InferenceBatchNorm) and isinstance(twin[1], InferenceBatchNorm)
    assert type(twin[2]) is nn.BatchNorm2d and not twin[2].training
    assert sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in twin.modules()) == 1


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(("cls", "shape"), [(layers.BatchNorm2d, (6, 4, 5, 5)), (layers.BatchNorm1d, (6, 4))],
                         ids=["2d", "1d"])
def test_a_batchnorm_vmaps_in_bf16_on_the_cpu_as_each_clients_own_layer(cls, shape, training):
    """Three clients' batch norms (their weights, biases and running statistics stacked) vmapped under bf16
    autocast on the CPU: each client's outputs, input and weight gradients and updated running statistics are
    those of its own layer called alone (PyTorch's kernel on bfloat16 input and float32 statistics), to
    bfloat16's rounding. PyTorch's batching rule refuses this mix on the CPU ("expected scalar type BFloat16
    but found Float"); the layer normalises such an input in float32 (layers._VmappableNorm)."""
    torch.manual_seed(0)
    clients = [cls(shape[1]).train(training) for _ in range(3)]
    for norm in clients:  # distinct affine weights and statistics per client
        for t in (norm.weight, norm.bias, norm.running_mean):
            t.data.normal_()
        norm.running_var.data.uniform_(0.5, 2.0)
    x = torch.randn(3, *shape).bfloat16()
    cotangent = torch.randn(3, *shape).bfloat16()
    template = cls(shape[1]).train(training)

    def client_loss(params, buffers, x, cotangent):
        out = torch.func.functional_call(template, {**params, **buffers}, (x,))
        return (out.float() * cotangent.float()).sum(), out

    params = {n: torch.stack([dict(c.named_parameters())[n].detach() for c in clients]) for n in ("weight", "bias")}
    buffers = {n: torch.stack([dict(c.named_buffers())[n].clone() for c in clients]) for n in
               ("running_mean", "running_var", "num_batches_tracked")}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (grads, x_grad), out = vmap(grad(client_loss, argnums=(0, 2), has_aux=True))(params, buffers, x, cotangent)
    for k, norm in enumerate(clients):
        xk = x[k].clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = norm(xk)
        (want.float() * cotangent[k].float()).sum().backward()
        assert out.dtype == want.dtype == torch.bfloat16
        assert torch.allclose(out[k].float(), want.float(), rtol=2 ** -7, atol=2 ** -7)
        assert torch.allclose(x_grad[k].float(), xk.grad.float(), rtol=2 ** -6, atol=2 ** -6)
        for n in ("weight", "bias"):
            assert torch.allclose(grads[n][k], dict(norm.named_parameters())[n].grad, rtol=1e-2, atol=1e-2), n
        for n in ("running_mean", "running_var"):
            assert buffers[n][k].dtype == torch.float32
            assert torch.allclose(buffers[n][k], dict(norm.named_buffers())[n], rtol=1e-5, atol=1e-6), n
        assert int(buffers["num_batches_tracked"][k]) == int(norm.num_batches_tracked)


def test_outside_client_batching_a_bf16_batchnorm_is_pytorchs_own(monkeypatch):
    """Outside the vectorised step (and on CUDA) the layer is nn.BatchNorm2d as it is: no float32 copy."""
    norm = layers.BatchNorm2d(4)
    seen = []
    monkeypatch.setattr(F, "batch_norm", lambda x, *a, **k: seen.append(x.dtype) or x)
    x = torch.randn(2, 4, 3, 3).bfloat16()
    norm(x)
    with client_batching():
        norm(x)
    assert seen == [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("settings", [{}, {"affine": False}, {"track_running_stats": False}],
                         ids=["affine_with_statistics", "statistics_only", "affine_only"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_bf16_batchnorm_vmaps_whatever_it_holds(settings, mode):
    """``_VmappableNorm`` casts a bfloat16 input to the dtype of the float32 tensors the layer holds: its running
    statistics, or its weight where it keeps none (``track_running_stats=False``). Without the cast, vmap's kernel
    refuses the mix where there are statistics, and gives float32 where there are none; with it, each client's
    output is the layer's own on that client, in bfloat16, with or without affine weights."""
    norm = layers.BatchNorm2d(4, **settings)
    getattr(norm, mode)()
    tensors = {**dict(norm.named_parameters()), **dict(norm.named_buffers())}
    per_client = {n: torch.stack([t + 0.1 * c if t.is_floating_point() else t for c in range(3)])
                  for n, t in tensors.items()}
    x = torch.randn(3, 5, 4, 6, 6, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = vmap(lambda p, xi: torch.func.functional_call(norm, p, (xi,)), randomness="different")(per_client, x)
    assert out.dtype == torch.bfloat16
    for c in range(3):
        own = torch.func.functional_call(norm, {n: t[c] for n, t in per_client.items()}, (x[c],))
        assert own.dtype == torch.bfloat16
        torch.testing.assert_close(out[c], own)  # bfloat16 tolerances: the kernels may sum in another order
