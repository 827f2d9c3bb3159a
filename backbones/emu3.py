"""Emu3 (transformers' Emu3ForConditionalGeneration, e.g. BAAI/Emu3-Gen-hf) behind the backbone interface.

Layout of one sequence (as Emu3Processor(return_for_image_generation=True) and the
documented `generate(..., prefix_allowed_tokens_fn=...)` recipe build it):

    [<bos>, prompt ..., <|image start|>, "H", "*", "W", <|image token|>,
     v_0 ... v_{W-1}, <|extra_200|>, v_W ... v_{2W-1}, <|extra_200|>, ...,
     <|extra_201|>, <|image end|>]

Every image row is W visual tokens followed by the end-of-line token
``<|extra_200|>``; the image ends with ``<|extra_201|><|image end|>`` (those two
are not generated here). Visual tokens are ordinary vocabulary ids
``<|visual tokenNNNNNN|>``; ``model.vocabulary_mapping.img2bpe`` maps codebook id
NNNNNN to its vocabulary id. The interface speaks codebook ids: `_forward_flat`
maps them (and -1, the EOL marker) to vocabulary ids, and `logits` returns the
``lm_head`` rows of the visual tokens in codebook order.

The text model's final RMSNorm (``model.model.text_model.norm``) is taken out of
it (replaced by an identity) so that the transformer returns the pre-norm
last-layer state; `logits` applies the norm and ``lm_head``.

Conditions: ``Condition(token_ids=...)`` (B, L) is the full prompt prefix in
Emu3's vocabulary, ending right before the first visual token, i.e. with
``<|image start|>{H}*{W}<|image token|>`` where H x W is this backbone's grid
(the header digits are not checked); every row of a batch has the same length
(no padding). ``Condition(prompts=...)`` needs the processor (full weights
directory) and builds ``<bos>{prompt}<|image start|>{H}*{W}<|image token|>``.

Classifier-free guidance mixes on log-probabilities (transformers'
`UnbatchedClassifierFreeGuidanceLogitsProcessor`, which Emu3's documented
generation uses with ``negative_prompt_ids``). The unconditional twin runs in the
same batch, so it must have the prompt's length. It is, by default, the prompt
with every token between BOS and the trailing image header replaced by the pad
token (the header is kept). Set ``backbone.negative_token_ids`` (1, L) to use a
tokenized negative prompt instead (it must end with the same image header and
have the conditional prompt's length; otherwise `prefill` raises ValueError).
Emu3's own recipe runs the negative prompt unbatched at its own length; that is
not implemented here. With a twin of equal length, greedy decoding through this
adapter reproduces transformers' ``generate`` with Emu3's documented recipe
(``negative_prompt_ids`` + ``prefix_allowed_tokens_fn``) on the tiny model.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Emu3Config, Emu3ForConditionalGeneration
from transformers.models.emu3.configuration_emu3 import Emu3TextConfig, Emu3VQVAEConfig

from backbones.base import (
    ARImageBackbone,
    Condition,
    DecodeState,
    ImageGeometry,
    contiguous_slice,
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

MODEL_ID = "BAAI/Emu3-Gen-hf"

BOI, IMAGE_WRAPPER, EOI, EOL, EOF = (
    "<|image start|>",
    "<|image token|>",
    "<|image end|>",
    "<|extra_200|>",
    "<|extra_201|>",
)

# Emu3-Gen's default generation size: image_area 518400 (720 x 720) at 8 pixels per token.
DEFAULT_GRID = 90


class Emu3Backbone(ARImageBackbone):
    """A frozen Emu3 text-to-image generator."""

    cfg_space = "logprobs"

    def __init__(
        self,
        model: Emu3ForConditionalGeneration,
        rows: int = DEFAULT_GRID,
        cols: int = DEFAULT_GRID,
        name: str = MODEL_ID,
        processor=None,
        negative_token_ids: torch.Tensor | None = None,
    ):
        super().__init__()
        self.model = model
        self.name = name
        self.processor = processor
        self.negative_token_ids = negative_token_ids
        config = model.config
        text_model = model.model.text_model
        # The final norm lives outside the text model: `_forward_flat` returns pre-norm states.
        self.final_norm = text_model.norm
        text_model.norm = nn.Identity()

        self.geometry = ImageGeometry(rows=rows, cols=cols, end_of_line=True)
        self.hidden_size = config.text_config.hidden_size
        self.codebook_size = config.vq_config.codebook_size

        vocab = config.vocabulary_map or {}
        missing = [t for t in (BOI, IMAGE_WRAPPER, EOL) if t not in vocab]
        if missing:
            raise ValueError(f"{name}: config.vocabulary_map lacks {missing}")
        self.boi_token_id, self.image_wrapper_token_id = vocab[BOI], vocab[IMAGE_WRAPPER]
        self.eol_token_id = vocab[EOL]
        self.bos_token_id = config.text_config.bos_token_id
        self.pad_token_id = config.text_config.pad_token_id
        img2bpe = model.vocabulary_mapping.img2bpe
        if sorted(img2bpe) != list(range(self.codebook_size)):
            raise ValueError(
                f"{name}: the vocabulary has {len(img2bpe)} visual tokens, not codebook ids 0..{self.codebook_size - 1}"
            )
        # codebook id -> vocabulary id; one extra last entry for the EOL marker -1.
        mapping = torch.tensor([img2bpe[i] for i in range(self.codebook_size)] + [self.eol_token_id], device="cpu")
        self.register_buffer("_codebook_to_vocab", mapping, persistent=False)
        # Real Emu3 checkpoints keep the visual tokens contiguous and in codebook order: then `logits`
        # slices lm_head's weight (a view) instead of gathering 32768 rows on every call.
        self._visual_slice = contiguous_slice(mapping[:-1])

    # ---- prompts --------------------------------------------------------------------------

    def prompt_token_ids(self, condition: Condition) -> torch.Tensor:
        """(B, L) prompt ids ending with ``<|image start|>{H}*{W}<|image token|>``."""
        if condition.token_ids is not None:
            ids = condition.token_ids.long()
        elif condition.prompts is not None:
            if self.processor is None:
                raise ValueError(
                    f"{self.name} was built without a processor (tokenizer); give Condition(token_ids=...) "
                    "or load the backbone with load_emu3_backbone(path) from the full weights directory"
                )
            tokenizer = getattr(self.processor, "tokenizer", self.processor)
            header = f"{BOI}{self.geometry.rows}*{self.geometry.cols}{IMAGE_WRAPPER}"
            rows = [
                tokenizer(f"{tokenizer.bos_token}{p}{header}", add_special_tokens=False)["input_ids"]
                for p in condition.prompts
            ]
            if len({len(r) for r in rows}) != 1:
                raise ValueError(
                    "prompts of one batch must tokenize to the same length (padding is not "
                    "implemented); decode them in separate batches (backbones.base.group_by_prompt_length "
                    "does that)"
                )
            ids = torch.tensor(rows, dtype=torch.long)
        else:
            raise ValueError("Emu3 is text-conditional: give Condition(prompts=...) or Condition(token_ids=...)")
        if ids.shape[1] < 1 or not bool((ids[:, -1] == self.image_wrapper_token_id).all()):
            raise ValueError(
                "Emu3 prompt token_ids must end with <|image start|>{H}*{W}<|image token|> "
                f"(last id {self.image_wrapper_token_id})"
            )
        return ids

    def unconditional_token_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The CFG twin, the prompt's length: `negative_token_ids` if set, else the prompt with its text padded out."""
        if self.negative_token_ids is not None:
            negative = self.negative_token_ids.long().to(token_ids.device)
            if negative.dim() == 1:
                negative = negative[None]
            if negative.shape[1] != token_ids.shape[1]:
                raise ValueError(
                    f"negative_token_ids has length {negative.shape[1]}, the prompt {token_ids.shape[1]}; "
                    "the unconditional twin must have the prompt's length"
                )
            return negative.expand(token_ids.shape[0], -1).clone()
        length = token_ids.shape[1]
        positions = torch.arange(length, device=token_ids.device).expand_as(token_ids)
        is_boi = token_ids == self.boi_token_id
        if not bool(is_boi.any(dim=1).all()):
            raise ValueError("every Emu3 prompt needs an <|image start|> header")
        header_start = torch.where(is_boi, positions, torch.full_like(positions, -1)).amax(dim=1, keepdim=True)
        keep = (positions >= header_start) | ((positions == 0) & (token_ids == self.bos_token_id))
        return token_ids.masked_fill(~keep, self.pad_token_id)

    # ---- ARImageBackbone --------------------------------------------------------------------

    def prefill(self, condition: Condition, guided: bool) -> tuple[DecodeState, torch.Tensor]:
        ids = self.prompt_token_ids(condition).to(self._device())
        if guided:
            ids = torch.cat([ids, self.unconditional_token_ids(ids)], dim=0)
        state = DecodeState(
            cache=self.image_cache(self.model.config.text_config.num_hidden_layers, ids.shape[1]),
            batch_size=condition.batch_size,
            guided=guided,
            prefix_length=ids.shape[1],
        )
        hidden = self._run(state, self.model.get_input_embeddings()(ids))
        return state, hidden[:, -1:]

    def pass_module(self) -> nn.Module:
        return self.model.model.text_model

    def _forward_flat(self, state: DecodeState, flat_tokens: torch.Tensor) -> torch.Tensor:
        return self._run(state, self.embed_image_tokens(flat_tokens))

    def _forward_flat_at(self, state, flat_tokens, slots, visible, positions=None) -> torch.Tensor:
        positional = positional_arguments(flat_tokens.shape[0], slots, visible, positions)
        return self._run(state, self.embed_image_tokens(flat_tokens), **positional)

    def _run(self, state: DecodeState, embeds: torch.Tensor, **positional) -> torch.Tensor:
        out = self.model.model.text_model(inputs_embeds=embeds, cache=state.cache, use_cache=True, **positional)
        return out.last_hidden_state

    def vocab_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """Codebook ids (and -1 for end-of-line) -> Emu3 vocabulary ids."""
        return self._codebook_to_vocab[tokens.long()]  # -1 indexes the last entry: the EOL token

    def image_head_weight(self) -> torch.Tensor:
        weight = self.model.lm_head.weight
        return weight[self._visual_slice] if self._visual_slice is not None else weight[self._codebook_to_vocab[:-1]]

    def embed_image_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(self.vocab_ids(tokens))

    def condition_embedding(self, condition: Condition) -> torch.Tensor:
        """(B, hidden): the prompt's frozen input embeddings, mean-pooled (conditions a MuLo-SD drafter)."""
        return pooled_prompt_embedding(self, self.model.get_input_embeddings(), condition, self.pad_token_id)

    def codebook_latents(self) -> torch.Tensor:
        return self.model.model.vqmodel.quantize.embedding.weight

    def tokens_to_pixels(self, tokens: torch.Tensor) -> torch.Tensor:
        pixels = self.model.model.vqmodel.decode(tokens.long().to(self._device()))
        return ((pixels.float() + 1) / 2).clamp(0, 1)  # the VQ decoder works in [-1, 1]


