"""The Tar adapter on a tiny random-weight Qwen2ForCausalLM (image tokens: vocabulary ids 40..71).

The reference is transformers' own Qwen2ForCausalLM forward (final norm and lm_head
included) on an unmodified copy of the same weights, without a cache.
"""

import pytest
import torch
from conftest import assert_greedy_lossless_methods_equal_greedy_ar

from backbones.base import Condition, ImageGeometry
from backbones.tar import (
    TarBackbone,
    random_tar_backbone,
    random_tar_model,
)
from decode.ar import generate_ar
from decode.sampling import SamplingConfig

SEED = 0
ROWS, COLS, CODES, OFFSET = 3, 4, 32, 40
IMAGE_IDS = torch.arange(OFFSET, OFFSET + CODES)
# [prompt..., <im_start>, <S0>] with tiny ids; the last two are the kept header of the CFG twin.
PROMPTS = torch.tensor([[5, 21, 22, 23, 24, 30, 31], [5, 25, 26, 27, 28, 30, 31]])


@pytest.fixture
def backbone():
    return random_tar_backbone(seed=SEED)


@pytest.fixture
def reference():
    return random_tar_model(seed=SEED)


def _ref_logits(model, ids):
    return model(input_ids=ids, use_cache=False).logits[..., IMAGE_IDS]


def test_geometry_and_sizes(backbone):
    assert backbone.geometry == ImageGeometry(rows=ROWS, cols=COLS, end_of_line=False)
    assert backbone.geometry.num_tokens == 12 and backbone.geometry.row_stride == COLS
    assert backbone.codebook_size == CODES and backbone.hidden_size == 32 and backbone.cfg_space == "logits"
    assert backbone.vocab_ids(torch.tensor([0, 31])).tolist() == [40, 71]
    with pytest.raises(ValueError):
        backbone.vocab_ids(torch.tensor([CODES]))
    with pytest.raises(ValueError, match="vocabulary"):
        TarBackbone(random_tar_model(SEED), image_token_offset=70, codebook_size=32)
    assert not any(p.requires_grad for p in backbone.parameters()) and not backbone.training


