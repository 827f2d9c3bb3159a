"""EAGLE-style draft head: one decoder layer over [token embedding; hidden state] predicting the next state.

EAGLE (Li et al., ICML 2024; EAGLE-2, EMNLP 2024; github.com/SafeAILab/EAGLE,
``model/cnets.py``) drafts along the sequence with a single transformer layer:
at position ``i`` it fuses the embedding of the token ``x_i`` and the target's
feature ``f_i`` (the state that predicted ``x_i``) with a linear layer ``fc``
(2H -> H, with bias, as the reference), runs the fused inputs through one causal
Llama decoder layer with its own KV cache (the first layer's input norm left
out, as the reference does), and reads the prediction of ``f_{i+1}`` off it. The
draft distribution is the backbone's own frozen final norm and image head on the
prediction, so the head learns a continuous latent. This is the 1-D baseline the
SSD paper calls MTP: it drafts in raster order only.

Two adaptations to this project's backbones, both because the state it reads is
the backbone's pre-norm last-layer state (backbones/base.py), where EAGLE's
reference reads the post-norm feature: the input state is RMS-normalised by the
head's own norm (the counterpart of EAGLE's normalised features), and the
prediction is compared with the pre-norm target in training (train/eagle_module.py).
Positions are grid positions (0 .. rows * cols - 1, RoPE); the condition reaches
the head through the states, which carry it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from transformers import LlamaConfig, LlamaModel

from backbones.kv_cache import preallocated_cache


@dataclass
class EagleHeadConfig:
    """Shape of an EAGLE head; stored in the export's heads.json."""

    hidden_size: int  # the backbone's hidden size (the head's width: one layer of the backbone's shape)
    num_heads: int  # attention heads of the decoder layer
    intermediate_size: int  # its MLP width
    max_positions: int  # grid tokens it drafts over (rows * cols): the length of its KV cache and RoPE table
    num_key_value_heads: int | None = None  # None: as many as num_heads
    rope_theta: float = 10000.0
    # Training: uniform feature noise U(-a/2, a/2) times the state's RMS on the input states (EAGLE's
    # data noise, uniform with std 0.2 on normalised features), so the head tolerates its own predictions.
    input_noise: float = 0.2

    def __post_init__(self):
        for key in ("hidden_size", "num_heads", "intermediate_size", "max_positions"):
            if getattr(self, key) < 1:
                raise ValueError(f"head.{key} must be >= 1, got {getattr(self, key)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"head.hidden_size {self.hidden_size} must be divisible by head.num_heads {self.num_heads}"
            )
        kv_heads = self.num_key_value_heads or self.num_heads
        if self.num_heads % kv_heads:
            raise ValueError(f"head.num_heads {self.num_heads} must be a multiple of num_key_value_heads {kv_heads}")
        if self.input_noise < 0:
            raise ValueError(f"head.input_noise must be >= 0, got {self.input_noise}")

    def to_dict(self) -> dict:
        return asdict(self)


class EagleHead(nn.Module):
    """(states (rows, T, H), token embeddings (rows, T, H)) at grid positions -> predicted next states (rows, T, H).

    ``forward`` runs teacher-forced over whole sequences (training) or appends to
    a KV cache from `new_cache` (drafting: `crop` rolls it back like the backbone's).
    """

    kind = "eagle"

    def __init__(self, config: EagleHeadConfig):
        super().__init__()
        self.config = config
        size = config.hidden_size
        self.state_norm = nn.RMSNorm(size)
        self.fc = nn.Linear(2 * size, size)
        layer_config = LlamaConfig(
            vocab_size=1,  # inputs arrive as fused embeddings
            hidden_size=size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=config.num_heads,
            num_key_value_heads=config.num_key_value_heads or config.num_heads,
            max_position_embeddings=config.max_positions,
            rope_theta=config.rope_theta,
            attn_implementation="sdpa",
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
        self.decoder = LlamaModel(layer_config)
        self.decoder.embed_tokens = None  # unused: the fused inputs are the layer's input embeddings
        self.decoder.layers[0].input_layernorm = nn.Identity()  # EAGLE: the fused input is not normed again
        self.decoder.norm = nn.Identity()  # the backbone's own final norm applies to the prediction

    def new_cache(self):
        """A KV cache for one image's drafting (all grid positions), appended to by `forward`."""
        return preallocated_cache(1, self.config.max_positions)

    def forward(self, states: torch.Tensor, token_embeddings: torch.Tensor, cache=None, **positional) -> torch.Tensor:
        """`positional`: position ids and a 4D attention mask for a pass at chosen cache slots (EAGLE-2's draft
        tree, decode/eagle2.py); by default the inputs follow the cache's end, causally."""
        fused = self.fc(torch.cat([token_embeddings, self.state_norm(states)], dim=-1))
        out = self.decoder(inputs_embeds=fused, cache=cache, use_cache=cache is not None, **positional)
        return out.last_hidden_state
