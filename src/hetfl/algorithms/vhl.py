"""VHL: Virtual Homogeneity Learning, a shared labelled virtual dataset calibrating local features.

Tang, Zhang, Shi, He, Chu, Li. "Virtual Homogeneity Learning: Defending against
Data Heterogeneity in Federated Learning." ICML 2022, the method section
(section and equation numbers not checked against the PDF; details from the
authors' code, github.com/wizard1203/VHL, ``VHL_alignNoiseContrast.sh`` and
``loss_fn/losses.py``). Every client trains on its real batch plus a batch of a
virtual dataset that is the same for every client (so the clients' data become
"virtually homogeneous"), with the local loss

    ``CE(real) + alpha CE(virtual) + w_align L_SC([f(x); sg(f(x_v))], [y; y_v]) + w_virt L_SC(f(x_v), y_v)``:

- labels: virtual class c is an *extra* class, ``C + c`` (the code's
  ``VHL_label_style = "extra"``): the cross-entropy runs over ``C + C_v``
  outputs, the model's C plus a virtual classifier ``vhl.classifier.*`` (a
  method tensor averaged with the model); evaluation uses the model's C
  outputs only (the code's ``VHL_shift_test``). ``labels = "shared"`` gives
  virtual class c the real label c instead (no extra outputs).
- feature calibration: the supervised contrastive loss ``L_SC`` (Khosla et al.,
  NeurIPS 2020, eq. 2, "out" form, one view) over the L2-normalised
  classifier-input features of the real and the virtual batch, a virtual
  sample of class c counting as the same class as a real sample of class c
  (the code's ``VHL_class_match``): it pulls real features of class c towards
  the virtual features of class c and away from other classes. The virtual
  features are detached in this term (``VHL_feat_detach``), so the virtual
  data act as fixed anchors; a second ``L_SC`` over the virtual features alone
  (weight 0.1, ``VHL_noise_contrastive``) keeps the virtual classes apart.
  Temperature 0.07 (the code's temperature and base temperature, whose ratio
  ``T / T_base`` multiplies the loss, is 1 here); anchors without a positive
  contribute 0 to the mean, as in the code. Real and virtual batch go through
  the model in one forward pass (BatchNorm statistics see both).

The virtual dataset. The paper samples it from an untrained (randomly
initialised) StyleGAN-v2, each class from its own Gaussian in latent space,
and the server shares it (or the generator) with the clients. hetfl uses a
lighter untrained generator from the same family, generated identically on
every client from the run seed (``method_generator(seed, "vhl.*")``), so no
bytes are sent (the paper's server would send the generator or its seed once):

- class c has a latent mean ``m_c ~ N(0, I_64)``; a sample is
  ``G(m_c + 0.3 eps)``, ``eps ~ N(0, I)`` (0.3: the code's
  ``style_gan_sample_z_std``; means drawn with unit spread, wider than the
  code's 0.3, so that the classes are separable without StyleGAN's per-class
  noise inputs);
- ``G`` for image inputs ``[ch, H, W]``: a linear map to 32 x 4 x 4, then
  (nearest 2x upsampling, 3x3 conv, LeakyReLU 0.2) until the size reaches H,
  a 3x3 conv to ``ch`` channels, tanh, bilinear resizing to ``H x W``; for
  vector inputs ``[D]``: ``64 -> 128 -> D`` with LeakyReLU, tanh. Weights
  ``N(0, 2 / fan_in)`` (He), biases 0, never trained;
- each input channel (feature, for vectors) is standardised over the whole
  virtual set (the code normalises virtual images with their own mean/std);
- ``num_virtual`` samples in all (2000, FedBR's Table 2 setting), split equally
  over ``C_v = C`` classes (``num_virtual // C`` each).

FedBR's code runs its own "VHL" baseline (``fedbr/algorithms.py`` ``VHL``) otherwise: the
contrastive terms on the *logits* (``self.predict``), not the features; the virtual
cross-entropy in the real label space (C outputs); and its class matching subtracts C
from virtual labels that are already in ``[0, C)`` (the generated set's folder
indices), so no real-virtual pair counts as positive. hetfl follows VHL's own code
(features, ``"extra"``; ``labels = "shared"`` gives FedBR's label space).

The virtual dataset is a constant of the run, so it is generated once per process and kept in the datasets'
cache (``data.cache_dir``, an entry ``vhl-virtual-<digest>`` keyed by the seed, the shape, the class
counts and the generator: its source text and its values on two small probes): a process that finds it
there reads it instead (the same tensor to the bit), so a Flower deployment, which starts a process for
every message, generates it once per machine, not once per client and round (about 3 s for 2,000
CIFAR-shaped samples, 30 s for 20,000, on a development CPU).

Each step draws ``virtual_batch`` virtual samples (0 = the real batch's size)
uniformly with replacement: the indices come from the executor's per-client
random stream (``Stage.draws``), the loss never draws. The server is FedAvg.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hetfl.algorithms.base import (
    Algorithm,
    Batch,
    ClientContext,
    DrawFn,
    ServerState,
    Setup,
    Stage,
    Tensors,
    cross_entropy,
)
from hetfl.algorithms.dann import init_mlp
from hetfl.data.datasets.cache import cached, resolve_cache_dir
from hetfl.params import ConfigError, setting
from hetfl.rng import method_generator

VIRTUAL_X, VIRTUAL_Y = "vhl.x", "vhl.y"  # extras: the virtual dataset (the same tensors for every client)
PICK = "vhl.pick"  # draws: indices of this step's virtual batch
HEAD = "vhl.classifier."  # the virtual classes' classifier rows (labels = "extra")
LATENT, CHANNELS, BASE, LATENT_STD = 64, 32, 4, 0.3
PROBES = ((3,), (1, 6, 5))  # generator_digest's probe shapes: the vector generator, the image one with a resize
GENERATE_CHUNK = 512  # virtual samples through the generator at once (32x32: about 16 MB per activation)


def _he(shape: tuple[int, ...], fan_in: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * math.sqrt(2.0 / fan_in)


def generate_virtual(
    seed: int, input_shape: tuple[int, ...], num_classes: int, per_class: int, chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The virtual dataset ``(x [num_classes * per_class, *input_shape], y)`` from an untrained
    generator and per-class latent Gaussians, all drawn from ``seed`` (float32, CPU; samples
    ordered by class).

    The draws come first (the class means, the latents, then each layer's weights, in that order); the
    layers then run ``chunk_size`` samples at a time (default :data:`GENERATE_CHUNK`), so the host memory
    the generator's activations take does not grow with the set (20,000 CIFAR-shaped samples in one pass:
    a 7.9 GB peak for a 245 MB result); the set is standardised as a whole afterwards."""
    chunk_size = GENERATE_CHUNK if chunk_size is None else chunk_size
    if chunk_size < 1:
        raise ValueError(f"generate_virtual: chunk_size = {chunk_size}; must be at least 1")
    gen = method_generator(seed, "vhl.generator")
    means = torch.randn(num_classes, LATENT, generator=gen)
    labels = torch.arange(num_classes).repeat_interleave(per_class)
    z = means[labels] + LATENT_STD * torch.randn(len(labels), LATENT, generator=gen)
    if len(input_shape) == 1:
        (dim,) = input_shape
        hidden, out = _he((LATENT, 128), LATENT, gen), _he((128, dim), 128, gen)

        def layers(zs: torch.Tensor) -> torch.Tensor:
            return torch.tanh(F.leaky_relu(zs @ hidden, 0.2) @ out)
    elif len(input_shape) == 3:
        ch, height, width = input_shape
        project = _he((LATENT, CHANNELS * BASE * BASE), LATENT, gen)
        upsampling, size = [], BASE
        while size < max(height, width):
            upsampling.append(_he((CHANNELS, CHANNELS, 3, 3), CHANNELS * 9, gen))
            size *= 2
        to_image = _he((ch, CHANNELS, 3, 3), CHANNELS * 9, gen)

        def layers(zs: torch.Tensor) -> torch.Tensor:
            h = F.leaky_relu((zs @ project).view(-1, CHANNELS, BASE, BASE), 0.2)
            for weight in upsampling:
                h = F.interpolate(h, scale_factor=2, mode="nearest")
                h = F.leaky_relu(F.conv2d(h, weight, padding=1), 0.2)
            h = torch.tanh(F.conv2d(h, to_image, padding=1))
            return F.interpolate(h, size=(height, width), mode="bilinear", align_corners=False)
    else:
        raise ValueError(f"vhl: no virtual data generator for inputs of shape {tuple(input_shape)}")
    x = torch.empty(len(labels), *input_shape)
    for start, zs in zip(range(0, len(labels), chunk_size), z.split(chunk_size), strict=True):
        x[start : start + len(zs)] = layers(zs)
    dims = [0, *range(2, x.dim())]
    mean, std = x.mean(dim=dims, keepdim=True), x.std(dim=dims, keepdim=True).clamp(min=1e-6)
    return x.sub_(mean).div_(std), labels  # in place: one copy of the set in memory


