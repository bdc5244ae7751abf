"""SCAFFOLD: control variates that correct client drift (option II).

Karimireddy, Kale, Mohri, Reddi, Stich, Suresh. "SCAFFOLD: Stochastic
Controlled Averaging for Federated Learning." ICML 2020, Algorithm 1.

- local step (line 10): ``y ← y - η_l (g(y) - c_i + c)``
- control variate, option II (line 12): ``c_i⁺ = c_i - c + (x - y) / (K η_l)``
- server (lines 16-17): ``x ← x + η_g mean_S(Δy)``, ``c ← c + |S|/N mean_S(Δc)``

``c_i`` persists per client across rounds (and in checkpoints) in the
engine's client store. With momentum or weight decay the option-II estimate
``(x - y)/(K η_l)`` is the average applied update, as in the reference code.

Departures from the paper/code: none in the rule (option II, uniform averages,
``eta_g = 1``). With momentum / weight decay, ``(x - y) / (K eta_l)`` is the
average applied update (as the reference code), not an average gradient, and the
corrected gradient ``g - c_i + c`` is what the run's SGD sees: its momentum
carries the correction too. The NIID-Bench code (and MOON's, CCVR's comparisons)
instead subtracts ``lr (c - c_i)`` after each optimiser step, outside momentum and
weight decay, on every state entry (BatchNorm statistics included) and averages
the models by data size (Xtra-Computing/NIID-Bench 61b901a, ``experiments.py``
``train_net_scaffold``: l. 312 SGD with momentum ``rho``, l. 345 the step, l. 349
the correction); with plain SGD (``train.momentum = 0``) the local steps
are the same.

Deliberate difference with momentum ``m > 0`` (kept as the default, not a bug):
for the same ``c - c_i``, a correction that goes through the momentum buffer
``b <- m b + (g - c_i + c)`` settles at ``(c - c_i) / (1 - m)`` per step, so the
applied correction is ``1 / (1 - m)`` times the references' ``lr (c - c_i)``
(10x at ``m = 0.9``), while the gradient itself is amplified by ``1 / (1 - m)`` in
both. Why: Algorithm 1 is stated for plain SGD, where the corrected gradient *is*
the step; hetfl hands every method's descent direction to the one optimiser the
run configures (``train.momentum``, ``train.weight_decay``), so the correction
and the gradient it corrects are treated alike (their ratio is Algorithm 1's),
where the references' form makes the correction ``1 - m`` times weaker than the
gradient it is meant to cancel. Set ``train.momentum = 0`` to compare with
numbers from the references' code under momentum-free SGD (the same steps).

``tests/algorithms/test_baseline_rounds.py`` recomputes three partially
participated rounds of this rule by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetfl.algorithms.base import Algorithm, ClientContext, ServerState, Stage, Tensors, Upload, weighted_mean
from hetfl.params import FLOAT32_MAX, setting

C = "scaffold.c/"  # payload prefix of the server control variate


@dataclass(frozen=True)
class ScaffoldHyper:
    """SCAFFOLD settings (Karimireddy et al. 2020).

    server_lr: η_g, the global step size (1.0 in the paper's experiments).
    """

    server_lr: float = setting(1.0, gt=0.0, lt=FLOAT32_MAX, doc="server learning rate eta_g")


class Scaffold(Algorithm):
    name = "scaffold"
    Hyper = ScaffoldHyper
    citation = "Karimireddy et al., ICML 2020"

    def init_server(self, model_state: Tensors) -> ServerState:
        zeros = {n: torch.zeros_like(model_state[n]) for n in self.model.param_names}
        return ServerState(model=model_state, extra=zeros)

    def payload(self, server: ServerState, client_id: int) -> Tensors:
        return {**server.model, **{C + n: c for n, c in server.extra.items()}}

    def init_client_state(self, client_id: int, server: ServerState) -> Tensors:
        return {n: torch.zeros_like(c) for n, c in server.extra.items()}

    def corrected_gradient(self, grads: Tensors, state: Tensors, ctx: ClientContext) -> Tensors:
        """Algorithm 1, line 10: ``g - c_i + c``."""
        return {n: g - ctx.state[n] + ctx.payload[C + n] for n, g in grads.items()}

    def stages(self, ctx: ClientContext) -> list[Stage]:
        (stage,) = super().stages(ctx)
        stage.grad_transform = self.corrected_gradient
        return [stage]

    def finish(self, ctx: ClientContext, local: Tensors, steps: int) -> tuple[Tensors, Tensors]:
        """Option II control variate; upload the local model and Δc_i."""
        scale = 1.0 / (max(steps, 1) * ctx.lr)
        new_c, upload = {}, {n: local[n] for n in self.model.state_names}
        if steps == 0:  # no sample, no step (data.min_size = 0): no gradient seen, c_i stays and dc_i = 0
            for n in self.model.param_names:
                new_c[n], upload[C + n] = ctx.state[n], torch.zeros_like(ctx.state[n])
            return upload, new_c
        for n in self.model.param_names:
            new_c[n] = ctx.state[n] - ctx.payload[C + n] + scale * (ctx.payload[n] - local[n])
            upload[C + n] = new_c[n] - ctx.state[n]
        return upload, new_c

    def aggregate(self, server: ServerState, uploads: list[Upload], round: int) -> ServerState:
        # the paper averages uniformly over the sampled clients (1/|S|, model and control variates alike),
        # whatever train.weighting says: the control variate's update c += |S|/N mean(dc_i) needs that mean
        ones = [1.0] * len(uploads)
        mean = weighted_mean([u.tensors for u in uploads], ones)
        model = {n: mean[n] for n in self.model.state_names}
        for n in self.model.param_names:
            model[n] = server.model[n] + self.hp.server_lr * (mean[n] - server.model[n])
        share = len(uploads) / self.setup.num_clients
        control = {n: c + share * mean[C + n] for n, c in server.extra.items()}
        return ServerState(model=model, extra=control)
