"""HAM10000 (Tschandl, Rosendahl, Kittler, Sci. Data 5:180161, 2018) from its official release.

The release (Harvard Dataverse, https://doi.org/10.7910/DVN/DBW86T) holds
10,015 dermatoscopic JPEGs (600x450) in ``HAM10000_images_part_1.zip`` and
``HAM10000_images_part_2.zip`` and one metadata table,
``HAM10000_metadata.csv`` (Dataverse also serves it ingested as
``HAM10000_metadata.tab``, tab-separated with quoted strings). Its columns:
``lesion_id``, ``image_id`` (the image's file stem, ``ISIC_0027419``), ``dx``
(the label: akiec, bcc, bkl, df, mel, nv, vasc: 7 classes), ``dx_type``, ``age``,
``sex``, ``localization`` and, in the current version, ``dataset``: the source
the image came from (rosendahl 2,259, vidir_modern 3,363, vidir_molemax 3,954,
vienna_dias 439). FedUV (Son et al., CVPR 2024, Table 1) uses those four sources
as the domains of a feature-shift federation, one client per domain; they are
the dataset's groups here (``data.partition = "domain"``).

Files read from ``root`` (or one subfolder of it, e.g. ``dataverse_files/``):
the metadata file, and the images either still in the zips or extracted (any
folders below); images not named in the metadata (the ISIC 2018 test images
that share the Dataverse page, segmentation masks) are ignored.

No download: the release's file checksums are not recorded in hetfl and could
not be verified from here, so hetfl never fetches it (``download = true`` with
files missing is an error that says where to get them).

Preprocessing: every image is resized (bilinear, aspect ratio not kept) to
``image_size`` x ``image_size``, default 96: FedUV's "we resize images from
these datasets into 96x96x3", which also keeps the decoded arrays small
(10,015 x 3 x 96 x 96 bytes = 277 MB) where the native 600x450 would take 8 GB.

Train/test split: the 10,015-image release has no official test split (the
ISIC 2018 challenge test images are a different set, without this metadata),
so one is drawn here, seeded by the run's seed: within each (domain, class)
cell ``round(test_fraction * cell size)`` images go to test, default 20 %
(FedUV: "roughly 20% from each domain ... 1955 images"). With ``split_by =
"lesion"`` (default) whole lesions are drawn, so that the several images of one
lesion (HAM10000 has 7,470 lesions for 10,015 images) never sit on both sides:
lesions of the cell are taken in a random order until the cell's test share is
reached (it may overshoot by one lesion's images). ``split_by = "image"`` draws
single images, as a plain random split does (near-duplicates then leak into
test). Like the image-folder domain datasets, decoded arrays are cached and the
split is made at load time, so changing it never decodes again.
"""

from __future__ import annotations

import csv
import io
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from hetfl.data.base import Dataset, DatasetError
from hetfl.data.datasets import decode, tree
from hetfl.data.datasets.cache import cached, fingerprint
from hetfl.data.datasets.common import Context, choose_domains, image_dataset
from hetfl.data.datasets.imagefolder import is_image
from hetfl.data.datasets.paths import check_source, present, read_file
from hetfl.rng import numpy_generator

FORMAT = 1  # bump when the decoded arrays change
CLASSES = ("akiec", "bcc", "bkl", "df", "mel", "nv", "vasc")
DOMAINS = ("rosendahl", "vidir_modern", "vidir_molemax", "vienna_dias")
METADATA_NAMES = ("HAM10000_metadata.csv", "HAM10000_metadata.tab", "HAM10000_metadata")
IMAGE_ARCHIVES = ("HAM10000_images_part_1.zip", "HAM10000_images_part_2.zip")
REQUIRED_COLUMNS = ("lesion_id", "image_id", "dx")
DOMAIN_COLUMN = "dataset"
SOURCE = "https://doi.org/10.7910/DVN/DBW86T"
DEFAULT_SIZE = 96
SPLIT_BY = ("lesion", "image")


@dataclass(frozen=True)
class Record:
    """One metadata row: the image's id, its lesion, its label and its source (domain; "" if unknown)."""

    image_id: str
    lesion_id: str
    dx: str
    domain: str


def find_metadata(root: Path) -> Path | None:
    """The metadata file in ``root`` or in one of its visible subfolders (sorted), else ``None``."""
    if not root.is_dir():
        return None
    folders = [root] + [p for p in sorted(root.iterdir()) if p.is_dir() and not p.name.startswith(".")]
    for folder in folders:
        for name in METADATA_NAMES:
            if present(folder / name):
                return folder / name
    return None


