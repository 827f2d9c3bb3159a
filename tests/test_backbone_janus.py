"""The Janus-Pro adapter behind the interface, on a tiny random-weight JanusForConditionalGeneration.

The reference for every check is transformers' own Janus code path on an
unmodified copy of the same weights (`random_janus_model` with the same seed).
"""

import pytest
import torch
from conftest import assert_greedy_lossless_methods_equal_greedy_ar

from backbones.base import Condition, ImageGeometry
from backbones.janus import (
    random_janus_backbone,
    random_janus_model,
)
from decode.ar import generate_ar
from decode.sampling import SamplingConfig

SEED = 0
# [BOS, prompt..., <begin_of_image>] with the tiny model's ids (pad 0, BOS 1, BOI 2); equal lengths.
PROMPTS = torch.tensor([[1, 10, 11, 12, 13, 2], [1, 20, 21, 22, 23, 2]])


@pytest.fixture
def backbone():
    return random_janus_backbone(seed=SEED)


@pytest.fixture
def reference():
    """The untouched transformers model with the backbone's weights (its final norm still inside)."""
    return random_janus_model(seed=SEED)


def _reference_hidden(model, prompt_ids, image_tokens):
    """Post-norm last-layer states of one no-cache forward over [prompt; image tokens]."""
    text = model.get_input_embeddings()(prompt_ids)
    image = model.prepare_embeddings_for_image_generation(image_tokens)
    embeds = torch.cat([text, image], dim=1)
    return model.model.language_model(inputs_embeds=embeds, use_cache=False).last_hidden_state


def test_geometry_and_sizes_come_from_the_config(backbone):
    config = backbone.model.config
    assert backbone.geometry == ImageGeometry(rows=4, cols=4, end_of_line=False)
    assert backbone.geometry.row_stride == 4 and backbone.geometry.num_tokens == 16
    assert config.vision_config.image_size // config.vision_config.patch_size == 4
    assert backbone.codebook_size == config.vq_config.num_embeddings == 64
    assert backbone.hidden_size == config.text_config.hidden_size == 32
    assert backbone.cfg_space == "logits"
    assert backbone.codebook_latents().shape == (64, config.vq_config.embed_dim)
    assert not any(p.requires_grad for p in backbone.parameters()) and not backbone.training


