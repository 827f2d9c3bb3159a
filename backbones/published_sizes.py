"""The real backbones at their published sizes, with random weights: what a pass costs, not what it generates.

Each entry builds the project's adapter around the model's real transformers
class, its language model at the published shape (layers, hidden size, attention
and KV heads, SwiGLU width, vocabulary) and its image grid at the published
resolution, through the same `random_*_backbone` builders the tests use at tiny
sizes. The vision encoder and the VQ model stay tiny: no backbone pass runs
through them, so their size does not change what a pass costs. `tiny` is the
same family at a test size, with a grid large enough to feed a few rows.

Shapes (config.json of each checkpoint, as in train/memory_estimate.py):
Janus-Pro-7B (deepseek-community/Janus-Pro-7B): Llama 30 x 4096, 32 heads,
SwiGLU 11008, vocabulary 102,400, generation VQ 16,384 codes, 24 x 24.
Lumina-mGPT-7B-768 (Chameleon-7B): 32 x 4096, 32 heads, qk-layernorm, SwiGLU 11008,
vocabulary 65,536 of which 8,192 image codes, 48 x 48 + an end-of-line per row.
Emu3-Gen (BAAI/Emu3-Gen-hf): 32 x 4096, 32 heads, 8 KV heads, SwiGLU 14336,
vocabulary 184,622, 32,768 codes, 90 x 90 + an end-of-line per row (720 px).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from backbones.base import ARImageBackbone, Condition

FILLER_TEXT_ID = 7  # a text id of every family (the prompt's content does not change a pass's cost)


@dataclass(frozen=True)
class PublishedBackbone:
    """One real model: its builder, the published shape's arguments and a tiny test shape's."""

    name: str
    build: Callable[..., ARImageBackbone]
    published: dict
    tiny: dict
    prompt: Callable[[ARImageBackbone, int], list[int]]  # (backbone, length) -> a valid prompt of that length
    notes: dict = field(default_factory=dict)

    def backbone(self, size: str, device: torch.device | str, dtype: torch.dtype) -> ARImageBackbone:
        """The adapter at `size` ("published" or "tiny"), built directly on `device` in `dtype` (no CPU copy)."""
        arguments = self.published if size == "published" else self.tiny
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                backbone = self.build(seed=0, device=str(device), **arguments)
        finally:
            torch.set_default_dtype(previous)
        return backbone.to(device=device, dtype=dtype).eval().requires_grad_(False)

    def condition(self, backbone: ARImageBackbone, batch: int, prompt_length: int) -> Condition:
        """`batch` copies of a prompt of `prompt_length` ids that the adapter accepts (header included)."""
        ids = torch.tensor([self.prompt(backbone, prompt_length)] * batch, dtype=torch.long)
        return Condition(token_ids=ids)


def _janus_prompt(backbone, length: int) -> list[int]:
    return [backbone.bos_token_id, *[FILLER_TEXT_ID] * (length - 2), backbone.boi_token_id]


def _emu3_prompt(backbone, length: int) -> list[int]:
    # <|image start|>{H}*{W}<|image token|>: the header's size tokens are text ids as well.
    return [
        backbone.bos_token_id,
        *[FILLER_TEXT_ID] * (length - 3),
        backbone.boi_token_id,
        backbone.image_wrapper_token_id,
    ]


def _lumina_prompt(backbone, length: int) -> list[int]:
    header = [backbone.image_start_token_id, *backbone.size_token_ids]
    return [backbone.model.config.bos_token_id, *[FILLER_TEXT_ID] * (length - 1 - len(header)), *header]


def _published() -> dict[str, PublishedBackbone]:
    from backbones.emu3 import random_emu3_backbone
    from backbones.janus import random_janus_backbone
    from backbones.lumina import random_lumina_backbone

    return {
        "janus_pro_7b": PublishedBackbone(
            name="janus_pro_7b",
            build=random_janus_backbone,
            published=dict(
                hidden_size=4096,
                num_layers=30,
                num_heads=32,
                intermediate_size=11008,
                vocab_size=102400,
                grid_size=24,
                codebook_size=16384,
                max_positions=16384,
            ),
            tiny=dict(grid_size=16),
            prompt=_janus_prompt,
        ),
        "lumina_mgpt_7b": PublishedBackbone(
            name="lumina_mgpt_7b",
            build=random_lumina_backbone,
            published=dict(
                hidden_size=4096,
                num_layers=32,
                num_heads=32,
                intermediate_size=11008,
                vocab_size=65536,
                codebook_size=8192,
                qk_layernorm=True,
                rows=48,
                cols=48,
                max_positions=10240,
                permuted_image_tokens=False,  # Chameleon's image tokens are contiguous, in codebook order
            ),
            tiny=dict(rows=16, cols=16),
            prompt=_lumina_prompt,
        ),
        "emu3_gen": PublishedBackbone(
            name="emu3_gen",
            build=random_emu3_backbone,
            published=dict(
                hidden_size=4096,
                num_layers=32,
                num_heads=32,
                num_kv_heads=8,
                intermediate_size=14336,
                vocab_size=184622,
                codebook_size=32768,
                rows=90,
                cols=90,
                max_positions=9216,
                shuffled_visual_tokens=False,  # as in the real vocabulary
            ),
            tiny=dict(rows=16, cols=16),
            prompt=_emu3_prompt,
        ),
    }


def published_backbones() -> dict[str, PublishedBackbone]:
    """Every real model whose pass cost the device benchmark measures, by name."""
    return _published()
