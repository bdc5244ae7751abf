"""pFedHN: a server-side hypernetwork generates each client's model from its embedding.

Shamsian, Navon, Fetaya, Chechik. "Personalized Federated Learning using
Hypernetworks." ICML 2021, Algorithm 1. The server holds a
hypernetwork ``h(.; phi)`` and one embedding ``v_i`` per client (both in
``ServerState.extra``). Client i receives ``theta_i = h(v_i; phi)``, trains it
locally (the run's local epochs, lr, momentum) into ``theta_i~`` and uploads
``delta_i = theta_i~ - theta_i``. The server updates, by the chain rule
(Algorithm 1, the ``nabla_phi`` and ``nabla_v_i`` lines),

    ``grad_phi = (d theta_i / d phi)^T (theta_i - theta_i~)``,
    ``grad_v_i = (d theta_i / d v_i)^T (theta_i - theta_i~)``,

and takes one SGD step on ``phi`` (the sum of the round's clients'
gradients: the authors take one step per client update) and on each
participating ``v_i`` (its own gradient), with momentum, weight decay and
per-client gradient-norm clipping as in the authors' code. Clients are evaluated
with their generated model ``h(v_i; phi)`` (``personalized = True``).

The hypernetwork is the authors' MLP on the embedding, ``Linear(E, H)`` then
``n_hidden`` x (ReLU, ``Linear(H, H)``), giving ``r_i``. The paper then has one
linear head per target tensor (``H x numel`` weights each: 10M parameters for
a 100k-parameter MLP, 60M for the 2-conv CNN); ``chunk_size = 0`` builds
exactly that. By default (``chunk_size > 0``) each target tensor is produced in
chunks of ``chunk_size`` values instead (chunked hypernetwork, von Oswald et
al., ICLR 2020): chunk j of tensor t has a learned chunk embedding ``c_tj``
and is ``W_out relu(W_c [r_i; c_tj] + b_c) + b_out``, one output layer shared
by all chunks, so the hypernetwork stays around ``H * chunk_size`` parameters
whatever the target. Target buffers (BatchNorm statistics) are not generated:
they are averaged over the uploads into the server's model, as FedAvg.

Everything is initialised from generators derived from the run seed:
embeddings and chunk embeddings ``N(0, 1)`` (``nn.Embedding``), linear layers
``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` (``nn.Linear``).

Output scale. Initialised this way, the hypernetwork emits every target tensor
with about the same spread (RMS ~0.1), whatever the tensor's fan-in, as the
authors' per-tensor heads do: the 2-conv CNN's 1024-input layer is initialised
at RMS ~0.018, so a generated CNN starts with logits far too large. At the
authors' local lr (0.005) that is harmless; at lr 0.05 local SGD overflows
(NaN from round 1 on the 2-conv CNN, MNIST dominant split). With
``output_scale = "init"`` each generated tensor is multiplied by a constant
fixed at initialisation, ``rms(target's own init) / rms(generated at init,
over all clients)``, so every generated model starts at its architecture's
initial scale (in the spirit of hyperfan initialisation, Chang et al., ICLR
2020); zero-initialised tensors (BatchNorm biases) take their module's
weight's scale. The constants live in ``ServerState.extra`` and are not
trained. The price: a tensor scaled by ``s`` moves ``s**2`` as fast under
the same server step. Measured (2-conv CNN, MNIST dominant split, 20 clients,
10 rounds, clients' accuracy): unscaled at local lr 0.005, 69.5%; scaled at
lr 0.05, 52.2% (unscaled: NaN); scaled at lr 0.005, 19.0%. Default ``"none"``
(the paper's hypernetwork); ``"init"`` lets pFedHN run at a larger shared
local lr.

Departures from the paper/code: by default each target tensor is produced in
chunks (``chunk_size = 4096``, hetfl's choice) instead of one linear head per
tensor (``chunk_size = 0``); the phi update sums a round's clients' gradients
into one step (the code takes one step per client); only the participating
clients' embeddings take a step (the code's optimiser holds all embeddings, so
momentum and weight decay also move those of clients not in the round).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hetfl.algorithms.base import Algorithm, ClientContext, ServerState, Setup, Tensors, Upload, weighted_mean
from hetfl.params import FLOAT32_MAX, above, setting
from hetfl.rng import torch_generator

HN = "pfedhn.hn/"  # server: hypernetwork tensors
MOMENTUM = "pfedhn.momentum/"  # server: their momentum buffers
EMBED, EMBED_MOMENTUM = "pfedhn.embed", "pfedhn.embed_momentum"  # server: [N, E] client embeddings
SCALE = "pfedhn.scale/"  # server: fixed output scale of each generated tensor (output_scale = "init")
DELTA = "pfedhn.delta/"  # upload: theta_local - theta_generated
STREAM = 0x48594E  # "HYN": keeps pFedHN's initialisation draws apart from other methods'


@dataclass(frozen=True)
class PFedHNHyper:
    """pFedHN settings (Shamsian et al. 2021; defaults from the authors' code unless said).

    embed_dim: client embedding size; 0 (default) means ``1 + num_clients / 4``,
        the authors' automatic size.
    hidden: H, width of the hypernetwork MLP (100).
    n_hidden: hidden (ReLU, Linear(H, H)) blocks after the first layer (3).
    chunk_size: values per generated chunk (4096; hetfl's choice, keeps the
        hypernetwork near 0.5M parameters for any model); 0 means one linear
        head per target tensor, as in the paper.
    chunk_embed_dim: size of the chunk embeddings (16; hetfl's choice).
    server_lr: step size of the hypernetwork update (0.01).
    embed_lr: step size of the embeddings; 0 means ``server_lr`` (as the code).
    server_momentum: SGD momentum of the server update (0.9).
    server_weight_decay: weight decay of the server update (1e-3).
    max_grad_norm: clip the server gradient's norm (50; 0 = off).
    output_scale: "none" (default, the paper) or "init": each generated tensor
        scaled to its target's initial RMS (hetfl's option; see the module doc).
    """

    embed_dim: int = setting(0, ge=0, doc="client embedding size (0 = 1 + num_clients/4)")
    hidden: int = setting(100, ge=1, doc="hypernetwork width")
    n_hidden: int = setting(3, ge=0, doc="hidden blocks of the hypernetwork MLP")
    chunk_size: int = setting(4096, ge=0, doc="values per generated chunk (0 = one head per tensor)")
    chunk_embed_dim: int = setting(16, when={"chunk_size": above(0)}, ge=1, doc="chunk embedding size")
    server_lr: float = setting(0.01, gt=0.0, lt=FLOAT32_MAX, doc="hypernetwork step size")
    embed_lr: float = setting(0.0, ge=0.0, lt=FLOAT32_MAX, doc="embedding step size (0 = server_lr)")
    server_momentum: float = setting(0.9, ge=0.0, lt=1.0, doc="server SGD momentum")
    server_weight_decay: float = setting(1e-3, ge=0.0, lt=FLOAT32_MAX, doc="server SGD weight decay")
    max_grad_norm: float = setting(50.0, ge=0.0, doc="clip the server gradient norm (0 = off)")
    output_scale: str = setting("none", choices=("none", "init"),
                                doc="scale each generated tensor to its target's initial RMS (init: stable at a "
                                    "larger local lr, learns slower) or not (none, the paper)")


def linear_init(out_features: int, in_features: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``nn.Linear``'s default initialisation, ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, from ``gen``."""
    bound = 1.0 / math.sqrt(in_features)
    weight = (torch.rand(out_features, in_features, generator=gen) * 2 - 1) * bound
    bias = (torch.rand(out_features, generator=gen) * 2 - 1) * bound
    return weight, bias


class PFedHN(Algorithm):
    name = "pfedhn"
    Hyper = PFedHNHyper
    citation = "Shamsian et al., ICML 2021"
    personalized = True

    def __init__(self, hyper: PFedHNHyper, setup: Setup) -> None:
        super().__init__(hyper, setup)
        module = setup.model.module
        # the target's layout (static, from the model): what the hypernetwork generates
        self.shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
        self.embed_dim = hyper.embed_dim or int(1 + setup.num_clients / 4)
        size = hyper.chunk_size
        self.chunks = {n: math.ceil(math.prod(s) / size) if size else 0 for n, s in self.shapes.items()}
        self.target_rms = {n: float(p.detach().float().pow(2).mean().sqrt()) for n, p in module.named_parameters()}

    def memory_needs(self, input_shape: tuple[int, ...], feature_dim: int) -> list[tuple[str, Any, int, str]]:
        """The hypernetwork (float32, with its momentum and one round's summed gradient: 3 copies), each part
        under the key that sizes it: the first layer and the clients' embeddings (``embed_dim``), the hidden
        blocks (``n_hidden`` x ``hidden`` x ``hidden``, named by the one further from its default), the chunk
        embeddings (``chunk_embed_dim``) and the output layer (``chunk_size``, or one head per target tensor)."""
        hp, h, copies, what = self.hp, self.hp.hidden, 3 * 4, "pFedHN's hypernetwork"
        blocks = ("algorithm.hidden", h) if h / 100 >= hp.n_hidden / 3 else ("algorithm.n_hidden", hp.n_hidden)
        first = (self.embed_dim + 1) * h + self.setup.num_clients * self.embed_dim
        needs = [("algorithm.embed_dim", self.embed_dim, copies * first, what + "'s first layer and client embeddings"),
                 (*blocks, copies * hp.n_hidden * (h + 1) * h, what + "'s hidden blocks")]
        if hp.chunk_size:
            chunks = sum(self.chunks.values())
            needs += [("algorithm.chunk_embed_dim", hp.chunk_embed_dim,
                       copies * (chunks + h) * hp.chunk_embed_dim, what + "'s chunk embeddings"),
                      ("algorithm.chunk_size", hp.chunk_size, copies * (h + 1) * (hp.chunk_size + h),
                       what + "'s output layer")]
        else:
            heads = sum((h + 1) * math.prod(shape) for shape in self.shapes.values())
            needs.append(("algorithm.hidden", h, copies * heads, what + "'s output heads"))
        return needs

    # ------------------------------------------------------- hypernetwork
    def init_hypernetwork(self, device: torch.device) -> Tensors:
        gen = torch_generator(self.setup.seed, "init", STREAM)
        hp, h = self.hp, self.hp.hidden
        net: Tensors = {}
        width = self.embed_dim
        for i in range(hp.n_hidden + 1):
            net[f"body.{i}.weight"], net[f"body.{i}.bias"] = linear_init(h, width, gen)
            width = h
        if hp.chunk_size:
            total = sum(self.chunks.values())
            net["chunks"] = torch.randn(total, hp.chunk_embed_dim, generator=gen)
            net["chunk.weight"], net["chunk.bias"] = linear_init(h, h + hp.chunk_embed_dim, gen)
            net["out.weight"], net["out.bias"] = linear_init(hp.chunk_size, h, gen)
        else:
            for n, shape in self.shapes.items():
                net[f"head.{n}.weight"], net[f"head.{n}.bias"] = linear_init(math.prod(shape), h, gen)
        embed = torch.randn(self.setup.num_clients, self.embed_dim, generator=gen)
        scales = self.output_scales(net, embed) if hp.output_scale == "init" else {}
        return {**{HN + k: v.to(device) for k, v in net.items()}, EMBED: embed.to(device),
                **{SCALE + n: v.to(device) for n, v in scales.items()}}

    def output_scales(self, net: Tensors, embed: torch.Tensor) -> Tensors:
        """Per target tensor, ``rms(target init) / rms(generated at init)`` (over all clients);
        a zero-initialised tensor takes its module's weight's scale (else 1)."""
        with torch.no_grad():
            generated = [self.generate(net, e) for e in embed]
        scales: dict[str, float] = {}
        for n in self.shapes:
            rms = math.sqrt(sum(float(g[n].pow(2).mean()) for g in generated) / len(generated))
            if self.target_rms[n] > 0 and rms > 0:
                scales[n] = self.target_rms[n] / rms
        for n in self.shapes:
            if n not in scales:
                scales[n] = scales.get(n.rsplit(".", 1)[0] + ".weight", 1.0)
        return {n: torch.tensor(v) for n, v in scales.items()}

    def generate(self, net: Tensors, embedding: torch.Tensor, scales: Tensors | None = None) -> Tensors:
        """Target parameters ``h(v; phi)`` from hypernetwork tensors ``net`` (names without prefix),
        each multiplied by its output scale when ``scales`` has one."""
        raw = self.generate_raw(net, embedding)
        if not scales:
            return raw
        return {n: t * scales[n] for n, t in raw.items()}

    def generate_raw(self, net: Tensors, embedding: torch.Tensor) -> Tensors:
        """``h(v; phi)`` before the output scale."""
        r = embedding
        for i in range(self.hp.n_hidden + 1):
            r = F.linear(r, net[f"body.{i}.weight"], net[f"body.{i}.bias"])
            if i < self.hp.n_hidden:
                r = F.relu(r)
        if not self.hp.chunk_size:
            return {n: F.linear(r, net[f"head.{n}.weight"], net[f"head.{n}.bias"]).view(shape)
                    for n, shape in self.shapes.items()}
        chunks = net["chunks"]
        inputs = torch.cat([r.expand(len(chunks), -1), chunks], dim=1)
        flat = F.linear(F.relu(F.linear(inputs, net["chunk.weight"], net["chunk.bias"])), net["out.weight"],
                        net["out.bias"])  # [total chunks, chunk_size]
        out, start = {}, 0
        for n, shape in self.shapes.items():
            k = self.chunks[n]
            out[n] = flat[start:start + k].reshape(-1)[: math.prod(shape)].view(shape)
            start += k
        return out

    def hypernetwork(self, server: ServerState) -> Tensors:
        return {k.removeprefix(HN): v for k, v in server.extra.items() if k.startswith(HN)}

    def scales(self, server: ServerState) -> Tensors:
        return {k.removeprefix(SCALE): v for k, v in server.extra.items() if k.startswith(SCALE)}

    def generated_model(self, server: ServerState, client_id: int) -> Tensors:
        """Client ``client_id``'s target model: generated parameters, the server's buffers."""
        with torch.no_grad():
            params = self.generate(self.hypernetwork(server), server.extra[EMBED][client_id], self.scales(server))
        return {**{n: server.model[n] for n in self.model.buffer_names}, **params}

    def gradients(self, server: ServerState, upload: Upload) -> tuple[Tensors, torch.Tensor]:
        """(grad phi, grad v_i) = (d theta_i / d (phi, v_i))^T (theta_generated - theta_local)."""
        net = {k: t.detach().requires_grad_() for k, t in self.hypernetwork(server).items()}
        embedding = server.extra[EMBED][upload.client_id].detach().requires_grad_()
        with torch.enable_grad():
            theta = self.generate(net, embedding, self.scales(server))
            names = list(self.shapes)
            grads = torch.autograd.grad([theta[n] for n in names], [*net.values(), embedding],
                                        grad_outputs=[-upload.tensors[DELTA + n] for n in names])
        return dict(zip(net, grads[:-1], strict=True)), grads[-1]

    # --------------------------------------------------------------- server
    def init_server(self, model_state: Tensors) -> ServerState:
        device = model_state[self.model.param_names[0]].device
        return ServerState(model=model_state, extra=self.init_hypernetwork(device))

    def payload(self, server: ServerState, client_id: int) -> Tensors:
        return self.generated_model(server, client_id)

    def aggregate(self, server: ServerState, uploads: list[Upload], round: int) -> ServerState:
        """One server SGD step: phi on the sum of the clients' gradients, each v_i on its own.

        The authors take one hypernetwork step per client update; summing the
        round's gradients (each clipped as in their code) keeps that step size
        per client update whatever the number of clients per round.
        """
        hp = self.hp
        shared: Tensors = {}
        embed_grads: dict[int, torch.Tensor] = {}
        for u in uploads:
            g_net, g_embed = self.gradients(server, u)
            if hp.max_grad_norm > 0:
                norm = torch.sqrt(sum((g**2).sum() for g in [*g_net.values(), g_embed]))
                scale = torch.clamp(hp.max_grad_norm / (norm + 1e-6), max=1.0)
                g_net, g_embed = {k: g * scale for k, g in g_net.items()}, g_embed * scale
            for k, g in g_net.items():
                shared[k] = shared[k] + g if k in shared else g
            embed_grads[u.client_id] = g_embed
        extra = dict(server.extra)
        for k, g in shared.items():
            p = extra[HN + k]
            buf = hp.server_momentum * extra.get(MOMENTUM + k, torch.zeros_like(p)) + g + hp.server_weight_decay * p
            extra[MOMENTUM + k], extra[HN + k] = buf, p - hp.server_lr * buf
        embed = extra[EMBED].clone()
        momentum = extra.get(EMBED_MOMENTUM, torch.zeros_like(embed)).clone()
        for c, g in embed_grads.items():
            momentum[c] = hp.server_momentum * momentum[c] + g + hp.server_weight_decay * embed[c]
            embed[c] = embed[c] - (hp.embed_lr or hp.server_lr) * momentum[c]
        extra[EMBED], extra[EMBED_MOMENTUM] = embed, momentum
        model = dict(server.model)
        if self.model.buffer_names:
            buffers = weighted_mean([{n: u.tensors[n] for n in self.model.buffer_names} for u in uploads],
                                    self.client_weights(uploads))
            model.update(buffers)
        return ServerState(model=model, extra=extra)

    # --------------------------------------------------------------- client
    def finish(self, ctx: ClientContext, local: Tensors, steps: int) -> tuple[Tensors, Tensors]:
        upload = {DELTA + n: local[n] - ctx.payload[n] for n in self.model.param_names}
        upload.update({n: local[n] for n in self.model.buffer_names})
        return upload, ctx.state

    # ----------------------------------------------------------- evaluation
    def client_model(self, server: ServerState, client_state: Tensors, client_id: int) -> Tensors:
        return self.generated_model(server, client_id)
