"""Compact Convolutional Transformer (CCT), FedBR's CIFAR-100 model.

Hassani, Walton, Shah, Abuduweili, Li, Shi. "Escaping the Big Data Paradigm
with Compact Transformers." arXiv:2104.05704 (2021). Defaults are CCT-7/3x1
(the reference code's ``cct_7_3x1_32``, github.com/SHI-Labs/Compact-Transformers,
``src/cct.py``, ``src/utils/tokenizer.py``, ``src/utils/transformers.py``),
written here in plain torch:

* convolutional tokenizer, ``conv_layers`` times: conv k x k (stride
  ``max(1, k//2 - 1)``, padding ``max(1, k//2)``, no bias; 64 channels between
  layers, ``embed_dim`` after the last), ReLU, max-pool 3 stride 2 padding 1;
  the map is flattened into ``H' * W'`` tokens (32x32 -> 16x16 = 256 tokens);
* a learnable positional embedding ``[tokens, embed_dim]``;
* ``num_layers`` encoder layers of the reference's form
  ``x = x + Attn(LN(x)); x = LN1(x); x = x + W2 GELU(W1 x)`` (attention: qkv
  without bias, ``num_heads`` heads, output projection with bias; MLP width
  ``mlp_ratio * embed_dim``);
* a final LayerNorm and sequence pooling: softmax over tokens of a linear
  score ``g(x)`` (``embed_dim -> 1``), ``z = softmax(g(x))^T x``;
* ``z`` (``embed_dim``) is the feature; the classifier is ``embed_dim -> C``.

Initialisation as the reference: linear weights truncated normal std 0.02 with
zero biases, LayerNorm 1 / 0, tokenizer convs Kaiming normal, positional
embedding truncated normal std 0.2.

Regularisation is off by default (``dropout = attention_dropout =
stochastic_depth = 0``; the reference trains with 0.1 / 0.1 / 0.1): with them
off, forward is a deterministic function of parameters and input, which the
engine's vectorised executor needs (``vmap(randomness="error")``; random ops
fall back to sequential execution) and which keeps runs reproducible from the
run's own generators (dropout would draw from torch's global RNG). The options
enable them for experiments that accept both.

Parameter count (3x32x32 inputs, defaults): tokenizer 6,912 + positional
65,536 + 7 x 526,336 + final LayerNorm 512 + pooling 257 = 3,757,569 in the
encoder; 3,760,139 with 10 classes (the paper's "3.76M" for CCT-7/3x1) and
3,783,269 with 100 (CIFAR-100, FedBR's use).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hetfl.models.base import FLModel, ModelError, check_positive_int, conv_out, image_shape
from hetfl.models.layers import Conv2d, Linear, MaxPool2d

TOKENIZER_WIDTH = 64  # channels between tokenizer convs (the reference's in_planes)


def _check_probability(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise ModelError(f"model.options.{key}", value, "must be a probability in [0, 1)")
    return float(value)


class DropPath(nn.Module):
    """Stochastic depth: zero a sample's residual branch with probability ``p`` (training only)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = 1.0 - self.p
        mask = torch.rand((x.shape[0],) + (1,) * (x.dim() - 1), dtype=x.dtype, device=x.device) < keep
        return x * mask / keep


