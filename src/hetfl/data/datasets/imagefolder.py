"""Image folders: split layout ``root/{train,test}/<class>/*`` or domain layout ``root/<domain>/<class>/*``.

The tree may be extracted or packed (``.tar``, ``.tar.gz``, ``.zip``) and may
sit inside one wrapper folder (``cifar10-jpeg/train/...``). The decoded arrays
are cached; for the domain layout the cache holds all domains and the domain
selection and train/test split happen at load time, so changing ``domains``,
``test_fraction`` or the seed never decodes again.

Data stays inside ``data.root``: a symbolic link (to a file or a folder) whose
target lies outside it is refused with a DatasetError naming the link, unless
``data.options.follow_links = true`` (then it is read like any file, and linked
folders are descended into); links that stay inside are always followed. A link
loop or a broken link is a DatasetError too. Archives are read, never extracted,
and their link members are skipped, so no archive path can leave the root.

Domain datasets (PACS, Li et al. 2017; Office-Home, Venkateswara et al. 2017;
DomainNet, Peng et al. 2019) use this loader with their domain names as
metadata. Their train/test split is the deterministic per-domain split below,
not DomainNet's official split lists.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetfl.data.base import Dataset, DatasetError
from hetfl.data.datasets import decode, tree
from hetfl.data.datasets.cache import cached, fingerprint
from hetfl.data.datasets.common import Context, Norm, choose_domains, image_dataset
from hetfl.data.datasets.paths import check_source, link_target, list_folder  # noqa: F401 (shared, re-exported)

FORMAT = 2  # bump when the decoded arrays change (2: 16-bit images scaled to 8 bits, no longer clipped)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".ppm", ".pgm", ".tif", ".tiff")
TEST_SPLITS = ("test", "val", "valid")
Entry = tuple[tuple[str, ...], np.ndarray]


@dataclass(frozen=True)
class DomainMeta:
    """What a domain dataset should contain (for the notes when a folder differs)."""

    domains: tuple[str, ...]
    num_classes: int


DOMAIN_DATASETS = {
    "pacs": DomainMeta(("art_painting", "cartoon", "photo", "sketch"), 7),
    "officehome": DomainMeta(("Art", "Clipart", "Product", "Real World"), 65),
    "domainnet": DomainMeta(("clipart", "infograph", "painting", "quickdraw", "real", "sketch"), 345),
}


def is_image(parts: tuple[str, ...]) -> bool:
    return parts[-1].lower().endswith(IMAGE_SUFFIXES)


def find_source(root: Path, *, needs_train: bool, exclude: Callable[[Path], bool] = lambda p: False) -> Path | None:
    """The image tree at ``root``: ``root`` itself, or the single archive / subfolder tree inside it.

    ``needs_train``: the split layout (a ``train/`` folder must be found).
    """
    if tree.is_archive(root):
        return None if exclude(root) else root
    if not root.is_dir():
        return None
    if (root / "train").is_dir() or (not needs_train and _has_image_folders(root)):
        return root
    inner = [p for p in sorted(root.iterdir()) if not p.name.startswith(".") and not exclude(p)
             and (tree.is_archive(p) or (p / "train").is_dir())]
    if len(inner) > 1:
        raise DatasetError(f"{root} holds several image trees ({', '.join(p.name for p in inner)}); "
                           "set data.root to the one to use")
    return inner[0] if inner else None


def _has_image_folders(root: Path) -> bool:
    return any(p.is_dir() and not p.name.startswith(".") for p in root.iterdir())


def read_images(source: Path, channels: int, size: decode.Size | None,
                skip: Callable[[tuple[str, ...]], bool] = lambda parts: False, *,
                root: Path | None = None, follow_links: bool | None = None) -> list[Entry]:
    """Decode every image under ``source`` (minus ``skip``ped paths), sorted by path, common wrapper removed.

    Images keep their own size when ``size`` is None (see :func:`decode.stack`). Links must stay inside
    ``root`` (default ``source``) unless ``follow_links`` (None: the caller offers no such option; see
    :func:`link_target`).
    """
    boundary = source if root is None else root
    entries = [(parts, decode.decode(data, f"{source}/{'/'.join(parts)}", channels, size))
               for parts, data in tree.walk(source, lambda p: is_image(p) and not skip(p), root=boundary,
                                            follow_links=follow_links)]
    entries.sort(key=lambda e: e[0])
    strip = tree.strip_common_top([p for p, _ in entries], 3)
    return [(parts[strip:], image) for parts, image in entries if len(parts) - strip >= 3]


def split_arrays(entries: Sequence[Entry], source: Path, size: decode.Size | None,
                 classes: Sequence[str] | None = None, test_split: str | None = None) -> dict[str, np.ndarray]:
    """Split layout -> ``{train,test}_{x,y}`` and ``classes`` (sorted folder names unless ``classes`` given)."""
    tops = {parts[0] for parts, _ in entries}
    test_name = test_split or next((t for t in TEST_SPLITS if t in tops), None)
    if "train" not in tops or test_name not in tops:
        raise DatasetError(f"{source}: expected images under train/<class>/ and "
                           f"{test_name or '{test,val}'}/<class>/ (found top folders: {sorted(tops)[:8]})")
    by_split = {s: [(parts[1], img) for parts, img in entries if parts[0] == s] for s in ("train", test_name)}
    found = sorted({c for items in by_split.values() for c, _ in items})
    names = tuple(classes) if classes is not None else tuple(found)
    unknown = sorted(set(found) - set(names))
    if unknown:
        raise DatasetError(f"{source}: unexpected class folders {unknown[:5]}; expected {', '.join(names)}")
    index = {c: i for i, c in enumerate(names)}
    if size is None:
        size = (int(by_split["train"][0][1].shape[1]), int(by_split["train"][0][1].shape[2]))
    arrays = {"classes": np.asarray(names, dtype=str)}
    for key, split in (("train", "train"), ("test", test_name)):
        arrays[f"{key}_x"] = decode.stack([img for _, img in by_split[split]], size)
        arrays[f"{key}_y"] = np.asarray([index[c] for c, _ in by_split[split]], dtype=np.int64)
    return arrays


def domain_arrays(entries: Sequence[Entry], source: Path, size: decode.Size | None) -> dict[str, np.ndarray]:
    """Domain layout -> all images ``x``, labels ``y``, domain ids ``g``, ``classes`` and ``domains`` (sorted)."""
    if not entries:
        raise DatasetError(f"{source}: no images found; expected {source}/<domain>/<class>/<image>")
    domains = sorted({parts[0] for parts, _ in entries})
    classes = sorted({parts[1] for parts, _ in entries})
    d_index, c_index = {d: i for i, d in enumerate(domains)}, {c: i for i, c in enumerate(classes)}
    return {
        "x": decode.stack([img for _, img in entries], size),
        "y": np.asarray([c_index[p[1]] for p, _ in entries], dtype=np.int64),
        "g": np.asarray([d_index[p[0]] for p, _ in entries], dtype=np.int64),
        "classes": np.asarray(classes, dtype=str),
        "domains": np.asarray(domains, dtype=str),
    }


def split_domains(arrays: dict[str, np.ndarray], chosen: Sequence[str], test_fraction: float,
                  seed: int) -> dict[str, np.ndarray]:
    """Train/test arrays of the ``chosen`` domains; ``g`` renumbered to positions in ``chosen``.

    Each (domain, class) cell puts ``round(test_fraction * n)`` random samples
    into test, drawn from a generator seeded by (seed, domain name): the split
    of a domain does not depend on which other domains are selected.
    """
    names = [str(d) for d in arrays["domains"]]
    parts: dict[str, list[np.ndarray]] = {"train": [], "test": []}
    group = np.full(len(arrays["g"]), -1, dtype=np.int64)
    for position, domain in enumerate(chosen):
        members = np.flatnonzero(arrays["g"] == names.index(domain))
        group[members] = position
        rng = np.random.default_rng([seed, zlib.crc32(domain.encode())])
        for label in np.unique(arrays["y"][members]):
            cell = rng.permutation(members[arrays["y"][members] == label])
            n_test = round(test_fraction * len(cell))
            parts["test"].append(cell[:n_test])
            parts["train"].append(cell[n_test:])
    out = {}
    for key, chunks in parts.items():
        index = np.sort(np.concatenate(chunks)) if chunks else np.zeros(0, dtype=np.int64)
        out[f"{key}_x"], out[f"{key}_y"], out[f"{key}_g"] = arrays["x"][index], arrays["y"][index], group[index]
    return out


def _size(image_size: int) -> decode.Size | None:
    return (image_size, image_size) if image_size else None


def load_imagefolder(ctx: Context, layout: str, domains: Sequence[str], image_size: int, channels: int,
                     test_fraction: float, norm: Norm | None = None, follow_links: bool = False) -> Dataset:
    """Any image folder; ``layout`` auto|split|domain, ``domains`` to select (domain layout);
    ``follow_links``: read symbolic links that lead out of ``data.root`` (refused otherwise)."""
    if not ctx.root.exists():
        raise DatasetError(f"{ctx.name}: data.root = {str(ctx.root)!r} does not exist; set it to the folder "
                           "with <train|test>/<class>/<image> or <domain>/<class>/<image> files")
    source = find_source(ctx.root, needs_train=layout == "split")
    if source is None:
        raise DatasetError(f"{ctx.name}: no image tree in {ctx.root}; expected {ctx.root}/<train|test>/<class>/"
                           f"<image> or {ctx.root}/<domain>/<class>/<image> (or a .tar/.tar.gz/.zip of it); "
                           "put the images there or set data.root to their folder")
    check_source(source, ctx.root, follow_links)  # before the fingerprint follows any link
    key = {"dataset": ctx.name, "format": FORMAT, "layout": layout, "image_size": image_size, "channels": channels,
           "source": fingerprint([source])}

    def build() -> dict[str, np.ndarray]:
        entries = read_images(source, channels, _size(image_size), root=ctx.root, follow_links=follow_links)
        tops = {parts[0] for parts, _ in entries}
        use = layout if layout != "auto" else "split" if "train" in tops and tops & set(TEST_SPLITS) else "domain"
        if use == "split":
            return split_arrays(entries, source, _size(image_size))
        return domain_arrays(entries, source, _size(image_size))

    arrays = dict(cached(ctx.cache_dir, key, build))
    if norm is not None and len(norm[0]) != channels:
        norm = None  # published constants are for RGB; compute them for grayscale
    classes = tuple(str(c) for c in arrays.pop("classes"))
    notes = [f"{ctx.name} from {source}"]
    if "domains" not in arrays:
        if domains:
            raise DatasetError(f"data.options.domains = {list(domains)}: {source} has the split layout "
                               "(train/test), not domains; remove the option")
        return image_dataset(ctx.name, arrays, classes, norm, notes=notes)
    available = tuple(str(d) for d in arrays["domains"])
    chosen = choose_domains(domains, available, source)
    meta = DOMAIN_DATASETS.get(ctx.name)
    if meta is not None and (set(available) != set(meta.domains) or len(classes) != meta.num_classes):
        notes.append(f"{ctx.name}: expected domains {list(meta.domains)} and {meta.num_classes} classes, found "
                     f"{list(available)} and {len(classes)}")
    return image_dataset(ctx.name, split_domains(arrays, chosen, test_fraction, ctx.seed), classes, norm,
                         groups=chosen, notes=notes)
