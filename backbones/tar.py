"""Tar (Han et al. 2025, github.com/csuhan/Tar) behind the backbone interface.

Tar's language model is a plain transformers ``Qwen2ForCausalLM`` (the public
inference scripts, e.g. ``t2i_inference_sana.py`` of csuhan/Tar, load
``Qwen2ForCausalLM.from_pretrained("csuhan/Tar-1.5B")``). Image tokens are TA-Tok
codes written as the added vocabulary tokens ``<I0>``, ``<I1>``, ... (the scripts
parse the generated text with ``re.findall(r'<I(\\d+)>', ...)``). This adapter
assumes they form one contiguous id range
``[image_token_offset, image_token_offset + codebook_size)`` in codebook order.
The real offset is ``tokenizer.convert_tokens_to_ids("<I0>")`` of the checkpoint;
`load_tar_backbone` reads it (and checks contiguity) from the tokenizer when no
offset is given. The offset and the TA-Tok codebook size were NOT verified here
against a checkpoint.

Layout of one sequence (Tar's generation scripts):

    chat_template([system "You are a helpful assistant.", user prompt], add_generation_prompt=True)
    + "<im_start><S{scale}>"  then  <I..> x seq_len

with ``seq_len`` 729 / 169 / 81 for scale 0 / 1 / 2, i.e. 27x27, 13x13, 9x9
grids (raster order, no end-of-line tokens). ``Condition(token_ids=...)`` is that
whole prefix already tokenized (every row the same length, ending with the
``<S{scale}>`` token); ``Condition(prompts=...)`` needs the tokenizer.

The final RMSNorm (``model.model.norm``) is taken out of the Qwen2 model so that
`_forward_flat` returns pre-norm states; `logits` applies it and the rows of
``lm_head`` of the image tokens.

Classifier-free guidance: Tar's public scripts sample the LLM WITHOUT guidance
(plain ``model.generate``; their ``cfg_scale`` goes to the pixel detokenizer).
The guided path here is therefore this adapter's own choice, not Tar's: logit
mixing ``u + s (c - u)``, with the unconditional twin being the prompt with every
token before the trailing ``<im_start><S{scale}>`` replaced by the pad token
(or ``negative_token_ids`` of the same length when set).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

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
    require_weights,
)

MODEL_ID = "csuhan/Tar-1.5B"
SYSTEM_PROMPT = "You are a helpful assistant."
IMAGE_START = "<im_start>"
SCALE_TOKENS = {0: 27, 1: 13, 2: 9}  # <S{scale}> -> grid side (seq_len 729 / 169 / 81)
DEFAULT_GRID = 27
HEADER_LENGTH = 2  # <im_start><S{scale}>

_DETOKENIZER_HELP = (
    "Tar's pixel detokenizers (MMAutoEncoder / SanaAutoEncoder / LuminaAutoEncoder) live in the `tok` package of "
    "https://github.com/csuhan/Tar, with weights from the HF repo csuhan/TA-Tok; clone that repository onto "
    "PYTHONPATH and set `backbone.detokenizer` to a built autoencoder (anything with "
    "`decode_from_encoder_indices(codes, ...)`)"
)


class TarBackbone(ARImageBackbone):
    """A frozen Tar text-to-image LLM (Qwen2) with a contiguous range of TA-Tok image tokens."""

    cfg_space = "logits"

    def __init__(
        self,
        model: Qwen2ForCausalLM,
        image_token_offset: int,
        codebook_size: int,
        rows: int = DEFAULT_GRID,
        cols: int = DEFAULT_GRID,
        name: str = MODEL_ID,
        tokenizer=None,
        scale: int = 0,
        negative_token_ids: torch.Tensor | None = None,
        detokenizer=None,
        codebook: torch.Tensor | None = None,
    ):
        super().__init__()
        vocab = model.config.vocab_size
        if not (0 <= image_token_offset and image_token_offset + codebook_size <= vocab and codebook_size > 0):
            raise ValueError(
                f"{name}: image tokens [{image_token_offset}, {image_token_offset + codebook_size}) "
                f"do not fit the vocabulary of {vocab}"
            )
        self.model = model
        self.name = name
        self.tokenizer = tokenizer
        self.scale = scale
        self.negative_token_ids = negative_token_ids
        self.detokenizer = detokenizer
        self.codebook = codebook
        self.final_norm = model.model.norm
        model.model.norm = nn.Identity()
        self.geometry = ImageGeometry(rows=rows, cols=cols, end_of_line=False)
        self.hidden_size = model.config.hidden_size
        self.codebook_size = codebook_size
        self.image_token_offset = image_token_offset
        pad = model.config.pad_token_id
        self.pad_token_id = pad if pad is not None else 0
        self._image_slice = slice(image_token_offset, image_token_offset + codebook_size)

    # ---- prompts --------------------------------------------------------------------------

    def prompt_token_ids(self, condition: Condition) -> torch.Tensor:
        """(B, L) ids: Tar's chat-template prompt followed by ``<im_start><S{scale}>``."""
        if condition.token_ids is not None:
            ids = condition.token_ids.long()
        elif condition.prompts is not None:
            if self.tokenizer is None:
                raise ValueError(
                    f"{self.name} was built without a tokenizer; give Condition(token_ids=...) or load "
                    "the backbone with load_tar_backbone(path) from the full weights directory"
                )
            rows = []
            for prompt in condition.prompts:
                messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                text += f"{IMAGE_START}<S{self.scale}>"
                rows.append(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            if len({len(r) for r in rows}) != 1:
                raise ValueError(
                    "prompts of one batch must tokenize to the same length (padding is not "
                    "implemented); decode them in separate batches (backbones.base.group_by_prompt_length "
                    "does that)"
                )
            ids = torch.tensor(rows, dtype=torch.long)
        else:
            raise ValueError("Tar is text-conditional: give Condition(prompts=...) or Condition(token_ids=...)")
        if ids.shape[1] <= HEADER_LENGTH:
            raise ValueError(f"Tar prompt token_ids must end with {IMAGE_START}<S{{scale}}> after the prompt")
        return ids

    def unconditional_token_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The CFG twin (adapter choice, see the module doc), the prompt's length."""
        if self.negative_token_ids is not None:
            negative = self.negative_token_ids.long().to(token_ids.device)
            negative = negative[None] if negative.dim() == 1 else negative
            if negative.shape[1] != token_ids.shape[1]:
                raise ValueError(
                    f"negative_token_ids has length {negative.shape[1]}, the prompt "
                    f"{token_ids.shape[1]}; the unconditional twin must have the prompt's length"
                )
            return negative.expand(token_ids.shape[0], -1).clone()
        twin = torch.full_like(token_ids, self.pad_token_id)
        twin[:, -HEADER_LENGTH:] = token_ids[:, -HEADER_LENGTH:]
        return twin

    # ---- ARImageBackbone --------------------------------------------------------------------

    def prefill(self, condition: Condition, guided: bool) -> tuple[DecodeState, torch.Tensor]:
        ids = self.prompt_token_ids(condition).to(self._device())
        if guided:
            ids = torch.cat([ids, self.unconditional_token_ids(ids)], dim=0)
        state = DecodeState(
            cache=self.image_cache(self.model.config.num_hidden_layers, ids.shape[1]),
            batch_size=condition.batch_size,
            guided=guided,
            prefix_length=ids.shape[1],
        )
        hidden = self._run(state, self.model.get_input_embeddings()(ids))
        return state, hidden[:, -1:]

    def pass_module(self) -> nn.Module:
        return self.model.model

    def _forward_flat(self, state: DecodeState, flat_tokens: torch.Tensor) -> torch.Tensor:
        return self._run(state, self.embed_image_tokens(flat_tokens))

    def _forward_flat_at(self, state, flat_tokens, slots, visible, positions=None) -> torch.Tensor:
        positional = positional_arguments(flat_tokens.shape[0], slots, visible, positions)
        return self._run(state, self.embed_image_tokens(flat_tokens), **positional)

    def _run(self, state: DecodeState, embeds: torch.Tensor, **positional) -> torch.Tensor:
        out = self.model.model(inputs_embeds=embeds, cache=state.cache, use_cache=True, **positional)
        return out.last_hidden_state

    def vocab_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """Codebook ids -> vocabulary ids (``<I{code}>``)."""
        tokens = tokens.long()
        if bool(((tokens < 0) | (tokens >= self.codebook_size)).any()):
            raise ValueError(f"codebook ids must lie in [0, {self.codebook_size})")
        return tokens + self.image_token_offset

    def image_head_weight(self) -> torch.Tensor:
        return self.model.lm_head.weight[self._image_slice]

    def embed_image_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(self.vocab_ids(tokens))

    def condition_embedding(self, condition: Condition) -> torch.Tensor:
        """(B, hidden): the prompt's frozen input embeddings, mean-pooled (conditions a MuLo-SD drafter)."""
        return pooled_prompt_embedding(self, self.model.get_input_embeddings(), condition, self.pad_token_id)

    def codebook_latents(self) -> torch.Tensor:
        if self.codebook is None:
            raise NotImplementedError(
                f"{self.name}: the TA-Tok codebook is not part of the LLM checkpoint; set "
                "`backbone.codebook` to the (codebook_size, dim) TA-Tok codebook. " + _DETOKENIZER_HELP
            )
        return self.codebook

    def tokens_to_pixels(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.detokenizer is None:
            raise NotImplementedError(f"{self.name} has no pixel detokenizer attached. " + _DETOKENIZER_HELP)
        codes = tokens.long().reshape(tokens.shape[0], -1).to(self._device())
        pixels = self.detokenizer.decode_from_encoder_indices(codes)
        if not isinstance(pixels, torch.Tensor):
            raise TypeError("the detokenizer returned no tensor; convert its images to (B, C, H, W) in [0, 1]")
        return pixels.float().clamp(0, 1)


def _image_range_from_tokenizer(tokenizer) -> tuple[int, int]:
    """(offset, count) of the contiguous ``<I0>``, ``<I1>``, ... tokens; ValueError when not contiguous."""
    offset = tokenizer.convert_tokens_to_ids("<I0>")
    if offset is None or offset == tokenizer.unk_token_id:
        raise ValueError("the tokenizer has no <I0> token; pass image_token_offset and codebook_size")
    vocab = tokenizer.get_vocab()
    count = 0
    while f"<I{count}>" in vocab:
        if vocab[f"<I{count}>"] != offset + count:
            raise ValueError(
                f"<I{count}> has id {vocab[f'<I{count}>']}, not {offset + count}: image tokens are not contiguous"
            )
        count += 1
    return offset, count


def load_tar_backbone(
    path: str,
    device: str = "cuda",
    dtype: str = "bfloat16",
    image_token_offset: int | None = None,
    codebook_size: int | None = None,
    rows: int = DEFAULT_GRID,
    cols: int = DEFAULT_GRID,
    scale: int = 0,
    trust_remote_code: bool = False,
    float32_head: bool = False,
) -> TarBackbone:
    """Hydra entry point: a frozen Tar LLM from a local weights directory (e.g. csuhan/Tar-1.5B).

    The image-token range comes from the tokenizer's ``<I0>..`` tokens unless given explicitly.
    """
    directory = require_weights(path, MODEL_ID)
    model = load_pretrained(Qwen2ForCausalLM, directory, dtype, trust_remote_code)
    processor = load_processor(directory, trust_remote_code)
    tokenizer = getattr(processor, "tokenizer", processor)
    if image_token_offset is None or codebook_size is None:
        if tokenizer is None:
            raise ValueError(f"no tokenizer at {directory}: pass image_token_offset and codebook_size")
        found_offset, found_size = _image_range_from_tokenizer(tokenizer)
        image_token_offset = found_offset if image_token_offset is None else image_token_offset
        codebook_size = found_size if codebook_size is None else codebook_size
    backbone = TarBackbone(
        model,
        image_token_offset,
        codebook_size,
        rows=rows,
        cols=cols,
        name=display_name(directory, MODEL_ID),
        tokenizer=tokenizer,
        scale=scale,
    )
    backbone.float32_head = float32_head
    return backbone.to(device).eval().requires_grad_(False)


# ---- a tiny random model (tests) -------------------------------------------------------------

TINY_ROWS, TINY_COLS, TINY_CODEBOOK, TINY_OFFSET, TINY_VOCAB = 3, 4, 32, 40, 80


def tiny_tar_config(
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 64,
    vocab_size: int = TINY_VOCAB,
) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=1,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )


def random_tar_model(seed: int = 0, **config_overrides) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(tiny_tar_config(**config_overrides)).eval().requires_grad_(False)


# Qwen2's chat template, reduced to what Tar's prompts use (system + user turns, generation prompt).
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tar_tokenizer(
    image_token_offset: int = TINY_OFFSET, codebook_size: int = TINY_CODEBOOK, vocab_size: int = TINY_VOCAB
):
    """A word-level tokenizer for the tiny Tar: Qwen2's chat markers, ``<im_start>``, ``<S0..2>`` and ``<I0>..``.

    Pad ``<|endoftext|>`` 0, ``<|im_end|>`` 2 (EOS), ``<|im_start|>`` 3, ``<im_start>`` 4, ``<S0>``..``<S2>``
    5..7, the image tokens ``<I{k}>`` at ``image_token_offset + k``; words take the remaining ids.
    """
    from backbones.tiny_tokenizer import tiny_word_tokenizer

    fixed = {
        "<|endoftext|>": 0,
        "<|bos|>": 1,
        "<|im_end|>": 2,
        "<|im_start|>": 3,
        IMAGE_START: 4,
        **{f"<S{scale}>": 5 + scale for scale in SCALE_TOKENS},
    }
    fixed.update({f"<I{k}>": image_token_offset + k for k in range(codebook_size)})
    free = [i for i in range(vocab_size) if i not in set(fixed.values())]
    return tiny_word_tokenizer(
        fixed,
        special=list(fixed),
        free_ids=free,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        chat_template=TINY_CHAT_TEMPLATE,
    )


def random_tar_backbone(
    seed: int = 0,
    device: str = "cpu",
    rows: int = TINY_ROWS,
    cols: int = TINY_COLS,
    image_token_offset: int = TINY_OFFSET,
    codebook_size: int = TINY_CODEBOOK,
    tokenizer: bool = False,
    **config_overrides,
) -> TarBackbone:
    """Hydra entry point: a tiny random-weight Tar (Qwen2) backbone (3x4 grid, image ids 40..71).

    `tokenizer=True` attaches `tiny_tar_tokenizer`, so ``Condition(prompts=...)`` works.
    """
    model = random_tar_model(seed, **config_overrides)
    words = tiny_tar_tokenizer(image_token_offset, codebook_size, model.config.vocab_size) if tokenizer else None
    backbone = TarBackbone(
        model, image_token_offset, codebook_size, rows=rows, cols=cols, name="tar-tiny-random", tokenizer=words
    )
    return backbone.to(device).eval().requires_grad_(False)
