"""pFedMe's inner step size on FedPAC's CNN: the quick variant of fedpac-cifar10's pFedMe run with another
``algorithm.personal_lr`` (session 28; benchmarks/results/pfedme_fedpac_cnn.md).

    python benchmarks/pfedme_step_check.py 0.01 [DATA_ROOT]
"""

import sys
from pathlib import Path
from hetfl import reproduce
from hetfl.engine.experiment import Experiment
lr = sys.argv[1]
root = sys.argv[2] if len(sys.argv) > 2 else "../shared/datasets/cifar10-jpeg.tar.gz"
preset = reproduce.load_preset("fedpac-cifar10").variant(True)
specs = reproduce.run_specs(preset)
spec = next(s for s in set(specs.values()) if s.algorithm == "pfedme")
cfg = reproduce.build_config(preset, spec, [f"data.root={root}", f"algorithm.personal_lr={lr}"])
print(cfg.train, cfg.algorithm)
s = Experiment(cfg).run(Path(f"runs/pfedme-{lr}"))
print(lr, {k: v for k, v in s.items() if k != "config"})