@torch.no_grad()
def test_cached_steps_give_the_no_cache_logits_at_every_position(backbone, reference):
    tokens = torch.randint(0, 64, (2, 16))
    state, hidden = backbone.prefill(Condition(token_ids=PROMPTS), guided=False)
    assert state.prefix_length == PROMPTS.shape[1] and state.cache.get_seq_length() == PROMPTS.shape[1]
    stepped = [backbone.logits(hidden)]
    for position in range(15):
        stepped.append(backbone.logits(backbone.step(state, tokens[:, position : position + 1])))
    full = _reference_hidden(reference, PROMPTS, tokens[:, :-1])[:, PROMPTS.shape[1] - 1 :]
    expected = reference.model.generation_head(full)
    torch.testing.assert_close(torch.cat(stepped, dim=1), expected, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_multi_token_step_equals_single_steps(backbone):
    tokens = torch.randint(0, 64, (2, 10))
    condition = Condition(token_ids=PROMPTS)
    state_a, _ = backbone.prefill(condition, guided=True)
    block = backbone.step(state_a, tokens)
    state_b, _ = backbone.prefill(condition, guided=True)
    singles = torch.cat([backbone.step(state_b, tokens[:, i : i + 1]) for i in range(10)], dim=1)
    torch.testing.assert_close(block, singles, atol=1e-5, rtol=1e-4)
    assert block.shape == (4, 10, 32)


@torch.no_grad()
def test_rollback_reproduces_the_logits_of_a_fresh_prefill(backbone):
    condition = Condition(token_ids=PROMPTS)
    prefix, wrong, right = (torch.randint(0, 64, (2, n)) for n in (6, 5, 5))
    state, _ = backbone.prefill(condition, guided=True)
    backbone.step(state, torch.cat([prefix, wrong], dim=1))
    backbone.rollback(state, 6)
    assert state.num_image_tokens == 6 and state.cache.get_seq_length() == PROMPTS.shape[1] + 6
    after_rollback = backbone.step(state, right)
    fresh_state, _ = backbone.prefill(condition, guided=True)
    fresh = backbone.step(fresh_state, torch.cat([prefix, right], dim=1))[:, 6:]
    torch.testing.assert_close(backbone.logits(after_rollback), backbone.logits(fresh), atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_pre_norm_hidden_through_logits_is_the_models_generation_head_output(backbone, reference):
    tokens = torch.randint(0, 64, (2, 16))
    hidden = backbone.teacher_forced_hidden(Condition(token_ids=PROMPTS), tokens)
    assert hidden.shape == (2, 16, 32)
    post_norm = _reference_hidden(reference, PROMPTS, tokens[:, :-1])[:, PROMPTS.shape[1] - 1 :]
    # Really pre-norm: not the model's final (normalised) state, whose RMS is ~ the norm weight.
    assert not torch.allclose(hidden, post_norm, atol=1e-3)
    torch.testing.assert_close(backbone.final_norm(hidden), post_norm, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(
        backbone.logits(hidden), reference.model.generation_head(post_norm), atol=1e-5, rtol=1e-4
    )


@torch.no_grad()
def test_unconditional_twin_and_guidance_follow_janus_generate(backbone, reference):
    # The twin: everything but BOS and <begin_of_image> becomes the pad token (as in generate()).
    assert backbone.unconditional_token_ids(PROMPTS).tolist() == [[1, 0, 0, 0, 0, 2], [1, 0, 0, 0, 0, 2]]
    state, hidden = backbone.prefill(Condition(token_ids=PROMPTS), guided=True)
    assert hidden.shape[0] == 4
    uncond_ids = PROMPTS.masked_fill((PROMPTS != 1) & (PROMPTS != 2), 0)
    both = torch.cat([PROMPTS, uncond_ids])
    last = reference.model.language_model(inputs_embeds=reference.get_input_embeddings()(both)).last_hidden_state
    ref_logits = reference.model.generation_head(last[:, -1:])
    cond, uncond = ref_logits[:2], ref_logits[2:]
    torch.testing.assert_close(
        backbone.scores(state, hidden, 4.0), uncond + 4.0 * (cond - uncond), atol=1e-5, rtol=1e-4
    )
    torch.testing.assert_close(backbone.scores(state, hidden, 1.0), cond, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_greedy_generate_ar_equals_janus_generate_image_mode(backbone, reference):
    expected = reference.generate(
        input_ids=PROMPTS,
        attention_mask=torch.ones_like(PROMPTS),
        generation_mode="image",
        do_sample=False,
        guidance_scale=3.0,
    )
    assert expected.shape == (2, 16)
    result = generate_ar(backbone, Condition(token_ids=PROMPTS), SamplingConfig(cfg_scale=3.0, greedy=True))
    assert result.tokens.shape == (2, 4, 4)
    assert torch.equal(result.tokens.view(2, -1), expected)
    assert len(result.tokens.unique()) > 1  # not a degenerate constant image


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_greedy_ssd_exact_equals_greedy_ar(backbone, cfg_scale):
    assert_greedy_lossless_methods_equal_greedy_ar(backbone, Condition(token_ids=PROMPTS), cfg_scale)


@torch.no_grad()
def test_pixels_round_trip_shapes_and_range(backbone):
    tokens = torch.randint(0, 64, (2, 4, 4))
    pixels = backbone.tokens_to_pixels(tokens)
    assert pixels.shape == (2, 3, backbone.image_size, backbone.image_size)
    assert pixels.min() >= 0 and pixels.max() <= 1
    assert backbone.pixels_to_tokens(pixels).shape == (2, 4, 4)
    # Same decoding as the model's own decode_image_tokens (channels last, in [-1, 1]).
    own = backbone.model.decode_image_tokens(tokens.view(2, -1)).permute(0, 3, 1, 2)
    torch.testing.assert_close(pixels, ((own + 1) / 2).clamp(0, 1))


def test_condition_needs_exactly_one_kind_and_unequal_prompts_are_refused(backbone):
    with pytest.raises(ValueError, match="exactly one"):
        Condition(class_ids=torch.tensor([0]), token_ids=PROMPTS)
    assert Condition(token_ids=PROMPTS).batch_size == 2
    with pytest.raises(ValueError, match="token_ids"):
        backbone.prefill(Condition(class_ids=torch.tensor([0])), guided=False)
    with pytest.raises(ValueError, match="processor"):  # the tiny model has no tokenizer
        backbone.prefill(Condition(prompts=["a red cube"]), guided=False)
