"""Reference models written as users write them (not an ``nn.Sequential``): split on their layer graph.

    # B: batch, T: time (sequence), C: channels (width), V: vocabulary, H: heads

``partition(model, p, sample)`` traces each of these (``pipeline.runtime.trace.tracing``) and cuts the
graph of its calls; what crosses a cut is every tensor live there:

    gpt_tied     token + position embeddings, a ModuleList of blocks called in a loop (each with
                 its residuals), final norm, and an LM head whose weight IS the token embedding's:
                 a tied weight that the first and the last stage both hold
    unet         an encoder that keeps each resolution's features for the decoder: long skips,
                 so a cut in the middle carries every skip still open
    two_stream   blocks that take and return two tensors (a, b), mixing them

Each builder returns the model and a sample (one micro-batch); ``gpt_loss`` (models.py) is the
GPT's loss, ``image_loss`` the U-Net's, ``F.cross_entropy`` the two-stream classifier's. No
BatchNorm: its statistics depend on the micro-batch, so no split run could equal one process.
Tensors a ``forward`` makes are made on its input's device.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.reference.models import Block

__all__ = ["DualBlock", "TiedGPT", "TwoStream", "UNet", "gpt_tied", "image_loss", "two_stream", "unet"]


class _Embedding(nn.Embedding):
    """GPT-2's initialisation, N(0, 0.02): with the head tied to it, the default N(0, 1) makes the
    first logits ~ sqrt(width) wide and the first loss ~ 60 nats. ``reset_parameters`` (not an init
    call in ``TiedGPT.__init__``) so that a model materialised from the meta device gets it too."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class TiedGPT(nn.Module):
    """(B, T) int64 -> (B, T, V) logits; ``head.weight`` is ``tok.weight``."""

    def __init__(self, vocab_size: int, width: int, n_layers: int, n_heads: int, max_seq_len: int) -> None:
        super().__init__()
        self.tok = _Embedding(vocab_size, width)
        self.pos = _Embedding(max_seq_len, width)
        self.blocks = nn.ModuleList([Block(width, n_heads) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied: one Parameter, two modules

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.pos.num_embeddings:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {self.pos.num_embeddings}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)  # x + attention(x), then x + mlp(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def gpt_tied(
    vocab_size: int = 96,
    width: int = 128,
    n_layers: int = 4,
    n_heads: int = 4,
    max_seq_len: int = 128,
    batch_size: int = 8,
) -> tuple[TiedGPT, torch.Tensor]:
    """The tied GPT and a sample of (batch_size, max_seq_len) token ids."""
    model = TiedGPT(vocab_size, width, n_layers, n_heads, max_seq_len)
    return model, torch.randint(0, vocab_size, (batch_size, max_seq_len))


def _conv(c_in: int, c_out: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1), nn.GroupNorm(1, c_out), nn.SiLU()
    )


class UNet(nn.Module):
    """(B, C_in, H, W) -> (B, C_in, H, W): halve the resolution ``len(widths) - 1`` times, then
    double it back, each decoder stage concatenating the encoder's features of its resolution."""

    def __init__(self, in_channels: int, widths: tuple[int, ...]) -> None:
        super().__init__()
        self.stem = _conv(in_channels, widths[0])
        self.down = nn.ModuleList([_conv(a, b, stride=2) for a, b in itertools.pairwise(widths)])
        self.middle = _conv(widths[-1], widths[-1])
        ups = list(zip(widths[:0:-1], widths[-2::-1], strict=True))  # (from, to) widths, deepest first
        self.up = nn.ModuleList([_conv(a + b, b) for a, b in ups])
        self.out = nn.Conv2d(widths[0], in_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        skips = []
        for down in self.down:
            skips.append(h)  # kept until the decoder comes back to this resolution
            h = down(h)
        h = self.middle(h)
        for up in self.up:
            h = F.interpolate(h, scale_factor=2.0, mode="nearest")
            h = up(torch.cat([h, skips.pop()], dim=1))
        out: torch.Tensor = self.out(h) + x  # the longest skip: the input itself
        return out


def unet(
    in_channels: int = 3, widths: tuple[int, ...] = (8, 16, 32), image_size: int = 32, batch_size: int = 8
) -> tuple[UNet, torch.Tensor]:
    """The U-Net and a sample of (batch_size, in_channels, image_size, image_size) images."""
    return UNet(in_channels, widths), torch.randn(batch_size, in_channels, image_size, image_size)


def image_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error between images."""
    return F.mse_loss(out.float(), target.float())


class DualBlock(nn.Module):
    """(a, b) -> (a + f(b), b + g(a + f(b))): two streams, each updated from the other."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
        self.g = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = a + self.f(b)
        return a, b + self.g(a)


class TwoStream(nn.Module):
    """(B, in) -> (B, classes): two projections of the input through ``DualBlock``s, then joined."""

    def __init__(self, in_features: int, width: int, depth: int, n_classes: int) -> None:
        super().__init__()
        self.into_a = nn.Linear(in_features, width)
        self.into_b = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList([DualBlock(width) for _ in range(depth)])
        self.head = nn.Linear(2 * width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.into_a(x), self.into_b(x)
        for block in self.blocks:
            a, b = block(a, b)
        logits: torch.Tensor = self.head(torch.cat([a, b], dim=-1))
        return logits


def two_stream(
    in_features: int = 32, width: int = 64, depth: int = 6, n_classes: int = 10, batch_size: int = 16
) -> tuple[TwoStream, torch.Tensor]:
    """The two-stream classifier and a sample of (batch_size, in_features) inputs."""
    return TwoStream(in_features, width, depth, n_classes), torch.randn(batch_size, in_features)