def load_emu3_backbone(
    path: str,
    device: str = "cuda",
    dtype: str = "bfloat16",
    trust_remote_code: bool = False,
    rows: int = DEFAULT_GRID,
    cols: int = DEFAULT_GRID,
    float32_head: bool = False,
) -> Emu3Backbone:
    """Hydra entry point: frozen Emu3-Gen from a local transformers-format weights directory."""
    directory = require_weights(path, MODEL_ID)
    require_model_type(directory, "emu3", MODEL_ID, original="BAAI/Emu3-Gen")
    model = load_pretrained(Emu3ForConditionalGeneration, directory, dtype, trust_remote_code)
    backbone = Emu3Backbone(
        model,
        rows=rows,
        cols=cols,
        name=display_name(directory, MODEL_ID),
        processor=load_processor(directory, trust_remote_code),
    )
    backbone.float32_head = float32_head
    return backbone.to(device).eval().requires_grad_(False)


# ---- a tiny random model (tests) -------------------------------------------------------------

TINY_ROWS, TINY_COLS, TINY_CODEBOOK = 3, 4, 32
_TINY_SPECIAL = ["<|endoftext|>", "<|extra_203|>", "<|extra_204|>", BOI, IMAGE_WRAPPER, EOI, EOL, EOF, "<image>"]
_TINY_FIRST_VISUAL = 40


