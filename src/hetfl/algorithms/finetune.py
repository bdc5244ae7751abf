"""FedAvg+FT: FedAvg, then each client fine-tunes the global model before it is evaluated.

The plain personalisation baseline in FedPAC's comparison (Xu, Tong, Huang,
ICLR 2023, "FedAvg-FT"), also FedRep's and FedBABU's "FedAvg+FT": training is
FedAvg (McMahan et al., AISTATS 2017, Algorithm 1); at evaluation client i
starts from a copy of the global model ``w`` and runs ``finetune_epochs``
epochs of SGD on its own training data,

    ``v_i = w - eta * sum_{batches b} grad F_i(v; b)``  (the whole model by default),

and is evaluated with ``v_i`` on its own test split. Fine-tuning never changes
the global model, which is evaluated as well (``global_acc``).

Departures from the paper/code: the papers do not fix FedAvg+FT's budget; one
epoch of whole-model fine-tuning at the training lr is hetfl's default.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetfl.algorithms.base import ClientContext, Stage
from hetfl.algorithms.fedavg import FedAvg
from hetfl.params import FLOAT32_MAX, above, setting


@dataclass(frozen=True)
class FedAvgFTHyper:
    """FedAvg+FT settings.

    finetune_epochs: local epochs of fine-tuning before each client's evaluation
        (1). The papers that use this baseline do not fix a budget (FedPAC only
        names it); one epoch is the cheapest that personalises, and several
        epochs over a few hundred samples over-fit. Use 5 to match FedBABU's
        default fine-tuning budget in hetfl.
    finetune_part: "full" (the whole model, the usual FedAvg+FT, default) or
        "head" (the classifier only, as FedBABU's head fine-tuning).
    finetune_lr: fine-tuning learning rate; 0 means the run's ``train.lr``.
    """

    finetune_epochs: int = setting(1, ge=0, doc="fine-tuning epochs at evaluation (0 = plain FedAvg)")
    finetune_part: str = setting("full", when={"finetune_epochs": above(0)}, choices=("full", "head"),
                                 doc="what is fine-tuned")
    finetune_lr: float = setting(0.0, when={"finetune_epochs": above(0)}, ge=0.0, lt=FLOAT32_MAX,
                                 doc="fine-tuning lr (0 = train.lr)")


class FedAvgFT(FedAvg):
    name = "fedavg_ft"
    Hyper = FedAvgFTHyper
    citation = "McMahan et al., AISTATS 2017 + fine-tuning"

    def personalize_stages(self, ctx: ClientContext) -> list[Stage]:
        """Fine-tuning on the client's own data, run on a copy of the global model."""
        return self.finetune_stages(self.hp.finetune_epochs, self.hp.finetune_part, self.hp.finetune_lr)
