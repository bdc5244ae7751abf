"""How fast can k clients' convolutions be? cnn2's encoder (forward + backward) for k clients at once.

The vectorised executor runs a round's clients as ``torch.func.vmap`` of one client's step: a
convolution with per-client weights becomes one grouped convolution (``groups = k``), which cuDNN runs
less efficiently than the ceiling's ordinary convolution of one model over all clients' batches
(benchmarks/results/profile_cuda.md: grouped-convolution and layout-conversion kernels are a third of the
GPU time of a round). This measures, on one device, side by side, the same work several ways:

- ``vmap``: vmap over per-client weights, NCHW input, PyTorch's pooling (hetfl's step before session 14);
- ``vmap_layout``: the same with hetfl's step since then: the batch stored sample-major and
  ``hetfl.models.layers.MaxPool2d`` and ``Linear`` inside ``client_batching`` (no layout copies of the
  activations, no scaled copy of the bias; the sample-major copy of the input is made by the timed call
  here, as the executor's gather makes it);
- ``vmap_cl``: the same with channels-last input;
- ``per_client``: hetfl's step with ``runtime.conv_batching = "per_client"``: ``hetfl.models.layers.Conv2d``
  runs one ordinary convolution per client (forward and backward) on the client-major batch, inside
  ``client_batching("per_client")`` (k convolutions where ``vmap`` runs one grouped convolution);
- ``streams`` (CUDA only): each client's forward and backward as an ordinary unbatched step on one of k
  CUDA streams, joined after (in the captured graph, k parallel branches): what per-client convolutions
  could reach if they ran concurrently (pytorch/pytorch#73764 found streams faster than a grouped
  convolution); the bound of that idea, not something the executor does;
- ``unfold_bmm``: each convolution as im2col (``unfold``) and one batched matrix product over clients
  (``bmm``: k GEMMs in one kernel), the per-client weights kept;
- ``vmap_compiled``: ``vmap`` compiled by ``torch.compile`` (Inductor: elementwise ops, pooling and the
  layout copies of vmap's batching rules fused into generated kernels; convolutions still cuDNN's);
- ``ceiling``: one model's ordinary convolutions over the k clients' batches together (no per-client
  weights: the bound, not an alternative).

On CUDA each variant's forward + backward is captured once as a CUDA graph and replayed (launch overhead
out of the picture); on the CPU it runs eagerly (a smoke run: the numbers mean little there). ``--check``
first compares ``unfold_bmm`` and ``vmap_cl`` with ``vmap`` (outputs and weight gradients, float32).

    python benchmarks/conv_kernels.py --clients 20 --batch-size 64 --dtype bf16
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from hetfl.engine.vectorized import channels_last_for_vmap
from hetfl.models.layers import Conv2d, Linear, MaxPool2d, client_batching

KERNEL = 5


def conv_unfold(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-client convolutions as im2col and one batched GEMM: ``x`` [k, n, C, H, W], ``w`` [k, O, C, 5, 5],
    ``b`` [k, O] -> [k, n, O, H-4, W-4]."""
    k, n, c, h, width = x.shape
    oh, ow = h - KERNEL + 1, width - KERNEL + 1
    cols = F.unfold(x.reshape(k * n, c, h, width), KERNEL)  # [k*n, C*25, oh*ow]
    cols = cols.view(k, n, c * KERNEL * KERNEL, oh * ow).transpose(1, 2).reshape(k, c * KERNEL * KERNEL, n * oh * ow)
    out = torch.bmm(w.reshape(k, w.shape[1], -1), cols) + b[:, :, None]  # [k, O, n*oh*ow]
    return out.view(k, -1, n, oh, ow).transpose(1, 2)


