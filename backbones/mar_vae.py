"""MAR's KL-16 VAE: the autoencoder whose latents MAR (and Harmon, xAR) generate as continuous tokens.

LTH14/mar ``models/vae.py`` ``AutoencoderKL(embed_dim=16, ch_mult=(1, 1, 2, 2, 4))``,
adopted there from latent-diffusion's KL autoencoder, weights ``kl16.ckpt``
(LTH14/mar ``util/download.py``). A 256 px image becomes a 16x16 grid of
16-channel latents; MAR models them multiplied by 0.2325 (``engine_mar.py``:
``posterior.sample().mul_(0.2325)`` in training, ``vae.decode(tokens / 0.2325)``
for images, which are in [-1, 1]).

Re-implemented with the official parameter names, so ``kl16.ckpt``'s
``"model"`` state dict loads as it is:

- encoder: ``conv_in``; per level ``down.{l}.block.{i}`` residual blocks
  (``num_res_blocks`` each), ``down.{l}.attn.{i}`` after them at the levels whose
  resolution is in ``encoder_attn_resolutions`` (16: the lowest level at 256 px),
  ``down.{l}.downsample`` except at the last level; ``mid.block_1``,
  ``mid.attn_1``, ``mid.block_2``; ``norm_out``, ``conv_out`` to 2 x 16 channels
  (mean and log variance);
- ``quant_conv`` (32 -> 32) and ``post_quant_conv`` (16 -> 16), 1x1;
- decoder: ``conv_in``; the same middle; per level ``up.{l}.block.{i}``
  (``num_res_blocks + 1`` each, level 0 the highest resolution, run last),
  ``up.{l}.upsample`` except at level 0, no attention outside the middle;
  ``norm_out``, ``conv_out`` to RGB.

Checked once against the official code (LTH14/mar at fe470ac, ``models/vae.py``
run from a temporary copy, CPU, float64): the official ``AutoencoderKL`` at the
released shape and a tiny one (ch 32, ch_mult (1, 2), one residual block, 8 px,
attention at resolution 4) took this module's weights through ``load_state_dict``
(strict, no key left over either way; the released shape has 312 tensors, 66,456,019
parameters), and the decoded images of random latents and the encoded means and
log variances of random images agreed to 2e-14.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from backbones.conv_autoencoder import AttnBlock, Downsample, ResBlock, Upsample, group_norm, run_level, swish
from backbones.hf_loading import load_safetensors_checkpoint, load_torch_checkpoint

log = logging.getLogger(__name__)

VAE_FILE = "kl16.ckpt"
VAE_DOWNLOAD = "https://www.dropbox.com/scl/fi/hhmuvaiacrarfg28qxhwz/kl16.ckpt?rlkey=l44xipsezc8atcffdp4q7mwmh&dl=0"
MAR_README = "https://github.com/LTH14/mar#installation"


@dataclass(frozen=True)
class KLVAEConfig:
    """Shape of a KL autoencoder (the official ``Encoder``/``Decoder`` arguments; defaults: MAR's KL-16)."""

    embed_dim: int = 16  # latent channels (MAR's vae_embed_dim; z_channels = embed_dim)
    ch: int = 128  # channels at the highest resolution
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)  # per level; len - 1 halvings: 256 px -> 16x16 latents
    num_res_blocks: int = 2  # per encoder level (the decoder has one more)
    resolution: int = 256  # the image size the encoder places its attention for
    encoder_attn_resolutions: tuple[int, ...] = (16,)  # the official Encoder's default
    decoder_attn_resolutions: tuple[int, ...] = ()  # the official Decoder's default: attention in the middle only
    scale: float = 0.2325  # MAR's tokens are the latents times this

    def __post_init__(self):
        if self.ch % 32 or any(self.ch * m % 32 for m in self.ch_mult):
            raise ValueError(f"every level's channels must be a multiple of 32 (GroupNorm(32)); got ch={self.ch}")
        if self.resolution % 2 ** (len(self.ch_mult) - 1):
            raise ValueError(f"resolution {self.resolution} is not divisible by 2^{len(self.ch_mult) - 1}")

    @property
    def downsampling(self) -> int:
        """Pixels per latent along each side (16 for KL-16)."""
        return 2 ** (len(self.ch_mult) - 1)

    def to_dict(self) -> dict:
        return asdict(self)


