"""The Emu3 adapter behind the interface, on a tiny random-weight Emu3ForConditionalGeneration.

The reference for every check is transformers' own Emu3 forward (final norm and
lm_head included) on an unmodified copy of the same weights (`random_emu3_model`
with the same seed), fed the flat sequence in Emu3's vocabulary, end-of-line
tokens included. The tiny vocabulary shuffles the visual tokens, so codebook
order differs from vocabulary order.
"""

import pytest
import torch
from conftest import assert_greedy_lossless_methods_equal_greedy_ar

from backbones.base import Condition, ImageGeometry
from backbones.emu3 import (
    Emu3Backbone,
    random_emu3_backbone,
    random_emu3_model,
)
from decode.ar import generate_ar
from decode.sampling import SamplingConfig

SEED = 0
ROWS, COLS, CODES = 3, 4, 32
# Tiny ids: pad 0, BOS 1, <|image start|> 3, <|image token|> 4, EOL 6, digits d -> 10 + d, '*' 20.
# [BOS, prompt..., <|image start|>, "3", "*", "4", <|image token|>]; equal lengths.
HEADER = [3, 13, 20, 14, 4]
PROMPTS = torch.tensor([[1, 21, 22, 23, 24] + HEADER, [1, 25, 26, 27, 28] + HEADER])
EOL_ID = 6


@pytest.fixture
def backbone():
    return random_emu3_backbone(seed=SEED)


@pytest.fixture
def reference():
    """The untouched transformers model with the backbone's weights (its final norm still inside)."""
    return random_emu3_model(seed=SEED)


def _visual_ids(model):
    """Vocabulary ids of the visual tokens in codebook order (from the model's own vocabulary mapping)."""
    img2bpe = model.vocabulary_mapping.img2bpe
    return torch.tensor([img2bpe[i] for i in range(CODES)])


def _flat_ids(model, prompt_ids, image_tokens):
    """[prompt; image tokens as vocabulary ids with an EOL after every complete row]."""
    visual = _visual_ids(model)
    rows = []
    for b in range(image_tokens.shape[0]):
        seq = []
        for i, code in enumerate(image_tokens[b].tolist()):
            seq.append(int(visual[code]))
            if (i + 1) % COLS == 0:
                seq.append(EOL_ID)
        rows.append(seq)
    return torch.cat([prompt_ids, torch.tensor(rows, dtype=torch.long).view(len(rows), -1)], dim=1)


def _grid_positions(prompt_length, num_tokens):
    """Flat positions whose logits predict grid tokens 0..num_tokens-1 (the EOL predicts a row's first token)."""
    positions, flat = [], prompt_length - 1
    for i in range(num_tokens):
        positions.append(flat)
        flat += 1 + int((i + 1) % COLS == 0)
    return torch.tensor(positions)


def _reference_logits(model, ids):
    """Restricted (codebook-order) logits at every flat position of one no-cache forward."""
    return model(input_ids=ids, use_cache=False).logits[..., _visual_ids(model)]


def test_geometry_and_sizes_come_from_the_config(backbone):
    config = backbone.model.config
    assert backbone.geometry == ImageGeometry(rows=ROWS, cols=COLS, end_of_line=True)
    assert backbone.geometry.row_stride == COLS + 1 and backbone.geometry.num_tokens == 12
    assert backbone.geometry.flat_length(12) == 15 and backbone.geometry.flat_length(5) == 6
    assert backbone.codebook_size == config.vq_config.codebook_size == CODES
    assert backbone.hidden_size == config.text_config.hidden_size == 32
    assert backbone.cfg_space == "logprobs"
    assert backbone.eol_token_id == backbone.model.vocabulary_mapping.eol_token_id == EOL_ID
    assert backbone.codebook_latents().shape == (CODES, config.vq_config.embed_dim)
    # Codebook order is not vocabulary order in the tiny model, so the mapping is really exercised.
    assert _visual_ids(backbone.model).tolist() != sorted(_visual_ids(backbone.model).tolist())
    assert not any(p.requires_grad for p in backbone.parameters()) and not backbone.training


