"""Does a CPU kernel's result depend on where its input lies in memory?

A safetensors file holds its tensors at 8-byte offsets, and tensors read from it were used in place until
session 22; torch aligns what it allocates to 64 bytes. This script computes ``F.linear`` (a matrix-vector
product at batch 1, a matrix product at batch 6) and ``sum`` with the weight copied to each 4-byte offset
from a 64-byte boundary, one thread, and prints the largest difference from the 64-byte-aligned result.
A nonzero row is why ``hetfl.engine.checkpoint.load_tensors`` copies every tensor it reads: a resumed run
must compute on its state exactly as the uninterrupted run did (pFedHN's generated models are products of
this kind). Appends to ``benchmarks/results/alignment_rounding_cpu.md``.

    python benchmarks/alignment_rounding.py
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = [(100, 16, 1), (97, 33, 1), (582, 100, 1), (4096, 100, 1), (1000, 100, 6)]  # (out, in, batch)


def at_offset(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of float32 ``t`` whose first element lies ``offset`` elements past a 64-byte boundary."""
    buf = torch.empty(t.numel() + 32, dtype=t.dtype)
    start = (-(buf.data_ptr() // t.element_size()) % 16) + offset
    out = buf[start : start + t.numel()].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 64 == (offset * t.element_size()) % 64
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "alignment_rounding_cpu.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    for out_f, in_f, batch in SHAPES:
        w, x, b = torch.randn(out_f, in_f), torch.randn(batch, in_f), torch.randn(out_f)
        ref = F.linear(x, w, b)
        linear = max((F.linear(x, at_offset(w, k), b) - ref).abs().max().item() for k in range(1, 16))
        flat = w.reshape(-1)
        total = max(abs((at_offset(flat, k).sum() - flat.sum()).item()) for k in range(1, 16))
        rows.append(f"| {out_f} x {in_f} | {batch} | {linear:.3g} | {total:.3g} |")
    cpu = platform.processor() or platform.machine()
    text = (f"\n`python benchmarks/alignment_rounding.py` on {cpu}, torch {torch.__version__}, one thread: the largest "
            "difference from the 64-byte-aligned result over the 15 other 4-byte offsets of the weight\n\n"
            "| weight | batch | `F.linear` | `sum` of the weight |\n|---|---|---|---|\n" + "\n".join(rows) + "\n")
    print(text)
    path = Path(args.out)
    if not path.exists():
        path.write_text("# A CPU kernel's rounding by the address of its input (benchmarks/alignment_rounding.py)\n")
    with path.open("a") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
