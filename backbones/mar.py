"""MAR (Li et al., "Autoregressive Image Generation without Vector Quantization", NeurIPS 2024; code LTH14/mar).

MAR is a masked autoencoder over the 16x16 grid of 16-channel KL-16 VAE latents
of a 256px image, generating in a random order: at each of `num_iter` steps a
bidirectional encoder reads the class condition and the tokens known so far,
a decoder fills in the unknown positions, and the per-token diffusion head
samples the tokens that this step reveals. It is not causal, so it does not sit
behind `backbones.continuous.ContinuousARBackbone` (which assumes a KV cache over
a raster order); `MARBackbone` gives the two things speculative decoding needs instead:
`sample` (the reference generator, with every random draw an argument) and
`predict_conditions` (one verifier pass: the conditioning vectors of every
position given any set of known tokens).

Architecture (LTH14/mar ``models/mar.py``, class ``MAR``), re-implemented with
the official parameter names so that checkpoints load through a name mapping
that touches only the diffusion head:

- ``class_emb`` (1000 classes) and ``fake_latent`` (the null condition of
  classifier-free guidance); ``z_proj`` + ``z_proj_ln`` embed the tokens;
- a buffer of ``buffer_size`` (64) positions in front of the grid, every one
  holding the class embedding; learned position embeddings for buffer + grid;
- the encoder (timm ViT blocks: LayerNorm eps 1e-6, fused qkv with bias, MLP
  ratio 4, exact GELU) runs on the buffer and the known positions only, then
  ``encoder_norm``;
- ``decoder_embed``, ``mask_token`` at the unknown positions, decoder position
  embedding, the decoder blocks, ``decoder_norm``; the buffer is dropped and
  ``diffusion_pos_embed_learned`` added: that is the condition ``z`` of each
  position's diffusion head;
- the diffusion head (``models/diffloss.py``, ``SimpleMLPAdaLN``) is this
  project's `backbones.diffusion_head.DiffusionHead`: 1000-step cosine
  schedule, 100 respaced sampling steps, learned-range variance, no clipping (`MARConfig.clip_denoised`),
  no noise at the last step (`DiffusionHeadConfig.final_step_noise=False`).

Released sizes (official ``mar_base/large/huge`` factories, and the diffusion
head depth and width of the README's evaluation commands):

    size    encoder = decoder      diffusion head    README
            (dim / depth / heads)  (depth / width)   (cfg, FID-50K, params)
    base    768 / 12 / 12          6 / 1024          2.9, 2.31, 208M
    large   1024 / 16 / 16         8 / 1280          3.0, 1.78, 479M
    huge    1280 / 20 / 16         12 / 1536         3.2, 1.55, 943M

The README evaluates with ``--num_iter 256 --cfg_schedule linear
--temperature 1.0`` (``--cfg 1.0 --temperature 0.95`` without guidance), under
CUDA fp16 autocast; this adapter runs in the dtype it is given.

The official time embedding feeds 256 sinusoidal frequencies (DiT's
``TimestepEmbedder``) to ``time_embed.mlp.0`` (width x 256) at every size; the
head here is built with `DiffusionHeadConfig.time_frequencies` = 256, so every
official weight loads as it is, under a new name only.

Checked once against the official code (LTH14/mar at fe470ac with timm 0.9.12, patched to take the orders and
noise, on CPU; tiny random models, 4x4 grid, float64): the sampled tokens agree to 1e-11 relative for head
widths 256 and 512, with and without guidance, both CFG schedules. (That check ran when the head embedded
timesteps at `width` frequencies with the official weight scattered onto every (width/256)-th, bit-identical
for those widths; at width 1280 it was 5e-4 off, frequency rounding. The head now takes the 256 frequencies
themselves, the official formula, at every width.)
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from backbones.base import ImageGeometry
from backbones.continuous import continuous_identity
from backbones.diffusion_head import DiffusionHead, DiffusionHeadConfig, DiffusionSample
from backbones.digits_continuous import images_to_patches, patches_to_images
from backbones.hf_loading import load_safetensors_checkpoint, load_torch_checkpoint
from backbones.mar_vae import MARKLVAE, load_kl16_vae, random_kl_vae
from common.atomic_io import atomic_save_safetensors, atomic_write_text

README = "https://github.com/LTH14/mar#installation"
HF_REPO = "jadechoghari/mar"
CHECKPOINT_FILE = "checkpoint-last.pth"
# A MAR trained by this project (`MARBackbone.save_pretrained`): its MARConfig, its weights under the official names.
SAVED_CONFIG_FILE, SAVED_WEIGHTS_FILE = "config.json", "model.safetensors"
# The README's direct download links (Dropbox), one `checkpoint-last.pth` per size; LTH14/mar `util/download.py`
# fetches the same files into pretrained_models/mar/mar_{size}/.
_DROPBOX = "https://www.dropbox.com/scl/fi/"
DOWNLOAD_LINKS = {
    "base": _DROPBOX + "f6dpuyjb7fudzxcyhvrhk/checkpoint-last.pth?rlkey=a6i4bo71vhfo4anp33n9ukujb&dl=0",
    "large": _DROPBOX + "pxacc5b2mrt3ifw4cah6k/checkpoint-last.pth?rlkey=m48ovo6g7ivcbosrbdaz0ehqt&dl=0",
    "huge": _DROPBOX + "1qmfx6fpy3k7j9vcjjs3s/checkpoint-last.pth?rlkey=4lae281yzxb406atp32vzc83o&dl=0",
}


@dataclass(frozen=True)
class MARConfig:
    """Shape of a MAR model (official ``MAR.__init__`` arguments in comments)."""

    encoder_dim: int = 768  # encoder_embed_dim
    encoder_depth: int = 12
    encoder_heads: int = 12
    decoder_dim: int = 768  # decoder_embed_dim: also the diffusion head's condition size
    decoder_depth: int = 12
    decoder_heads: int = 12
    mlp_ratio: float = 4.0
    token_dim: int = 16  # vae_embed_dim * patch_size**2 (KL-16 VAE, patch_size 1)
    grid_size: int = 16  # img_size // vae_stride // patch_size = 256 // 16 // 1
    buffer_size: int = 64
    num_classes: int = 1000  # class_num
    diffloss_depth: int = 6  # diffloss_d
    diffloss_width: int = 1024  # diffloss_w
    sampling_steps: int = 100  # num_sampling_steps (diffusion steps per token)
    time_frequencies: int = 256  # DiT TimestepEmbedder frequency_embedding_size (fixed in the official code)
    # False: the official sampler (the last reverse step adds no noise, a token is its trajectory's final mean).
    # True: the last step adds its std (sigma_0 ~ 1e-2) noise, so a token given its trajectory is Gaussian and
    # exact CSpD (decode/cspd_mar.py) is defined; a variant of MAR, not the released sampler.
    final_step_noise: bool = False
    # > 0: every token is a patch of pixel_patch_size x pixel_patch_size grey pixels in [-1, 1] (the embedded digits
    # MAR trained here, conf/experiment/backbone_mar_digits.yaml), so pixels need no VAE. 0: KL-16 VAE latents.
    pixel_patch_size: int = 0
    # True: each reverse step clips its predicted x_0 to [-1, 1] (tokens known to lie there: pixel patches). The
    # official sampler does not (latents are unbounded); without it the embedded MAR's first reverse steps, at
    # alpha_bar ~ 1e-8, amplify its noise-prediction error into tokens of size 1e3 (teacher-forced error 306
    # against 0.13 with it, at step 1100 of its training).
    clip_denoised: bool = False
    name: str = "mar-base"

    def __post_init__(self):
        for key in ("encoder", "decoder"):
            dim, heads = getattr(self, f"{key}_dim"), getattr(self, f"{key}_heads")
            if dim % heads:
                raise ValueError(f"{key}_dim {dim} is not divisible by {key}_heads {heads}")

    @property
    def seq_len(self) -> int:
        return self.grid_size**2

    def diffusion_config(self) -> DiffusionHeadConfig:
        """The head as MAR samples it: 1000 cosine steps respaced to `sampling_steps`, last step noise-free
        (unless `final_step_noise`)."""
        return DiffusionHeadConfig(
            token_dim=self.token_dim,
            condition_dim=self.decoder_dim,
            width=self.diffloss_width,
            depth=self.diffloss_depth,
            training_steps=1000,
            sampling_steps=self.sampling_steps,
            final_step_noise=self.final_step_noise,
            clip_denoised=self.clip_denoised,
            time_frequencies=self.time_frequencies,
        )

    def to_dict(self) -> dict:
        return asdict(self)


# Official mar_base / mar_large / mar_huge (encoder = decoder), with the diffusion head depth and width of the
# README's evaluation commands (--diffloss_d / --diffloss_w; the argparse defaults, 12 / 1536, fit MAR-H only).
MAR_SIZES: dict[str, dict] = {
    "base": dict(
        encoder_dim=768,
        encoder_depth=12,
        encoder_heads=12,
        decoder_dim=768,
        decoder_depth=12,
        decoder_heads=12,
        diffloss_depth=6,
        diffloss_width=1024,
        name="mar-base",
    ),
    "large": dict(
        encoder_dim=1024,
        encoder_depth=16,
        encoder_heads=16,
        decoder_dim=1024,
        decoder_depth=16,
        decoder_heads=16,
        diffloss_depth=8,
        diffloss_width=1280,
        name="mar-large",
    ),
    "huge": dict(
        encoder_dim=1280,
        encoder_depth=20,
        encoder_heads=16,
        decoder_dim=1280,
        decoder_depth=20,
        decoder_heads=16,
        diffloss_depth=12,
        diffloss_width=1536,
        name="mar-huge",
    ),
}
# Test-sized: 4x4 grid, 4 buffer positions, 10 classes, a 10-step diffusion head.
MAR_SIZES["tiny"] = {
    "encoder_dim": 32,
    "encoder_depth": 2,
    "encoder_heads": 2,
    "decoder_dim": 32,
    "decoder_depth": 2,
    "decoder_heads": 2,
    "token_dim": 4,
    "grid_size": 4,
    "buffer_size": 4,
    "num_classes": 10,
    "diffloss_depth": 2,
    "diffloss_width": 64,
    "sampling_steps": 10,
    "time_frequencies": 32,
    "name": "mar-tiny-random",
}


def mar_config(size: str = "base", **overrides) -> MARConfig:
    """The config of a released size ("base", "large", "huge") or "tiny", with `overrides` applied."""
    if size not in MAR_SIZES:
        raise ValueError(f"unknown MAR size {size!r}; choose from {sorted(MAR_SIZES)}")
    return MARConfig(**{**MAR_SIZES[size], **overrides})


def mask_lengths(seq_len: int, num_iter: int) -> list[int]:
    """Positions still masked after each step of MAR's generation (0 after the last step).

    LTH14/mar ``MAR.sample_tokens``: after step s, ``mask_len = floor(seq_len * cos(pi/2 * (s+1) / num_iter))``
    clamped to ``[1, masked - 1]`` (each step reveals at least one position while two or more are masked, and
    keeps one for the last step, which reveals all that are left). Computed in float64 with numpy as there.
    """
    return [0 if step == num_iter - 1 else length for step, length in enumerate(_schedule(seq_len, num_iter))]


def _schedule(seq_len: int, num_iter: int) -> list[int]:
    """The reference's ``mask_len`` of every step, as the linear CFG schedule reads it.

    At the last step this is max(1, min(left - 1, 0)) = 1, not 0: the reference's last step guides with
    ``1 + (cfg - 1) * (seq_len - 1) / seq_len``.
    """
    if num_iter < 1:
        raise ValueError(f"num_iter must be >= 1, got {num_iter}")
    masked, lengths = seq_len, []
    for step in range(num_iter):
        ratio = np.cos(math.pi / 2.0 * (step + 1) / num_iter)
        length = max(1, min(masked - 1, int(np.floor(seq_len * ratio))))
        lengths.append(length)
        masked = length
    return lengths


@dataclass(frozen=True)
class RevealStep:
    """One step of MAR's generation: it samples the positions ``orders[:, start:end]``, guided at `cfg_scale`."""

    start: int
    end: int
    cfg_scale: float