def tiny_vocabulary_map(codebook_size: int = TINY_CODEBOOK, seed: int = 0, shuffle: bool = True) -> dict[str, int]:
    """pad 0, BOS 1, EOS 2, specials 3..8, digits 10..19, '*' 20, visual tokens at 40.. in a shuffled order
    (`shuffle=False`: in codebook order, as real Emu3 checkpoints keep them)."""
    vocab = {token: i for i, token in enumerate(_TINY_SPECIAL)}
    vocab.update({str(d): 10 + d for d in range(10)})
    vocab["*"] = 20
    generator = torch.Generator().manual_seed(seed)
    order = (
        torch.randperm(codebook_size, generator=generator, device="cpu").tolist() if shuffle else range(codebook_size)
    )
    vocab.update({f"<|visual token{code:06d}|>": _TINY_FIRST_VISUAL + slot for slot, code in enumerate(order)})
    return vocab


def tiny_emu3_config(
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 64,
    codebook_size: int = TINY_CODEBOOK,
    num_kv_heads: int | None = None,
    vocab_size: int | None = None,
    max_positions: int = 256,
    shuffled_visual_tokens: bool = True,
) -> Emu3Config:
    """A tiny Emu3 config; the text model's arguments also build it at a published size
    (backbones/published_sizes.py: GQA through `num_kv_heads`, the full vocabulary through `vocab_size`)."""
    vocabulary_map = tiny_vocabulary_map(codebook_size, shuffle=shuffled_visual_tokens)
    text_config = Emu3TextConfig(
        vocab_size=max(vocab_size or 0, _TINY_FIRST_VISUAL + codebook_size + 8),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        max_position_embeddings=max_positions,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attention_dropout=0.0,
    )
    vq_config = Emu3VQVAEConfig(
        codebook_size=codebook_size,
        embed_dim=4,
        latent_channels=4,
        base_channels=32,  # the VQ model's GroupNorms have 32 groups
        channel_multiplier=[1, 1],
        num_res_blocks=1,
        attn_resolutions=[],
        hidden_size=32,
    )
    return Emu3Config(text_config=text_config, vq_config=vq_config, vocabulary_map=vocabulary_map)