@torch.no_grad()
@pytest.mark.parametrize("guided", [False, True])
def test_cached_steps_give_the_no_cache_logits_at_every_position(backbone, reference, guided):
    tokens = torch.randint(0, CODES, (2, 12))
    state, hidden = backbone.prefill(Condition(token_ids=PROMPTS), guided=guided)
    assert state.prefix_length == PROMPTS.shape[1] and state.cache.get_seq_length() == PROMPTS.shape[1]
    stepped = [backbone.logits(hidden)]
    for i in range(11):
        stepped.append(backbone.logits(backbone.step(state, tokens[:, i : i + 1])))
    prompts = torch.cat([PROMPTS, backbone.unconditional_token_ids(PROMPTS)]) if guided else PROMPTS
    both = torch.cat([tokens, tokens]) if guided else tokens
    flat = torch.cat([prompts, both[:, :-1] + OFFSET], dim=1)
    expected = _ref_logits(reference, flat)[:, PROMPTS.shape[1] - 1 :]
    torch.testing.assert_close(torch.cat(stepped, dim=1), expected, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_multi_token_step_equals_single_steps(backbone):
    tokens = torch.randint(0, CODES, (2, 10))
    state_a, _ = backbone.prefill(Condition(token_ids=PROMPTS), guided=True)
    block = backbone.step(state_a, tokens)
    state_b, _ = backbone.prefill(Condition(token_ids=PROMPTS), guided=True)
    singles = torch.cat([backbone.step(state_b, tokens[:, i : i + 1]) for i in range(10)], dim=1)
    assert block.shape == (4, 10, 32)
    torch.testing.assert_close(block, singles, atol=1e-5, rtol=1e-4)


@torch.no_grad()
@pytest.mark.parametrize("keep", [6, 3, 4])
def test_rollback_reproduces_a_fresh_prefill(backbone, keep):
    condition = Condition(token_ids=PROMPTS)
    prefix, wrong, right = (torch.randint(0, CODES, (2, n)) for n in (keep, 5, 5))
    state, _ = backbone.prefill(condition, guided=True)
    backbone.step(state, torch.cat([prefix, wrong], dim=1))
    backbone.rollback(state, keep)
    assert state.num_image_tokens == keep and state.cache.get_seq_length() == PROMPTS.shape[1] + keep
    after = backbone.step(state, right)
    fresh_state, _ = backbone.prefill(condition, guided=True)
    fresh = backbone.step(fresh_state, torch.cat([prefix, right], dim=1))[:, keep:]
    torch.testing.assert_close(backbone.logits(after), backbone.logits(fresh), atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_pre_norm_hidden_through_logits_is_the_models_own_output(backbone, reference):
    tokens = torch.randint(0, CODES, (2, 12))
    hidden = backbone.teacher_forced_hidden(Condition(token_ids=PROMPTS), tokens)
    assert hidden.shape == (2, 12, 32)
    flat = torch.cat([PROMPTS, tokens[:, :-1] + OFFSET], dim=1)
    post_norm = reference.model(input_ids=flat, use_cache=False).last_hidden_state[:, PROMPTS.shape[1] - 1 :]
    assert not torch.allclose(hidden, post_norm, atol=1e-3)
    torch.testing.assert_close(backbone.final_norm(hidden), post_norm, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(
        backbone.logits(hidden), reference.lm_head(post_norm)[..., IMAGE_IDS], atol=1e-5, rtol=1e-4
    )


@torch.no_grad()
def test_unconditional_twin_and_logit_guidance(backbone, reference):
    assert backbone.unconditional_token_ids(PROMPTS).tolist() == [[0, 0, 0, 0, 0, 30, 31]] * 2
    state, hidden = backbone.prefill(Condition(token_ids=PROMPTS), guided=True)
    ref = _ref_logits(reference, torch.cat([PROMPTS, backbone.unconditional_token_ids(PROMPTS)]))[:, -1:]
    cond, uncond = ref[:2], ref[2:]
    torch.testing.assert_close(
        backbone.scores(state, hidden, 4.0), uncond + 4.0 * (cond - uncond), atol=1e-5, rtol=1e-4
    )
    backbone.negative_token_ids = torch.tensor([9, 9, 9, 9, 9, 30, 31])
    assert backbone.unconditional_token_ids(PROMPTS).tolist() == [[9, 9, 9, 9, 9, 30, 31]] * 2
    backbone.negative_token_ids = torch.tensor([9, 30, 31])
    with pytest.raises(ValueError, match="length"):
        backbone.prefill(Condition(token_ids=PROMPTS), guided=True)


def _greedy_reference(model, prompts, uncond, cfg_scale):
    guided = cfg_scale != 1.0
    ids = torch.cat([prompts, uncond]) if guided else prompts
    batch, codes = prompts.shape[0], []
    for _ in range(ROWS * COLS):
        logits = model(input_ids=ids, use_cache=False).logits[:, -1, IMAGE_IDS]
        if guided:
            logits = logits[batch:] + cfg_scale * (logits[:batch] - logits[batch:])
        code = logits.argmax(-1)
        codes.append(code)
        new = (code + OFFSET)[:, None]
        ids = torch.cat([ids, torch.cat([new, new]) if guided else new], dim=1)
    return torch.stack(codes, dim=1)


@torch.no_grad()
@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_greedy_generate_ar_equals_a_plain_greedy_loop(backbone, reference, cfg_scale):
    expected = _greedy_reference(reference, PROMPTS, backbone.unconditional_token_ids(PROMPTS), cfg_scale)
    result = generate_ar(backbone, Condition(token_ids=PROMPTS), SamplingConfig(cfg_scale=cfg_scale, greedy=True))
    assert result.tokens.shape == (2, ROWS, COLS)
    assert torch.equal(result.tokens.view(2, -1), expected)
    assert len(result.tokens.unique()) > 1


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_greedy_ssd_exact_equals_greedy_ar(backbone, cfg_scale):
    assert_greedy_lossless_methods_equal_greedy_ar(backbone, Condition(token_ids=PROMPTS), cfg_scale)


def test_conditions_are_checked(backbone):
    with pytest.raises(ValueError, match="token_ids"):
        backbone.prefill(Condition(class_ids=torch.tensor([0])), guided=False)
    with pytest.raises(ValueError, match="tokenizer"):
        backbone.prefill(Condition(prompts=["a red cube"]), guided=False)


def test_pixels_and_codebook_without_the_detokenizer_say_what_to_install(backbone):
    with pytest.raises(NotImplementedError, match="csuhan/Tar") as error:
        backbone.tokens_to_pixels(torch.zeros(1, ROWS, COLS, dtype=torch.long))
    assert "TA-Tok" in str(error.value) and "detokenizer" in str(error.value)
    with pytest.raises(NotImplementedError, match="TA-Tok"):
        backbone.codebook_latents()
