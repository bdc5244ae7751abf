"""CINIC-10 (Darlow et al. 2018): CIFAR-10 classes, 32x32 PNGs from CIFAR-10 and ImageNet.

Official layout ``{train,valid,test}/<class>/*.png`` (90,000 each); the train
and test splits are used, ``valid`` is skipped. Read from the extracted
folder or straight from ``CINIC-10.tar.gz`` (Edinburgh DataShare; the MD5 is
the one published with the dataset's reference loaders).
"""

from __future__ import annotations

import numpy as np

from hetfl.data.base import Dataset
from hetfl.data.datasets import imagefolder
from hetfl.data.datasets.cache import cached, fingerprint
from hetfl.data.datasets.cifar import CIFAR10_CLASSES
from hetfl.data.datasets.common import CINIC10_NORM, Context, image_dataset
from hetfl.data.datasets.download import Remote, ensure
from hetfl.data.datasets.paths import check_source

FORMAT = 1  # bump when the decoded arrays change
CINIC10 = Remote("CINIC-10.tar.gz", ("https://datashare.ed.ac.uk/bitstream/handle/10283/3192/CINIC-10.tar.gz",),
                 md5="6ee4d0c996905fe93221de577967a372")


def load_cinic10(ctx: Context) -> Dataset:
    """CINIC-10's train (90,000) and test (90,000) splits, classes in CIFAR-10's order."""
    source = imagefolder.find_source(ctx.root, needs_train=True)
    if source is None:
        ensure(ctx.root, [CINIC10], download=ctx.download, dataset="cinic10",
               alternative="(or the extracted train/<class>/, test/<class>/ folders)")
        source = ctx.root / CINIC10.name
    check_source(source, ctx.root)  # before the fingerprint follows any link
    key = {"dataset": "cinic10", "format": FORMAT, "source": fingerprint([source])}

    def build() -> dict[str, np.ndarray]:
        entries = imagefolder.read_images(source, 3, (32, 32), skip=lambda parts: "valid" in parts[:-2],
                                           root=ctx.root)
        arrays = imagefolder.split_arrays(entries, source, (32, 32), classes=CIFAR10_CLASSES, test_split="test")
        del arrays["classes"]
        return arrays

    arrays = cached(ctx.cache_dir, key, build)
    return image_dataset("cinic10", arrays, CIFAR10_CLASSES, CINIC10_NORM, notes=[f"cinic10 from {source}"])
