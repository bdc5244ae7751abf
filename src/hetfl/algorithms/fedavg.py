"""FedAvg: local SGD, server averages the client models weighted by data size.

McMahan, Moore, Ramage, Hampson, Agüera y Arcas. "Communication-Efficient
Learning of Deep Networks from Decentralized Data." AISTATS 2017 (Algorithm 1).

Every hook is the :class:`~hetfl.algorithms.base.Algorithm` default: local
cross-entropy epochs, upload of the local model, ``w = sum_k n_k/n w_k``.

Departures from the paper/code: none in the rule. The paper's client fraction C,
batch size B and epochs E are the run's ``train.*`` settings.
"""

from __future__ import annotations

from hetfl.algorithms.base import Algorithm


class FedAvg(Algorithm):
    name = "fedavg"
    citation = "McMahan et al., AISTATS 2017"
