"""Lumina-mGPT (transformers' ChameleonForConditionalGeneration with Lumina weights) behind the interface.

Weights: the Hub releases (Alpha-VLLM/Lumina-mGPT-7B-768 ...) hold per-rank q/k norms and no VQ-VAE;
``python -m backbones.convert lumina <release> <out> --vqgan <Meta's vqgan.ckpt>`` turns one into the
transformers layout `load_lumina_backbone` loads (backbones/convert.py says what changes and why).

Layout of one sequence (Lumina-mGPT's ``FlexARItemProcessor`` / ``inference_solver`` conventions,
read from Lumina-mGPT's source, NOT checked against real weights in this repository):

    [<s>, prompt text ..., <racm3:break>, <h-size>, <w-size>,
     t_0 ... t_{cols-1}, <eol>, t_cols ... , <eol>, ..., <eoss>]

- ``<racm3:break>`` (vocabulary id 8197) starts an image;
- the size tokens are ``<reserved{8800 + side_px // 32:05d}>`` = id ``8804 + side_px // 32`` for the
  height and the width; the latent grid is twice that (16 px per cell): at 768 px both are id
  8828 and the grid is 48 x 48;
- every row of the grid is followed by the end-of-line token ``<reserved08799>`` (vocabulary id
  8803). transformers' Chameleon does not define it, so it is a constructor / loader parameter
  (`eol_token_id`);
- ``<eoss>`` (8196) ends the image (never produced here: the grid size is fixed).

Image tokens are vocabulary ids given by the model's vocabulary map
(``ChameleonImageVocabularyMapping.img2bpe``: the ``IMGIMG...`` entries), not a fixed offset
of the codebook id. The interface speaks codebook ids ``0..V-1``: `_forward_flat` maps them
(and ``-1`` = end of line) to vocabulary ids, and `logits` returns the lm_head scores of the
image tokens in codebook order. HF's ``ChameleonForConditionalGeneration.forward`` sets
image-token logits to the dtype minimum (it is a text generator), so this adapter never uses
its logits: it runs ``model.model`` (whose final RMSNorm is replaced by an identity, so the
states are pre-norm) and applies the norm and ``lm_head`` itself.

Conditions: ``Condition(token_ids=...)`` (B, L) is the whole prompt prefix in the model's
vocabulary, up to and including the image header, i.e. it must end with
``[<racm3:break>, <h-size>, <w-size>]`` (`image_header_length` = 3 tokens); the hidden state of
its last token predicts grid token 0. Prompts of one batch must have the same length (no
padding of conditional prompts is implemented; `backbones.base.group_by_prompt_length` splits a
ragged batch). ``Condition(prompts=...)`` needs the tokenizer (`load_lumina_backbone` loads the
processor from the weights directory) and builds what Lumina-mGPT's ``FlexARInferenceSolver``
feeds for text-to-image (its ``Conversation`` template; transformers' ``ChameleonProcessor``
also ends a prompt with the tokenizer's ``sep_token``, the same ``<reserved08706>``):

    [<s>] + tokens("Generate an image of {W}x{H} according to the following prompt:\n{prompt}<reserved08706>")
    + [<racm3:break>, <h-size>, <w-size>]

with W x H the image size in pixels (16 per grid cell). Lumina-mGPT lets the model generate the
three header tokens; here they are forced to this backbone's grid.

Classifier-free guidance (Lumina-mGPT: scale 3.0, image top-k 2000). The unconditional twin
(``uncond="image_header"``, the default) is what Lumina-mGPT's
``LLMImageStartTriggeredUnbatchedClassifierFreeGuidanceLogitsProcessor`` runs: the sequence from
the image-start token on, ``[<racm3:break>, <h-size>, <w-size>, image tokens...]`` (no BOS, no
text). It shares the batch and cache with the conditional rows by being left-padded with the
pad token under an attention mask (kept in ``state.extras``), with position ids counting only
real tokens. ``uncond="pad"`` instead keeps the prompt's length and replaces every token but
the first and the header with the pad token (no mask). Lumina-mGPT mixes
``u + s * (c - u)`` on raw logits; over one fixed candidate set that differs from mixing
log-probabilities by a per-row constant only, so the guided distribution is the same and
`cfg_space` is "logprobs" as for Emu3.

Pixels: transformers' ``ChameleonVQVAE`` has an encoder only, so `pixels_to_tokens` works but
`tokens_to_pixels` raises NotImplementedError (Lumina-mGPT decodes with the original Chameleon
VQGAN checkpoint, outside transformers).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import (
    ChameleonConfig,
    ChameleonForConditionalGeneration,
)
from transformers.models.chameleon.configuration_chameleon import ChameleonVQVAEConfig

from backbones.base import (
    ARImageBackbone,
    Condition,
    DecodeState,
    ImageGeometry,
    contiguous_slice,
    pooled_prompt_embedding,
)
from backbones.convert import lumina_release_problems
from backbones.hf_loading import (
    display_name,
    load_pretrained,
    load_processor,
    positional_arguments,
    require_weights,
)

MODEL_ID = "Alpha-VLLM/Lumina-mGPT-7B-768"

# Lumina-mGPT's special tokens in Chameleon's vocabulary (from Lumina-mGPT's generation code;
# assumptions, not read from the transformers config, which does not define them).
LUMINA_EOL_TOKEN_ID = 8803  # <reserved08799>, after every image row
LUMINA_IMAGE_START_TOKEN_ID = 8197  # <racm3:break>
LUMINA_IMAGE_END_TOKEN_ID = 8196  # <eoss>
LUMINA_GRID = 48  # 768 px / 16 px per cell
LUMINA_SIZE_TOKEN_BASE = 8804  # <reserved08800>: size token = 8804 + side_px // 32 (8828 at 768 px)
LUMINA_PIXELS_PER_CELL = 16
LUMINA_SEP = "<reserved08706>"  # ends a conversation turn (Lumina-mGPT's Conversation; Chameleon's sep_token)
LUMINA_T2I_INSTRUCTION = "Generate an image of {width}x{height} according to the following prompt:\n{prompt}"

# Token ids of the tiny random model (its vocabulary is meaningless; only the roles matter).
_TINY_BOS, _TINY_PAD, _TINY_EOS, _TINY_EOL, _TINY_IMAGE_START, _TINY_IMAGE = 0, 1, 2, 3, 4, 5
_TINY_SIZE_BASE = 6  # size token for n grid cells: 6 + n (n <= 9)
_TINY_TEXT_VOCAB = 32  # ids below this are "text"; image tokens live above it, permuted
_TINY_SEP = 16  # <reserved08706> in the tiny tokenizer; words take ids 17..31


class LuminaBackbone(ARImageBackbone):
    """A frozen Lumina-mGPT (Chameleon) text-to-image generator."""

    cfg_space = "logprobs"

    def __init__(
        self,
        model: ChameleonForConditionalGeneration,
        name: str = MODEL_ID,
        rows: int = LUMINA_GRID,
        cols: int = LUMINA_GRID,
        eol_token_id: int = LUMINA_EOL_TOKEN_ID,
        pad_token_id: int | None = None,
        image_header_length: int = 3,
        uncond: str = "image_header",
        processor=None,
        image_start_token_id: int = LUMINA_IMAGE_START_TOKEN_ID,
        size_token_ids: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.model = model
        self.name = name
        self.processor = processor
        self.image_start_token_id = int(image_start_token_id)
        # Lumina-mGPT's size tokens count 32-px units (two grid cells); an odd grid has none.
        if size_token_ids is None and rows % 2 == 0 and cols % 2 == 0:
            size_token_ids = (LUMINA_SIZE_TOKEN_BASE + rows // 2, LUMINA_SIZE_TOKEN_BASE + cols // 2)
        self.size_token_ids = None if size_token_ids is None else tuple(int(i) for i in size_token_ids)
        config = model.config
        inner = model.model
        # The final norm lives outside the model: `_forward_flat` returns pre-norm states.
        self.final_norm = inner.norm
        inner.norm = nn.Identity()

        self.geometry = ImageGeometry(rows=rows, cols=cols, end_of_line=True)
        if config.vocabulary_map is None:
            raise ValueError(f"{name}: config.vocabulary_map is missing; it maps codebook ids to vocabulary ids")
        img2bpe = inner.vocabulary_mapping.img2bpe  # codebook id -> vocabulary id
        self.codebook_size = config.vq_config.num_embeddings
        if sorted(img2bpe) != list(range(self.codebook_size)):
            raise ValueError(
                f"{name}: the vocabulary map has {len(img2bpe)} image tokens, not one for each of the "
                f"{self.codebook_size} codebook entries"
            )
        mapping = torch.tensor([img2bpe[k] for k in range(self.codebook_size)], dtype=torch.long, device="cpu")
        self.register_buffer("codebook_to_vocab", mapping, persistent=False)
        # Chameleon keeps its image tokens contiguous and in codebook order: `logits` slices lm_head then.
        self._image_slice = contiguous_slice(mapping)
        if not 0 <= eol_token_id < config.vocab_size or eol_token_id in img2bpe.values():
            raise ValueError(f"{name}: eol_token_id={eol_token_id} is not a non-image vocabulary id")
        self.eol_token_id = int(eol_token_id)
        self.hidden_size = config.hidden_size
        pad = pad_token_id if pad_token_id is not None else config.pad_token_id
        self.pad_token_id = None if pad is None else int(pad)
        self.image_header_length = image_header_length
        if uncond not in ("image_header", "pad"):
            raise ValueError(f"uncond must be 'image_header' (Lumina-mGPT's) or 'pad', got {uncond!r}")
        self.uncond = uncond

    # ---- prompts --------------------------------------------------------------------------

    def prompt_token_ids(self, condition: Condition) -> torch.Tensor:
        """(B, L) prompt ids: [BOS, text..., image start, height size, width size]."""
        if condition.token_ids is not None:
            return condition.token_ids.long()
        if condition.prompts is None:
            raise ValueError(
                "Lumina-mGPT is text-conditional: give Condition(prompts=...) or Condition(token_ids=...) "
                "with the full prompt prefix ending with the image-start and the two size tokens"
            )
        if self.processor is None:
            raise ValueError(
                f"{self.name} was built without a processor (tokenizer); give Condition(token_ids=...) "
                "or load the backbone with load_lumina_backbone(path) from a weights directory that "
                "holds the tokenizer files"
            )
        if self.size_token_ids is None:
            raise ValueError(
                f"{self.name}: a {self.geometry.rows}x{self.geometry.cols} grid has no Lumina-mGPT size "
                "tokens (they count pairs of cells); pass size_token_ids=(h_id, w_id)"
            )
        tokenizer = getattr(self.processor, "tokenizer", self.processor)
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        sep = getattr(tokenizer, "sep_token", None) or LUMINA_SEP
        header = [self.image_start_token_id, *self.size_token_ids]
        width = self.geometry.cols * LUMINA_PIXELS_PER_CELL
        height = self.geometry.rows * LUMINA_PIXELS_PER_CELL
        rows = []
        for prompt in condition.prompts:
            text = LUMINA_T2I_INSTRUCTION.format(width=width, height=height, prompt=prompt) + sep
            rows.append([bos, *tokenizer(text, add_special_tokens=False)["input_ids"], *header])
        if len({len(r) for r in rows}) != 1:
            raise ValueError(
                "prompts of one batch must tokenize to the same length (padding is not implemented); "
                "decode them in separate batches (backbones.base.group_by_prompt_length does that)"
            )
        return torch.tensor(rows, dtype=torch.long)

    def unconditional_token_ids(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The CFG twin (same length as `token_ids`) and its attention mask (None: attend to all).

        "image_header": [pad..., image start, h-size, w-size] with the pads masked out (Lumina-mGPT's
        unconditional branch); "pad": the prompt with all but BOS and the header made pad tokens.
        """
        if self.pad_token_id is None:
            raise ValueError(f"{self.name}: no pad token id (config.pad_token_id or pad_token_id=...) for CFG")
        length = token_ids.shape[1]
        if length < 1 + self.image_header_length:
            raise ValueError(f"a prompt needs BOS and the {self.image_header_length}-token image header")
        keep = torch.zeros(length, dtype=torch.bool, device=token_ids.device)
        keep[length - self.image_header_length :] = True
        if self.uncond == "image_header":
            mask = keep.long().expand(token_ids.shape[0], -1)
            return token_ids.masked_fill(~keep, self.pad_token_id), mask
        keep[0] = True
        return token_ids.masked_fill(~keep, self.pad_token_id), None

    # ---- ARImageBackbone --------------------------------------------------------------------

    def prefill(self, condition: Condition, guided: bool) -> tuple[DecodeState, torch.Tensor]:
        ids = self.prompt_token_ids(condition).to(self._device())
        if ids.shape[1] < 1:
            raise ValueError("empty prompt")
        prefix_mask = None
        if guided:
            uncond_ids, uncond_mask = self.unconditional_token_ids(ids)
            if uncond_mask is not None:
                prefix_mask = torch.cat([torch.ones_like(ids), uncond_mask], dim=0)
            ids = torch.cat([ids, uncond_ids], dim=0)
        state = DecodeState(
            cache=self.image_cache(self.model.config.num_hidden_layers, ids.shape[1]),
            batch_size=condition.batch_size,
            guided=guided,
            prefix_length=ids.shape[1],
            extras={} if prefix_mask is None else {"prefix_attention_mask": prefix_mask},
        )
        hidden = self._run(state, self.model.model.embed_tokens(ids))
        return state, hidden[:, -1:]

    def flat_to_vocab(self, flat_tokens: torch.Tensor) -> torch.Tensor:
        """Codebook ids (with -1 = end of line) -> the model's vocabulary ids."""
        eol = flat_tokens < 0
        vocab = self.codebook_to_vocab[flat_tokens.clamp(min=0)]
        return vocab.masked_fill(eol, self.eol_token_id)

    def pass_module(self) -> nn.Module:
        return self.model.model

    def _forward_flat(self, state: DecodeState, flat_tokens: torch.Tensor) -> torch.Tensor:
        return self._run(state, self.model.model.embed_tokens(self.flat_to_vocab(flat_tokens)))

    def _forward_flat_at(self, state, flat_tokens, slots, visible, positions=None) -> torch.Tensor:
        embeds = self.model.model.embed_tokens(self.flat_to_vocab(flat_tokens))
        positional = positional_arguments(flat_tokens.shape[0], slots, visible, positions)
        prefix_mask = state.extras.get("prefix_attention_mask")
        if prefix_mask is not None:  # left-padded twins: the pads stay masked, positions count real tokens only
            positional["position_ids"] = positional["position_ids"] - (prefix_mask == 0).sum(-1, keepdim=True)
            mask = positional["attention_mask"].clone()
            mask[..., : prefix_mask.shape[1]] &= prefix_mask.bool()[:, None, None, :]
            positional["attention_mask"] = mask
        out = self.model.model(inputs_embeds=embeds, cache=state.cache, use_cache=True, **positional)
        return out.last_hidden_state

    def _run(self, state: DecodeState, embeds: torch.Tensor) -> torch.Tensor:
        prefix_mask = state.extras.get("prefix_attention_mask")
        if prefix_mask is None:
            out = self.model.model(inputs_embeds=embeds, cache=state.cache, use_cache=True)
            return out.last_hidden_state
        # Left-padded rows: mask the pads and count positions over real tokens only. The mask is
        # rebuilt from the cache length, so it stays right after `rollback` crops the cache.
        past, new = state.cache.get_seq_length(), embeds.shape[1]
        total = past + new
        mask = prefix_mask[:, :total]
        if total > mask.shape[1]:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], total - mask.shape[1])], dim=1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, past:]
        out = self.model.model(
            inputs_embeds=embeds, attention_mask=mask, position_ids=positions, cache=state.cache, use_cache=True
        )
        return out.last_hidden_state

    def image_head_weight(self) -> torch.Tensor:
        weight = self.model.lm_head.weight  # (V, hidden) rows in codebook order:
        return weight[self._image_slice] if self._image_slice is not None else weight[self.codebook_to_vocab]

    def embed_image_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(self.codebook_to_vocab[tokens])

    def condition_embedding(self, condition: Condition) -> torch.Tensor:
        """(B, hidden): the prompt's frozen input embeddings, mean-pooled (conditions a MuLo-SD drafter)."""
        return pooled_prompt_embedding(self, self.model.model.embed_tokens, condition, self.pad_token_id)

    def codebook_latents(self) -> torch.Tensor:
        return self.model.model.vqmodel.quantize.embedding.weight

    def tokens_to_pixels(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(
            "transformers' ChameleonVQVAE has no decoder; decode Lumina-mGPT tokens with the original "
            "Chameleon VQGAN (Lumina-mGPT's ckpts/chameleon/tokenizer)"
        )

    def pixels_to_tokens(self, images: torch.Tensor) -> torch.Tensor:
        vq = self.model.model.vqmodel
        pixels = images.to(self._device(), dtype=vq.quant_conv.weight.dtype) * 2 - 1
        tokens = vq.encode(pixels, return_dict=True).image_tokens
        batch = images.shape[0]
        if tokens.numel() != batch * self.geometry.num_tokens:
            raise ValueError(
                f"{self.name} encodes images to a {self.geometry.rows}x{self.geometry.cols} grid; "
                f"{tuple(images.shape[-2:])} gave {tokens.numel() // max(batch, 1)} tokens"
            )
        return tokens.view(batch, self.geometry.rows, self.geometry.cols)


def load_lumina_backbone(
    path: str,
    device: str = "cuda",
    dtype: str = "bfloat16",
    eol_token_id: int = LUMINA_EOL_TOKEN_ID,
    rows: int = LUMINA_GRID,
    cols: int = LUMINA_GRID,
    pad_token_id: int | None = None,
    uncond: str = "image_header",
    trust_remote_code: bool = False,
    float32_head: bool = False,
) -> LuminaBackbone:
    """Hydra entry point: frozen Lumina-mGPT from a transformers-format Chameleon weights directory.

    The Hub releases are not that yet (per-rank q/k norms, no VQ-VAE): `backbones.convert` converts
    them once, and a release given here as it is is refused with that command.
    """
    directory = require_weights(
        path,
        MODEL_ID,
        how_to_get=(
            "a transformers-format ChameleonForConditionalGeneration checkpoint is needed: download the "
            f"release (`huggingface-cli download {MODEL_ID} --local-dir <dir>`) and convert it once with "
            "`python -m backbones.convert lumina <dir> <out> --vqgan <Meta's Chameleon vqgan.ckpt>` "
            "(docs/backbones.md), then give path=<out>"
        ),
    )
    problems = lumina_release_problems(directory)
    if problems:
        raise ValueError(
            f"{directory} is a Lumina-mGPT release in its own layout, which transformers' Chameleon does not "
            f"load: {'; '.join(problems)}. Convert it once with `python -m backbones.convert lumina {directory} "
            f"{directory}-chameleon --vqgan <Meta's Chameleon vqgan.ckpt>` (docs/backbones.md) and give "
            f"path={directory}-chameleon"
        )
    model = load_pretrained(ChameleonForConditionalGeneration, directory, dtype, trust_remote_code)
    name = display_name(directory, MODEL_ID)
    backbone = LuminaBackbone(
        model,
        name=name,
        rows=rows,
        cols=cols,
        eol_token_id=eol_token_id,
        pad_token_id=pad_token_id,
        uncond=uncond,
        processor=_load_lumina_tokenizer(directory, trust_remote_code),
    )
    backbone.float32_head = float32_head
    return backbone.to(device).eval().requires_grad_(False)


def _load_lumina_tokenizer(directory, trust_remote_code: bool = False):
    """The processor, else the bare tokenizer, else None (``Condition(token_ids=...)`` still works).

    Alpha-VLLM/Lumina-mGPT-7B-768 ships tokenizer files only (no preprocessor_config.json), which
    AutoProcessor refuses; the other releases ship none (Lumina-mGPT's item processor reads 7B-768's).
    """
    processor = load_processor(directory, trust_remote_code)
    if processor is not None:
        return processor
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None


def _image_token_name(codebook_id: int) -> str:
    """Chameleon's name of image token k: 'IMGIMG' + digits spelt A..J + 'Z' (see bpe2img)."""
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(codebook_id)) + "Z"


