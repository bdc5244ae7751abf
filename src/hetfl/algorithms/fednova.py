"""FedNova: normalised averaging that removes objective inconsistency.

Wang, Liu, Liang, Joshi, Poor. "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization." NeurIPS 2020, eq. (6)-(7) and App. D:
client i's cumulative update is divided by its ``a_i`` (``a_i = τ_i`` local
steps for plain SGD; ``[τ_i - ρ(1-ρ^τ_i)/(1-ρ)] / (1-ρ)`` with momentum ρ),
then ``w ← w - η_s τ_eff Σ p_i (w - w_i)/a_i`` with ``τ_eff = Σ p_i a_i`` and
``p_i = n_i / n``.

Departures from the paper/code: none in the rule; ``a_i`` uses the run's
``train.momentum`` (the cumulative momentum weights, as the authors'
``local_normalizing_vec``) and ignores weight decay, as the code does. FedNova's
proximal variant (FedProx's local solver, where the code uses ``tau_eff =
sum p_i tau_i``) is not offered.

``train.weighting = "uniform"`` is refused: FedNova's ``p_i = n_i / n`` weigh both
the normalised direction and ``tau_eff``; the objective it is consistent with is
``sum_i p_i F_i`` for those weights, so a uniform ``p_i`` would be another method,
not FedNova with another server average.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetfl.algorithms.base import Algorithm, ServerState, Setup, Upload, weighted_mean
from hetfl.params import FLOAT32_MAX, ConfigError, setting


def normalizing_factor(steps: int, momentum: float) -> float:
    """``a_i`` of FedNova for ``steps`` local SGD steps with momentum ``momentum``."""
    if momentum == 0.0:
        return float(steps)
    rho = momentum
    return (steps - rho * (1 - rho**steps) / (1 - rho)) / (1 - rho)


@dataclass(frozen=True)
class FedNovaHyper:
    """FedNova settings (Wang et al. 2020). server_lr: η_s (1.0 in the paper)."""

    server_lr: float = setting(1.0, gt=0.0, lt=FLOAT32_MAX, doc="server learning rate")


class FedNova(Algorithm):
    name = "fednova"
    Hyper = FedNovaHyper
    citation = "Wang et al., NeurIPS 2020"

    def __init__(self, hyper: FedNovaHyper, setup: Setup) -> None:
        super().__init__(hyper, setup)
        if setup.train.weighting != "size":
            raise ConfigError("train.weighting", setup.train.weighting,
                              "FedNova weighs its normalised updates by p_i = n_i / n (the data sizes): only "
                              "'size' is allowed")

    def aggregate(self, server: ServerState, uploads: list[Upload], round: int) -> ServerState:
        total = float(sum(u.num_samples for u in uploads))
        p = [u.num_samples / total for u in uploads]
        a = [normalizing_factor(max(u.steps, 1), self.setup.train.momentum) for u in uploads]
        tau_eff = sum(pi * ai for pi, ai in zip(p, a, strict=True))
        model = weighted_mean([u.tensors for u in uploads], p)  # buffers: plain weighted mean
        for n in self.model.param_names:
            direction = sum(
                pi / ai * (server.model[n] - u.tensors[n]) for pi, ai, u in zip(p, a, uploads, strict=True)
            )
            model[n] = server.model[n] - self.hp.server_lr * tau_eff * direction
        return ServerState(model=model, extra=server.extra)
