"""The Lumina-mGPT adapter behind the interface, on a tiny random-weight ChameleonForConditionalGeneration.

The reference for every check is transformers' own Chameleon model on an unmodified
copy of the same weights (`random_lumina_model` with the same seed): one no-cache
forward over the whole flat sequence [prompt; image tokens as vocabulary ids, with
the end-of-line token after every row]. Its own logits set image tokens to the dtype
minimum, so the reference scores are ``lm_head(last_hidden_state)`` restricted to the
image tokens in codebook order (through the model's vocabulary map).
"""

import pytest
import torch
from conftest import assert_greedy_lossless_methods_equal_greedy_ar

from backbones.base import Condition, ImageGeometry
from backbones.lumina import (
    LuminaBackbone,
    load_lumina_backbone,
    random_lumina_backbone,
    random_lumina_model,
    tiny_lumina_prompt,
)
from decode.ar import generate_ar
from decode.sampling import SamplingConfig

SEED = 0
ROWS, COLS, V, HIDDEN = 3, 4, 64, 32
EOL, PAD = 3, 1
PROMPTS = torch.tensor([tiny_lumina_prompt([10, 11, 12]), tiny_lumina_prompt([20, 21, 22])])  # (2, 7)
L = PROMPTS.shape[1]


@pytest.fixture
def backbone():
    return random_lumina_backbone(seed=SEED)


@pytest.fixture
def reference():
    """The untouched transformers model with the backbone's weights (its final norm still inside)."""
    return random_lumina_model(seed=SEED)


def _image_vocab_ids(model):
    """Codebook id k -> vocabulary id, straight from transformers' vocabulary mapping."""
    img2bpe = model.model.vocabulary_mapping.img2bpe
    return torch.tensor([img2bpe[k] for k in range(V)])


def _flat_vocab(model, tokens):
    """(B, N) codebook ids -> vocabulary ids with the EOL token after every complete row."""
    vocab = _image_vocab_ids(model)[tokens]
    pieces = [vocab[:, :0]]
    for start in range(0, tokens.shape[1], COLS):
        row = vocab[:, start : start + COLS]
        pieces.append(row)
        if row.shape[1] == COLS:
            pieces.append(torch.full_like(row[:, :1], EOL))
    return torch.cat(pieces, dim=1)


def _reference_scores(model, prompt_ids, flat_ids):
    """Restricted logits (codebook order) at every position of one no-cache forward."""
    ids = torch.cat([prompt_ids, flat_ids], dim=1)
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state  # post-norm
    return model.lm_head(hidden)[..., _image_vocab_ids(model)], hidden


def _grid_positions(num_tokens):
    """Indices, in the flat sequence after the prompt's last token, of the states predicting each grid token."""
    geometry = ImageGeometry(ROWS, COLS, end_of_line=True)
    # grid token i is predicted by the flat token just before it (the prompt's last token for i = 0)
    return torch.tensor([geometry.flat_length(i) for i in range(num_tokens)])


def test_geometry_and_sizes(backbone, reference):
    geometry = backbone.geometry
    assert geometry == ImageGeometry(rows=ROWS, cols=COLS, end_of_line=True)
    assert geometry.row_stride == COLS + 1 and geometry.num_tokens == ROWS * COLS
    assert geometry.flat_length(COLS) == COLS + 1 and geometry.flat_length(COLS + 1) == COLS + 2
    assert geometry.flat_length(ROWS * COLS) == ROWS * (COLS + 1)
    assert backbone.codebook_size == V and backbone.hidden_size == HIDDEN
    assert backbone.cfg_space == "logprobs" and backbone.eol_token_id == EOL
    assert backbone.codebook_latents().shape == (V, backbone.model.config.vq_config.embed_dim)
    assert not any(p.requires_grad for p in backbone.parameters()) and not backbone.training
    # The codebook -> vocabulary map is transformers' img2bpe, and not a constant offset.
    vocab = _image_vocab_ids(reference)
    assert torch.equal(backbone.codebook_to_vocab, vocab)
    assert len(set((vocab - torch.arange(V)).tolist())) > 1
    assert sorted(vocab.tolist()) == reference.model.vocabulary_mapping.image_tokens
    assert backbone.flat_to_vocab(torch.tensor([[0, -1, 5]])).tolist() == [[vocab[0].item(), EOL, vocab[5].item()]]


