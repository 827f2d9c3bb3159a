"""The interface `train/` and `decode/` know about a frozen continuous-token AR image model.

The continuous counterpart of `backbones.base.ARImageBackbone`, for generators
whose tokens are vectors sampled by a per-token diffusion head (MAR, xAR,
Harmon, the embedded continuous digits model). The decoders speak grid positions
and token vectors:

- token ``i`` of an image is grid cell ``(i // cols, i % cols)``; its value is a
  vector of `token_dim` floats;
- ``hidden[:, i]`` is the last-layer state (before the final norm) that
  conditions token ``i``; `condition(hidden)` is what the diffusion head reads
  (the family's final norm and whatever it adds);
- `sample_tokens` runs the diffusion head with every random draw passed in
  (`DiffusionHead.sample`), so a drafter and the backbone can share a
  trajectory's noise (CSpD) and tests can replay a draw.

Classifier-free guidance runs [cond; uncond] twins as one batch of ``2B`` cache
rows, as for the discrete backbones; the diffusion head mixes the twins' noise
predictions.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod

import torch
from torch import nn

from backbones.base import CompilablePasses, Condition, ContinuousBatching, DecodeState, ImageGeometry
from backbones.diffusion_head import DiffusionHead, DiffusionSample


def continuous_identity(model) -> dict:
    """The identity every continuous-token model records (name, sizes, geometry, weights fingerprint)."""
    return {
        "name": model.name,
        "family": type(model).__name__,
        "hidden_size": model.hidden_size,
        "token_dim": model.token_dim,
        "geometry": model.geometry.to_dict(),
        "weights_fingerprint": model.weights_fingerprint(),
    }


class ContinuousARBackbone(CompilablePasses, ContinuousBatching, nn.Module, ABC):
    """A frozen causal continuous-token image generator behind a small, family-agnostic API."""

    geometry: ImageGeometry
    token_dim: int
    hidden_size: int
    name: str
    diffusion: DiffusionHead
    num_classes: int | None = None  # class-conditional families; None for text-to-image

    token_kind = "continuous"  # what the method registry checks a generator against (decode/method.py)

    @abstractmethod
    def prefill(self, condition: Condition, guided: bool) -> tuple[DecodeState, torch.Tensor]:
        """Run the condition (and its unconditional twin when `guided`) into a new KV cache.

        Returns the state and the hidden state (rows, 1, hidden) conditioning token 0.
        """

    @abstractmethod
    def _forward_tokens(self, state: DecodeState, tokens: torch.Tensor) -> torch.Tensor:
        """Append token vectors (rows, T, token_dim) to the cache; return pre-norm hidden states (rows, T, hidden)."""

    @abstractmethod
    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The input embedding of token vectors, (..., token_dim) -> (..., hidden) (what latent heads read)."""

    @abstractmethod
    def condition(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden states (..., hidden) -> the diffusion head's conditioning vectors (..., condition_dim)."""

    @abstractmethod
    def tokens_to_pixels(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, rows, cols, token_dim) tokens -> (B, channels, height, width) images in [0, 1]."""

    def pixels_to_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """(B, channels, height, width) images in [0, 1] -> (B, rows, cols, token_dim) tokens."""
        raise NotImplementedError(f"{type(self).__name__} has no pixel encoder")

    # ---- shared mechanics ------------------------------------------------------------------

    def step(self, state: DecodeState, tokens: torch.Tensor) -> torch.Tensor:
        """Append token vectors (B, T, token_dim) after those in `state`; return their hidden states.

        ``out[:, j]`` (rows, T, hidden) conditions the token after ``tokens[:, j]``. Under guidance
        both twins get the same tokens.
        """
        if tokens.shape[0] != state.batch_size:
            raise ValueError(f"step got {tokens.shape[0]} rows of tokens for a batch of {state.batch_size}")
        start, count = state.num_image_tokens, tokens.shape[1]
        if start + count > self.geometry.num_tokens:
            raise ValueError(f"step would write past the image: {start} + {count} > {self.geometry.num_tokens}")
        if state.guided:
            tokens = torch.cat([tokens, tokens], dim=0)
        hidden = self._forward_tokens(state, tokens)
        state.num_image_tokens = start + count
        return hidden

    def step_ragged(self, state: DecodeState, tokens: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """Each image feeds its own run of token vectors from its own grid position, all in one pass.

        tokens (B, T, token_dim): image ``b``'s go to positions ``starts[b] .. starts[b] + T - 1`` (pad a shorter
        run with anything: those states are computed and ignored). Each token sees its image's prompt, its
        image's cache slots before its own position and the tokens before it in this run, at the position ids
        `step` gives it there, so ``out[b, j]`` (rows, T, hidden) is what `step` returns for that token after
        the image's first ``starts[b] + j`` tokens. As `ARImageBackbone.step_ragged`: the caller keeps, per
        image, how far the cache is final; `state.num_image_tokens` is not maintained (mix no `step` or
        `rollback` with ragged passes).
        """
        batch = tokens.shape[0]
        if batch != state.batch_size or starts.shape != (batch,):
            raise ValueError(
                f"step_ragged got tokens {tuple(tokens.shape)} and starts {tuple(starts.shape)} for a batch of "
                f"{state.batch_size}: give (batch, T, token_dim) tokens and one start per image"
            )
        if int(starts.min()) < 0 or int(starts.max()) >= self.geometry.num_tokens:
            raise ValueError(
                f"step_ragged: starts must be grid positions in [0, {self.geometry.num_tokens}), got {starts}"
            )
        return self._ragged_pass(state, tokens, starts, lambda *layout: self._forward_tokens_at(state, *layout))

    def _forward_tokens_at(self, state, tokens, slots, visible, positions) -> torch.Tensor:
        """Token vectors (rows, T, token_dim) at cache `slots` (rows, T), each seeing the slots `visible`
        (rows, T, attend), at position ids `positions` (rows, T): the family's ragged pass."""
        raise NotImplementedError(
            f"{type(self).__name__} has no ragged pass: use the batched methods (cspd, not cspd_ragged) with it"
        )

    def rollback(self, state: DecodeState, num_image_tokens: int) -> None:
        """Crop the cache back so that only the first `num_image_tokens` tokens remain."""
        if not 0 <= num_image_tokens <= state.num_image_tokens:
            raise ValueError(f"cannot roll back to {num_image_tokens} tokens from {state.num_image_tokens}")
        excess = state.cache.get_seq_length() - (state.prefix_length + num_image_tokens)
        if excess > 0:
            state.cache.crop(-excess)
        state.num_image_tokens = num_image_tokens

    def sample_tokens(
        self, state: DecodeState, hidden: torch.Tensor, noise: torch.Tensor, cfg_scale: float, temperature: float
    ) -> DiffusionSample:
        """Tokens at T positions of every image: hidden (rows, T, hidden), noise (B, T, noise_steps, token_dim).

        Returns a `DiffusionSample` whose fields are shaped (B, T, token_dim).
        """
        batch, count = noise.shape[:2]
        z = self.condition(hidden)  # (rows, T, C)
        if state.guided:  # [cond rows; uncond rows], position-major inside each twin
            cond, uncond = z.chunk(2)
            z = torch.cat([cond.flatten(0, 1), uncond.flatten(0, 1)])
        else:
            z = z.flatten(0, 1)
        drawn = self.diffusion.sample(z, noise.flatten(0, 1), cfg_scale, temperature, guided=state.guided)
        return drawn.map(lambda value: value.view(batch, count, -1))

    def draw_noise(
        self, batch: int, count: int, generator: torch.Generator | None, device: torch.device | None = None
    ) -> torch.Tensor:
        """Fresh trajectory noise (batch, count, noise_steps, token_dim) for `sample_tokens`."""
        device = device or self._device()
        shape = (batch, count, self.diffusion.noise_steps, self.token_dim)
        return torch.randn(shape, generator=generator, device=device)

    def identity(self) -> dict:
        """What exported drafters record and check: name, sizes, geometry and a weights fingerprint."""
        return continuous_identity(self)

    def weights_fingerprint(self) -> str:
        """A short hash of the diffusion head's response to a fixed probe."""
        device = self._device()
        probe = torch.zeros(1, self.hidden_size, device=device)
        probe[0, : min(8, self.hidden_size)] = 1.0
        x = torch.zeros(1, self.token_dim, device=device)
        with torch.no_grad():
            eps, _ = self.diffusion.net(x, torch.zeros(1, dtype=torch.long, device=device), self.condition(probe))
        return hashlib.sha1(eps.float().cpu().numpy().round(4).tobytes()).hexdigest()[:12]

    def _device(self) -> torch.device:
        return next(self.parameters()).device