def tiny_lumina_config(
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 64,
    codebook_size: int = 64,
    vq_embed_dim: int = 8,
    seed: int = 0,
    vocab_size: int | None = None,
    qk_layernorm: bool = False,
    max_positions: int = 512,
    permuted_image_tokens: bool = True,
) -> ChameleonConfig:
    """A tiny Chameleon config with a vocabulary map whose image tokens are a permutation of
    ids ``32..32+V-1`` (so the codebook -> vocabulary map is not an offset).

    The text model's arguments also build it at a published size (backbones/published_sizes.py).
    """
    generator = torch.Generator().manual_seed(seed + 12345)
    permutation = (
        torch.randperm(codebook_size, generator=generator, device="cpu").tolist()
        if permuted_image_tokens
        else list(range(codebook_size))
    )
    vocabulary_map = {
        "<s>": _TINY_BOS,
        "<pad>": _TINY_PAD,
        "</s>": _TINY_EOS,
        "<reserved08799>": _TINY_EOL,
        "<racm3:break>": _TINY_IMAGE_START,
        "<image>": _TINY_IMAGE,
    }
    for k in range(codebook_size):
        vocabulary_map[_image_token_name(k)] = _TINY_TEXT_VOCAB + permutation[k]
    vq_config = ChameleonVQVAEConfig(
        embed_dim=vq_embed_dim,
        num_embeddings=codebook_size,
        latent_channels=32,
        resolution=16,
        base_channels=32,  # GroupNorms with 32 groups
        channel_multiplier=[1, 1],  # one downsampling: 2 px per grid cell
        num_res_blocks=1,
    )
    return ChameleonConfig(
        vocab_size=max(vocab_size or 0, _TINY_TEXT_VOCAB + codebook_size),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        qk_layernorm=qk_layernorm,
        max_position_embeddings=max_positions,
        bos_token_id=_TINY_BOS,
        pad_token_id=_TINY_PAD,
        eos_token_id=_TINY_EOS,
        vq_config=vq_config.to_dict(),
        vocabulary_map=vocabulary_map,
    )