@torch.no_grad()
@pytest.mark.parametrize("guided", [False, True])
def test_cached_steps_give_the_no_cache_logits_at_every_position(backbone, reference, guided):
    tokens = torch.randint(0, CODES, (2, 12))
    state, hidden = backbone.prefill(Condition(token_ids=PROMPTS), guided=guided)
    assert state.prefix_length == PROMPTS.shape[1] and state.cache.get_seq_length() == PROMPTS.shape[1]
    stepped = [backbone.logits(hidden)]
    for position in range(11):
        stepped.append(backbone.logits(backbone.step(state, tokens[:, position : position + 1])))
    assert state.cache.get_seq_length() == PROMPTS.shape[1] + backbone.geometry.flat_length(11)
    prompts = torch.cat([PROMPTS, backbone.unconditional_token_ids(PROMPTS)]) if guided else PROMPTS
    both = torch.cat([tokens, tokens]) if guided else tokens
    flat = _flat_ids(reference, prompts, both[:, :-1])
    expected = _reference_logits(reference, flat)[:, _grid_positions(PROMPTS.shape[1], 12)]
    torch.testing.assert_close(torch.cat(stepped, dim=1), expected, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_multi_token_step_equals_single_steps(backbone):
    tokens = torch.randint(0, CODES, (2, 10))
    condition = Condition(token_ids=PROMPTS)
    state_a, _ = backbone.prefill(condition, guided=True)
    block = backbone.step(state_a, tokens)
    state_b, _ = backbone.prefill(condition, guided=True)
    singles = torch.cat([backbone.step(state_b, tokens[:, i : i + 1]) for i in range(10)], dim=1)
    torch.testing.assert_close(block, singles, atol=1e-5, rtol=1e-4)
    assert block.shape == (4, 10, 32)


@torch.no_grad()
@pytest.mark.parametrize("keep", [6, 3, 4])  # 3: roll back across the row end; 4: to just after it
def test_rollback_reproduces_the_logits_of_a_fresh_prefill(backbone, keep):
    condition = Condition(token_ids=PROMPTS)
    prefix, wrong, right = (torch.randint(0, CODES, (2, n)) for n in (keep, 5, 5))
    state, _ = backbone.prefill(condition, guided=True)
    backbone.step(state, torch.cat([prefix, wrong], dim=1))
    backbone.rollback(state, keep)
    assert state.num_image_tokens == keep
    assert state.cache.get_seq_length() == PROMPTS.shape[1] + backbone.geometry.flat_length(keep)
    after_rollback = backbone.step(state, right)
    fresh_state, _ = backbone.prefill(condition, guided=True)
    fresh = backbone.step(fresh_state, torch.cat([prefix, right], dim=1))[:, keep:]
    torch.testing.assert_close(backbone.logits(after_rollback), backbone.logits(fresh), atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_pre_norm_hidden_through_logits_is_the_models_lm_head_output(backbone, reference):
    tokens = torch.randint(0, CODES, (2, 12))
    hidden = backbone.teacher_forced_hidden(Condition(token_ids=PROMPTS), tokens)
    assert hidden.shape == (2, 12, 32)
    flat = _flat_ids(reference, PROMPTS, tokens[:, :-1])
    post_norm = reference.model(input_ids=flat, use_cache=False).last_hidden_state
    post_norm = post_norm[:, _grid_positions(PROMPTS.shape[1], 12)]
    # Really pre-norm: not the model's final (normalised) state.
    assert not torch.allclose(hidden, post_norm, atol=1e-3)
    torch.testing.assert_close(backbone.final_norm(hidden), post_norm, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(
        backbone.logits(hidden), reference.lm_head(post_norm)[..., _visual_ids(reference)], atol=1e-5, rtol=1e-4
    )


@torch.no_grad()
def test_unconditional_twin_and_logprob_guidance(backbone, reference):
    # Default twin: the text between BOS and the image header becomes the pad token.
    assert backbone.unconditional_token_ids(PROMPTS).tolist() == [[1, 0, 0, 0, 0] + HEADER] * 2
    state, hidden = backbone.prefill(Condition(token_ids=PROMPTS), guided=True)
    assert hidden.shape[0] == 4
    uncond_ids = PROMPTS.clone()
    uncond_ids[:, 1:5] = 0
    ref = _reference_logits(reference, torch.cat([PROMPTS, uncond_ids]))[:, -1:]
    cond, uncond = ref[:2].log_softmax(-1), ref[2:].log_softmax(-1)
    torch.testing.assert_close(
        backbone.scores(state, hidden, 4.0), uncond + 4.0 * (cond - uncond), atol=1e-5, rtol=1e-4
    )
    # Mixing full-vocabulary log-probs (what UnbatchedClassifierFreeGuidanceLogitsProcessor does) differs
    # only by a per-row constant: the same distribution over visual tokens.
    full = reference(input_ids=torch.cat([PROMPTS, uncond_ids]), use_cache=False).logits[:, -1:].log_softmax(-1)
    mixed_full = (full[2:] + 4.0 * (full[:2] - full[2:]))[..., _visual_ids(reference)]
    torch.testing.assert_close(
        backbone.scores(state, hidden, 4.0).softmax(-1), mixed_full.softmax(-1), atol=1e-5, rtol=1e-4
    )


@torch.no_grad()
def test_negative_token_ids_twin(backbone):
    negative = torch.tensor([1, 29, 30, 31, 0] + HEADER)
    backbone.negative_token_ids = negative
    assert backbone.unconditional_token_ids(PROMPTS).tolist() == [negative.tolist()] * 2
    backbone.negative_token_ids = negative[1:]
    with pytest.raises(ValueError, match="length"):
        backbone.prefill(Condition(token_ids=PROMPTS), guided=True)


def _greedy_reference(model, prompts, uncond, cfg_scale):
    """A plain greedy loop over the model's own no-cache forward, EOLs inserted as Emu3 does, log-prob CFG."""
    visual = _visual_ids(model)
    guided = cfg_scale != 1.0
    ids = torch.cat([prompts, uncond]) if guided else prompts
    batch = prompts.shape[0]
    codes = []
    for i in range(ROWS * COLS):
        logits = model(input_ids=ids, use_cache=False).logits[:, -1].log_softmax(-1)
        if guided:
            logits = logits[batch:] + cfg_scale * (logits[:batch] - logits[batch:])
        allowed = torch.full_like(logits, float("-inf"))
        allowed[:, visual] = logits[:, visual]
        chosen = allowed.argmax(-1)  # vocabulary ids of visual tokens
        codes.append(torch.tensor([model.vocabulary_mapping.bpe2img[int(c)] for c in chosen]))
        new = chosen[:, None]
        if (i + 1) % COLS == 0:
            new = torch.cat([new, torch.full_like(new, EOL_ID)], dim=1)
        ids = torch.cat([ids, torch.cat([new, new]) if guided else new], dim=1)
    return torch.stack(codes, dim=1)


@torch.no_grad()
@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_greedy_generate_ar_equals_a_plain_greedy_loop_over_the_model(backbone, reference, cfg_scale):
    expected = _greedy_reference(reference, PROMPTS, backbone.unconditional_token_ids(PROMPTS), cfg_scale)
    result = generate_ar(backbone, Condition(token_ids=PROMPTS), SamplingConfig(cfg_scale=cfg_scale, greedy=True))
    assert result.tokens.shape == (2, ROWS, COLS)
    assert torch.equal(result.tokens.view(2, -1), expected)
    assert len(result.tokens.unique()) > 1  # not a degenerate constant image


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_greedy_ssd_exact_equals_greedy_ar(backbone, cfg_scale):
    assert_greedy_lossless_methods_equal_greedy_ar(backbone, Condition(token_ids=PROMPTS), cfg_scale)


@torch.no_grad()
def test_pixels_match_the_models_own_decode(backbone):
    tokens = torch.randint(0, CODES, (2, ROWS, COLS))
    pixels = backbone.tokens_to_pixels(tokens)
    assert pixels.shape == (2, 3, ROWS * 2, COLS * 2)  # 2 VQ levels: 2 pixels per token
    assert pixels.min() >= 0 and pixels.max() <= 1
    # The model's own decode_image_tokens takes the generated vocabulary ids: rows + EOLs, then 3 end tokens.
    flat = _flat_ids(backbone.model, PROMPTS[:, :0], tokens.view(2, -1))
    flat = torch.cat([flat, torch.zeros(2, 3, dtype=torch.long)], dim=1)
    own = backbone.model.decode_image_tokens(image_tokens=flat, height=ROWS, width=COLS)
    torch.testing.assert_close(pixels, ((own.float() + 1) / 2).clamp(0, 1))


def test_conditions_are_checked(backbone):
    with pytest.raises(ValueError, match="token_ids"):
        backbone.prefill(Condition(class_ids=torch.tensor([0])), guided=False)
    with pytest.raises(ValueError, match="processor"):  # the tiny model has no tokenizer
        backbone.prefill(Condition(prompts=["a red cube"]), guided=False)
    with pytest.raises(ValueError, match="image token"):  # no image header at the end
        backbone.prefill(Condition(token_ids=PROMPTS[:, :-1]), guided=False)


@torch.no_grad()
def test_greedy_generate_ar_equals_transformers_generate_with_the_documented_emu3_recipe(backbone, reference):
    """Emu3's documented image generation: negative_prompt_ids (UnbatchedClassifierFreeGuidanceLogitsProcessor,
    log-prob mixing) and a prefix_allowed_tokens_fn that forces EOL / EOF / EOI / EOS and otherwise visual tokens."""
    wrapper, eof, eoi, eos, pad = 4, 7, 5, 2, 0
    visual = reference.vocabulary_mapping.image_tokens

    def allowed(batch_id, ids):
        offset = ids.shape[0] - torch.nonzero(ids == wrapper, as_tuple=True)[0][0]
        end = (COLS + 1) * ROWS
        if offset % (COLS + 1) == 0:
            return [EOL_ID]
        return {end + 1: [eof], end + 2: [eoi], end + 3: [eos]}.get(int(offset), [pad] if offset > end + 3 else visual)

    negative = backbone.unconditional_token_ids(PROMPTS)
    out = reference.generate(
        input_ids=PROMPTS,
        attention_mask=torch.ones_like(PROMPTS),
        max_new_tokens=ROWS * (COLS + 1) + 3,
        prefix_allowed_tokens_fn=allowed,
        do_sample=False,
        guidance_scale=3.0,
        negative_prompt_ids=negative,
        negative_prompt_attention_mask=torch.ones_like(negative),
    )
    generated = out[:, PROMPTS.shape[1] :]
    assert generated[:, -3:].tolist() == [[eof, eoi, eos]] * 2
    expected = reference.vocabulary_mapping.convert_bpe2img(generated[:, :-3].view(2, ROWS, COLS + 1))
    result = generate_ar(backbone, Condition(token_ids=PROMPTS), SamplingConfig(cfg_scale=3.0, greedy=True))
    assert torch.equal(result.tokens, expected.long())


@torch.no_grad()
def test_contiguous_visual_vocabulary_uses_a_slice_with_the_same_logits():
    """Real checkpoints keep visual tokens contiguous and in codebook order: `logits` slices lm_head instead."""
    from transformers import Emu3ForConditionalGeneration

    from backbones.emu3 import tiny_emu3_config

    config = tiny_emu3_config()
    vocab = {k: v for k, v in config.vocabulary_map.items() if not k.startswith("<|visual token")}
    vocab.update({f"<|visual token{code:06d}|>": 40 + code for code in range(CODES)})
    config.vocabulary_map = vocab
    torch.manual_seed(SEED)
    model = Emu3ForConditionalGeneration(config).eval()
    backbone = Emu3Backbone(model, rows=ROWS, cols=COLS)
    assert backbone._visual_slice == slice(40, 40 + CODES)
    hidden = torch.randn(2, 5, 32)
    torch.testing.assert_close(backbone.logits(hidden), model.lm_head(backbone.final_norm(hidden))[..., 40:72])
