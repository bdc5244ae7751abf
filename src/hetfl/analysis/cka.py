"""Linear centred kernel alignment (CKA) between layer representations.

CKA (Kornblith, Norouzi, Lee & Hinton, "Similarity of Neural Network
Representations Revisited", ICML 2019, sec. 3) compares two representations of
the same ``n`` inputs, ``X [n, d1]`` and ``Y [n, d2]``. With the linear kernel
and column-centred features it is

    CKA(X, Y) = ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F),

equivalently ``HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L))`` for the Gram matrices
``K = X X^T``, ``L = Y Y^T``. It lies in ``[0, 1]``, is 1 for identical
representations, and is invariant to orthogonal transforms and isotropic scaling
of either input (but not to arbitrary invertible linear maps).

CCVR (Luo et al., NeurIPS 2021, sec. 3, Figures 1-2) uses it to show that, under
non-IID data, the *same* layer of different clients' local models becomes less
similar the deeper the layer is, and least similar at the classifier:
:func:`pairwise_cka` computes those client-by-client matrices on shared probe data
and :func:`mean_off_diagonal` their summary per layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call


def _centred(x: Tensor) -> Tensor:
    """Column-centred float64 copy of ``x [n, d]``; all zeros when ``x`` is constant over the inputs
    to rounding (centring leaves less than 1e-12 of its norm), so that CKA is then ``nan``. A ValueError
    when ``x`` holds a NaN or an infinity (not a silent ``nan``, which means a constant layer)."""
    if x.dim() != 2:
        raise ValueError(f"features must be a matrix [n, d], got shape {tuple(x.shape)}")
    x = x.detach().to(torch.float64)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("features are not finite (NaN or inf; a diverged model?): CKA is undefined")
    xc = x - x.mean(dim=0, keepdim=True)
    if torch.linalg.matrix_norm(xc) <= 1e-12 * torch.linalg.matrix_norm(x):
        return torch.zeros_like(xc)
    return xc


def _representation(xc: Tensor) -> Tensor:
    """What CKA needs of centred features ``[n, d]``: the features themselves when ``d <= n``,
    else the Gram matrix ``X X^T [n, n]`` (smaller, and enough: CKA depends on ``X`` only through it)."""
    n, d = xc.shape
    return xc if d <= n else xc @ xc.T


def _self_norm(rep: Tensor, gram: bool) -> Tensor:
    """``||X^T X||_F`` (``= ||X X^T||_F``: the two share their nonzero eigenvalues)."""
    return torch.linalg.matrix_norm(rep if gram else rep.T @ rep)


def _cka(rx: Tensor, ry: Tensor, gram: bool, nx: Tensor, ny: Tensor) -> Tensor:
    """``||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F)`` from two representations of the same kind;
    ``||Y^T X||_F^2 = tr(X X^T Y Y^T)`` is the elementwise product of the Gram matrices summed."""
    denom = nx * ny
    if denom == 0:  # a constant representation (e.g. a dead ReLU layer): CKA is undefined
        return torch.tensor(float("nan"), dtype=torch.float64)
    cross = (rx * ry).sum() if gram else (ry.T @ rx).square().sum()
    return (cross / denom).cpu()


def linear_cka(x: Tensor, y: Tensor) -> float:
    """Linear CKA between features ``x [n, d1]`` and ``y [n, d2]`` of the same ``n`` inputs.

    Computed in float64 after centring each column (Kornblith et al. 2019, linear-kernel CKA).
    Returns ``nan`` when either representation is constant over the inputs (zero after centring);
    raises ValueError when either holds a NaN or an infinity.
    """
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y must describe the same inputs: {x.shape[0]} vs {y.shape[0]} rows")
    if x.shape[0] < 2:
        raise ValueError("CKA needs at least 2 inputs")
    xc, yc = _centred(x), _centred(y.to(x.device))
    n, d1, d2 = xc.shape[0], xc.shape[1], yc.shape[1]
    gram = d1 * d2 > n * (d1 + d2)  # the cheaper route: n d1 d2 for Y^T X, n^2 (d1 + d2) for the Grams
    rx, ry = (xc @ xc.T, yc @ yc.T) if gram else (xc, yc)
    return float(_cka(rx, ry, gram, _self_norm(rx, gram), _self_norm(ry, gram)))


def layer_features(
    model: nn.Module,
    state: Mapping[str, Tensor],
    x: Tensor,
    layers: Sequence[str],
    *,
    batch_size: int | None = None,
) -> dict[str, Tensor]:
    """Outputs of the submodules named in ``layers`` when ``model`` runs on ``x`` with weights ``state``.

    The model is called through :func:`torch.func.functional_call` with the model's own
    parameter and buffer names taken from ``state`` (extra method tensors in ``state`` are
    ignored; a missing one is an error, never silently replaced by the module's own weights).
    It runs in eval mode (BatchNorm uses its running statistics, dropout is off) under
    ``torch.no_grad``; the module's training flag is restored afterwards. Each output is
    captured by a forward hook and flattened per sample to ``[n, -1]`` (float, on ``x``'s device).

    Args:
        model: the network; ``layers`` are names from ``model.named_modules()`` (``""`` is the model).
        state: parameters and buffers to run with (e.g. a client's local model).
        x: probe inputs ``[n, ...]``.
        layers: submodule names whose outputs to capture.
        batch_size: run ``x`` in chunks of this size (``None``: all at once).
    """
    modules = dict(model.named_modules())
    missing = [name for name in layers if name not in modules]
    if missing:
        available = ", ".join(repr(n) for n in modules if n)
        raise KeyError(f"no submodule named {missing} in the model; available: {available}")
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    absent = [n for n in names if n not in state]
    if absent:
        raise KeyError(f"state lacks the model tensors {absent}")
    own = {n: state[n] for n in names}
    captured: dict[str, list[Tensor]] = {name: [] for name in layers}

    def hook_for(name: str):
        def hook(_module: nn.Module, _inputs: object, output: object) -> None:
            if isinstance(output, tuple | list):
                output = output[0]
            if not isinstance(output, Tensor):
                raise TypeError(f"layer {name!r} returned {type(output).__name__}, not a tensor")
            captured[name].append(output.detach().reshape(output.shape[0], -1).float())

        return hook

    handles = [modules[name].register_forward_hook(hook_for(name)) for name in layers]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            step = batch_size or max(len(x), 1)
            for batch, start in enumerate(range(0, len(x), step)):
                functional_call(model, own, (x[start : start + step],))
                reused = [name for name in layers if len(captured[name]) > batch + 1]
                if reused:
                    raise ValueError(f"layers {reused} run more than once per forward pass (a shared module, "
                                     "e.g. one ReLU used twice): their outputs are ambiguous; hook another module")
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    out = {}
    for name in layers:
        if not captured[name]:
            raise RuntimeError(f"layer {name!r} was not called in the forward pass")
        out[name] = torch.cat(captured[name])
    return out


def pairwise_cka(
    states: Sequence[Mapping[str, Tensor]],
    model: nn.Module,
    x: Tensor,
    layers: Sequence[str],
    *,
    batch_size: int | None = None,
) -> dict[str, Tensor]:
    """Linear CKA of each layer between every pair of models (CCVR Figures 1-2).

    All ``m`` states (e.g. clients' local models after a round) run on the same probe
    inputs ``x``; for every layer the result is a symmetric float64 matrix ``[m, m]`` with
    ``out[layer][i, j] = CKA(features_i, features_j)`` and ones on the diagonal (``nan``
    where a layer's output is constant).
    """
    if len(states) < 1:
        raise ValueError("pairwise_cka needs at least one state")
    m = len(states)
    reps: dict[str, list[Tensor]] = {layer: [] for layer in layers}
    grams: dict[str, bool] = {}
    for state in states:  # keep only each layer's compact representation, not the raw features
        feats = layer_features(model, state, x, layers, batch_size=batch_size)
        for layer in layers:
            f = feats.pop(layer)
            grams[layer] = f.shape[1] > f.shape[0]
            reps[layer].append(_representation(_centred(f)))
    out = {}
    for layer in layers:
        rep = reps.pop(layer)
        gram = grams[layer]
        norms = [_self_norm(r, gram) for r in rep]
        mat = torch.empty(m, m, dtype=torch.float64)
        for i in range(m):
            mat[i, i] = 1.0 if norms[i] > 0 else float("nan")
            for j in range(i + 1, m):
                mat[i, j] = mat[j, i] = _cka(rep[i], rep[j], gram, norms[i], norms[j])
        out[layer] = mat
    return out


def mean_off_diagonal(matrix: Tensor) -> float:
    """Mean of the off-diagonal entries of a square matrix (the average pairwise similarity
    between different models); ``nan`` for a 1 x 1 matrix."""
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"expected a square matrix, got shape {tuple(matrix.shape)}")
    m = matrix.shape[0]
    if m < 2:
        return float("nan")
    mask = ~torch.eye(m, dtype=torch.bool, device=matrix.device)
    return float(matrix[mask].double().mean())


def mean_pairwise_cka(cka: Mapping[str, Tensor]) -> dict[str, float]:
    """:func:`mean_off_diagonal` of every layer's matrix from :func:`pairwise_cka`."""
    return {layer: mean_off_diagonal(mat) for layer, mat in cka.items()}