def random_lumina_model(seed: int = 0, **config_overrides) -> ChameleonForConditionalGeneration:
    """A tiny ChameleonForConditionalGeneration with seeded random weights."""
    config = tiny_lumina_config(seed=seed, **config_overrides)
    torch.manual_seed(seed)
    return ChameleonForConditionalGeneration(config).eval().requires_grad_(False)


def tiny_lumina_prompt(text: list[int], rows: int = 3, cols: int = 4) -> list[int]:
    """[BOS, text..., image start, height size, width size] in the tiny model's vocabulary."""
    return [_TINY_BOS, *text, _TINY_IMAGE_START, _TINY_SIZE_BASE + rows, _TINY_SIZE_BASE + cols]


def tiny_lumina_tokenizer():
    """A word-level tokenizer inside the tiny model's text ids (0..31): ``<s>`` 0, ``<pad>`` 1, ``</s>`` 2,
    ``<racm3:break>`` 4, the turn separator ``<reserved08706>`` 16 (also its ``sep_token``), words 17..31."""
    from backbones.tiny_tokenizer import tiny_word_tokenizer

    fixed = {
        "<s>": _TINY_BOS,
        "<pad>": _TINY_PAD,
        "</s>": _TINY_EOS,
        "<reserved08799>": _TINY_EOL,
        "<racm3:break>": _TINY_IMAGE_START,
        "<image>": _TINY_IMAGE,
        LUMINA_SEP: _TINY_SEP,
    }
    tokenizer = tiny_word_tokenizer(
        fixed,
        special=list(fixed),
        free_ids=list(range(_TINY_SEP + 1, _TINY_TEXT_VOCAB)),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    tokenizer.sep_token = LUMINA_SEP
    return tokenizer


def random_lumina_backbone(
    seed: int = 0,
    device: str = "cpu",
    rows: int = 3,
    cols: int = 4,
    uncond: str = "image_header",
    tokenizer: bool = False,
    **config_overrides,
) -> LuminaBackbone:
    """Hydra entry point: a tiny random-weight Lumina (Chameleon) backbone, 3x4 grid with EOL; nothing to load.

    `tokenizer=True` attaches `tiny_lumina_tokenizer`, so ``Condition(prompts=...)`` works; the image
    header is `tiny_lumina_prompt`'s (size token ``6 + cells``).
    """
    model = random_lumina_model(seed, **config_overrides)
    backbone = LuminaBackbone(
        model,
        name="lumina-tiny-random",
        rows=rows,
        cols=cols,
        eol_token_id=_TINY_EOL,
        uncond=uncond,
        processor=tiny_lumina_tokenizer() if tokenizer else None,
        image_start_token_id=_TINY_IMAGE_START,
        size_token_ids=(_TINY_SIZE_BASE + rows, _TINY_SIZE_BASE + cols),
    )
    return backbone.to(device).eval().requires_grad_(False)