def random_emu3_model(seed: int = 0, **config_overrides) -> Emu3ForConditionalGeneration:
    torch.manual_seed(seed)
    model = Emu3ForConditionalGeneration(tiny_emu3_config(**config_overrides))
    return model.eval().requires_grad_(False)


def tiny_emu3_tokenizer(vocabulary_map: dict[str, int] | None = None, vocab_size: int | None = None):
    """A word-level tokenizer inside the tiny model's text ids (BOS/EOS/pad and image markers as Emu3's).

    The specials, digits and ``*`` keep their tiny ids, so the image header
    ``<|image start|>3*4<|image token|>`` tokenizes as the real tokenizer does;
    other words take the ids the tiny vocabulary leaves free (9, 21..39 and the
    ids after the visual tokens).
    """
    from backbones.tiny_tokenizer import tiny_word_tokenizer

    vocabulary_map = vocabulary_map if vocabulary_map is not None else tiny_vocabulary_map()
    fixed = {token: i for token, i in vocabulary_map.items() if not token.startswith("<|visual token")}
    taken = set(vocabulary_map.values())
    vocab_size = vocab_size or max(taken) + 1
    free = [i for i in range(vocab_size) if i not in taken]
    return tiny_word_tokenizer(
        fixed,
        special=list(_TINY_SPECIAL),
        free_ids=free,
        bos_token="<|extra_203|>",
        eos_token="<|extra_204|>",
        pad_token="<|endoftext|>",
    )


def random_emu3_backbone(
    seed: int = 0,
    device: str = "cpu",
    rows: int = TINY_ROWS,
    cols: int = TINY_COLS,
    tokenizer: bool = False,
    **config_overrides,
) -> Emu3Backbone:
    """Hydra entry point: a tiny random-weight Emu3 backbone (3x4 grid, 32 codes; nothing to download).

    `tokenizer=True` attaches `tiny_emu3_tokenizer`, so ``Condition(prompts=...)`` works.
    """
    model = random_emu3_model(seed, **config_overrides)
    processor = (
        tiny_emu3_tokenizer(model.config.vocabulary_map, model.config.text_config.vocab_size) if tokenizer else None
    )
    backbone = Emu3Backbone(model, rows=rows, cols=cols, name="emu3-tiny-random", processor=processor)
    return backbone.to(device).eval().requires_grad_(False)
