"""APFL: adaptive personalised FL, a learned mixture of a local and the global model.

Deng, Kamani, Mahdavi. "Adaptive Personalized Federated Learning."
arXiv:2003.13461, 2020, Algorithm 1. Client i keeps a local model ``v_i`` and
a mixing weight ``alpha_i`` (client store: ``apfl.local/<name>``,
``apfl.alpha``); its personalised model is

    ``v_bar_i = alpha_i v_i + (1 - alpha_i) w``.

Each local step on a batch, all from the same point (Algorithm 1):

- global copy: ``w_i <- w_i - eta grad f_i(w_i)``
- local model: ``v_i <- v_i - eta grad_v f_i(v_bar_i) = v_i - eta alpha_i grad f_i(v_bar_i)``

and the mixing weight takes a projected gradient step (projected on [0, 1] so
that the mixture stays convex)

    ``alpha_i <- P_[0,1](alpha_i - eta_alpha <v_i - w_i, grad f_i(v_bar_i)>)``,

either once per round (``alpha_every = "round"``, default, as the authors'
code, which updates alpha at the first local step only; here computed at the
start of the round on the client's whole training set, with ``w_i = w^t``) or
at every local step (``"step"``, Algorithm 1 as written; on skewed clients
alpha then tends to collapse to 0 within a round, since the local copy
``w_i`` fits the client's data as well as ``v_i`` does).

The per-step updates are the gradients of one loss,
``f_i(w) + f_i(alpha v + (1 - alpha) stopgrad(w))``, taken together. The
server averages the ``w_i`` (FedAvg). Clients are evaluated with
``alpha_i v_i + (1 - alpha_i) w`` (w: the current global model); the global
model is evaluated too (``global_acc``).

Buffers (BatchNorm statistics) of the mixture are those of ``v_i``.

Departures from the paper/code: the one alpha step per round is computed on the
client's whole training set at the start of the round (the code: at the first
local batch); ``alpha = 0.5`` initial value (the paper's middle fixed value).

Deliberate differences in alpha's defaults from the authors' code
(MLOPTPSU/FedTorch ab8068d):

- Learned by default (``learn_alpha = true``); the code keeps alpha fixed unless
  asked (``fedtorch/parameters.py`` l. 70: ``--fed_adaptive_alpha`` default False;
  its launcher ``run_mpi.py`` l. 156-157: alpha 0.0 and no adaptation, i.e. FedAvg
  with a local model on the side). Why: the method the paper names and evaluates
  as APFL is the adaptive one (Algorithm 1 updates alpha); fixed alpha is its
  ablation, kept as ``learn_alpha = false``.
- Initial alpha 0.5, as the code's ``parameters.py`` l. 68 (``--fed_personal_alpha``
  0.5), not ``run_mpi.py``'s 0.0 (a mixture with no local model at all, which the
  adaptive step can only leave through the gradient of ``v``).
- The code's alpha step adds ``0.02 * alpha`` to the gradient (an L2 penalty
  ``0.01 alpha^2``, ``fedtorch/comms/utils/flow_utils.py`` l. 247) and uses the
  gradient mix ``alpha grad_v + (1 - alpha) grad_w`` of the two copies
  (l. 244); hetfl takes the plain projected gradient step of Algorithm 1 on
  ``<v_i - w_i, grad f_i(v_bar_i)>``, the paper's update, without the penalty the
  paper does not state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetfl.algorithms.base import Algorithm, Batch, ClientContext, ServerState, Stage, Tensors, cross_entropy
from hetfl.params import FLOAT32_MAX, setting

LOCAL, ALPHA = "apfl.local/", "apfl.alpha"


@dataclass(frozen=True)
class APFLHyper:
    """APFL settings (Deng et al. 2020).

    alpha: initial mixing weight of the local model (0.5: the middle of the
        fixed alphas the paper compares, 0.25, 0.5 and 0.75).
    learn_alpha: learn alpha_i by its gradient (adaptive APFL, default) or
        keep it fixed at ``alpha``.
    alpha_every: "round" (default: one alpha step per round, the authors'
        code) or "step" (every local step, Algorithm 1 as written).
    alpha_lr: step size of alpha; 0 means the client learning rate (the paper
        and code use one step size for all updates).
    """

    alpha: float = setting(0.5, ge=0.0, le=1.0, doc="initial mixing weight of the local model")
    learn_alpha: bool = setting(True, doc="learn alpha by gradient (false: fixed alpha)")
    alpha_every: str = setting("round", choices=("round", "step"), when={"learn_alpha": (True,)},
                               doc="when alpha takes a gradient step")
    alpha_lr: float = setting(0.0, ge=0.0, lt=FLOAT32_MAX, when={"learn_alpha": (True,)},
                              doc="step size of alpha (0 = the client lr)")


def mixture(local: Tensors, glob: Tensors, alpha: torch.Tensor, param_names: tuple[str, ...],
            buffer_names: tuple[str, ...]) -> Tensors:
    """``alpha v + (1 - alpha) w`` on the parameters; buffers from ``v``."""
    mixed = {n: alpha * local[n] + (1 - alpha) * glob[n] for n in param_names}
    mixed.update({n: local[n] for n in buffer_names})
    return mixed


class APFL(Algorithm):
    name = "apfl"
    Hyper = APFLHyper
    citation = "Deng et al., arXiv 2020"
    personalized = False  # w is the FedAvg global model, evaluated too

    def local(self, state: Tensors) -> Tensors:
        return {n: state[LOCAL + n] for n in self.model.state_names}

    def running_buffers(self) -> tuple[str, ...]:
        """The global copy's buffers and the local model's (the mixture's forward updates those)."""
        return self.model.buffer_names + tuple(LOCAL + n for n in self.model.buffer_names)

    def init_client_state(self, client_id: int, server: ServerState) -> Tensors:
        state = {LOCAL + n: server.model[n].clone() for n in self.model.state_names}
        first = server.model[self.model.param_names[0]]
        state[ALPHA] = torch.tensor(self.hp.alpha, dtype=first.dtype, device=first.device)
        return state

    def alpha_gradient(self, ctx: ClientContext) -> torch.Tensor:
        """``<v_i - w^t, grad f_i(v_bar_i)>`` = d f_i(alpha v_i + (1 - alpha) w^t) / d alpha, on the
        client's whole training set (in chunks; BatchNorm statistics are not updated)."""
        if ctx.inputs is None:
            raise ValueError("apfl needs the client's data (ClientContext.inputs)")
        data = ctx.inputs()
        n, chunk = len(data.y), self.setup.train.eval_batch_size
        local = {k: t.clone() if k in self.model.buffer_names else t for k, t in self.local(ctx.state).items()}
        alpha = ctx.state[ALPHA].detach().clone().requires_grad_()
        total = torch.zeros_like(alpha)
        with torch.enable_grad():
            for i in range(0, n, chunk):
                mixed = mixture(local, ctx.payload, alpha, self.model.param_names, self.model.buffer_names)
                logits = self.model.logits(mixed, data.x[i : i + chunk])
                loss = F.cross_entropy(logits, data.y[i : i + chunk], reduction="sum") / n
                total = total + torch.autograd.grad(loss, alpha)[0]
        return total

    def begin(self, ctx: ClientContext) -> Tensors:
        """Once-per-round alpha step (``alpha_every = "round"``), before local training."""
        if not (self.hp.learn_alpha and self.hp.alpha_every == "round"):
            return {}
        step = (self.hp.alpha_lr or ctx.lr) * self.alpha_gradient(ctx)
        return {ALPHA: (ctx.state[ALPHA] - step).clamp(0.0, 1.0).detach()}

    def start_state(self, ctx: ClientContext) -> Tensors:
        state = {**{n: ctx.payload[n] for n in self.model.state_names}, **ctx.state}
        if ALPHA in ctx.extras:
            state[ALPHA] = ctx.extras[ALPHA]
        return state

    def loss(self, state: Tensors, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
        """``f(w) + f(alpha v + (1 - alpha) stopgrad(w))``: the gradients are the three APFL updates."""
        ce_global = cross_entropy(self.model.logits(state, batch.x), batch.y)
        frozen_w = {n: state[n].detach() for n in self.model.param_names}
        mixed = mixture(self.local(state), frozen_w, state[ALPHA], self.model.param_names, self.model.buffer_names)
        ce_mixed = cross_entropy(self.model.logits(mixed, batch.x), batch.y)
        return ce_global + ce_mixed, {"ce": ce_global.detach(), "ce_personal": ce_mixed.detach(),
                                      "alpha": state[ALPHA].detach()}

    def alpha_step(self, grads: Tensors, state: Tensors, ctx: ClientContext) -> Tensors:
        """Replace alpha's gradient by the one whose SGD step lands on ``P_[0,1](alpha - eta_alpha g)``.

        Exact for SGD without momentum; the stage's weight decay is cancelled for alpha.
        """
        if ALPHA not in grads:
            return grads
        alpha, lr = state[ALPHA], ctx.lr
        if lr <= 0:
            return {**grads, ALPHA: torch.zeros_like(alpha)}
        target = (alpha - (self.hp.alpha_lr or lr) * grads[ALPHA]).clamp(0.0, 1.0)
        step = (alpha - target) / lr - self.setup.train.weight_decay * alpha
        return {**grads, ALPHA: step}

    def stages(self, ctx: ClientContext) -> list[Stage]:
        (stage,) = super().stages(ctx)
        trainable = self.model.param_names + tuple(LOCAL + n for n in self.model.param_names)
        per_step = self.hp.learn_alpha and self.hp.alpha_every == "step"
        stage.trainable = trainable + ((ALPHA,) if per_step else ())
        stage.grad_transform = self.alpha_step
        return [stage]

    def finish(self, ctx: ClientContext, local: Tensors, steps: int) -> tuple[Tensors, Tensors]:
        upload = {n: local[n] for n in self.model.state_names}
        state = {LOCAL + n: local[LOCAL + n] for n in self.model.state_names}
        state[ALPHA] = local[ALPHA].clamp(0.0, 1.0)
        return upload, state

    def client_model(self, server: ServerState, client_state: Tensors, client_id: int) -> Tensors:
        """The personalised model ``alpha_i v_i + (1 - alpha_i) w``."""
        if ALPHA not in client_state:
            return server.model
        return mixture(self.local(client_state), server.model, client_state[ALPHA], self.model.param_names,
                       self.model.buffer_names)