def reveal_steps(seq_len: int, num_iter: int, cfg_scale: float = 1.0, cfg_schedule: str = "linear") -> list[RevealStep]:
    """The steps of MAR's generation that reveal at least one position, in order (LTH14/mar ``sample_tokens``).

    Step s keeps the first `mask_lengths` [s] positions of each order masked and samples the rest of those
    still masked (the last step: all of them). Guidance mixes the noise predictions with
    ``1 + (cfg - 1) * (seq_len - mask_len) / seq_len`` ("linear", after Muse; the last step reads
    mask_len 1, as the reference) or ``cfg`` ("constant").
    """
    if cfg_schedule not in ("linear", "constant"):
        raise ValueError(f"cfg_schedule must be 'linear' or 'constant', got {cfg_schedule!r}")
    steps, masked = [], seq_len
    for step, mask_len in enumerate(_schedule(seq_len, num_iter)):
        start = 0 if step == num_iter - 1 else mask_len
        scale = cfg_scale if cfg_schedule == "constant" else 1 + (cfg_scale - 1) * (seq_len - mask_len) / seq_len
        if start < masked:  # (with num_iter > seq_len some steps reveal nothing)
            steps.append(RevealStep(start, masked, scale))
        masked = start
    return steps


@dataclass(frozen=True)
class MAREncoding:
    """The encoder half's output (`MARBackbone.encode_known`), what the decoder half reads."""

    x: torch.Tensor  # (rows, width, encoder_dim) after encoder_norm: buffer, known positions ascending, padding
    kept: torch.Tensor  # (rows, width): the index in [buffer; grid] each entry of x came from
    valid: torch.Tensor  # (rows, width) bool: False at the padding of rows that know fewer than the longest
    positions: int  # buffer_size + seq_len: the decoder's sequence length


