"""kNN-Per: the FedAvg model interpolated with a local k-nearest-neighbour memory.

Marfoq, Neglia, Vidal, Kameni, Vidal. "Personalized Federated Learning through
Local Memorization." ICML 2022. Training is FedAvg. At evaluation
client i builds a datastore of its own training set's features under the
global model, ``{(phi(x_j), y_j)}``, and for a test input ``x`` predicts

    ``p_i(y | x) = lam p_kNN(y | x) + (1 - lam) p_model(y | x)``,
    ``p_kNN(y | x) = sum_{j in N_k(x)} 1[y_j = y] s_j / sum_{j in N_k(x)} s_j``,
    ``s_j = exp(-||phi(x) - phi(x_j)||^2 / (d * scale))``,

with ``N_k(x)`` the k nearest stored features in Euclidean distance and
``d`` the feature size (the Gaussian kernel of the authors' code, length
scale ``scale``). Features are the classifier input (``ctx.features``). The
predictor returns ``log p_i`` as logits (same argmax; the evaluation loss
is the log loss of the interpolated distribution). The global model is
evaluated too (``global_acc``).

Departures from the paper/code: ``k = 10`` and one fixed ``lam = 0.5`` for all
clients (the paper selects lam per client on a validation split over a grid);
the datastore is the whole training set (no held-out split).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetfl.algorithms.base import ClientContext, Tensors
from hetfl.algorithms.fedavg import FedAvg
from hetfl.params import setting


@dataclass(frozen=True)
class KNNPerHyper:
    """kNN-Per settings (Marfoq et al. 2022).

    k: neighbours retrieved (10: hetfl's choice; the authors' scripts take k
        as an argument and the paper studies its effect).
    lam: weight of the kNN distribution (0.5). The paper picks lam per client
        on a validation split over a grid in [0, 1]; hetfl uses one fixed
        value, the grid's middle. lam = 0 is the FedAvg model.
    scale: length scale of the Gaussian kernel (1.0, the authors' default).
    """

    k: int = setting(10, ge=1, doc="number of neighbours")
    lam: float = setting(0.5, ge=0.0, le=1.0, doc="interpolation weight of the kNN distribution")
    scale: float = setting(1.0, gt=0.0, doc="length scale of the Gaussian kernel")


def knn_probabilities(queries: torch.Tensor, keys: torch.Tensor, labels: torch.Tensor, k: int, num_classes: int,
                      scale: float) -> torch.Tensor:
    """``p_kNN(y | x)`` [B, C] of each query from the k nearest keys (Gaussian kernel on squared distances)."""
    dist2 = torch.cdist(queries.float(), keys.float()).pow(2)
    k = min(k, keys.shape[0])
    nearest, idx = dist2.topk(k, dim=1, largest=False)
    # normalised kernel weights; softmax of -d^2/(d*scale) is exp(.)/sum exp(.) without underflow
    weights = torch.softmax(-nearest / (keys.shape[1] * scale), dim=1)
    probs = torch.zeros(queries.shape[0], num_classes, device=queries.device, dtype=weights.dtype)
    return probs.scatter_add_(1, labels[idx], weights)


def interpolated_log_probs(logits: torch.Tensor, knn_probs: torch.Tensor, lam: float) -> torch.Tensor:
    """``log(lam p_kNN + (1 - lam) softmax(logits))``, computed in log space (lam = 0 gives log_softmax exactly)."""
    log_model = F.log_softmax(logits.float(), dim=1)
    if lam == 0.0:
        return log_model
    if lam == 1.0:
        return torch.log(knn_probs)
    both = torch.stack([math.log(lam) + torch.log(knn_probs), math.log(1 - lam) + log_model])
    return torch.logsumexp(both, dim=0)


class KNNPer(FedAvg):
    name = "knnper"
    Hyper = KNNPerHyper
    citation = "Marfoq et al., ICML 2022"

    def predictor(self, state: Tensors, ctx: ClientContext) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Client ``ctx.client_id``'s interpolation of the model with its training-set datastore."""
        if ctx.features is None:
            raise ValueError("knnper needs the client's training features (ClientContext.features)")
        keys, labels = ctx.features(state)
        if len(labels) == 0:
            return None  # an empty datastore: the model alone
        hp, num_classes = self.hp, self.setup.num_classes

        def predict(x: torch.Tensor) -> torch.Tensor:
            z, logits = self.model.features_and_logits(state, x)
            p_knn = knn_probabilities(z, keys, labels, hp.k, num_classes, hp.scale)
            return interpolated_log_probs(logits, p_knn, hp.lam)

        return predict
