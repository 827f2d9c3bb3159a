"""Janus-Pro (transformers' JanusForConditionalGeneration) behind the backbone interface.

Layout of one sequence (as `JanusForConditionalGeneration.generate(generation_mode="image")`
builds it):

    [prompt tokens ..., <begin_of_image>, t_0, t_1, ..., t_{N-1}]

The prompt is embedded with the language model's text embedding table; image
tokens (codebook ids) with ``generation_embeddings`` + ``generation_aligner``
(`prepare_embeddings_for_image_generation`) and scored by ``generation_head``
(not ``lm_head``). The grid is ``num_patches x num_patches`` (24 x 24 = 576 for
Janus-Pro at 384 px), with no end-of-line token.

The language model's final RMSNorm is taken out of it (replaced by an identity)
so that the transformer returns the pre-norm last-layer state the draft heads are
trained on; `logits` applies the norm and the generation head.

Classifier-free guidance: the unconditional twin is the conditional prompt with
every token that is neither BOS nor ``<begin_of_image>`` replaced by the pad
token, mixed on logits as ``u + s * (c - u)`` (transformers'
`ClassifierFreeGuidanceLogitsProcessor`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import (
    JanusConfig,
    JanusForConditionalGeneration,
    LlamaConfig,
)
from transformers.models.janus.configuration_janus import (
    JanusVisionConfig,
    JanusVQVAEConfig,
)

from backbones.base import (
    ARImageBackbone,
    Condition,
    DecodeState,
    ImageGeometry,
    pooled_prompt_embedding,
)
from backbones.hf_loading import (
    display_name,
    load_pretrained,
    load_processor,
    positional_arguments,
    require_model_type,
    require_weights,
)

MODEL_ID = "deepseek-community/Janus-Pro-7B"

# Token ids of the tiny random model (its vocabulary is meaningless; only the roles matter).
_TINY_PAD, _TINY_BOS, _TINY_BOI, _TINY_IMAGE = 0, 1, 2, 3


class JanusBackbone(ARImageBackbone):
    """A frozen Janus(-Pro) text-to-image generator."""

    cfg_space = "logits"

    def __init__(self, model: JanusForConditionalGeneration, name: str = MODEL_ID, processor=None):
        super().__init__()
        self.model = model
        self.name = name
        self.processor = processor
        config = model.config
        language_model = model.model.language_model
        # The final norm lives outside the language model: `_forward_flat` returns pre-norm states.
        self.final_norm = language_model.norm
        language_model.norm = nn.Identity()

        side = config.vq_config.num_patches  # = vision image_size // patch_size (set by JanusConfig)
        self.geometry = ImageGeometry(rows=side, cols=side)
        expected = config.vision_config.num_image_tokens
        if expected != self.geometry.num_tokens:
            raise ValueError(f"{name}: vision_config.num_image_tokens={expected} but the VQ grid is {side}x{side}")
        self.codebook_size = config.vq_config.num_embeddings
        self.hidden_size = config.text_config.hidden_size

        generation = model.generation_config
        boi = (generation.generation_kwargs or {}).get("boi_token_id")
        missing = [
            k
            for k, v in (
                ("bos_token_id", generation.bos_token_id),
                ("pad_token_id", generation.pad_token_id),
                ("generation_kwargs.boi_token_id", boi),
            )
            if v is None
        ]
        if missing:
            raise ValueError(f"{name}: generation_config lacks {missing}, needed for prompts and CFG")
        self.bos_token_id = int(_first(generation.bos_token_id))
        self.pad_token_id = int(_first(generation.pad_token_id))
        self.boi_token_id = int(boi)

    # ---- prompts --------------------------------------------------------------------------

    def prompt_token_ids(self, condition: Condition) -> torch.Tensor:
        """(B, L) prompt ids ending with <begin_of_image>, as `generate(generation_mode="image")` expects."""
        if condition.token_ids is not None:
            return condition.token_ids.long()
        if condition.prompts is None:
            raise ValueError("Janus is text-conditional: give Condition(prompts=...) or Condition(token_ids=...)")
        if self.processor is None:
            raise ValueError(
                f"{self.name} was built without a processor (tokenizer); give Condition(token_ids=...) "
                "or load the backbone with load_janus_backbone(path) from the full weights directory"
            )
        texts = []
        for prompt in condition.prompts:
            messages = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
            texts.append(self.processor.apply_chat_template(messages, add_generation_prompt=True))
        # generation_mode="image" appends the <begin_of_image> token to every text.
        encoded = self.processor(text=texts, generation_mode="image", padding=True, return_tensors="pt")
        mask = encoded.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise ValueError(
                "prompts of one batch must tokenize to the same length (left padding is not implemented); "
                "decode them in separate batches (backbones.base.group_by_prompt_length does that)"
            )
        return encoded["input_ids"].long()

    def unconditional_token_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The CFG twin: every token but BOS and <begin_of_image> replaced by the pad token."""
        keep = (token_ids == self.bos_token_id) | (token_ids == self.boi_token_id)
        return token_ids.masked_fill(~keep, self.pad_token_id)

    # ---- ARImageBackbone --------------------------------------------------------------------

    def prefill(self, condition: Condition, guided: bool) -> tuple[DecodeState, torch.Tensor]:
        ids = self.prompt_token_ids(condition).to(self._device())
        if ids.shape[1] < 1:
            raise ValueError("empty prompt")
        if guided:
            ids = torch.cat([ids, self.unconditional_token_ids(ids)], dim=0)
        state = DecodeState(
            cache=self.image_cache(self.model.config.text_config.num_hidden_layers, ids.shape[1]),
            batch_size=condition.batch_size,
            guided=guided,
            prefix_length=ids.shape[1],
        )
        embeds = self.model.get_input_embeddings()(ids)
        hidden = self._run(state, embeds)
        return state, hidden[:, -1:]

    def pass_module(self) -> nn.Module:
        return self.model.model.language_model

    def _forward_flat(self, state: DecodeState, flat_tokens: torch.Tensor) -> torch.Tensor:
        return self._run(state, self.embed_image_tokens(flat_tokens))

    def _forward_flat_at(self, state, flat_tokens, slots, visible, positions=None) -> torch.Tensor:
        positional = positional_arguments(flat_tokens.shape[0], slots, visible, positions)
        return self._run(state, self.embed_image_tokens(flat_tokens), **positional)

    def _run(self, state: DecodeState, embeds: torch.Tensor, **positional) -> torch.Tensor:
        out = self.model.model.language_model(inputs_embeds=embeds, cache=state.cache, use_cache=True, **positional)
        return out.last_hidden_state

    def image_head(self, normed: torch.Tensor) -> torch.Tensor:
        return self.model.model.generation_head(normed)  # an MLP (projector, GELU, vocabulary head)

    def float32_image_head(self):
        return copy.deepcopy(self.model.model.generation_head).float()

    def embed_image_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.prepare_embeddings_for_image_generation(tokens)

    def condition_embedding(self, condition: Condition) -> torch.Tensor:
        """(B, hidden): the prompt's frozen input embeddings, mean-pooled (conditions a MuLo-SD drafter)."""
        return pooled_prompt_embedding(self, self.model.get_input_embeddings(), condition, self.pad_token_id)

    def codebook_latents(self) -> torch.Tensor:
        """The VQ codebook's raw embedding weights (the decoder L2-normalises them before use)."""
        return self.model.model.vqmodel.quantize.embedding.weight

    def tokens_to_pixels(self, tokens: torch.Tensor) -> torch.Tensor:
        batch = tokens.shape[0]
        pixels = self.model.model.vqmodel.decode(tokens.reshape(batch, -1).to(self._device()))
        return ((pixels.float() + 1) / 2).clamp(0, 1)  # the VQ decoder works in [-1, 1]

    def pixels_to_tokens(self, images: torch.Tensor) -> torch.Tensor:
        vq = self.model.model.vqmodel
        pixels = images.to(self._device(), dtype=vq.quant_conv.weight.dtype) * 2 - 1
        tokens = vq.encode(pixels).image_tokens
        batch = images.shape[0]
        if tokens.numel() != batch * self.geometry.num_tokens:
            side = self.image_size
            raise ValueError(f"{self.name} encodes {side}x{side} images; got {tuple(images.shape[-2:])}")
        return tokens.view(batch, self.geometry.rows, self.geometry.cols)

    @property
    def image_size(self) -> int:
        """Pixel side of the VQ model's images (grid side x 2^(levels - 1))."""
        vq_config = self.model.config.vq_config
        return self.geometry.rows * 2 ** (len(vq_config.channel_multiplier) - 1)