class _Attention(nn.Module):
    """timm ``Attention`` (qkv_bias=True, no qk norm), names ``qkv`` and ``proj``."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        # Bidirectional, scale head_dim**-0.5 as timm; `mask` (B, 1, 1, L): the keys each row may read.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(batch, length, dim))


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _Block(nn.Module):
    """timm ``vision_transformer.Block`` at inference (dropouts, layer scale and drop path are identities)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = _Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = _Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), mask)
        return x + self.mlp(self.norm2(x))


# Local (this project's DenoisingMLP, under "diffusion.net.") -> official (SimpleMLPAdaLN, under "diffloss.net.").
_HEAD_RENAMES = [
    (r"time_embed\.(\d+)\.", r"time_embed.mlp.\1."),
    (r"condition_embed\.", "cond_embed."),
    (r"input_proj\.", "input_proj."),
    (r"blocks\.(\d+)\.norm\.", r"res_blocks.\1.in_ln."),
    (r"blocks\.(\d+)\.mlp\.", r"res_blocks.\1.mlp."),
    (r"blocks\.(\d+)\.modulation\.", r"res_blocks.\1.adaLN_modulation."),
    (r"final_modulation\.", "final_layer.adaLN_modulation."),
    (r"output\.", "final_layer.linear."),
]
_LOCAL_HEAD, _OFFICIAL_HEAD = "diffusion.net.", "diffloss.net."


def official_name(local: str) -> str:
    """The official LTH14/mar state-dict name of a `MARBackbone` parameter (only the diffusion head's differ)."""
    if not local.startswith(_LOCAL_HEAD):
        return local
    rest = local.removeprefix(_LOCAL_HEAD)
    for pattern, replacement in _HEAD_RENAMES:
        renamed, count = re.subn(f"^{pattern}", replacement, rest)
        if count:
            return _OFFICIAL_HEAD + renamed
    raise KeyError(f"no official name for diffusion head parameter {local!r}")


