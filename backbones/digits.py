"""The embedded backbone: a small class-conditional Llama over digit token grids.

It is a real AR image model (transformers' LlamaModel with KV cache, RoPE, SDPA),
small enough to train and decode on a CPU, and the test bed on which heads,
acceptance, speedups and quality are measured. Layout of one sequence:

    [BOS, t_0, t_1, ..., t_{N-1}]      with the class embedding added at every position

A single class token at the start conditions too weakly (samples drift to other
digits), so the class embedding is added to every input. Class id 10 is the
null class, used for the unconditional twin of classifier-free guidance and
trained by class dropout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, LlamaModel
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from backbones.base import ARImageBackbone, Condition, DecodeState, ImageGeometry
from backbones.hf_loading import positional_arguments
from backbones.saved_model import load_model, save_model

NUM_CLASSES = 10  # the ten digits; the class embedding adds a null class for guidance


@dataclass(frozen=True)
class DigitsTokenizer:
    """Maps grey images in [0, 1] to intensity tokens and back.

    Token t stands for intensity t / (levels - 1); the codebook latents are those
    intensities, shape (levels, 1).
    """

    levels: int = 16

    def __post_init__(self):
        if not 2 <= self.levels <= 256:
            raise ValueError(f"tokenizer levels must be in [2, 256], got {self.levels}")

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """(..., H, W) float in [0, 1] -> (..., H, W) long tokens."""
        return torch.round(images.clamp(0, 1) * (self.levels - 1)).long()

    def encode_sequence(self, images: torch.Tensor) -> torch.Tensor:
        """(N, H, W) images -> (N, H*W) tokens in raster order, what the backbone trains on."""
        return self.encode(images).flatten(1)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """(..., H, W) long tokens -> (..., H, W) float intensities in [0, 1]."""
        return tokens.float() / (self.levels - 1)

    def codebook_latents(self) -> torch.Tensor:
        """(levels, 1): the intensity each token stands for."""
        return torch.linspace(0, 1, self.levels).unsqueeze(1)


@dataclass
class DigitsBackboneConfig:
    """Shape of the digits backbone; stored beside its weights as config.json."""

    grid_size: int = 24  # tokens per side; 24x24 = 576, the length of Janus-Pro's images
    levels: int = 16  # intensity codebook size (= image vocabulary)
    hidden_size: int = 192
    num_layers: int = 4
    num_heads: int = 3  # head dim 64, as in the real models
    intermediate_size: int = 512  # SwiGLU width, ~2.7x hidden
    rope_theta: float = 10000.0
    name: str = "digits-backbone"

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.grid_size < 2:
            raise ValueError(f"grid_size must be >= 2, got {self.grid_size}")

    @property
    def null_class(self) -> int:
        return NUM_CLASSES

    @property
    def bos_token(self) -> int:
        return self.levels


class DigitsBackbone(ARImageBackbone):
    """Class-conditional Llama over (grid_size x grid_size) intensity tokens."""

    cfg_space = "logits"

    def __init__(self, config: DigitsBackboneConfig):
        super().__init__()
        self.config = config
        self.name = config.name
        self.geometry = ImageGeometry(rows=config.grid_size, cols=config.grid_size)
        self.codebook_size = config.levels
        self.hidden_size = config.hidden_size
        self.tokenizer = DigitsTokenizer(config.levels)
        llama_config = LlamaConfig(
            vocab_size=1,  # inputs arrive as embeddings; LlamaModel's own table is unused
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_heads,
            num_key_value_heads=config.num_heads,
            max_position_embeddings=config.grid_size**2 + 1,
            rope_theta=config.rope_theta,
            attn_implementation="sdpa",
            bos_token_id=None,  # ids of LlamaModel's unused vocabulary; ours live in DigitsBackboneConfig
            eos_token_id=None,
            pad_token_id=None,
        )
        self.token_embed = nn.Embedding(config.levels + 1, config.hidden_size)  # + BOS
        self.class_embed = nn.Embedding(NUM_CLASSES + 1, config.hidden_size)  # + null class
        self.transformer = LlamaModel(llama_config)
        # Keep the final norm outside LlamaModel so that the transformer returns the
        # pre-norm last-layer state the draft heads are trained on.
        self.transformer.norm = nn.Identity()
        self.norm = LlamaRMSNorm(config.hidden_size, eps=llama_config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.levels, bias=False)

    @property
    def num_classes(self) -> int:
        """Class-conditional: the 10 digits (the null class, id 10, is the CFG twin)."""
        return NUM_CLASSES

    # ---- training -----------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, class_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits (B, N, levels) for images (B, N) of classes (B,)."""
        bos = torch.full_like(tokens[:, :1], self.config.bos_token)
        inputs = torch.cat([bos, tokens[:, :-1]], dim=1)  # (B, N)
        embeds = self.token_embed(inputs) + self.class_embed(class_ids)[:, None]
        hidden = self.transformer(inputs_embeds=embeds, use_cache=False).last_hidden_state
        return self.logits(hidden)

    # ---- ARImageBackbone --------------------------------------------------------------------

    def prefill(self, condition: Condition, guided: bool) -> tuple[DecodeState, torch.Tensor]:
        if condition.class_ids is None:
            raise ValueError("the digits backbone is class-conditional: give Condition(class_ids=...)")
        class_ids = condition.class_ids.to(self._device())
        if guided:
            class_ids = torch.cat([class_ids, torch.full_like(class_ids, self.config.null_class)])
        state = DecodeState(
            # Sized for the BOS and the whole image once: appending writes in place (backbones/kv_cache.py).
            cache=self.image_cache(self.config.num_layers, 1),
            batch_size=condition.batch_size,
            guided=guided,
            prefix_length=1,
            extras={"class_ids": class_ids},
        )
        bos = torch.full((len(class_ids), 1), self.config.bos_token, device=class_ids.device)
        return state, self._run(state, bos)

    def pass_module(self) -> nn.Module:
        return self.transformer

    def _forward_flat(self, state: DecodeState, flat_tokens: torch.Tensor) -> torch.Tensor:
        return self._run(state, flat_tokens)

    def _forward_flat_at(self, state, flat_tokens, slots, visible, positions=None) -> torch.Tensor:
        return self._run(state, flat_tokens, **positional_arguments(flat_tokens.shape[0], slots, visible, positions))

    def _run(self, state: DecodeState, inputs: torch.Tensor, **positional) -> torch.Tensor:
        embeds = self.token_embed(inputs) + self.class_embed(state.extras["class_ids"])[:, None]
        out = self.transformer(inputs_embeds=embeds, cache=state.cache, use_cache=True, **positional)
        return out.last_hidden_state

    @property
    def final_norm(self) -> nn.Module:
        return self.norm

    def image_head_weight(self) -> torch.Tensor:
        return self.head.weight

    def embed_image_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.token_embed(tokens)

    def draft_scorer(self, state: DecodeState, cfg_scale: float):
        """Final norm, head and guidance in three calls (norm, concatenation, one product): guided =
        s * head(c) + (1 - s) * head(u) is one product of the twins' normed states side by side with the
        head's weight scaled twice."""
        size, eps = self.norm.weight.shape[0], self.norm.variance_epsilon

        def normed(hidden: torch.Tensor) -> torch.Tensor:
            return nn.functional.rms_norm(hidden.float(), (size,), self.norm.weight, eps)

        if not state.guided:
            return lambda hidden: nn.functional.linear(normed(hidden), self.head.weight)
        folded = torch.cat([cfg_scale * self.head.weight, (1 - cfg_scale) * self.head.weight], dim=1)  # (V, 2H)
        return lambda hidden: nn.functional.linear(torch.cat(normed(hidden).chunk(2), dim=-1), folded)

    def codebook_latents(self) -> torch.Tensor:
        return self.tokenizer.codebook_latents().to(self._device())

    def tokens_to_pixels(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tokenizer.decode(tokens).unsqueeze(1)  # (B, 1, rows, cols)

    def pixels_to_tokens(self, images: torch.Tensor) -> torch.Tensor:
        return self.tokenizer.encode(images.mean(dim=1))

    # ---- persistence --------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write config.json + model.safetensors into `directory`, each atomically."""
        return save_model(self, self.config, directory)

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu") -> DigitsBackbone:
        """Load a saved digits backbone, frozen and in eval mode."""
        advice = (
            "the committed one is checkpoints/digits-backbone, "
            "or train one with `python -m train +experiment=backbone_digits`"
        )
        return load_model(cls, DigitsBackboneConfig, directory, device, "digits backbone", advice)


def load_digits_backbone(path: str | Path, device: str = "cpu") -> DigitsBackbone:
    """Hydra entry point: the frozen digits backbone saved at `path`."""
    return DigitsBackbone.from_pretrained(path, device=device)


def random_digits_backbone(seed: int = 0, device: str = "cpu", **architecture) -> DigitsBackbone:
    """Hydra entry point: an untrained digits backbone with seeded random weights (for tests)."""
    torch.manual_seed(seed)
    return DigitsBackbone(DigitsBackboneConfig(**architecture)).to(device).eval().requires_grad_(False)
