"""pFedMe: personalised FL with Moreau envelopes.

T. Dinh, Tran, Nguyen. "Personalized Federated Learning with Moreau
Envelopes." NeurIPS 2020, sec. 3 and Algorithm 1. Client i minimises
the Moreau envelope of its loss,

    ``F_i(w) = min_theta f_i(theta) + lam/2 ||theta - w||^2``,

whose gradient is ``lam (w - theta_hat_i(w))``. Each local step, on a batch:

1. ``theta_hat`` ~ argmin of ``f_i(theta; batch) + lam/2 ||theta - w_i||^2``,
   by ``K`` gradient steps of size ``personal_lr`` (warm-started from the
   previous step's ``theta_hat``, from ``w^t`` at the start of the round, as
   in the authors' code);
2. ``w_i <- w_i - eta lam (w_i - theta_hat)``.

Server: ``w <- (1 - beta) w + beta sum_i n_i/n w_i`` (Algorithm 1; data-size
weights, as in the authors' code). The personalised model of client i
is its last ``theta_hat`` (client store, ``pfedme.theta/<name>``); the global
model ``w`` is evaluated too (``global_acc``).

In hetfl's stage machinery one step carries both ``w`` and ``theta`` as
trainable tensors: the loss solves step 1 and returns a surrogate whose SGD
step (plain SGD at the client lr ``eta``) is exactly step 2 for ``w`` and
moves ``theta`` onto ``theta_hat``; its value is the envelope estimate
``f_i(theta_hat) + lam/2 ||theta_hat - w||^2``. The run's momentum is not used
(pFedMe's update is plain gradient descent); its weight decay is applied in
the inner problem. ``train.max_grad_norm`` would clip this surrogate
gradient too, so leave it at 0 with pFedMe. BatchNorm statistics (shared by
``w`` and ``theta``) are updated once per step, by the forward of
``theta_hat`` that gives the envelope's value.

Departures from the paper/code: lam 15, K 5 and personal lr 0.1 are the
authors' MNIST runs; beta 1 is plain averaging; the outer step size is
``train.lr`` (theirs 0.005 on MNIST); momentum is not used (plain gradient
steps, as the paper).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetfl.algorithms.base import (
    Algorithm,
    Batch,
    ClientContext,
    ServerState,
    Stage,
    Tensors,
    Upload,
    cross_entropy,
    weighted_mean,
)
from hetfl.params import FLOAT32_MAX, setting

THETA = "pfedme.theta/"


@dataclass(frozen=True)
class PFedMeHyper:
    """pFedMe settings (T. Dinh et al. 2020; defaults from the authors' MNIST runs).

    lam: lambda, the Moreau-envelope regularisation (15).
    inner_steps: K, gradient steps of the inner problem per local step (5).
    personal_lr: step size of the inner problem (0.1, the authors' value for their MNIST MLP).
        Plain gradient steps on ``f + lam/2 ||theta - w||^2`` are stable only while
        ``personal_lr * (L + lam) < 2`` (L: the loss's curvature): with lam = 15 a CNN
        diverges at 0.1 (cnn2 on MNIST, benchmarks/results/all_methods_cpu.md) and learns
        at 0.01.
    beta: server mixing, ``w <- (1 - beta) w + beta mean(w_i)`` (1.0: FedAvg-style averaging).
    The outer step size is the run's ``train.lr`` (the authors use 0.005 on MNIST:
    ``eta * lam`` must stay below 1).
    """

    lam: float = setting(15.0, gt=0.0, doc="Moreau-envelope weight lambda")
    inner_steps: int = setting(5, ge=1, doc="K, inner steps solving theta_hat")
    personal_lr: float = setting(0.1, gt=0.0, lt=FLOAT32_MAX, doc="inner-problem step size")
    beta: float = setting(1.0, gt=0.0, doc="server mixing weight beta")


class PFedMe(Algorithm):
    name = "pfedme"
    Hyper = PFedMeHyper
    citation = "T. Dinh et al., NeurIPS 2020"
    personalized = False  # w is the global model of the paper's "pFedMe (GM)", evaluated too
    # a step reads w and theta from its state (both start from the payload): a sampled round's first-timers
    # and returning clients (with a kept theta, for evaluation) train as one vectorised group
    step_reads = frozenset()

    def start_state(self, ctx: ClientContext) -> Tensors:
        state = {n: ctx.payload[n] for n in self.model.state_names}
        state.update({THETA + n: ctx.payload[n] for n in self.model.param_names})
        return state

    def solve_theta(self, theta: Tensors, w: Tensors, buffers: Tensors, batch: Batch) -> Tensors:
        """K gradient steps on ``f(theta; batch) + lam/2 ||theta - w||^2`` from ``theta`` (no graph kept).

        ``torch.func.grad`` so that the solve also runs inside the vectorised
        executor's ``vmap``; the inner forwards use copies of the buffers, so
        BatchNorm statistics are not updated K times per step.
        """
        lam, lr, wd = self.hp.lam, self.hp.personal_lr, self.setup.train.weight_decay
        w = {n: t.detach() for n, t in w.items()}
        buffers = {n: t.detach() for n, t in buffers.items()}

        def inner(th: Tensors) -> torch.Tensor:
            own = {n: b.clone() for n, b in buffers.items()}
            ce = cross_entropy(self.model.logits({**th, **own}, batch.x), batch.y)
            return ce + 0.5 * lam * sum(((th[n] - w[n]) ** 2).sum() for n in th)

        theta = {n: t.detach() for n, t in theta.items()}
        for _ in range(self.hp.inner_steps):
            grads = torch.func.grad(inner)(theta)
            theta = {n: t - lr * (grads[n] + wd * t) for n, t in theta.items()}
        return theta

    def loss(self, state: Tensors, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
        names = self.model.param_names
        w = {n: state[n] for n in names}
        theta = {n: state[THETA + n] for n in names}
        buffers = {n: state[n] for n in self.model.buffer_names}
        theta_hat = self.solve_theta(theta, w, buffers, batch)
        lam = self.hp.lam
        # the envelope's value at theta_hat; this forward (a plain one, with the state's buffers)
        # is the step's only update of BatchNorm statistics
        ce = cross_entropy(self.model.logits({**theta_hat, **buffers}, batch.x), batch.y).detach()
        envelope = ce + 0.5 * lam * sum(((theta_hat[n] - w[n].detach()) ** 2).sum() for n in names)
        # d/dw: lam (w - theta_hat), the envelope's gradient;
        # d/dtheta: (theta - theta_hat) / eta, so that one SGD step lands on theta_hat
        surrogate = 0.5 * lam * sum(((w[n] - theta_hat[n]) ** 2).sum() for n in names)
        if ctx.lr > 0:
            surrogate = surrogate + sum(((theta[n] - theta_hat[n]) ** 2).sum() for n in names) / (2 * ctx.lr)
        loss = surrogate - surrogate.detach() + envelope
        return loss, {"ce_personal": ce, "envelope": envelope}

    def stages(self, ctx: ClientContext) -> list[Stage]:
        train = self.setup.train
        trainable = self.model.param_names + tuple(THETA + n for n in self.model.param_names)
        sgd = self.setup.sgd(ctx.lr, momentum=0.0, weight_decay=0.0)  # pFedMe's own update: plain SGD
        return [Stage("local", self.loss, trainable, sgd, epochs=train.local_epochs, steps=train.local_steps)]

    def finish(self, ctx: ClientContext, local: Tensors, steps: int) -> tuple[Tensors, Tensors]:
        upload = {n: local[n] for n in self.model.state_names}
        return upload, {THETA + n: local[THETA + n] for n in self.model.param_names}

    def aggregate(self, server: ServerState, uploads: list[Upload], round: int) -> ServerState:
        """``w <- (1 - beta) w + beta sum_i n_i/n w_i`` (``train.weighting = "uniform"``: ``1/M``; buffers: the
        plain weighted mean)."""
        mean = weighted_mean([u.tensors for u in uploads], self.client_weights(uploads))
        beta = self.hp.beta
        model = dict(mean)
        for n in self.model.param_names:
            model[n] = (1 - beta) * server.model[n] + beta * mean[n]
        return ServerState(model=model, extra=server.extra)

    def client_model(self, server: ServerState, client_state: Tensors, client_id: int) -> Tensors:
        """The personalised model theta_i, with the global model's buffers."""
        if not all(THETA + n in client_state for n in self.model.param_names):
            return server.model
        state = dict(server.model)
        state.update({n: client_state[THETA + n] for n in self.model.param_names})
        return state