class MARBackbone(nn.Module):
    """A frozen MAR generator: the official modules and names, this project's diffusion head.

    ``sample`` reproduces LTH14/mar ``MAR.sample_tokens`` with the generation orders and every token's
    trajectory noise passed in; ``predict_conditions`` is one encoder-decoder pass for a verifier.
    Tokens are (B, seq_len, token_dim), token i at grid cell (i // grid_size, i % grid_size) (the official
    ``patchify`` with patch_size 1).
    """

    # Continuous tokens in a masked random order: decoded by `ar` (this sampler) and decode/cspd_mar.py only.
    token_kind = "masked"

    def __init__(self, config: MARConfig, num_iter: int = 64, cfg_schedule: str = "linear"):
        super().__init__()
        reveal_steps(config.seq_len, num_iter, cfg_schedule=cfg_schedule)  # refuses bad values now
        self.config = c = config
        # How `python -m decode` generates with this model (every method of a run): MAR's steps and CFG schedule.
        self.num_iter, self.cfg_schedule = num_iter, cfg_schedule
        self.name = c.name
        self.geometry = ImageGeometry(rows=c.grid_size, cols=c.grid_size, end_of_line=False)
        self.seq_len, self.token_dim, self.hidden_size = c.seq_len, c.token_dim, c.decoder_dim
        self.num_classes, self.buffer_size = c.num_classes, c.buffer_size
        positions = c.buffer_size + c.seq_len

        self.class_emb = nn.Embedding(c.num_classes, c.encoder_dim)
        self.fake_latent = nn.Parameter(torch.zeros(1, c.encoder_dim))
        self.z_proj = nn.Linear(c.token_dim, c.encoder_dim)
        self.z_proj_ln = nn.LayerNorm(c.encoder_dim, eps=1e-6)
        self.encoder_pos_embed_learned = nn.Parameter(torch.zeros(1, positions, c.encoder_dim))
        self.encoder_blocks = nn.ModuleList(
            _Block(c.encoder_dim, c.encoder_heads, c.mlp_ratio) for _ in range(c.encoder_depth)
        )
        self.encoder_norm = nn.LayerNorm(c.encoder_dim, eps=1e-6)
        self.decoder_embed = nn.Linear(c.encoder_dim, c.decoder_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, c.decoder_dim))
        self.decoder_pos_embed_learned = nn.Parameter(torch.zeros(1, positions, c.decoder_dim))
        self.decoder_blocks = nn.ModuleList(
            _Block(c.decoder_dim, c.decoder_heads, c.mlp_ratio) for _ in range(c.decoder_depth)
        )
        self.decoder_norm = nn.LayerNorm(c.decoder_dim, eps=1e-6)
        self.diffusion_pos_embed_learned = nn.Parameter(torch.zeros(1, c.seq_len, c.decoder_dim))
        self.diffusion = DiffusionHead(c.diffusion_config())
        # Pixels: the tokens themselves when they are pixel patches, else the KL-16 VAE, a separate checkpoint
        # (load_mar_backbone's vae_path).
        object.__setattr__(self, "vae", PixelPatches(c.pixel_patch_size) if c.pixel_patch_size else None)

    def identity(self) -> dict:
        """What a run records and a drafter is checked against: name, sizes, geometry, a weights fingerprint."""
        return {
            **continuous_identity(self),
            "noise_steps": self.diffusion.noise_steps,
            "final_step_noise": self.config.final_step_noise,
            "num_iter": self.num_iter,
            "cfg_schedule": self.cfg_schedule,
        }

    def weights_fingerprint(self) -> str:
        """A short hash of the weights (their sum per tensor, rounded): equal models, equal fingerprints."""
        digest = hashlib.sha1()
        for name, value in self.state_dict().items():
            digest.update(name.encode())
            digest.update(np.float64(value.double().sum().item()).round(4).tobytes())
        return digest.hexdigest()[:12]

    # ---- official weights ------------------------------------------------------------------

    def official_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under their LTH14/mar names and shapes (what the official ``MAR.state_dict()`` holds).

        As with ``state_dict()``, the tensors share storage with this module.
        """
        return {official_name(local): value for local, value in self.state_dict().items()}

    def load_official_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load an official state dict (``checkpoint["model_ema"]`` of LTH14/mar) strictly.

        Every official key must be present, none other, each of the official shape; the first offending
        key is named in the ValueError. Values are cast to this module's dtype and device.
        """
        own = self.state_dict()
        expected = {official_name(local): local for local in own}
        for name, value in state.items():
            if name not in expected:
                raise ValueError(f"unexpected key {name!r} in the MAR state dict (not a parameter of {self.name})")
            shape = tuple(own[expected[name]].shape)
            if tuple(value.shape) != shape:
                raise ValueError(
                    f"MAR state dict key {name!r} has shape {tuple(value.shape)}, {self.name} expects {shape}"
                )
        missing = [name for name in expected if name not in state]
        if missing:
            raise ValueError(f"MAR state dict lacks {missing[0]!r} ({len(missing)} keys missing)")
        local = {}
        for name, value in state.items():
            target = own[expected[name]]
            local[expected[name]] = value.to(device=target.device, dtype=target.dtype)
        self.load_state_dict(local, strict=True)

    # ---- the encoder-decoder ----------------------------------------------------------------

    def conditions(self, tokens: torch.Tensor, known: torch.Tensor, class_embedding: torch.Tensor) -> torch.Tensor:
        """One encoder-decoder pass (MAR's ``forward_mae_encoder`` + ``forward_mae_decoder``): z (rows, seq_len, dim).

        tokens (rows, seq_len, token_dim) read where `known` (rows, seq_len) is True; `class_embedding`
        (rows, encoder_dim) from `class_embedding` (twins stacked by the caller).

        The encoder reads the buffer and the known positions only (the reference drops the others with a
        reshape that needs every row to know as many); rows that know different numbers run in one batch,
        their kept positions padded to the longest row's and the padding masked out of the encoder's
        attention (a verifier's rows of different draft prefixes: one pass).

        The pass is `encode_known` then `decode_conditions` (Harmon, backbones/harmon.py, adds its LLM's
        residual between the two).
        """
        return self.decode_conditions(self.encode_known(tokens, known, class_embedding))

    def encode_known(
        self,
        tokens: torch.Tensor,
        known: torch.Tensor,
        class_embedding: torch.Tensor,
        pos_embed: torch.Tensor | None = None,
    ) -> MAREncoding:
        """The encoder half of `conditions` (``forward_mae_encoder``, ending with ``encoder_norm``).

        `pos_embed` (1, buffer_size + seq_len, encoder_dim) replaces ``encoder_pos_embed_learned`` (Harmon
        interpolates it to another grid; then tokens hold that grid's seq_len positions).
        """
        rows, buffer = tokens.shape[0], self.buffer_size
        pos_embed = self.encoder_pos_embed_learned if pos_embed is None else pos_embed
        x = self.z_proj(tokens)
        x = torch.cat([class_embedding[:, None].expand(rows, buffer, -1).to(x.dtype), x], dim=1)
        x = self.z_proj_ln(x + pos_embed)
        keep = torch.cat([known.new_ones(rows, buffer), known], dim=1)  # the buffer is always visible
        counts = keep.sum(1)
        width = int(counts.max())
        # Each row's kept positions in ascending order (then its others, cut off or masked as padding).
        kept = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :width]
        valid = torch.arange(width, device=x.device)[None] < counts[:, None]  # (rows, width)
        mask = None if bool(valid.all()) else valid[:, None, None, :]  # keys a query may attend to
        x = x.gather(1, kept[..., None].expand(-1, -1, x.shape[-1]))
        for block in self.encoder_blocks:
            x = block(x, mask)
        return MAREncoding(self.encoder_norm(x), kept, valid, keep.shape[1])

    def decode_conditions(
        self,
        encoding: MAREncoding,
        pos_embed: torch.Tensor | None = None,
        diffusion_pos_embed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder half of `conditions` (``forward_mae_decoder``): z (rows, seq_len, decoder_dim).

        `pos_embed` (1, buffer_size + seq_len, decoder_dim) and `diffusion_pos_embed` (1, seq_len,
        decoder_dim) replace the learned ones (Harmon's interpolated grids).
        """
        pos_embed = self.decoder_pos_embed_learned if pos_embed is None else pos_embed
        if diffusion_pos_embed is None:
            diffusion_pos_embed = self.diffusion_pos_embed_learned
        kept, valid = encoding.kept, encoding.valid
        rows, width = valid.shape
        x = self.decoder_embed(encoding.x)
        padded = self.mask_token.to(x.dtype).expand(rows, encoding.positions, -1).clone()
        row_index = torch.arange(rows, device=x.device)[:, None].expand(-1, width)
        padded[row_index[valid], kept[valid]] = x[valid]
        x = padded + pos_embed
        for block in self.decoder_blocks:
            x = block(x)
        return self.decoder_norm(x)[:, self.buffer_size :] + diffusion_pos_embed

    def condition_state(self, class_ids: torch.Tensor, guided: bool) -> torch.Tensor:
        """What `conditions` reads for these class ids: their buffer embeddings, [class; fake latent] twins when
        `guided` (the masked generators' name for it; Harmon's is its prompts' KV cache)."""
        return self.class_embedding(class_ids, guided)

    def repeat_condition(self, state: torch.Tensor, times: int, guided: bool) -> torch.Tensor:
        """`state` for `times` copies of the batch: [cond x times; uncond x times], the twins' row layout."""
        return repeat_twin_blocks(state, times, 2 if guided else 1)

    def drafter_settings(self, device: str | torch.device | None = None) -> dict:
        """The loader's arguments a drafter of this model takes from it: device, dtype, steps, CFG schedule and
        last-step setting (CSpD shares the trajectory noise and the steps, so these must agree)."""
        return {
            "device": str(device or self.z_proj.weight.device),
            "dtype": str(self.z_proj.weight.dtype).removeprefix("torch."),
            "num_iter": self.num_iter,
            "cfg_schedule": self.cfg_schedule,
            "final_step_noise": self.config.final_step_noise,
        }

    def load_drafter(self, path: str | Path, device: str | torch.device | None = None) -> MARBackbone:
        """A MAR checkpoint at `path` loaded to draft for this model (`drafter_settings`)."""
        return load_mar_backbone(path, **self.drafter_settings(device))

    def class_embedding(self, class_ids: torch.Tensor, guided: bool) -> torch.Tensor:
        """The buffer's class embeddings (B, dim), or (2B, dim) as [class; fake latent] when `guided`."""
        if class_ids.dim() != 1:
            raise ValueError(f"class_ids must be (B,), got shape {tuple(class_ids.shape)}")
        if len(class_ids) and not (0 <= int(class_ids.min()) and int(class_ids.max()) < self.num_classes):
            raise ValueError(f"class ids must lie in [0, {self.num_classes})")
        embedding = self.class_emb(class_ids)
        if guided:  # [cond; uncond]: the null condition is the learned fake latent
            embedding = torch.cat([embedding, self.fake_latent.expand(len(class_ids), -1).to(embedding.dtype)])
        return embedding

    @torch.no_grad()
    def predict_conditions(
        self, tokens: torch.Tensor, known_mask: torch.Tensor, class_ids: torch.Tensor, guided: bool
    ) -> torch.Tensor:
        """The diffusion head's condition z of every position given the known tokens: (rows, seq_len, dim).

        tokens (B, seq_len, token_dim), values read only where ``known_mask`` (B, seq_len) is True; the
        encoder sees the buffer and the known positions, the decoder all (LTH14/mar ``forward_mae_encoder``,
        ``forward_mae_decoder``). rows = 2B as [cond; uncond] when `guided`, else B. Rows may know different
        numbers of tokens; each row's result does not depend on the others.
        """
        batch = tokens.shape[0]
        if tokens.shape[1:] != (self.seq_len, self.token_dim) or known_mask.shape != (batch, self.seq_len):
            raise ValueError(
                f"tokens must be (B, {self.seq_len}, {self.token_dim}) and known_mask (B, {self.seq_len}); "
                f"got {tuple(tokens.shape)} and {tuple(known_mask.shape)}"
            )
        known = known_mask.bool()
        class_embedding = self.class_embedding(class_ids, guided)
        if guided:
            tokens, known = torch.cat([tokens, tokens]), torch.cat([known, known])
        return self.conditions(tokens.to(self.z_proj.weight.dtype), known, class_embedding)

    # ---- sampling ---------------------------------------------------------------------------

    @torch.no_grad()
    def sample(
        self,
        class_ids: torch.Tensor,
        num_iter: int = 64,
        cfg_scale: float = 1.0,
        cfg_schedule: str = "linear",
        temperature: float = 1.0,
        orders: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        steps: list[RevealStep] | None = None,
    ) -> torch.Tensor:
        """MAR's masked random-order generation (LTH14/mar ``MAR.sample_tokens``): tokens (B, seq_len, token_dim).

        Step s runs the encoder-decoder on the tokens known so far, keeps the first ``mask_len`` positions
        of each row's order masked (`mask_lengths`, MaskGIT's cosine schedule) and samples the positions
        ``orders[:, mask_len:masked]`` with the diffusion head (the last step: all that remain). Guidance
        (``cfg_scale != 1``) runs [class; fake latent] twins and mixes the head's noise predictions with
        ``1 + (cfg - 1) * (seq_len - mask_len) / seq_len`` ("linear", after Muse) or ``cfg`` ("constant").

        `orders` (B, seq_len): one permutation of the positions per row (the reference shuffles with numpy);
        `noise` (B, seq_len, noise_steps, token_dim): the trajectory noise of the token at each position
        (``noise[:, i, 0]`` its x_T). Whichever is missing is drawn from `generator`. Since a token's noise
        is fixed by its position, not by the step that reveals it, two models given the same `noise` follow
        aligned trajectories (CSpD). Rows are independent of each other.

        `steps` replaces the schedule's steps (`reveal_steps` of `num_iter`, `cfg_scale`, `cfg_schedule`)
        with others that reveal every position once (decode/mar_grouped.py: several of them at a time).
        """
        batch, device = len(class_ids), self.z_proj.weight.device
        steps = reveal_steps(self.seq_len, num_iter, cfg_scale, cfg_schedule) if steps is None else steps
        orders = self.check_orders(orders, batch, generator, device)
        noise = self.check_noise(noise, batch, generator, device)
        guided = cfg_scale != 1.0  # as the reference: guidance twins only when the scale is not exactly 1
        class_embedding = self.class_embedding(class_ids.to(device), guided)
        tokens = torch.zeros(batch, self.seq_len, self.token_dim, device=device, dtype=self.z_proj.weight.dtype)
        known = torch.zeros(batch, self.seq_len, dtype=torch.bool, device=device)
        for step in steps:
            positions = orders[:, step.start : step.end]  # (B, n): the same count in every row
            z = self.conditions_at(tokens, known, class_embedding, positions)
            drawn = self.sample_positions(z, gather_positions(noise, positions), step.cfg_scale, temperature)
            tokens, known = reveal(tokens, known, positions, drawn.tokens)
        return tokens

    def conditions_at(
        self, tokens: torch.Tensor, known: torch.Tensor, class_embedding: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The conditions of `positions` (B, n) given the known tokens: (B*n, dim), or (2B*n, dim) as
        [cond; uncond] when `class_embedding` holds twins (the diffusion head's layout). (Harmon's too: its
        condition's len is its rows.)"""
        guided = len(class_embedding) == 2 * len(tokens)
        if guided:
            tokens, known, positions = torch.cat([tokens, tokens]), torch.cat([known, known]), positions.repeat(2, 1)
        z = self.conditions(tokens, known, class_embedding)
        return z.gather(1, positions[..., None].expand(-1, -1, z.shape[-1])).flatten(0, 1)

    def sample_positions(
        self, z: torch.Tensor, noise: torch.Tensor, cfg_scale: float | torch.Tensor, temperature: float
    ) -> DiffusionSample:
        """The diffusion head's tokens at B*n positions given their conditions z (`conditions_at`) and their
        trajectory noise (B, n, noise_steps, token_dim); every field of the result is (B, n, token_dim).

        `cfg_scale` is a number or one scale per position, (B*n, 1) (verifying several steps at once).
        """
        batch, count = noise.shape[:2]
        guided = z.shape[0] == 2 * batch * count
        drawn = self.diffusion.sample(z, noise.flatten(0, 1), cfg_scale, temperature, guided=guided)
        return drawn.map(lambda value: value.view(batch, count, -1))

    def check_orders(self, orders, batch, generator, device) -> torch.Tensor:
        """`orders` checked (B, seq_len), one permutation per row; drawn from `generator` when None."""
        if orders is None:
            return torch.stack([torch.randperm(self.seq_len, generator=generator) for _ in range(batch)]).to(device)
        orders = orders.to(device=device, dtype=torch.long)
        identity = torch.arange(self.seq_len, device=device).expand(batch, -1)
        if orders.shape != (batch, self.seq_len) or not torch.equal(orders.sort(1).values, identity):
            raise ValueError(
                f"orders must be (B={batch}, {self.seq_len}) with one permutation of the positions per row"
            )
        return orders

    def check_noise(self, noise, batch, generator, device) -> torch.Tensor:
        """`noise` checked (B, seq_len, noise_steps, token_dim); drawn from `generator` when None."""
        shape = (batch, self.seq_len, self.diffusion.noise_steps, self.token_dim)
        if noise is None:
            return torch.randn(shape, generator=generator).to(device)
        if tuple(noise.shape) != shape:
            raise ValueError(f"noise must be {shape} (B, seq_len, noise_steps, token_dim), got {tuple(noise.shape)}")
        return noise.to(device)

    # ---- pixels ----------------------------------------------------------------------------

    def attach_vae(self, vae: MARKLVAE | None) -> None:
        """Decode and encode pixels through `vae` (MAR's KL-16, backbones/mar_vae.py); None detaches it.

        The VAE is kept outside this module's parameters, so the weights fingerprint, the official state
        dict and ``.to()`` see MAR only; `tokens_to_pixels` runs it on the tokens' device.
        """
        if self.config.pixel_patch_size:  # its tokens are its pixels: nothing to attach or detach
            if vae is not None:
                raise ValueError(f"{self.name}'s tokens are pixel patches: it decodes pixels without a VAE")
            return
        if vae is not None and vae.config.embed_dim != self.token_dim:
            raise ValueError(
                f"the VAE has {vae.config.embed_dim} latent channels, {self.name}'s tokens have {self.token_dim}"
            )
        object.__setattr__(self, "vae", vae)

    def _pixel_codec(self, device: torch.device) -> MARKLVAE | PixelPatches:
        vae = self.vae
        if vae is None:
            raise NotImplementedError(
                f"{self.name} has no pixel decoder: MAR's tokens are KL-16 VAE latents; {_vae_advice()}"
            )
        return vae.to(device)

    def tokens_to_pixels(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens (B, rows, cols, token_dim) -> images (B, 3, 16 rows, 16 cols) in [0, 1] through the KL-16 VAE
        (`attach_vae`, ``backbone.vae_path``); NotImplementedError without one. Pixel-patch tokens (the embedded
        digits MAR): (B, 1, rows * p, cols * p)."""
        return self._pixel_codec(tokens.device).tokens_to_pixels(tokens)

    def pixels_to_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1] -> tokens (B, H / 16, W / 16, token_dim) (the VAE posterior's mean)."""
        return self._pixel_codec(images.device).pixels_to_tokens(images)

    # ---- a MAR trained here ----------------------------------------------------------------

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write config.json (the `MARConfig`) and model.safetensors (the weights under their official LTH14/mar
        names, as `official_state_dict`), each atomically, then read the weights back and compare them.

        `load_mar_backbone(directory)` loads it through the same path as a released checkpoint's state dict.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {name: value.detach().cpu().contiguous() for name, value in self.official_state_dict().items()}
        atomic_save_safetensors(state, directory / SAVED_WEIGHTS_FILE)
        written = load_safetensors_checkpoint(directory / SAVED_WEIGHTS_FILE, "a MAR checkpoint", _RETRAIN)
        if written.keys() != state.keys() or any(not torch.equal(written[k], v) for k, v in state.items()):
            raise OSError(f"{directory / SAVED_WEIGHTS_FILE} does not read back as written; write it again")
        atomic_write_text(directory / SAVED_CONFIG_FILE, json.dumps(self.config.to_dict(), indent=2) + "\n")
        return directory


@dataclass(frozen=True)
class PixelPatches:
    """The pixel codec of pixel-patch tokens (`MARConfig.pixel_patch_size`), in place of a VAE: a token is a
    ``p x p`` patch of grey pixels in [-1, 1], as the embedded continuous digits backbone's."""

    patch_size: int

    def to(self, device: torch.device) -> PixelPatches:
        return self  # (no weights)

    def tokens_to_pixels(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, rows, cols, p*p) -> (B, 1, rows*p, cols*p) in [0, 1]."""
        return patches_to_images(tokens.float(), self.patch_size)

    def pixels_to_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 1 or 3, H, W) in [0, 1] -> (B, H/p, W/p, p*p) in [-1, 1] (colour channels averaged)."""
        return images_to_patches(images.float(), self.patch_size)


def repeat_twin_blocks(rows: torch.Tensor, times: int, twins: int) -> torch.Tensor:
    """rows (twins * B, ...) as [cond; uncond] blocks -> (twins * times * B, ...): each block `times` times over."""
    return torch.cat([block.repeat(times, *[1] * (rows.dim() - 1)) for block in rows.chunk(twins)])


def gather_positions(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """values (B, seq_len, ...) at positions (B, n): (B, n, ...)."""
    return values[torch.arange(values.shape[0], device=values.device)[:, None], positions]


def reveal(tokens: torch.Tensor, known: torch.Tensor, positions: torch.Tensor, values: torch.Tensor):
    """New (tokens, known) with `values` (B, n, token_dim) written at `positions` (B, n) and marked known."""
    index = positions[..., None].expand(-1, -1, tokens.shape[-1])
    return tokens.scatter(1, index, values.to(tokens.dtype)), known.scatter(1, positions, True)


# ---- loading ----------------------------------------------------------------------------------


def _read_state_dict(path: Path, trust_pickle: bool) -> dict[str, torch.Tensor]:
    """The official state dict in `path`: ``model_ema`` (falling back to ``model``) of a checkpoint-last.pth,
    or a bare state dict (.pth or .safetensors)."""
    if path.suffix == ".safetensors":
        return load_safetensors_checkpoint(path, "a MAR checkpoint", f"({README})")
    checkpoint = load_torch_checkpoint(path, trust_pickle, "a MAR checkpoint", f"({README})")
    # main_mar.py saves {"model", "model_ema", "optimizer", "epoch", "scaler", "args"}; the demo loads "model_ema".
    for key in ("model_ema", "model"):
        if isinstance(checkpoint.get(key), dict):
            return checkpoint[key]
    if all(isinstance(value, torch.Tensor) for value in checkpoint.values()):
        return checkpoint
    raise KeyError(f"{path}: neither 'model_ema' nor 'model' in the checkpoint (keys: {sorted(checkpoint)[:8]})")


def _vae_advice() -> str:
    return (
        "pass backbone.vae_path=<dir or kl16.ckpt> (load_mar_backbone(..., vae_path=...)); get kl16.ckpt from "
        f"the LTH14/mar README ({README}) or `python util/download.py` in a clone (pretrained_models/vae/kl16.ckpt)"
    )


def _download_advice(size: str) -> str:
    link = DOWNLOAD_LINKS.get(size, README)
    return (
        f"get MAR-{size[0].upper()} from the LTH14/mar README ({README}): {CHECKPOINT_FILE} at\n"
        f"  {link}\n"
        f"(or `python util/download.py` in a clone of LTH14/mar: pretrained_models/mar/mar_{size}/{CHECKPOINT_FILE})\n"
        f"or the Hugging Face mirror's safetensors with\n"
        f"  huggingface-cli download {HF_REPO} mar-{size}.safetensors --local-dir <dir>\n"
        "and pass the file or its directory"
    )


def load_mar_backbone(
    path: str | Path,
    size: str = "auto",
    device: str = "cpu",
    dtype: str = "float32",
    trust_pickle: bool = False,
    num_iter: int = 64,
    cfg_schedule: str = "linear",
    final_step_noise: bool = False,
    vae_path: str | Path | None = None,
) -> MARBackbone:
    """Hydra entry point: a frozen MAR from its official weights (Li et al. 2024; LTH14/mar).

    `path` is a file or a directory holding ``checkpoint-last.pth`` (the README's download, read with
    ``torch.load(weights_only=True)``: ``model_ema`` as the official evaluation and demo use, ``model`` if
    there is no EMA) or ``mar-{size}.safetensors`` (the Hugging Face mirror jadechoghari/mar, a bare state
    dict converted by a third party). `size` "auto" reads it off the weights' shapes. `trust_pickle=True`
    allows arbitrary pickled objects (only for files from a source you trust). `num_iter` and `cfg_schedule`
    are how this model generates in `python -m decode` (the README's evaluation: 256, linear);
    `final_step_noise` see `MARConfig`. `vae_path`: the KL-16 VAE (``kl16.ckpt`` or its directory), loaded in
    the same dtype, for images and image quality; without it runs report passes and speed only. Raises
    FileNotFoundError with the download links when a checkpoint is not there.

    A directory holding config.json and model.safetensors is a MAR trained here (`MARBackbone.save_pretrained`,
    e.g. checkpoints/mar-digits): its shape comes from config.json (`size` must be "auto"), its weights load
    by their official names as a released state dict's do.
    """
    path = Path(path)
    if (path / SAVED_CONFIG_FILE).is_file():
        return _load_saved_mar(path, size, device, dtype, num_iter, cfg_schedule, final_step_noise, vae_path)
    if size != "auto" and size not in MAR_SIZES:  # ("tiny" too: tests save official-layout tiny checkpoints)
        raise ValueError(f"unknown MAR size {size!r}; choose from auto, {', '.join(sorted(MAR_SIZES))}")
    if path.is_dir():
        names = [CHECKPOINT_FILE] + [f"mar-{s}.safetensors" for s in (MAR_SIZES if size == "auto" else [size])]
        candidates = [path / name for name in names]
        path = next((p for p in candidates if p.is_file()), candidates[0])
    if not path.is_file():
        raise FileNotFoundError(f"no MAR checkpoint at {path}: {_download_advice('base' if size == 'auto' else size)}")
    state = _read_state_dict(path, trust_pickle)
    size = infer_size(state, path) if size == "auto" else size
    backbone = MARBackbone(mar_config(size, final_step_noise=final_step_noise), num_iter, cfg_schedule)
    try:
        backbone.load_official_state_dict(state)
    except ValueError as error:
        raise ValueError(f"{path}: {error} (is it a MAR-{size[0].upper()} checkpoint?)") from error
    if vae_path is not None:  # read now, so that a missing VAE stops the run before any image is generated
        backbone.attach_vae(load_kl16_vae(vae_path, device=device, dtype=dtype, trust_pickle=trust_pickle))
    return backbone.to(device=device, dtype=getattr(torch, dtype)).eval().requires_grad_(False)


_RETRAIN = "or export it again (python -m train +experiment=backbone_mar_digits for the embedded MAR)"


def _load_saved_mar(path, size, device, dtype, num_iter, cfg_schedule, final_step_noise, vae_path) -> MARBackbone:
    """`load_mar_backbone` of a directory written by `MARBackbone.save_pretrained`."""
    if size != "auto":
        raise ValueError(f"{path} holds a MAR trained here, whose shape is its {SAVED_CONFIG_FILE}: pass size=auto")
    weights = path / SAVED_WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(
            f"{path} has {SAVED_CONFIG_FILE} but no {SAVED_WEIGHTS_FILE}: the export did not finish; export it again"
        )
    saved = json.loads((path / SAVED_CONFIG_FILE).read_text())
    config = MARConfig(**{**saved, "final_step_noise": final_step_noise})
    backbone = MARBackbone(config, num_iter, cfg_schedule)
    try:
        backbone.load_official_state_dict(load_safetensors_checkpoint(weights, "a MAR checkpoint", _RETRAIN))
    except ValueError as error:
        raise ValueError(f"{weights}: {error} (does {SAVED_CONFIG_FILE} belong to these weights?)") from error
    if vae_path is not None:
        backbone.attach_vae(load_kl16_vae(vae_path, device=device, dtype=dtype))
    return backbone.to(device=device, dtype=getattr(torch, dtype)).eval().requires_grad_(False)


def infer_size(state: dict[str, torch.Tensor], path: Path | str = "the state dict") -> str:
    """The `MAR_SIZES` entry whose shapes an official state dict has (width, depths, diffusion head)."""

    def depth(prefix: str) -> int:
        return len({key.split(".")[1] for key in state if key.startswith(prefix)})

    try:
        found = {
            "encoder_dim": state["z_proj.weight"].shape[0],
            "token_dim": state["z_proj.weight"].shape[1],
            "decoder_dim": state["decoder_embed.weight"].shape[0],
            "encoder_depth": depth("encoder_blocks."),
            "decoder_depth": depth("decoder_blocks."),
            "diffloss_width": state["diffloss.net.input_proj.weight"].shape[0],
            "diffloss_depth": len({key.split(".")[3] for key in state if key.startswith("diffloss.net.res_blocks.")}),
        }
    except KeyError as error:
        raise ValueError(f"{path}: no {error.args[0]!r}: not an official MAR state dict") from None
    for size in MAR_SIZES:
        config = mar_config(size)
        if all(getattr(config, key) == value for key, value in found.items()):
            return size
    raise ValueError(
        f"{path}: a MAR of shape {found} is none of the released sizes ({', '.join(MAR_SIZES)}); "
        "pass backbone.size= if it is one of them"
    )


def random_mar_backbone(
    seed: int = 0,
    device: str = "cpu",
    size: str = "tiny",
    num_iter: int = 64,
    cfg_schedule: str = "linear",
    dtype: str = "float32",
    vae_seed: int | None = None,
    **overrides,
) -> MARBackbone:
    """A MAR backbone with seeded random weights (tiny by default; for tests).

    The official init zeroes the diffusion head's modulations and output (every token would be the mean
    of the schedule); random weights test more. Norm weights are centred on 1. `vae_seed`: attach a tiny
    random KL VAE (`backbones.mar_vae.random_kl_vae`, 2 pixels per token) so that pixels can be decoded.
    """
    torch.manual_seed(seed)
    backbone = MARBackbone(mar_config(size, **overrides), num_iter, cfg_schedule)
    return randomized(backbone, device, dtype, vae_seed)


def randomized(backbone: nn.Module, device: str, dtype: str, vae_seed: int | None) -> nn.Module:
    """`backbone` (MAR or Harmon) with the tiny test instances' random weights, drawn from the global generator
    (normal; norm weights centred on 1), a tiny random KL VAE when `vae_seed` is given, frozen on `device`."""
    with torch.no_grad():
        for name, parameter in backbone.named_parameters():
            nn.init.normal_(parameter, std=0.5 if parameter.dim() == 1 else 0.2)
            if name.endswith("weight") and ("norm" in name or "_ln" in name):
                parameter.add_(1.0)
    if vae_seed is not None:
        backbone.attach_vae(random_kl_vae(vae_seed, dtype=dtype, embed_dim=backbone.token_dim))
    return backbone.to(device=device, dtype=getattr(torch, dtype)).eval().requires_grad_(False)


__all__ = [
    "MAR_SIZES",
    "MARBackbone",
    "MARConfig",
    "MAREncoding",
    "PixelPatches",
    "RevealStep",
    "gather_positions",
    "infer_size",
    "load_mar_backbone",
    "mar_config",
    "mask_lengths",
    "official_name",
    "random_mar_backbone",
    "randomized",
    "reveal",
    "repeat_twin_blocks",
    "reveal_steps",
]