def _first(value):
    return value[0] if isinstance(value, (list, tuple)) else value


def load_janus_backbone(
    path: str,
    device: str = "cpu",
    dtype: str = "bfloat16",
    trust_remote_code: bool = False,
    float32_head: bool = False,
) -> JanusBackbone:
    """Hydra entry point: frozen Janus-Pro from a local transformers-format weights directory."""
    directory = require_weights(path, MODEL_ID)
    require_model_type(directory, "janus", MODEL_ID, original="deepseek-ai/Janus-Pro-7B")
    model = load_pretrained(JanusForConditionalGeneration, directory, dtype, trust_remote_code)
    backbone = JanusBackbone(
        model, name=display_name(directory, MODEL_ID), processor=load_processor(directory, trust_remote_code)
    )
    backbone.float32_head = float32_head
    return backbone.to(device).eval().requires_grad_(False)


def tiny_janus_config(
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 64,
    vocab_size: int = 64,
    grid_size: int = 4,
    codebook_size: int = 64,
    vq_embed_dim: int = 8,
    max_positions: int = 512,
) -> JanusConfig:
    """A tiny Janus config: Llama text model, 1-layer vision tower, 2-level VQ model (32 channels).

    The text model's arguments also build it at a published size (backbones/published_sizes.py).
    """
    patch_size = 4
    text_config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        bos_token_id=_TINY_BOS,
        pad_token_id=_TINY_PAD,
        eos_token_id=None,
    )
    vision_config = JanusVisionConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=grid_size * patch_size,
        patch_size=patch_size,
        projection_dim=hidden_size,
        num_image_tokens=grid_size * grid_size,
        mlp_ratio=2.0,
    )
    vq_config = JanusVQVAEConfig(
        embed_dim=vq_embed_dim,
        num_embeddings=codebook_size,
        latent_channels=32,
        base_channels=32,  # the VQ model's GroupNorms have 32 groups
        channel_multiplier=[1, 1],
        num_res_blocks=1,
        projection_dim=hidden_size,
        image_token_embed_dim=hidden_size,
        num_hidden_layers=2,
    )
    return JanusConfig(
        text_config=text_config, vision_config=vision_config, vq_config=vq_config, image_token_id=_TINY_IMAGE
    )