@torch.no_grad()
def test_reference_model_masks_image_logits(reference):
    # Why the adapter (and these tests) apply lm_head themselves.
    logits = reference(input_ids=PROMPTS).logits
    assert (logits[..., _image_vocab_ids(reference)] == torch.finfo(logits.dtype).min).all()


@torch.no_grad()
@pytest.mark.parametrize("block", [1, 5])
def test_cached_steps_give_the_no_cache_logits_at_every_position(backbone, reference, block):
    n = ROWS * COLS
    tokens = torch.randint(0, V, (2, n))
    state, hidden = backbone.prefill(Condition(token_ids=PROMPTS), guided=False)
    assert state.prefix_length == L and state.cache.get_seq_length() == L
    stepped = [backbone.logits(hidden)]
    for start in range(0, n - 1, block):
        chunk = tokens[:, start : min(start + block, n - 1)]
        stepped.append(backbone.logits(backbone.step(state, chunk)))
    # n - 1 grid tokens in: two complete rows (two EOLs) plus COLS - 1 tokens
    assert state.cache.get_seq_length() == L + backbone.geometry.flat_length(n - 1)
    expected_all, _ = _reference_scores(reference, PROMPTS, _flat_vocab(reference, tokens[:, :-1]))
    expected = expected_all[:, L - 1 :][:, _grid_positions(n)]
    torch.testing.assert_close(torch.cat(stepped, dim=1), expected, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_multi_token_step_equals_single_steps_under_guidance(backbone):
    tokens = torch.randint(0, V, (2, 10))
    condition = Condition(token_ids=PROMPTS)
    state_a, _ = backbone.prefill(condition, guided=True)
    block = backbone.step(state_a, tokens)
    state_b, _ = backbone.prefill(condition, guided=True)
    singles = torch.cat([backbone.step(state_b, tokens[:, i : i + 1]) for i in range(10)], dim=1)
    torch.testing.assert_close(block, singles, atol=1e-5, rtol=1e-4)
    assert block.shape == (4, 10, HIDDEN)
    assert state_a.cache.get_seq_length() == L + backbone.geometry.flat_length(10)


@torch.no_grad()
@pytest.mark.parametrize("keep", [2, COLS, COLS + 1])  # mid-row, right at a row end, just past it
def test_rollback_reproduces_the_logits_of_a_fresh_prefill(backbone, keep):
    condition = Condition(token_ids=PROMPTS)
    prefix = torch.randint(0, V, (2, keep))
    wrong, right = (torch.randint(0, V, (2, 6)) for _ in range(2))
    state, _ = backbone.prefill(condition, guided=True)
    backbone.step(state, torch.cat([prefix, wrong], dim=1))  # crosses at least one row end
    backbone.rollback(state, keep)
    assert state.num_image_tokens == keep
    assert state.cache.get_seq_length() == L + backbone.geometry.flat_length(keep)
    after_rollback = backbone.step(state, right)
    fresh_state, _ = backbone.prefill(condition, guided=True)
    fresh = backbone.step(fresh_state, torch.cat([prefix, right], dim=1))[:, keep:]
    torch.testing.assert_close(backbone.logits(after_rollback), backbone.logits(fresh), atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_pre_norm_hidden_through_logits_is_lm_head_on_the_models_final_state(backbone, reference):
    n = ROWS * COLS
    tokens = torch.randint(0, V, (2, n))
    hidden = backbone.teacher_forced_hidden(Condition(token_ids=PROMPTS), tokens)
    assert hidden.shape == (2, n, HIDDEN)
    expected_scores, post_norm_all = _reference_scores(reference, PROMPTS, _flat_vocab(reference, tokens[:, :-1]))
    post_norm = post_norm_all[:, L - 1 :][:, _grid_positions(n)]
    # Really pre-norm: not the model's final (normalised) state.
    assert not torch.allclose(hidden, post_norm, atol=1e-3)
    torch.testing.assert_close(backbone.final_norm(hidden), post_norm, atol=1e-5, rtol=1e-4)
    restricted = reference.lm_head(post_norm)[..., _image_vocab_ids(reference)]
    torch.testing.assert_close(backbone.logits(hidden), restricted, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(restricted, expected_scores[:, L - 1 :][:, _grid_positions(n)])


HEADER = [4, 6 + ROWS, 6 + COLS]  # [image start, h-size, w-size] of the tiny vocabulary


@torch.no_grad()
def test_unconditional_twin_is_lumina_image_header_only(backbone, reference):
    # Lumina-mGPT's unconditional branch: the sequence from the image-start token on, left-padded here.
    uncond, mask = backbone.unconditional_token_ids(PROMPTS)
    assert uncond.tolist() == [[PAD] * 4 + HEADER] * 2 and mask.tolist() == [[0] * 4 + [1] * 3] * 2
    state, hidden = backbone.prefill(Condition(token_ids=PROMPTS), guided=True)
    assert hidden.shape == (4, 1, HIDDEN) and state.cache_rows == 4 and state.prefix_length == L
    tokens = torch.randint(0, V, (2, ROWS * COLS - 1))
    stepped = torch.cat([hidden, backbone.step(state, tokens)], dim=1)
    flat = _flat_vocab(reference, tokens)
    cond_scores, _ = _reference_scores(reference, PROMPTS, flat)
    uncond_scores, _ = _reference_scores(reference, PROMPTS[:, -3:], flat)  # no padding at all
    positions = _grid_positions(ROWS * COLS)
    expected = torch.cat([cond_scores[:, L - 1 :][:, positions], uncond_scores[:, 2:][:, positions]])
    torch.testing.assert_close(backbone.logits(stepped), expected, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_pad_twin_option(reference):
    backbone = random_lumina_backbone(seed=SEED, uncond="pad")
    uncond, mask = backbone.unconditional_token_ids(PROMPTS)
    assert uncond.tolist() == [[0, PAD, PAD, PAD] + HEADER] * 2 and mask is None
    state, hidden = backbone.prefill(Condition(token_ids=PROMPTS), guided=True)
    assert "prefix_attention_mask" not in state.extras
    last = reference.model(input_ids=torch.cat([PROMPTS, uncond])).last_hidden_state[:, -1:]
    torch.testing.assert_close(backbone.final_norm(hidden), last, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="uncond"):
        random_lumina_backbone(seed=SEED, uncond="empty")


@torch.no_grad()
def test_logprob_guidance(backbone, reference):
    state, hidden = backbone.prefill(Condition(token_ids=PROMPTS), guided=True)
    ref_cond = reference.model(input_ids=PROMPTS).last_hidden_state[:, -1:]
    ref_uncond = reference.model(input_ids=PROMPTS[:, -3:]).last_hidden_state[:, -1:]
    vocab = _image_vocab_ids(reference)
    cond = reference.lm_head(ref_cond)[..., vocab].log_softmax(-1)
    uncond_lp = reference.lm_head(ref_uncond)[..., vocab].log_softmax(-1)
    torch.testing.assert_close(
        backbone.scores(state, hidden, 3.0), uncond_lp + 3.0 * (cond - uncond_lp), atol=1e-5, rtol=1e-4
    )
    torch.testing.assert_close(backbone.scores(state, hidden, 1.0), cond, atol=1e-5, rtol=1e-4)


def _greedy_reference(model, prompt_ids, cfg_scale):
    """A plain greedy loop: full no-cache forward each step, EOL after each row, log-prob CFG."""
    guided = cfg_scale != 1.0
    uncond_ids = prompt_ids[:, -3:]  # Lumina-mGPT's unconditional branch: from the image start on
    vocab = _image_vocab_ids(model)
    tokens = torch.empty(prompt_ids.shape[0], 0, dtype=torch.long)
    for _ in range(ROWS * COLS):
        flat = _flat_vocab(model, tokens)
        scores, _ = _reference_scores(model, prompt_ids, flat)
        scores = scores[:, -1].float()
        if guided:
            u, _ = _reference_scores(model, uncond_ids, flat)
            c, u = scores.log_softmax(-1), u[:, -1].float().log_softmax(-1)
            scores = u + cfg_scale * (c - u)
        tokens = torch.cat([tokens, scores.argmax(-1, keepdim=True)], dim=1)
    assert vocab.shape == (V,)
    return tokens


@torch.no_grad()
@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_greedy_generate_ar_equals_a_plain_greedy_loop(backbone, reference, cfg_scale):
    expected = _greedy_reference(reference, PROMPTS, cfg_scale)
    result = generate_ar(backbone, Condition(token_ids=PROMPTS), SamplingConfig(cfg_scale=cfg_scale, greedy=True))
    assert result.tokens.shape == (2, ROWS, COLS)
    assert torch.equal(result.tokens.view(2, -1), expected)
    assert len(result.tokens.unique()) > 1  # not a degenerate constant image


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_greedy_ssd_exact_equals_greedy_ar(backbone, cfg_scale):
    assert_greedy_lossless_methods_equal_greedy_ar(backbone, Condition(token_ids=PROMPTS), cfg_scale)


@torch.no_grad()
def test_pixels_to_tokens_and_no_pixel_decoder(backbone):
    tokens = backbone.pixels_to_tokens(torch.rand(2, 3, 2 * ROWS, 2 * COLS))
    assert tokens.shape == (2, ROWS, COLS) and tokens.min() >= 0 and tokens.max() < V
    with pytest.raises(ValueError, match="grid"):
        backbone.pixels_to_tokens(torch.rand(1, 3, 8, 8))
    with pytest.raises(NotImplementedError, match="no decoder"):
        backbone.tokens_to_pixels(tokens)


def test_conditions_other_than_token_ids_are_refused(backbone):
    with pytest.raises(ValueError, match="token_ids"):
        backbone.prefill(Condition(prompts=["a red cube"]), guided=False)
    with pytest.raises(ValueError, match="token_ids"):
        backbone.prefill(Condition(class_ids=torch.tensor([0])), guided=False)


def test_eol_token_must_not_be_an_image_token(reference):
    image_id = int(_image_vocab_ids(reference)[0])
    with pytest.raises(ValueError, match="eol_token_id"):
        LuminaBackbone(reference, rows=ROWS, cols=COLS, eol_token_id=image_id)


def test_missing_weights_say_which_format_is_needed(tmp_path):
    # The shared checks (model id, download command) are in test_backbone_loading.py.
    with pytest.raises(FileNotFoundError) as error:
        load_lumina_backbone(str(tmp_path / "nowhere"))
    assert "transformers-format" in str(error.value) and "Chameleon" in str(error.value)
    assert "python -m backbones.convert lumina" in str(error.value)  # the Hub release needs it (test_backbone_convert)


def test_real_config_has_lumina_mgpt_768_geometry():
    from conftest import CONF_DIR
    from omegaconf import OmegaConf

    real = OmegaConf.load(CONF_DIR / "backbone" / "lumina.yaml")
    assert real.eol_token_id == 8803 and real.rows == real.cols == 48 and real.uncond == "image_header"


def test_contiguous_image_tokens_use_a_slice_with_the_same_logits():
    """Chameleon keeps its image tokens contiguous in codebook order: `logits` slices lm_head instead of gathering."""
    backbone = random_lumina_backbone(seed=0, permuted_image_tokens=False)
    assert backbone._image_slice == slice(32, 32 + backbone.codebook_size)
    hidden = torch.randn(2, 3, backbone.hidden_size)
    gathered = torch.nn.functional.linear(
        backbone.final_norm(hidden), backbone.model.lm_head.weight[backbone.codebook_to_vocab]
    )
    assert torch.equal(backbone.logits(hidden), gathered)
    assert random_lumina_backbone(seed=0)._image_slice is None  # the tiny default's permuted map gathers
