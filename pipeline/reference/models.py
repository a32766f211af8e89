"""Reference models for the scripts, tests and examples, each an ``nn.Sequential`` of n layers.

Importable by users (``from pipeline.reference.models import gpt``), but not
part of the runtime: nothing in ``pipeline.runtime`` or ``pipeline.schedules``
depends on them. Each entry of the chain is one layer l, so a stage s can be
cut at any boundary between layers l and l + 1.

    # B: batch, T: time (sequence), C: channels (width), V: vocabulary, H: heads

Each builder returns the model and a sample input; ``gpt`` is the default model
of ``scripts/train.py``, and all three are the built-in models of
``scripts/profile_balance.py``. Every tensor a ``forward`` makes is made on its
input's device, never on the default one: the runtime runs steps with the
default device set to "meta" to prove that nothing relies on it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Block",
    "Documents",
    "Embedding",
    "FinalNorm",
    "ResidualBlock",
    "document_mask",
    "gpt",
    "gpt_loss",
    "mlp",
    "resnet",
    "with_documents",
]


Documents = tuple[torch.Tensor, torch.Tensor]  # (activations or tokens, position ids (B, T) int64)


class Embedding(nn.Module):
    """Token plus learned position embedding: (B, T) int64 -> (B, T, C); given documents, rows of
    sequences end to end with their position ids ``(tokens, pos)``, -> ``(x, pos)``."""

    def __init__(self, vocab_size: int, width: int, max_seq_len: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(max_seq_len, width)

    def forward(self, idx: torch.Tensor | Documents) -> torch.Tensor | Documents:
        if isinstance(idx, tuple):  # each document's positions count from 0 (VarLen(documents=True))
            tokens, positions = idx
            return self.token(tokens) + self.position(positions), positions  # (B, T, C), (B, T)
        t = idx.shape[1]
        if t > self.position.num_embeddings:
            raise ValueError(
                f"sequence length {t} exceeds the model's max_seq_len {self.position.num_embeddings}; "
                "build the model with a larger max_seq_len or feed shorter sequences"
            )
        pos = torch.arange(t, device=idx.device)  # (T,), on the input's device
        out: torch.Tensor = self.token(idx) + self.position(pos)  # (B, T, C)
        return out


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then MLP, each with a residual; given
    documents ``(x, pos)``, each token attends only to its own document's earlier tokens."""

    def __init__(self, width: int, n_heads: int) -> None:
        super().__init__()
        if width % n_heads != 0:
            raise ValueError(f"width ({width}) must be divisible by n_heads ({n_heads})")
        self.n_heads = n_heads
        self.ln_attn = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln_mlp = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.fc_out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor | Documents) -> torch.Tensor | Documents:
        if isinstance(x, tuple):
            h, positions = x
            return self._run(h, document_mask(positions)), positions
        return self._run(x, None)

    def _run(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).split(c, dim=2)  # 3 x (B, T, C)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)  # (B, H, T, C/H)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        out: torch.Tensor = x + self.fc_out(F.gelu(self.fc(self.ln_mlp(x))))  # (B, T, C)
        return out


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """(B, T) position ids of documents end to end, each from 0 -> (B, 1, T, T) bool: token i may
    attend to token j <= i of its own document."""
    t = positions.shape[1]
    document = (positions == 0).cumsum(1)  # (B, T): which document of its row each token is
    same = document.unsqueeze(2) == document.unsqueeze(1)  # (B, T, T)
    causal = torch.ones((t, t), dtype=torch.bool, device=positions.device).tril()  # (T, T)
    return (same & causal).unsqueeze(1)  # (B, 1, T, T), broadcast over heads


class FinalNorm(nn.LayerNorm):
    """The last LayerNorm; given documents ``(x, pos)``, of ``x`` alone (the head needs no positions)."""

    def forward(self, x: torch.Tensor | Documents) -> torch.Tensor:
        return super().forward(x[0] if isinstance(x, tuple) else x)


def gpt(
    vocab_size: int = 96,
    width: int = 128,
    n_layers: int = 4,
    n_heads: int = 4,
    max_seq_len: int = 128,
    batch_size: int = 8,
) -> tuple[nn.Sequential, torch.Tensor]:
    """A GPT as a chain of n = n_layers + 3 layers: embedding, blocks, final norm, LM head.

    (B, T) int64 -> (B, T, V); the sample is (batch_size, max_seq_len) token ids.
    """
    layers: list[nn.Module] = [Embedding(vocab_size, width, max_seq_len)]
    layers += [Block(width, n_heads) for _ in range(n_layers)]
    layers += [nn.LayerNorm(width), nn.Linear(width, vocab_size, bias=False)]
    sample = torch.randint(0, vocab_size, (batch_size, max_seq_len))
    return nn.Sequential(*layers), sample


def with_documents(built: tuple[nn.Sequential, torch.Tensor]) -> tuple[nn.Sequential, Documents]:
    """``gpt(...)``'s model and sample, the model now also taking rows of documents end to end,
    ``(tokens, position ids)`` (B, T) each (``VarLen(documents=True)``); the sample such a pair, one
    document a row. The model is changed in place: its final norm becomes a ``FinalNorm`` (which
    takes either input) holding the same parameter tensors (device, dtype, values), under the same
    names; every other layer takes either input already."""
    model, tokens = built
    norm = model[-2]
    if not isinstance(norm, nn.LayerNorm):
        raise TypeError(f"with_documents takes gpt(...)'s model, whose layer -2 is a LayerNorm, not {norm!r}")
    final = FinalNorm(norm.normalized_shape, norm.eps, norm.elementwise_affine, norm.bias is not None,
                      device="meta")  # fmt: skip
    final.load_state_dict(norm.state_dict(), assign=True)  # the norm's own tensors
    model[-2] = final
    b, t = tokens.shape
    return model, (tokens, torch.arange(t).expand(b, -1).contiguous())


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class ResidualBlock(nn.Module):
    """conv-bn-relu-conv-bn plus shortcut; strides by 2 when the width grows."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        stride = 2 if c_out != c_in else 1
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))  # (B, C_out, H', W'); H' = H / stride
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))  # (B, C_out, H', W')


def resnet(
    widths: tuple[int, ...] = (16, 32, 64, 128),
    blocks_per_width: int = 2,
    n_classes: int = 10,
    image_size: int = 32,
    batch_size: int = 8,
) -> tuple[nn.Sequential, torch.Tensor]:
    """A ResNet-style CNN whose widths grow while its resolution shrinks: (B, 3, H, W) -> (B, classes).

    n = 1 + len(widths) * blocks_per_width + 3 layers: stem, residual blocks, pool, flatten, classifier.
    """
    layers: list[nn.Module] = [
        nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
    ]
    c_in = widths[0]
    for c_out in widths:
        for _ in range(blocks_per_width):
            layers.append(ResidualBlock(c_in, c_out))
            c_in = c_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, n_classes)]
    sample = torch.randn(batch_size, 3, image_size, image_size)
    return nn.Sequential(*layers), sample


def mlp(
    width: int = 1024, depth: int = 8, in_features: int | None = None, batch_size: int = 128
) -> tuple[nn.Sequential, torch.Tensor]:
    """n = ``depth`` layers of Linear + ReLU (each one entry of the chain): (B, in) -> (B, width)."""
    d_in = width if in_features is None else in_features
    layers = [nn.Sequential(nn.Linear(d_in if k == 0 else width, width), nn.ReLU()) for k in range(depth)]
    return nn.Sequential(*layers), torch.randn(batch_size, d_in)
