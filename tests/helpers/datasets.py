"""Tiny dataset files in the official formats (MNIST's IDX, EMNIST, CIFAR records, STL-10, image folders,
Tiny ImageNet, HAM10000's release), for the loader tests."""

from __future__ import annotations

import gzip
import io
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

from hetfl.data.datasets import ham10000 as ham

PIL = pytest.importorskip("PIL.Image")


def idx_bytes(array: np.ndarray) -> bytes:
    """IDX encoding of a uint8 array (magic 0x00 0x00 0x08 ndim, big-endian sizes)."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def write_idx(path: Path, array: np.ndarray, gz: bool = True) -> Path:
    data = idx_bytes(array)
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def make_mnist(root: Path, n_train: int = 12, n_test: int = 6, gz: bool = True, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    data = {
        "train_x": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train_y": (np.arange(n_train) % 10).astype(np.uint8),
        "test_x": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "test_y": (np.arange(n_test)[::-1] % 10).astype(np.uint8),
    }
    for prefix, split in (("train", "train"), ("t10k", "test")):
        name = f"{prefix}-images-idx3-ubyte.gz"
        write_idx(root / (name if gz else name[:-3]), data[f"{split}_x"], gz)
        name = f"{prefix}-labels-idx1-ubyte.gz"
        write_idx(root / (name if gz else name[:-3]), data[f"{split}_y"], gz)
    return data


def png_bytes(array: np.ndarray) -> bytes:
    """``[C, H, W]`` uint8 -> PNG bytes (lossless, so pixels can be compared)."""
    img = PIL.fromarray(array[0] if array.shape[0] == 1 else array.transpose(1, 2, 0))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def write_png(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png_bytes(array))


def solid(value: int, size: tuple[int, int] = (8, 8), channels: int = 3) -> np.ndarray:
    return np.full((channels, *size), value, dtype=np.uint8)


def make_split_folder(root: Path, classes: dict[str, int], per_split: tuple[int, int] = (3, 2),
                      size: tuple[int, int] = (8, 8), test_name: str = "test") -> None:
    """``root/{train,test}/<class>/i.png`` with pixel value = class value + i."""
    for split, n in zip(("train", test_name), per_split, strict=True):
        for cls, value in classes.items():
            for i in range(n):
                write_png(root / split / cls / f"{i:04d}.png", solid(value + i, size))


def tar_folder(folder: Path, archive: Path, arcname: str) -> Path:
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname=arcname)
    return archive


def emnist_files(folder: Path, split: str, upright: np.ndarray, labels: np.ndarray) -> dict[str, bytes]:
    """The four EMNIST files, images stored transposed as in the official release."""
    stored = upright.transpose(0, 2, 1)
    out = {}
    for part in ("train", "test"):
        out[f"emnist-{split}-{part}-images-idx3-ubyte.gz"] = gzip.compress(idx_bytes(stored))
        out[f"emnist-{split}-{part}-labels-idx1-ubyte.gz"] = gzip.compress(idx_bytes(labels))
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in out.items():
        (folder / name).write_bytes(data)
    return out


def cifar_records(labels: list[tuple[int, ...]], seed: int) -> tuple[bytes, np.ndarray]:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (len(labels), 3, 32, 32), dtype=np.uint8)
    rows = [bytes(lab) + img.tobytes() for lab, img in zip(labels, images, strict=True)]
    return b"".join(rows), images


def make_cifar10(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    folder.mkdir(parents=True, exist_ok=True)
    train = []
    for i in range(1, 6):
        data, images = cifar_records([(i,), (9,)], seed=i)
        (folder / f"data_batch_{i}.bin").write_bytes(data)
        train.append(images)
    data, test = cifar_records([(3,), (0,), (7,)], seed=9)
    (folder / "test_batch.bin").write_bytes(data)
    return np.concatenate(train), test


def make_stl10(folder: Path, n_train: int = 3, n_test: int = 2) -> tuple[np.ndarray, np.ndarray]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    upright = {}
    for split, n in (("train", n_train), ("test", n_test)):
        x = rng.integers(0, 256, (n, 3, 96, 96), dtype=np.uint8)
        upright[split] = x
        (folder / f"{split}_X.bin").write_bytes(x.transpose(0, 1, 3, 2).tobytes())  # column-major per channel
        (folder / f"{split}_y.bin").write_bytes((np.arange(n) % 10 + 1).astype(np.uint8).tobytes())
    return upright["train"], upright["test"]


def make_tinyimagenet(base: Path) -> None:
    wnids = ["n02", "n01", "n03"]
    (base / "val" / "images").mkdir(parents=True)
    (base / "wnids.txt").write_text("\n".join(wnids) + "\n")
    for w, wnid in enumerate(wnids):
        for i in range(2):
            write_png(base / "train" / wnid / "images" / f"{wnid}_{i}.JPEG", solid(10 * w + i, (64, 64)))
        (base / "train" / wnid / f"{wnid}_boxes.txt").write_text("")
    lines = []
    for i, wnid in enumerate(["n03", "n02", "n03", "n01"]):
        write_png(base / "val" / "images" / f"val_{i}.JPEG", solid(100 + i, (64, 64)))
        lines.append(f"val_{i}.JPEG\t{wnid}\t0\t0\t63\t63")
    (base / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    write_png(base / "test" / "images" / "test_0.JPEG", solid(5, (64, 64)))  # unlabelled: ignored


HEADER = ["lesion_id", "image_id", "dx", "dx_type", "age", "sex", "localization", "dataset"]


def jpeg(value: int) -> bytes:
    """A 60x45 (the release's 4:3, scaled down) JPEG of one grey level."""
    buf = io.BytesIO()
    PIL.new("RGB", (60, 45), (value, value, value)).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def fake_rows() -> list[list[str]]:
    """40 images: 2 sources x 7 classes, lesions of 1-3 images; vidir_modern has 3 images per lesion of nv."""
    rows, n = [], 0
    for domain in ("rosendahl", "vidir_modern"):
        for dx in ham.CLASSES:
            per_lesion = 3 if (domain, dx) == ("vidir_modern", "nv") else 1
            count = 9 if dx == "nv" else 2
            for k in range(count):
                lesion = f"HAM_{domain[:3]}{dx}{k // per_lesion}"
                rows.append([lesion, f"ISIC_{n:07d}", dx, "histo", "50.0", "male", "back", domain])
                n += 1
    return rows


def make_release(base: Path, rows: list[list[str]], *, tab: bool = False, zipped: bool = True,
                 header: list[str] = HEADER) -> Path:
    """Write the metadata (CSV, or Dataverse's quoted .tab) and the images split over two zips or folders."""
    base.mkdir(parents=True, exist_ok=True)
    sep = "\t" if tab else ","
    quote = (lambda v: f'"{v}"') if tab else (lambda v: v)
    lines = [sep.join(quote(h) for h in header)] + [sep.join(quote(v) for v in row[: len(header)]) for row in rows]
    name = "HAM10000_metadata.tab" if tab else "HAM10000_metadata.csv"
    (base / name).write_text("\n".join(lines) + "\n")
    halves = (rows[: len(rows) // 2], rows[len(rows) // 2 :])
    for part, half in zip(ham.IMAGE_ARCHIVES, halves, strict=True):
        if zipped:
            with zipfile.ZipFile(base / part, "w") as zf:
                for row in half:
                    zf.writestr(f"{row[1]}.jpg", jpeg(10 + 5 * int(row[1][5:])))
        else:
            folder = base / part.removesuffix(".zip")
            folder.mkdir()
            for row in half:
                (folder / f"{row[1]}.jpg").write_bytes(jpeg(10 + 5 * int(row[1][5:])))
    return base