def missing_files_error(root: Path, download: bool) -> DatasetError:
    why = ("hetfl does not download HAM10000 (the release's checksums are not recorded in hetfl, so a download "
           "could not be verified)" if download else "downloading is off (data.download = false)")
    return DatasetError(
        f"ham10000: no {METADATA_NAMES[0]} (or {METADATA_NAMES[1]}) in {root} and {why}. Get the official files "
        f"from the Harvard Dataverse release {SOURCE}: {METADATA_NAMES[0]} and {', '.join(IMAGE_ARCHIVES)} "
        f"(the zips or their extracted folders); put them into {root}, or set data.root to the folder that holds them")


def parse_metadata(text: str, source: Path) -> list[Record]:
    """Rows of the metadata (comma- or tab-separated, quoted or not), checked: ids unique, ``dx`` known."""
    first = text.split("\n", 1)[0]
    reader = csv.DictReader(io.StringIO(text), delimiter="\t" if "\t" in first else ",")
    columns = [c.strip() for c in reader.fieldnames or []]
    missing = [c for c in REQUIRED_COLUMNS if c not in columns]
    if missing:
        raise DatasetError(f"{source}: column(s) {missing} missing (found {columns[:10]}); expected the official "
                           f"HAM10000 metadata with columns {', '.join(REQUIRED_COLUMNS)}, ... from {SOURCE}")
    records: list[Record] = []
    seen: set[str] = set()
    for line, raw in enumerate(reader, start=2):
        row = {(k or "").strip(): (v or "").strip() for k, v in raw.items()}
        if not row["image_id"]:
            continue
        if row["dx"] not in CLASSES:
            raise DatasetError(f"{source}, line {line}: dx = {row['dx']!r} is not one of {', '.join(CLASSES)}")
        if row["image_id"] in seen:
            raise DatasetError(f"{source}, line {line}: image_id {row['image_id']!r} appears twice")
        seen.add(row["image_id"])
        records.append(Record(row["image_id"], row["lesion_id"] or row["image_id"], row["dx"],
                              row.get(DOMAIN_COLUMN, "")))
    if not records:
        raise DatasetError(f"{source}: no rows; expected the official HAM10000 metadata from {SOURCE}")
    return records


def read_images(folder: Path, wanted: set[str], size: int, root: Path | None = None) -> dict[str, np.ndarray]:
    """Decode the wanted images (file stem = image_id) found under ``folder`` or in the zips directly in it.

    An image present twice (zip and extracted copy) is decoded once. Files must stay inside ``root``
    (default ``folder``; see :mod:`hetfl.data.datasets.paths`).
    """
    root = folder if root is None else root
    images: dict[str, np.ndarray] = {}

    def select(parts: tuple[str, ...]) -> bool:
        return is_image(parts) and PurePosixPath(parts[-1]).stem in wanted and \
            PurePosixPath(parts[-1]).stem not in images

    sources = [folder] + [p for p in sorted(folder.iterdir()) if p.is_file() and p.name.lower().endswith(".zip")]
    for source in sources:
        for parts, data in tree.walk(source, select, root=root):
            stem = PurePosixPath(parts[-1]).stem
            if stem not in images:
                images[stem] = decode.decode(data, f"{source}/{'/'.join(parts)}", 3, (size, size))
    return images


def decode_ham10000(metadata: Path, size: int, root: Path | None = None) -> dict[str, np.ndarray]:
    """All images in metadata order with labels ``y``, domain ids ``g``, lesion ids ``lesion``, names;
    files must stay inside ``root`` (default the metadata's folder)."""
    root = metadata.parent if root is None else root
    records = parse_metadata(read_file(metadata, root).decode("utf-8-sig"), metadata)
    images = read_images(metadata.parent, {r.image_id for r in records}, size, root)
    absent = [r.image_id for r in records if r.image_id not in images]
    if absent:
        raise DatasetError(f"{metadata.parent}: {len(absent)} of the {len(records)} images named in {metadata.name} "
                           f"are missing (e.g. {', '.join(absent[:3])}); put {' and '.join(IMAGE_ARCHIVES)} (or "
                           f"their extracted folders) next to {metadata.name}; they are at {SOURCE}")
    domains = sorted({r.domain for r in records})
    lesions = {lesion: i for i, lesion in enumerate(sorted({r.lesion_id for r in records}))}
    return {
        "x": np.stack([images[r.image_id] for r in records]),
        "y": np.asarray([CLASSES.index(r.dx) for r in records], dtype=np.int64),
        "g": np.asarray([domains.index(r.domain) for r in records], dtype=np.int64),
        "lesion": np.asarray([lesions[r.lesion_id] for r in records], dtype=np.int64),
        "domains": np.asarray(domains, dtype=str),
    }


