"""In-memory word-level tokenizers for the tiny random-weight backbones (tests; nothing to download).

The tiny transformers models (`random_emu3_backbone`, `random_janus_backbone`,
`random_lumina_backbone`, `random_tar_backbone`) have vocabularies of 64-80 ids
whose text part means nothing. To exercise the real ``Condition(prompts=...)``
paths of the adapters (chat templates, image headers, special tokens) on them,
each builder can attach a `transformers.PreTrainedTokenizerFast` made here: a
``tokenizers`` WordLevel model whose every id lies inside the tiny model's text
vocabulary. Known words get their own id, any other word the unknown token, so
prompts of different word counts tokenize to different lengths (as real prompts
do). The pre-tokenizer splits on whitespace and punctuation (``"3*4"`` ->
``"3"``, ``"*"``, ``"4"``); the given special tokens are matched before that.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

# Words that get their own id when the vocabulary has room (in this order); the rest is the unknown token.
COMMON_WORDS = [
    "a",
    "of",
    "the",
    "image",
    "photo",
    "cat",
    "dog",
    "red",
    "blue",
    "in",
    "on",
    "and",
    "with",
    "an",
    "Generate",
    "according",
    "to",
    "following",
    "prompt",
    ":",
    "system",
    "user",
    "assistant",
    "You",
    "are",
    "helpful",
    ".",
    "green",
    "tree",
    "house",
    "car",
    "sky",
]


def tiny_word_tokenizer(
    fixed: dict[str, int],
    special: list[str],
    free_ids: list[int],
    unk_token: str = "<unk>",
    bos_token: str | None = None,
    eos_token: str | None = None,
    pad_token: str | None = None,
    add_bos: bool = False,
    chat_template: str | None = None,
    extra_special_tokens: dict[str, str] | None = None,
) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the ids of a tiny model.

    `fixed` maps the tokens whose ids the model defines (BOS, image markers, digits)
    to those ids; the names in `special` among them are matched as whole special
    tokens. `free_ids` are text ids the model leaves unused: the first becomes
    `unk_token`, the others `COMMON_WORDS` in order. `add_bos` prepends `bos_token`
    when the tokenizer is called with special tokens (as Llama-style tokenizers do).
    """
    if len(free_ids) < 2:
        raise ValueError(f"a tiny tokenizer needs at least 2 free ids (unknown token and a word), got {free_ids}")
    taken = set(fixed.values())
    clash = taken.intersection(free_ids)
    if clash:
        raise ValueError(f"free ids {sorted(clash)} are already used by fixed tokens")
    vocab = dict(fixed)
    vocab[unk_token] = free_ids[0]
    words = [w for w in COMMON_WORDS if w not in vocab]
    vocab.update(zip(words, free_ids[1:]))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=unk_token))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    missing = [t for t in special if t not in fixed]
    if missing:
        raise ValueError(f"special tokens {missing} need ids in `fixed`")
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    if add_bos:
        if bos_token is None:
            raise ValueError("add_bos needs bos_token")
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", special_tokens=[(bos_token, fixed[bos_token])]
        )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token=unk_token,
        bos_token=bos_token,
        eos_token=eos_token,
        pad_token=pad_token,
        extra_special_tokens=extra_special_tokens or {},
    )
    if chat_template is not None:
        wrapped.chat_template = chat_template
    return wrapped