class _KLEncoder(nn.Module):
    """Images (B, 3, H, W) in [-1, 1] -> (B, 2 * embed_dim, H / f, W / f) moments (before ``quant_conv``)."""

    def __init__(self, c: KLVAEConfig):
        super().__init__()
        self.conv_in = nn.Conv2d(3, c.ch, 3, padding=1)
        self.down = nn.ModuleList()
        block_in, resolution = c.ch, c.resolution
        for level, mult in enumerate(c.ch_mult):
            down = nn.Module()
            down.block, down.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(c.num_res_blocks):
                down.block.append(ResBlock(block_in, c.ch * mult))
                block_in = c.ch * mult
                if resolution in c.encoder_attn_resolutions:
                    down.attn.append(AttnBlock(block_in))
            if level != len(c.ch_mult) - 1:
                down.downsample = Downsample(block_in)
                resolution //= 2
            self.down.append(down)
        self.mid = _middle(block_in)
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, 2 * c.embed_dim, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for down in self.down:
            h = run_level(h, down.block, down.attn)
            if hasattr(down, "downsample"):
                h = down.downsample(h)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        return self.conv_out(swish(self.norm_out(h)))


class _KLDecoder(nn.Module):
    """Latents (B, embed_dim, h, w) (after ``post_quant_conv``) -> images (B, 3, h * f, w * f), unclamped."""

    def __init__(self, c: KLVAEConfig):
        super().__init__()
        block_in = c.ch * c.ch_mult[-1]
        resolution = c.resolution // c.downsampling
        self.conv_in = nn.Conv2d(c.embed_dim, block_in, 3, padding=1)
        self.mid = _middle(block_in)
        levels = [nn.Module() for _ in c.ch_mult]  # indexed by level, level 0 the highest resolution
        for level in reversed(range(len(c.ch_mult))):
            up = levels[level]
            up.block, up.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(c.num_res_blocks + 1):
                up.block.append(ResBlock(block_in, c.ch * c.ch_mult[level]))
                block_in = c.ch * c.ch_mult[level]
                if resolution in c.decoder_attn_resolutions:
                    up.attn.append(AttnBlock(block_in))
            if level != 0:
                up.upsample = Upsample(block_in)
                resolution *= 2
        self.up = nn.ModuleList(levels)
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, 3, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for up in reversed(self.up):  # lowest resolution first
            h = run_level(h, up.block, up.attn)
            if hasattr(up, "upsample"):
                h = up.upsample(h)
        return self.conv_out(swish(self.norm_out(h)))


def _middle(channels: int) -> nn.Module:
    """The middle of both halves: ``block_1``, ``attn_1``, ``block_2`` at the lowest resolution."""
    middle = nn.Module()
    middle.block_1, middle.attn_1 = ResBlock(channels, channels), AttnBlock(channels)
    middle.block_2 = ResBlock(channels, channels)
    return middle