def held_out_indices(y: np.ndarray, g: np.ndarray, lesion: np.ndarray, domains: Sequence[str],
                     test_fraction: float, split_by: str, seed: int) -> np.ndarray:
    """Sorted indices of the test images (rule in the module docstring).

    Each (domain, class) cell draws from its own stream, seeded by (seed, domain
    name, class): a domain's split does not depend on the other domains. With
    ``split_by = "lesion"`` a lesion belongs to the cell of its first image.
    """
    unit = lesion if split_by == "lesion" else np.arange(len(y))
    members: dict[int, list[int]] = {}
    for i, u in enumerate(unit.tolist()):
        members.setdefault(u, []).append(i)
    cells: dict[tuple[int, int], list[int]] = {}
    for u, idx in members.items():
        cells.setdefault((int(g[idx[0]]), int(y[idx[0]])), []).append(u)
    chosen: list[int] = []
    for (d, label), units in sorted(cells.items()):
        target = round(test_fraction * sum(len(members[u]) for u in units))
        rng = numpy_generator(seed, "partition", zlib.crc32(f"ham10000/{domains[d]}".encode()), label)
        taken = 0
        for u in rng.permutation(np.asarray(sorted(units), dtype=np.int64)).tolist():
            if taken >= target:
                break
            chosen.extend(members[u])
            taken += len(members[u])
    return np.asarray(sorted(chosen), dtype=np.int64)


def load_ham10000(ctx: Context, image_size: int, test_fraction: float, split_by: str,
                  domains: Sequence[str]) -> Dataset:
    """HAM10000: 10,015 images, 7 classes (``dx``), 4 source domains; resized to ``image_size`` (default 96)."""
    metadata = find_metadata(ctx.root)
    if metadata is None:
        raise missing_files_error(ctx.root, ctx.download)
    check_source(metadata, ctx.root)  # before the fingerprint follows any link
    check_source(metadata.parent, ctx.root)
    size = image_size or DEFAULT_SIZE
    key = {"dataset": "ham10000", "format": FORMAT, "image_size": size, "source": fingerprint([metadata.parent])}
    arrays = dict(cached(ctx.cache_dir, key, lambda: decode_ham10000(metadata, size, ctx.root)))
    available = tuple(str(d) for d in arrays["domains"])
    chosen = choose_domains(domains, available, metadata)
    keep = np.isin(arrays["g"], [available.index(d) for d in chosen])
    index = np.flatnonzero(keep)
    y, lesion = arrays["y"][index], arrays["lesion"][index]
    g = np.asarray([chosen.index(available[i]) for i in arrays["g"][index]], dtype=np.int64)
    test = np.zeros(len(index), dtype=bool)
    test[held_out_indices(y, g, lesion, chosen, test_fraction, split_by, ctx.seed)] = True
    split = {}
    for name, mask in (("train", ~test), ("test", test)):
        split[f"{name}_x"], split[f"{name}_y"] = arrays["x"][index[mask]], y[mask]
        split[f"{name}_g"] = g[mask]
    notes = [f"ham10000 ({size}px; test: {test_fraction:g} of each (domain, class) cell by {split_by}, seed "
             f"{ctx.seed}) from {metadata.parent}"]
    groups: tuple[str, ...] = chosen
    if chosen == ("",):  # metadata without the ``dataset`` column: no domains
        groups = ()
        split = {k: v for k, v in split.items() if not k.endswith("_g")}
        notes.append(f"ham10000: {metadata.name} has no '{DOMAIN_COLUMN}' column, so no source domains (the domain "
                     f"partition needs the current metadata from {SOURCE})")
    elif set(available) != set(DOMAINS):
        notes.append(f"ham10000: expected the sources {list(DOMAINS)}, found {list(available)}")
    return image_dataset("ham10000", split, CLASSES, None, groups=groups, notes=notes)