def random_janus_model(seed: int = 0, **config_overrides) -> JanusForConditionalGeneration:
    """A tiny JanusForConditionalGeneration with seeded random weights and a usable generation_config."""
    torch.manual_seed(seed)
    model = JanusForConditionalGeneration(tiny_janus_config(**config_overrides))
    generation = model.generation_config
    generation.bos_token_id = _TINY_BOS
    generation.pad_token_id = _TINY_PAD
    generation.eos_token_id = None
    generation.generation_kwargs = {"boi_token_id": _TINY_BOI}
    return model.eval().requires_grad_(False)


# Janus-Pro's chat template reduced to one user turn: "<|User|>: {prompt}\n\n<|Assistant|>:".
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}<|User|>: "
    "{% for content in message['content'] %}{% if content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}\n\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|Assistant|>:{% endif %}"
)


def tiny_janus_processor(vocab_size: int = 64, grid_size: int = 4):
    """A `JanusProcessor` over a word-level tokenizer inside the tiny model's text ids.

    pad 0, BOS 1 (prepended, as Janus' Llama tokenizer does), ``<begin_of_image>`` 2,
    ``<image_placeholder>`` 3, ``<end_of_image>`` 4, ``<|User|>`` 5, ``<|Assistant|>`` 6;
    words take ids 7..; the chat template follows Janus-Pro's user/assistant format.
    """
    import transformers
    from transformers import JanusProcessor

    from backbones.tiny_tokenizer import tiny_word_tokenizer

    fixed = {
        "<pad>": _TINY_PAD,
        "<bos>": _TINY_BOS,
        "<begin_of_image>": _TINY_BOI,
        "<image_placeholder>": _TINY_IMAGE,
        "<end_of_image>": 4,
        "<|User|>": 5,
        "<|Assistant|>": 6,
    }
    tokenizer = tiny_word_tokenizer(
        fixed,
        special=list(fixed),
        free_ids=list(range(7, vocab_size)),
        bos_token="<bos>",
        pad_token="<pad>",
        add_bos=True,
        extra_special_tokens={
            "image_token": "<image_placeholder>",
            "boi_token": "<begin_of_image>",
            "eoi_token": "<end_of_image>",
        },
    )
    # The PIL image processor: the default one wants torchvision, and prompts need no image processing.
    image_processor_class = getattr(transformers, "JanusImageProcessorPil", None) or transformers.JanusImageProcessor
    return JanusProcessor(
        image_processor=image_processor_class(),
        tokenizer=tokenizer,
        chat_template=TINY_CHAT_TEMPLATE,
        num_image_tokens=grid_size * grid_size,
    )


def random_janus_backbone(
    seed: int = 0, device: str = "cpu", tokenizer: bool = False, **config_overrides
) -> JanusBackbone:
    """Hydra entry point: a tiny random-weight Janus backbone (for tests; nothing to download).

    `tokenizer=True` attaches `tiny_janus_processor`, so ``Condition(prompts=...)`` works.
    """
    model = random_janus_model(seed, **config_overrides)
    side = model.config.vq_config.num_patches
    processor = tiny_janus_processor(model.config.text_config.vocab_size, side) if tokenizer else None
    return JanusBackbone(model, name="janus-tiny-random", processor=processor).to(device).eval().requires_grad_(False)