def encoder_unfold(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """cnn2's encoder for k clients with :func:`conv_unfold` (params stacked over clients)."""
    k, n = x.shape[:2]
    h = conv_unfold(x, params["0.weight"], params["0.bias"]).relu()
    h = F.max_pool2d(h.flatten(0, 1), 2).unflatten(0, (k, n))
    h = conv_unfold(h, params["3.weight"], params["3.bias"]).relu()
    h = F.max_pool2d(h.flatten(0, 1), 2).flatten(1).unflatten(0, (k, n))
    return torch.baddbmm(params["7.bias"][:, None], h, params["7.weight"].transpose(1, 2)).relu()


def make_encoder(channels: int, size: int, pool: type[torch.nn.Module] = torch.nn.MaxPool2d,
                 linear: type[torch.nn.Linear] = torch.nn.Linear,
                 conv: type[torch.nn.Conv2d] = torch.nn.Conv2d) -> torch.nn.Sequential:
    flat = 64 * ((((size - 4) // 2) - 4) // 2) ** 2
    return torch.nn.Sequential(conv(channels, 32, KERNEL), torch.nn.ReLU(), pool(2),
                               conv(32, 64, KERNEL), torch.nn.ReLU(), pool(2),
                               torch.nn.Flatten(), linear(flat, 512), torch.nn.ReLU())


def sample_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` [k, n, ...] stored as [n, k, ...] (the same values): how the executor gathers a step's batch."""
    return x.transpose(0, 1).contiguous().transpose(0, 1)


def variants(model: torch.nn.Module, k: int) -> dict[str, Callable[[dict, torch.Tensor], dict]]:
    """name -> (stacked params, x [k, n, C, H, W]) -> weight gradients (a loss: the features' mean square)."""

    def one(params: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, params, (x,)).square().mean()

    per_client = vmap(grad(one))
    layout_model = make_encoder(3, 32, MaxPool2d, Linear).to(next(model.parameters()).device)

    def one_in_place(params: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(layout_model, params, (x,)).square().mean()

    def in_place(params: dict, x: torch.Tensor) -> dict:
        with client_batching():  # hetfl's layers take their batching rules only inside (as in the executor)
            return vmap(grad(one_in_place))(params, sample_major(x))

    per_client_model = make_encoder(3, 32, MaxPool2d, Linear, Conv2d).to(next(model.parameters()).device)

    def one_per_client(params: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(per_client_model, params, (x,)).square().mean()

    def per_client_convs(params: dict, x: torch.Tensor) -> dict:
        with client_batching("per_client"):  # the batch client-major, as the executor gathers it then
            return vmap(grad(one_per_client))(params, x)

    side = [torch.cuda.Stream() for _ in range(k)] if torch.cuda.is_available() else []

    def streams(params: dict, x: torch.Tensor) -> dict:
        main = torch.cuda.current_stream()
        grads = []
        for c, stream in enumerate(side):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                grads.append(grad(one)({n: p[c] for n, p in params.items()}, x[c]))
        for stream in side:
            main.wait_stream(stream)
        return {n: torch.stack([g[n] for g in grads]) for n in grads[0]}

    def unfold(params: dict, x: torch.Tensor) -> dict:
        return grad(lambda p: encoder_unfold(p, x).square().mean(dim=(1, 2)).sum())(params)

    def ceiling(params: dict, x: torch.Tensor) -> dict:
        shared = {n: p[0] for n, p in params.items()}
        return grad(lambda p: functional_call(model, p, (x.flatten(0, 1),)).square().mean())(shared)

    compiled = torch.compile(per_client, dynamic=False)
    # the compiled variant last: its first call compiles (tens of seconds), so a time limit cuts it, not the others
    return {"vmap": per_client, "vmap_layout": in_place,
            "vmap_cl": lambda p, x: per_client(p, channels_last_for_vmap(x)), "per_client": per_client_convs,
            **({"streams": streams} if side else {}),
            "unfold_bmm": unfold, "ceiling": ceiling, "vmap_compiled": compiled}


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Seconds per call: a CUDA graph replayed on CUDA, eager calls on the CPU."""
    if device.type == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            graph.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / repeats
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--check", action="store_true", help="compare the variants' gradients with vmap's first")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    k, n = args.clients, args.batch_size
    model = make_encoder(3, 32).to(device)
    params = {name: p.detach()[None].repeat(k, *[1] * p.dim()) + 0.01 * torch.randn(k, *p.shape, device=device)
              for name, p in model.named_parameters()}
    x = torch.randn(k, n, 3, 32, 32, device=device)
    ways = variants(model, k)
    reference = ways["vmap"](params, x) if args.check else {}
    checks: list[str] = []

    def check(name: str) -> None:
        """``name``'s gradients against vmap's (float32), said under the table."""
        if args.check:
            got = ways[name](params, x)
            worst = max(((got[p] - reference[p]).abs().max() / reference[p].abs().max()).item() for p in reference)
            checks.append(f"check {name}: largest gradient difference {worst:.2e} of the largest gradient")

    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    print(f"cnn2 encoder, {k} clients x batch {n}, {args.dtype}, {device} "
          f"({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}), torch {torch.__version__}")
    print("| variant | ms per step (fwd + bwd) | samples/s | vs vmap |")
    print("|---|---|---|---|")
    times = {}
    for name, fn in ways.items():
        if name in ("vmap_layout", "vmap_cl", "per_client", "streams", "unfold_bmm", "vmap_compiled"):
            check(name)
        def step(fn: Callable = fn) -> object:
            with autocast:
                return fn(params, x)
        try:
            times[name] = timed(step, device, args.repeats)
        except RuntimeError as err:  # a variant that cannot be captured or run here: said, not fatal
            print(f"| {name} | failed: {str(err).splitlines()[0][:80]} | | |")
            continue
        ms = 1000 * times[name]
        print(f"| {name} | {ms:.3f} | {k * n / times[name]:,.0f} | {times['vmap'] / times[name]:.2f}x |"
              if "vmap" in times else f"| {name} | {ms:.3f} | {k * n / times[name]:,.0f} | |", flush=True)
    print("", *checks, sep="\n")


if __name__ == "__main__":
    main()
