"""The embedded continuous-token backbone: a class-conditional causal Llama over digit patches, MAR-style head.

The continuous counterpart of backbones/digits.py, trained here (`python -m train
+experiment=backbone_digits_continuous`) and committed in
checkpoints/digits-continuous, so that continuous speculative decoding (CSpD)
is measured on a real model on a CPU. The digits are rendered as for the
discrete backbone but not quantised; each token is one ``patch x patch`` patch
of pixels scaled to [-1, 1] (24x24 images, 2x2 patches: 144 tokens of 4
values), in raster order:

    [BOS, x_0, x_1, ..., x_{N-1}]      with the class embedding added at every position

The transformer's pre-norm state at a position, after the final norm, is the
condition ``z`` of MAR's diffusion head (backbones/diffusion_head.py), which
samples the token. Class id 10 is the null class of classifier-free guidance
(class dropout in training). The same class, smaller, is the CSpD paper's
drafter (heads/cspd.py): "a smaller model of the same family".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, LlamaModel
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from backbones.base import Condition, DecodeState, ImageGeometry
from backbones.continuous import ContinuousARBackbone
from backbones.diffusion_head import DiffusionHead, DiffusionHeadConfig
from backbones.hf_loading import positional_arguments
from backbones.saved_model import load_model, save_model

NUM_CLASSES = 10


@dataclass
class ContinuousDigitsConfig:
    """Shape of a continuous digits model; stored beside its weights as config.json."""

    image_size: int = 24  # pixels per side, as the discrete backbone's grid
    patch_size: int = 2  # pixels per token side: 12x12 = 144 tokens of 4 values
    hidden_size: int = 192
    num_layers: int = 4
    num_heads: int = 3  # head dim 64
    intermediate_size: int = 512
    head_width: int = 256  # the diffusion MLP's width
    head_depth: int = 3  # its AdaLN residual blocks (MAR's 3)
    training_steps: int = 1000
    sampling_steps: int = 50
    rope_theta: float = 10000.0
    name: str = "digits-continuous"

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.patch_size < 1 or self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} must be a multiple of patch_size {self.patch_size} (>= 1)")
        if self.grid_size < 2:
            raise ValueError(f"the token grid needs >= 2 tokens per side, got {self.grid_size}")

    @property
    def grid_size(self) -> int:
        return self.image_size // self.patch_size

    @property
    def token_dim(self) -> int:
        return self.patch_size**2

    @property
    def null_class(self) -> int:
        return NUM_CLASSES

    def diffusion_config(self) -> DiffusionHeadConfig:
        return DiffusionHeadConfig(
            token_dim=self.token_dim,
            condition_dim=self.hidden_size,
            width=self.head_width,
            depth=self.head_depth,
            training_steps=self.training_steps,
            sampling_steps=self.sampling_steps,
            final_step_noise=True,  # exact CSpD (backbones/diffusion_head.py)
            clip_denoised=True,  # tokens are pixels in [-1, 1]
        )


def images_to_patches(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, H, W) or (B, 1, H, W) in [0, 1] -> (B, H/p, W/p, p*p) tokens in [-1, 1]."""
    if images.dim() == 4:
        images = images.mean(1)
    batch, height, width = images.shape
    p = patch_size
    patches = images.reshape(batch, height // p, p, width // p, p).permute(0, 1, 3, 2, 4)
    return patches.reshape(batch, height // p, width // p, p * p) * 2 - 1


def patches_to_images(tokens: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, rows, cols, p*p) tokens -> (B, 1, rows*p, cols*p) images in [0, 1] (clamped)."""
    batch, rows, cols, _ = tokens.shape
    p = patch_size
    pixels = tokens.reshape(batch, rows, cols, p, p).permute(0, 1, 3, 2, 4).reshape(batch, rows * p, cols * p)
    return ((pixels + 1) / 2).clamp(0, 1).unsqueeze(1)


@dataclass(frozen=True)
class PatchTokenizer:
    """Images in [0, 1] to the continuous backbone's patch tokens, as the digits data module feeds them."""

    patch_size: int = 2

    def encode_sequence(self, images: torch.Tensor) -> torch.Tensor:
        """(N, H, W) images -> (N, H*W / p^2, p^2) tokens in [-1, 1], raster order."""
        return images_to_patches(images, self.patch_size).flatten(1, 2)


class ContinuousDigitsBackbone(ContinuousARBackbone):
    """Class-conditional causal Llama over patch tokens, each sampled by a diffusion head."""

    def __init__(self, config: ContinuousDigitsConfig):
        super().__init__()
        self.config = config
        self.name = config.name
        self.geometry = ImageGeometry(rows=config.grid_size, cols=config.grid_size)
        self.token_dim = config.token_dim
        self.hidden_size = config.hidden_size
        self.num_classes = NUM_CLASSES
        llama_config = LlamaConfig(
            vocab_size=1,  # inputs arrive as embeddings
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_heads,
            num_key_value_heads=config.num_heads,
            max_position_embeddings=config.grid_size**2 + 1,
            rope_theta=config.rope_theta,
            attn_implementation="sdpa",
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
        self.token_proj = nn.Linear(config.token_dim, config.hidden_size)
        self.bos = nn.Parameter(torch.zeros(config.hidden_size))
        self.class_embed = nn.Embedding(NUM_CLASSES + 1, config.hidden_size)  # + null class
        self.transformer = LlamaModel(llama_config)
        self.transformer.norm = nn.Identity()  # the pre-norm state is what latent heads predict
        self.norm = LlamaRMSNorm(config.hidden_size, eps=llama_config.rms_norm_eps)
        self.diffusion = DiffusionHead(config.diffusion_config())
        nn.init.normal_(self.bos, std=0.02)

    # ---- training -----------------------------------------------------------------------

    def teacher_forced_hidden_states(self, tokens: torch.Tensor, class_ids: torch.Tensor) -> torch.Tensor:
        """Pre-norm states (B, N, hidden) conditioning each token of known images (B, N, token_dim)."""
        embeds = torch.cat([self.bos.expand(tokens.shape[0], 1, -1), self.token_proj(tokens[:, :-1])], dim=1)
        embeds = embeds + self.class_embed(class_ids)[:, None]
        return self.transformer(inputs_embeds=embeds, use_cache=False).last_hidden_state

    def forward(self, tokens: torch.Tensor, class_ids: torch.Tensor, repeats: int = 1) -> torch.Tensor:
        """Per-token diffusion loss (B * N * repeats,) for images (B, N, token_dim) of classes (B,).

        `repeats` draws that many diffusion steps per token on one transformer pass (MAR's
        ``diffusion_batch_mul``, 4).
        """
        z = self.condition(self.teacher_forced_hidden_states(tokens, class_ids)).flatten(0, 1)
        return self.diffusion.loss(z.repeat(repeats, 1), tokens.flatten(0, 1).repeat(repeats, 1))

    # ---- ContinuousARBackbone -------------------------------------------------------------

    def prefill(self, condition: Condition, guided: bool) -> tuple[DecodeState, torch.Tensor]:
        if condition.class_ids is None:
            raise ValueError(f"{self.name} is class-conditional: give Condition(class_ids=...)")
        class_ids = condition.class_ids.to(self._device())
        if guided:
            class_ids = torch.cat([class_ids, torch.full_like(class_ids, self.config.null_class)])
        state = DecodeState(
            cache=self.image_cache(self.config.num_layers, 1),
            batch_size=condition.batch_size,
            guided=guided,
            prefix_length=1,
            extras={"class_embedding": self.class_embed(class_ids)[:, None]},
        )
        return state, self._run(state, self.bos.expand(len(class_ids), 1, -1))

    def _forward_tokens(self, state: DecodeState, tokens: torch.Tensor) -> torch.Tensor:
        return self._run(state, self.embed_tokens(tokens))

    def _forward_tokens_at(self, state, tokens, slots, visible, positions) -> torch.Tensor:
        return self._run(
            state, self.embed_tokens(tokens), **positional_arguments(tokens.shape[0], slots, visible, positions)
        )

    def pass_module(self) -> nn.Module:
        return self.transformer

    def _run(self, state: DecodeState, embeds: torch.Tensor, **positional) -> torch.Tensor:
        embeds = embeds + state.extras["class_embedding"]
        return self.transformer(inputs_embeds=embeds, cache=state.cache, use_cache=True, **positional).last_hidden_state

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.token_proj(tokens.to(self.token_proj.weight.dtype))

    def condition(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)

    def tokens_to_pixels(self, tokens: torch.Tensor) -> torch.Tensor:
        return patches_to_images(tokens.float(), self.config.patch_size)

    def pixels_to_tokens(self, images: torch.Tensor) -> torch.Tensor:
        return images_to_patches(images.float(), self.config.patch_size)

    # ---- persistence --------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write config.json + model.safetensors into `directory`, each atomically."""
        return save_model(self, self.config, directory)

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu") -> ContinuousDigitsBackbone:
        """Load a saved continuous digits model, frozen and in eval mode."""
        advice = (
            "the committed one is checkpoints/digits-continuous, "
            "or train one with `python -m train +experiment=backbone_digits_continuous`"
        )
        return load_model(cls, ContinuousDigitsConfig, directory, device, "continuous digits backbone", advice)


def load_continuous_digits_backbone(path: str | Path, device: str = "cpu") -> ContinuousDigitsBackbone:
    """Hydra entry point: the frozen continuous digits backbone saved at `path`."""
    return ContinuousDigitsBackbone.from_pretrained(path, device=device)


def random_continuous_digits_backbone(seed: int = 0, device: str = "cpu", **architecture) -> ContinuousDigitsBackbone:
    """Hydra entry point: an untrained continuous digits model with seeded random weights (for tests)."""
    torch.manual_seed(seed)
    model = ContinuousDigitsBackbone(ContinuousDigitsConfig(**architecture))
    return model.to(device).eval().requires_grad_(False)