def generator_digest() -> str:
    """A digest of the code that draws the virtual set: its source text and constants, and what it computes on
    two small probes (a vector and an image shape), so that an edit of the generator, or a patched one under a
    mutation tool, never reads a set another generator stored."""
    parts = [repr((LATENT, CHANNELS, BASE, LATENT_STD))]
    for function in (_he, generate_virtual):
        try:
            parts.append(inspect.getsource(function))
        except (OSError, TypeError):  # no source files (a frozen install): the function's bytecode
            parts.append(function.__code__.co_code.hex())
    digest = hashlib.sha256("\0".join(parts).encode())
    for shape in PROBES:
        x, y = generate_virtual(0, shape, 2, 2)
        digest.update(x.numpy().tobytes())
        digest.update(y.numpy().tobytes())
    return digest.hexdigest()[:16]


def cached_virtual(
    seed: int, input_shape: tuple[int, ...], num_classes: int, per_class: int, cache_dir: str = ""
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`generate_virtual`'s set, read from the datasets' cache folder (``data.cache_dir``, '' = the
    default) when an earlier process stored it there, else generated and stored (an unwritable cache only
    costs the next process the generation)."""
    key = {"dataset": "vhl-virtual", "seed": seed, "input_shape": list(input_shape), "num_classes": num_classes,
           "per_class": per_class, "generator": generator_digest()}

    def build() -> dict[str, Any]:
        x, y = generate_virtual(seed, input_shape, num_classes, per_class)
        return {"x": x.numpy(), "y": y.numpy()}

    arrays = cached(resolve_cache_dir(cache_dir), key, build)
    return torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"])


def supervised_contrastive_loss(features: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """Khosla et al.'s ``L^sup_out`` with one view, as VHL's code computes it: for each anchor i
    (rows of the L2-normalised ``features``), ``-mean_{p in P(i)} log(exp(z_i.z_p / T) /
    sum_{a != i} exp(z_i.z_a / T))`` with ``P(i)`` the other samples of i's class; averaged
    over all anchors, an anchor without positives counting 0 (0 for fewer than 2 samples)."""
    if len(features) < 2:  # decided on the static shape: no pair, no loss (vmappable)
        return features.sum() * 0.0
    z = F.normalize(features, dim=1)
    sim = z @ z.T / temperature
    eye = torch.eye(len(z), dtype=torch.bool, device=z.device)
    others = torch.where(eye, torch.full_like(sim, -1e9), sim)  # finite: no inf - inf in the backward pass
    log_prob = sim - torch.logsumexp(others, dim=1, keepdim=True)
    positive = ((labels.unsqueeze(0) == labels.unsqueeze(1)) & ~eye).to(sim.dtype)
    mean_log_prob = (positive * log_prob).sum(1) / positive.sum(1).clamp(min=1.0)
    return -mean_log_prob.mean()


def pick_draws(num_virtual: int, virtual_batch: int) -> DrawFn:
    """Per-step draws: ``virtual_batch`` (0 = the real batch size) uniform indices into the virtual set."""

    def draw(generator: torch.Generator, batch_size: int) -> Tensors:
        return {PICK: torch.randint(0, num_virtual, (virtual_batch or batch_size,), generator=generator)}

    return draw


@dataclass(frozen=True)
class VHLHyper:
    """VHL settings (Tang et al. 2022; defaults from the authors' VHL_alignNoiseContrast.sh).

    num_virtual: size of the virtual dataset (2000, FedBR's Table 2; split equally over classes).
    virtual_batch: virtual samples per step (0 = the real batch's size).
    alpha: weight of the virtual data's cross-entropy (1.0, ``VHL_alpha``).
    align_weight: weight of the real-virtual supervised contrastive term (1.0).
    virtual_weight: weight of the virtual-only supervised contrastive term (0.1).
    temperature: of the supervised contrastive loss (0.07).
    labels: "extra" (virtual classes are C more outputs, the paper's) or
        "shared" (virtual class c labelled c).
    """

    num_virtual: int = setting(2000, ge=1, doc="virtual samples in all")
    virtual_batch: int = setting(0, ge=0, doc="virtual samples per step (0 = batch size)")
    alpha: float = setting(1.0, ge=0.0, doc="weight of the virtual cross-entropy")
    align_weight: float = setting(1.0, ge=0.0, doc="weight of the real-virtual contrastive term")
    virtual_weight: float = setting(0.1, ge=0.0, doc="weight of the virtual-only contrastive term")
    temperature: float = setting(0.07, gt=0.0, doc="supervised contrastive temperature")
    labels: str = setting("extra", choices=("extra", "shared"), doc="label space of the virtual data")


class VHL(Algorithm):
    name = "vhl"
    Hyper = VHLHyper
    citation = "Tang et al., ICML 2022"

    def __init__(self, hyper: VHLHyper, setup: Setup) -> None:
        super().__init__(hyper, setup)
        if hyper.num_virtual < setup.num_classes:
            raise ConfigError("algorithm.num_virtual", hyper.num_virtual,
                              f"must be >= the number of classes ({setup.num_classes})")
        # the virtual dataset, a constant of the run (seed and input shape): generated once,
        # from the first client's inputs, and the same tensor objects for every client after
        self._virtual: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def extra(self) -> bool:
        return self.hp.labels == "extra"

    def memory_needs(self, input_shape: tuple[int, ...], feature_dim: int) -> list[tuple[str, Any, int, str]]:
        """The virtual dataset (``num_virtual`` float32 inputs, generated then kept: 2 copies) and a step's
        virtual batch gathered from it (with its augmented copy)."""
        size = 4 * math.prod(input_shape)
        batch = self.hp.virtual_batch or self.setup.train.batch_size
        return [("algorithm.num_virtual", self.hp.num_virtual, 2 * size * self.hp.num_virtual,
                 f"VHL's virtual dataset ({self.hp.num_virtual:,} samples)"),
                ("algorithm.virtual_batch", self.hp.virtual_batch, 2 * size * batch,
                 f"VHL's virtual batch of {batch:,} samples")]

    def head_names(self) -> tuple[str, ...]:
        if not self.extra:
            return ()
        names = [HEAD + "weight"]
        if "classifier.bias" in self.model.state_names:
            names.append(HEAD + "bias")
        return tuple(names)

    def virtual_data(self, ctx: ClientContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The virtual dataset, shaped like the client's inputs (generated on the first call)."""
        if self._virtual is None:
            if ctx.inputs is None:
                raise ValueError("vhl needs the client's inputs (ClientContext.inputs) to shape the virtual data")
            like = ctx.inputs().x
            c = self.setup.num_classes
            x, y = cached_virtual(self.setup.seed, tuple(like.shape[1:]), c, self.hp.num_virtual // c,
                                  self.setup.cache_dir)
            self._virtual = (x.to(dtype=like.dtype, device=like.device), y.to(like.device))
        return self._virtual

    # ------------------------------------------------------------------ server
    def init_server(self, model_state: Tensors) -> ServerState:
        if not self.extra:
            return ServerState(model=model_state)
        classifier = model_state["classifier.weight"]
        gen = method_generator(self.setup.seed, "vhl.classifier")
        rows = init_mlp([classifier.shape[1], self.setup.num_classes], HEAD, gen, classifier.dtype, classifier.device)
        head = {HEAD + "weight": rows[HEAD + "0.weight"], HEAD + "bias": rows[HEAD + "0.bias"]}
        return ServerState(model={**model_state, **{n: head[n] for n in self.head_names()}})

    # ------------------------------------------------------------------ client
    def begin(self, ctx: ClientContext) -> Tensors:
        x, y = self.virtual_data(ctx)
        return {VIRTUAL_X: x, VIRTUAL_Y: y}

    def start_state(self, ctx: ClientContext) -> Tensors:
        return {name: ctx.payload[name] for name in (*self.model.state_names, *self.head_names())}

    def trainable_names(self) -> tuple[str, ...]:
        return (*self.model.param_names, *self.head_names())

    def loss(self, state: Tensors, batch: Batch, ctx: ClientContext) -> tuple[torch.Tensor, Tensors]:
        pick = batch.draws[PICK]
        x_v, y_v = ctx.extras[VIRTUAL_X][pick], ctx.extras[VIRTUAL_Y][pick]
        n = len(batch.y)
        z_all, logits_all = self.model.features_and_logits(state, torch.cat([batch.x, x_v]))
        if self.extra:
            virtual_logits = F.linear(z_all, state[HEAD + "weight"], state.get(HEAD + "bias"))
            logits_all = torch.cat([logits_all, virtual_logits], dim=1)
            target_v = y_v + self.setup.num_classes
        else:
            target_v = y_v
        z, z_v = z_all[:n], z_all[n:]
        ce = cross_entropy(logits_all[:n], batch.y)
        ce_v = cross_entropy(logits_all[n:], target_v)
        align = supervised_contrastive_loss(torch.cat([z, z_v.detach()]), torch.cat([batch.y, y_v]),
                                            self.hp.temperature)
        loss = ce + self.hp.alpha * ce_v + self.hp.align_weight * align
        metrics = {"ce": ce.detach(), "virtual_ce": ce_v.detach(), "align": align.detach()}
        if self.hp.virtual_weight > 0:
            virt = supervised_contrastive_loss(z_v, y_v, self.hp.temperature)
            loss = loss + self.hp.virtual_weight * virt
            metrics["virtual_contrast"] = virt.detach()
        return loss, metrics

    def stages(self, ctx: ClientContext) -> list[Stage]:
        total = self.setup.num_classes * (self.hp.num_virtual // self.setup.num_classes)
        draws = pick_draws(total, self.hp.virtual_batch)
        return [dataclasses.replace(stage, draws=draws) for stage in super().stages(ctx)]

    def finish(self, ctx: ClientContext, local: Tensors, steps: int) -> tuple[Tensors, Tensors]:
        return {name: local[name] for name in (*self.model.state_names, *self.head_names())}, ctx.state