class Attention(nn.Module):
    """Multi-head self-attention as the reference: qkv without bias, projection with bias."""

    def __init__(self, dim: int, num_heads: int, attention_dropout: float, projection_dropout: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.attn_drop = nn.Dropout(attention_dropout)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(projection_dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = self.attn_drop(torch.softmax((q @ k.transpose(-2, -1)) * self.scale, dim=-1))
        out = (attn @ v).transpose(1, 2).reshape(b, n, c)
        return self.proj_drop(self.proj(out))


class EncoderLayer(nn.Module):
    """The reference's ``TransformerEncoderLayer``: pre-norm attention, a LayerNorm on the
    residual stream, then the GELU MLP with a residual connection."""

    def __init__(
        self, dim: int, num_heads: int, mlp_dim: int, dropout: float, attention_dropout: float, drop_path: float
    ) -> None:
        super().__init__()
        self.pre_norm = nn.LayerNorm(dim)
        self.self_attn = Attention(dim, num_heads, attention_dropout, dropout)
        self.linear1 = nn.Linear(dim, mlp_dim)
        self.dropout1 = nn.Dropout(dropout)
        self.norm1 = nn.LayerNorm(dim)
        self.linear2 = nn.Linear(mlp_dim, dim)
        self.dropout2 = nn.Dropout(dropout)
        self.drop_path = DropPath(drop_path)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop_path(self.self_attn(self.pre_norm(x)))
        x = self.norm1(x)
        y = self.linear2(self.dropout1(F.gelu(self.linear1(x))))
        return x + self.drop_path(self.dropout2(y))


class CCTEncoder(nn.Module):
    """Tokenizer, positional embedding, encoder layers, final LayerNorm and sequence pooling."""

    def __init__(
        self,
        channels: int,
        tokens: int,
        *,
        embed_dim: int,
        num_layers: int,
        num_heads: int,
        mlp_dim: int,
        kernel_size: int,
        conv_layers: int,
        dropout: float,
        attention_dropout: float,
        stochastic_depth: float,
    ) -> None:
        super().__init__()
        widths = [channels] + [TOKENIZER_WIDTH] * (conv_layers - 1) + [embed_dim]
        stride, padding = max(1, kernel_size // 2 - 1), max(1, kernel_size // 2)
        convs: list[nn.Module] = []
        for cin, cout in itertools.pairwise(widths):
            conv = Conv2d(cin, cout, kernel_size, stride=stride, padding=padding, bias=False)
            nn.init.kaiming_normal_(conv.weight)
            convs += [conv, nn.ReLU(), MaxPool2d(3, stride=2, padding=1)]
        self.tokenizer = nn.Sequential(*convs)
        self.positional_emb = nn.Parameter(torch.zeros(1, tokens, embed_dim))
        nn.init.trunc_normal_(self.positional_emb, std=0.2)
        self.dropout = nn.Dropout(dropout)
        rates = [stochastic_depth * i / max(num_layers - 1, 1) for i in range(num_layers)]  # torch.linspace
        self.blocks = nn.Sequential(
            *(EncoderLayer(embed_dim, num_heads, mlp_dim, dropout, attention_dropout, r) for r in rates)
        )
        self.norm = nn.LayerNorm(embed_dim)
        self.attention_pool = nn.Linear(embed_dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.tokenizer(x).flatten(2).transpose(1, 2)  # [B, H'W', D]
        z = self.blocks(self.dropout(tokens + self.positional_emb))
        z = self.norm(z)
        weights = torch.softmax(self.attention_pool(z), dim=1)  # [B, T, 1]
        return (weights.transpose(1, 2) @ z).squeeze(1)


def tokenizer_side(size: int, kernel_size: int, conv_layers: int) -> int:
    """Side of the token map after the tokenizer's ``conv_layers`` (conv, max-pool 3/2/1) stages."""
    stride, padding = max(1, kernel_size // 2 - 1), max(1, kernel_size // 2)
    for _ in range(conv_layers):
        size = conv_out(conv_out(size, kernel_size, stride, padding), 3, 2, 1)
    return size


class CCT(FLModel):
    """CCT, by default CCT-7/3x1: 7 layers, embedding 256, 4 heads, MLP ratio 2, one 3x3 tokenizer conv."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        *,
        num_layers: int = 7,
        embed_dim: int = 256,
        num_heads: int = 4,
        mlp_ratio: float = 2.0,
        kernel_size: int = 3,
        conv_layers: int = 1,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
        stochastic_depth: float = 0.0,
    ) -> None:
        c, h, w = image_shape("cct", input_shape)
        for key, value in (
            ("num_layers", num_layers),
            ("embed_dim", embed_dim),
            ("num_heads", num_heads),
            ("kernel_size", kernel_size),
            ("conv_layers", conv_layers),
        ):
            check_positive_int(key, value)
        if embed_dim % num_heads:
            raise ModelError("model.options.num_heads", num_heads, f"must divide embed_dim ({embed_dim})")
        if isinstance(mlp_ratio, bool) or not isinstance(mlp_ratio, int | float) or not mlp_ratio > 0:
            raise ModelError("model.options.mlp_ratio", mlp_ratio, "must be a positive number")
        mlp_dim = int(embed_dim * mlp_ratio)
        if mlp_dim < 1:
            raise ModelError("model.options.mlp_ratio", mlp_ratio, f"embed_dim * mlp_ratio must be >= 1 ({embed_dim})")
        probabilities = {
            k: _check_probability(k, v)
            for k, v in (
                ("dropout", dropout),
                ("attention_dropout", attention_dropout),
                ("stochastic_depth", stochastic_depth),
            )
        }
        # padding >= kernel // 2 and the pool's padding 1 keep every side >= 1: any image size gives tokens
        th, tw = tokenizer_side(h, kernel_size, conv_layers), tokenizer_side(w, kernel_size, conv_layers)
        encoder = CCTEncoder(
            c,
            th * tw,
            embed_dim=embed_dim,
            num_layers=num_layers,
            num_heads=num_heads,
            mlp_dim=mlp_dim,
            kernel_size=kernel_size,
            conv_layers=conv_layers,
            **probabilities,
        )
        classifier = Linear(embed_dim, num_classes)
        super().__init__(encoder, classifier)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        self.tokens: int = th * tw