class MARKLVAE(nn.Module):
    """The KL-16 VAE, between MAR's tokens (B, rows, cols, embed_dim) and images (B, 3, H, W) in [0, 1]."""

    def __init__(self, config: KLVAEConfig | None = None):
        super().__init__()
        self.config = c = config or KLVAEConfig()
        self.encoder = _KLEncoder(c)
        self.decoder = _KLDecoder(c)
        self.quant_conv = nn.Conv2d(2 * c.embed_dim, 2 * c.embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(c.embed_dim, c.embed_dim, 1)

    def encode(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Images (B, 3, H, W) in [-1, 1] -> the posterior's (mean, log variance), each (B, embed_dim, h, w).

        The log variance is clamped to [-30, 20], as the official ``DiagonalGaussianDistribution`` does.
        """
        mean, log_var = self.quant_conv(self.encoder(images)).chunk(2, dim=1)
        return mean, log_var.clamp(-30.0, 20.0)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents (B, embed_dim, h, w), unscaled -> images (B, 3, h * 16, w * 16) in about [-1, 1]."""
        return self.decoder(self.post_quant_conv(latents))

    def tokens_to_pixels(self, tokens: torch.Tensor) -> torch.Tensor:
        """MAR's tokens (B, rows, cols, embed_dim) -> images (B, 3, rows * 16, cols * 16) in [0, 1].

        As LTH14/mar ``evaluate``: ``vae.decode(tokens / 0.2325)``, then ``(x + 1) / 2``; clamped here.
        Computed in this VAE's dtype and device.
        """
        weight = self.post_quant_conv.weight
        latents = tokens.permute(0, 3, 1, 2).to(device=weight.device, dtype=weight.dtype) / self.config.scale
        return ((self.decode(latents) + 1) / 2).clamp(0, 1)

    def pixels_to_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1] -> MAR's tokens (B, H / 16, W / 16, embed_dim): the posterior's mean
        times 0.2325 (Harmon's encoding; MAR's training draws from the posterior instead)."""
        weight = self.quant_conv.weight
        mean, _ = self.encode(images.to(device=weight.device, dtype=weight.dtype) * 2 - 1)
        return (mean * self.config.scale).permute(0, 2, 3, 1)


def random_kl_vae(seed: int = 0, dtype: str = "float32", **overrides) -> MARKLVAE:
    """A KL VAE with seeded random weights (tiny by default: ch 32, ch_mult (1, 2), one block, 8 px; for tests)."""
    shape = {"ch": 32, "ch_mult": (1, 2), "num_res_blocks": 1, "resolution": 8, "encoder_attn_resolutions": (4,)}
    torch.manual_seed(seed)
    vae = MARKLVAE(KLVAEConfig(**{**shape, **overrides}))
    with torch.no_grad():
        for name, parameter in vae.named_parameters():
            nn.init.normal_(parameter, std=0.1 if parameter.dim() == 1 else 0.05)
            if name.endswith("weight") and parameter.dim() == 1:  # GroupNorm scales centred on 1
                parameter.add_(1.0)
    return vae.to(getattr(torch, dtype)).eval().requires_grad_(False)


def _download_advice() -> str:
    return (
        f"get MAR's KL-16 VAE ({VAE_FILE}) from the LTH14/mar README ({MAR_README}):\n"
        f"  {VAE_DOWNLOAD}\n"
        f"(or `python util/download.py` in a clone of LTH14/mar: pretrained_models/vae/{VAE_FILE})\n"
        "and pass the file or its directory as backbone.vae_path"
    )


def read_vae_state_dict(path: Path, trust_pickle: bool = False) -> dict[str, torch.Tensor]:
    """The state dict in ``kl16.ckpt`` (its ``"model"`` entry, as the official ``init_from_ckpt`` reads it),
    or a bare one (.pth, .safetensors)."""
    if path.suffix == ".safetensors":
        return load_safetensors_checkpoint(path, "a KL-16 VAE", f"({MAR_README})")
    checkpoint = load_torch_checkpoint(path, trust_pickle, "a KL-16 VAE checkpoint", f"({MAR_README})")
    state = checkpoint.get("model", checkpoint)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: no state dict in the checkpoint (keys: {sorted(checkpoint)[:8]})")
    return state


def load_kl16_vae(
    path: str | Path,
    device: str = "cpu",
    dtype: str = "float32",
    trust_pickle: bool = False,
    config: KLVAEConfig | None = None,
) -> MARKLVAE:
    """MAR's KL-16 VAE from ``kl16.ckpt`` (a file, or a directory holding ``kl16.ckpt`` or ``kl16.safetensors``
    with the same names). `config`: another shape than the released one (tests load tiny ones).

    Every parameter of the official ``AutoencoderKL`` must be there with its shape; the first one that is
    not is named in the ValueError. Keys beyond them (a training checkpoint's loss terms) are skipped and
    counted in the log, as the official loader (``strict=False``) skips them. Raises FileNotFoundError with
    the download link when nothing is at `path`.
    """
    path = Path(path)
    if path.is_dir():
        candidates = [path / VAE_FILE, path / "kl16.safetensors"]
        path = next((p for p in candidates if p.is_file()), candidates[0])
    if not path.is_file():
        raise FileNotFoundError(f"no KL-16 VAE at {path}: {_download_advice()}")
    state = read_vae_state_dict(path, trust_pickle)
    vae = MARKLVAE(config)
    own = vae.state_dict()
    for name, value in own.items():
        if name not in state:
            missing = sum(key not in state for key in own)
            raise ValueError(f"{path}: the KL-16 VAE lacks {name!r} ({missing} keys missing): is it kl16.ckpt?")
        if tuple(state[name].shape) != tuple(value.shape):
            raise ValueError(
                f"{path}: KL-16 VAE key {name!r} has shape {tuple(state[name].shape)}, expected {tuple(value.shape)}"
            )
    skipped = [key for key in state if key not in own]
    if skipped:
        log.info("%s: %d keys that are not VAE parameters skipped (e.g. %s)", path, len(skipped), skipped[0])
    vae.load_state_dict({name: state[name] for name in own}, strict=True)
    return vae.to(device=device, dtype=getattr(torch, dtype)).eval().requires_grad_(False)


__all__ = ["KLVAEConfig", "MARKLVAE", "load_kl16_vae", "random_kl_vae", "read_vae_state_dict"]
