"""A context-free stand-in backbone whose every distribution is known, for accept/reject tests.

The target token at grid cell (r, c) is (r + c) % V, with one-hot logits of
height `peak`, whatever came before; the hidden state *is* the logit vector, and
a token's embedding is its one-hot vector. So the right draft for both SSD
offsets is "previous token + 1", and a head that adds 2 is always wrong.
"""

from __future__ import annotations

import torch
from torch import nn

from backbones.base import ARImageBackbone, DecodeState, ImageGeometry


class CountingCache:
    """Tracks only the cached length, like a KV cache would."""

    def __init__(self):
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        self.length += tokens_to_remove  # negative: remove that many


class MockBackbone(ARImageBackbone):
    cfg_space = "logits"
    name = "mock"

    def __init__(self, rows=4, cols=5, vocab=7, peak=20.0):
        super().__init__()
        self.geometry = ImageGeometry(rows, cols)
        self.codebook_size = self.hidden_size = vocab
        self.peak = peak
        self.anchor = nn.Parameter(torch.zeros(1))  # gives the module a device

    def target_token(self, position: int) -> int:
        return (position // self.geometry.cols + position % self.geometry.cols) % self.codebook_size

    def target_tokens(self) -> torch.Tensor:
        return torch.tensor([self.target_token(i) for i in range(self.geometry.num_tokens)]).view(
            self.geometry.rows, self.geometry.cols
        )

    def _hidden_for(self, positions: list[int], rows: int) -> torch.Tensor:
        targets = torch.tensor([self.target_token(min(i, self.geometry.num_tokens - 1)) for i in positions])
        return (
            (torch.nn.functional.one_hot(targets, self.codebook_size).float() * self.peak).expand(rows, -1, -1).clone()
        )

    def prefill(self, condition, guided):
        state = DecodeState(cache=CountingCache(), batch_size=condition.batch_size, guided=guided, prefix_length=1)
        state.cache.length = 1
        return state, self._hidden_for([0], state.cache_rows)

    def _forward_flat(self, state, flat_tokens):
        start = state.num_image_tokens
        state.cache.length += flat_tokens.shape[1]
        return self._hidden_for(list(range(start + 1, start + 1 + flat_tokens.shape[1])), flat_tokens.shape[0])

    def logits(self, hidden):
        return hidden

    def embed_image_tokens(self, tokens):
        return torch.nn.functional.one_hot(tokens, self.codebook_size).float()

    def codebook_latents(self):
        return torch.arange(self.codebook_size).float()[:, None]

    def tokens_to_pixels(self, tokens):
        return tokens.float()[:, None] / (self.codebook_size - 1)


class ShiftHead(nn.Module):
    """Predicts the logits of (input token + shift) % V: shift 1 is always right, 2 always wrong."""

    def __init__(self, vocab: int, shift: int, peak: float = 20.0):
        super().__init__()
        self.vocab, self.shift, self.peak = vocab, shift, peak

    def forward(self, hidden, token_embedding):
        token = token_embedding.argmax(-1)
        return torch.nn.functional.one_hot((token + self.shift) % self.vocab, self.vocab).float() * self.peak


class MockHeads(nn.Module):
    def __init__(self, vocab: int, horizontal_shift: int, vertical_shift: int):
        super().__init__()
        self.horizontal = ShiftHead(vocab, horizontal_shift)
        self.vertical = ShiftHead(vocab, vertical_shift)
