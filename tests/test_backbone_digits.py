"""The digits backbone behind the interface: cache, rollback, CFG, hidden states, persistence."""

import json

import pytest
import torch
from conftest import COMMITTED_BACKBONE, TINY_BACKBONE

from backbones.base import ARImageBackbone, Condition, DecodeState, ImageGeometry
from backbones.digits import DigitsBackbone, DigitsBackboneConfig


@torch.no_grad()
def test_cached_steps_give_the_teacher_forced_logits_at_every_position(tiny_backbone):
    tokens = torch.randint(0, 8, (3, 64))
    class_ids = torch.tensor([1, 5, 9])
    reference = tiny_backbone(tokens, class_ids)  # (B, 64, V), one forward without cache
    state, hidden = tiny_backbone.prefill(Condition(class_ids=class_ids), guided=False)
    stepped = [tiny_backbone.logits(hidden)]
    for position in range(63):
        stepped.append(tiny_backbone.logits(tiny_backbone.step(state, tokens[:, position : position + 1])))
    torch.testing.assert_close(torch.cat(stepped, dim=1), reference, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_multi_token_step_equals_single_steps(tiny_backbone):
    tokens = torch.randint(0, 8, (2, 20))
    condition = Condition(class_ids=torch.tensor([0, 3]))
    state_a, _ = tiny_backbone.prefill(condition, guided=True)
    block = tiny_backbone.step(state_a, tokens)
    state_b, _ = tiny_backbone.prefill(condition, guided=True)
    singles = torch.cat([tiny_backbone.step(state_b, tokens[:, i : i + 1]) for i in range(20)], dim=1)
    torch.testing.assert_close(block, singles, atol=1e-5, rtol=1e-4)
    assert block.shape == (4, 20, TINY_BACKBONE["hidden_size"])  # [cond; uncond] rows


@torch.no_grad()
def test_rollback_reproduces_the_logits_of_a_fresh_prefill(tiny_backbone):
    condition = Condition(class_ids=torch.tensor([2, 7]))
    prefix, wrong, right = torch.randint(0, 8, (2, 10)), torch.randint(0, 8, (2, 6)), torch.randint(0, 8, (2, 6))
    state, _ = tiny_backbone.prefill(condition, guided=True)
    tiny_backbone.step(state, torch.cat([prefix, wrong], dim=1))
    tiny_backbone.rollback(state, 10)
    assert state.num_image_tokens == 10 and state.cache.get_seq_length() == 11  # BOS + 10
    after_rollback = tiny_backbone.step(state, right)
    fresh_state, _ = tiny_backbone.prefill(condition, guided=True)
    fresh = tiny_backbone.step(fresh_state, torch.cat([prefix, right], dim=1))[:, 10:]
    torch.testing.assert_close(tiny_backbone.logits(after_rollback), tiny_backbone.logits(fresh), atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_guidance_mixes_on_logits_and_scale_one_is_conditional(tiny_backbone):
    condition = Condition(class_ids=torch.tensor([4]))
    state, hidden = tiny_backbone.prefill(condition, guided=True)
    logits = tiny_backbone.logits(hidden)
    cond, uncond = logits[:1], logits[1:]
    torch.testing.assert_close(tiny_backbone.scores(state, hidden, 3.0), uncond + 3.0 * (cond - uncond))
    torch.testing.assert_close(tiny_backbone.scores(state, hidden, 1.0), cond)


@torch.no_grad()
@pytest.mark.parametrize("guided, scale", [(True, 3.0), (True, 0.5), (False, 1.0)])
def test_draft_scorer_gives_the_guided_scores(tiny_backbone, guided, scale):
    """The folded norm + head + guidance the drafters use per token equals `scores`, for any batch of twins
    and any leading shape (a chain step's (rows, H), a row's (rows, C, H))."""
    state, _ = tiny_backbone.prefill(Condition(class_ids=torch.tensor([1, 4, 7])), guided=guided)
    draft_scores = tiny_backbone.draft_scorer(state, scale)
    rows = 4 if guided else 2  # a subset of the batch's images, as a chain drafts for the images still open
    for shape in ((rows, TINY_BACKBONE["hidden_size"]), (rows, 5, TINY_BACKBONE["hidden_size"])):
        hidden = 3 * torch.randn(shape)
        torch.testing.assert_close(draft_scores(hidden), tiny_backbone.scores(state, hidden, scale))


def test_logits_of_the_pre_norm_hidden_state_are_the_models_logits(tiny_backbone):
    tokens = torch.randint(0, 8, (2, 64))
    class_ids = torch.tensor([3, 8])
    hidden = tiny_backbone.teacher_forced_hidden(Condition(class_ids=class_ids), tokens)
    # The hidden state really is pre-norm: its scale is not the RMS-normalised one.
    assert not torch.allclose(hidden.pow(2).mean(-1), torch.ones(2, 64), atol=0.05)
    torch.testing.assert_close(tiny_backbone.logits(hidden), tiny_backbone(tokens, class_ids), atol=1e-5, rtol=1e-4)


def test_step_refuses_writing_past_the_image(tiny_backbone):
    state, _ = tiny_backbone.prefill(Condition(class_ids=torch.tensor([0])), guided=False)
    with pytest.raises(ValueError, match="past the image"):
        tiny_backbone.step(state, torch.zeros(1, 65, dtype=torch.long))


class _EndOfLineRecorder(ARImageBackbone):
    """A stand-in for Emu3/Lumina-mGPT geometry: records the flat tokens it is fed."""

    cfg_space = "logprobs"

    def __init__(self):
        super().__init__()
        self.geometry = ImageGeometry(rows=3, cols=4, end_of_line=True)
        self.fed = []

    def _forward_flat(self, state, flat_tokens):
        self.fed.append(flat_tokens)
        return flat_tokens.float().unsqueeze(-1)  # "hidden" = the token itself, to see which ones come back

    prefill = logits = embed_image_tokens = codebook_latents = tokens_to_pixels = None


def test_end_of_line_tokens_are_inserted_and_their_hidden_states_returned():
    backbone = _EndOfLineRecorder()
    assert backbone.geometry.row_stride == 5 and backbone.geometry.flat_length(8) == 10
    state = DecodeState(cache=None, batch_size=1, guided=False, prefix_length=2, num_image_tokens=2)
    hidden = backbone.step(state, torch.tensor([[10, 11, 12, 13, 14]]))  # grid positions 2..6 cross a row end
    assert backbone.fed[-1].tolist() == [[10, 11, -1, 12, 13, 14]]
    # Position 3 ends row 0: what comes back for it is the EOL's hidden (it predicts position 4).
    assert hidden[0, :, 0].tolist() == [10, -1, 12, 13, 14]


def test_guidance_on_log_probabilities():
    backbone = _EndOfLineRecorder()
    logits = torch.randn(2, 1, 5)
    cond, uncond = logits[:1].log_softmax(-1), logits[1:].log_softmax(-1)
    torch.testing.assert_close(backbone.guide(logits, 2.0), uncond + 2.0 * (cond - uncond))


def test_save_and_load_round_trip(tiny_backbone, tmp_path):
    tiny_backbone.save_pretrained(tmp_path)
    loaded = DigitsBackbone.from_pretrained(tmp_path)
    for key, value in tiny_backbone.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert not any(p.requires_grad for p in loaded.parameters()) and not loaded.training
    assert loaded.identity() == tiny_backbone.identity()


def test_missing_backbone_path_says_how_to_get_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="backbone_digits"):
        DigitsBackbone.from_pretrained(tmp_path / "nowhere")


def test_committed_backbone_loads_with_its_config():
    backbone = DigitsBackbone.from_pretrained(COMMITTED_BACKBONE)
    stored = json.loads((COMMITTED_BACKBONE / "config.json").read_text())
    assert DigitsBackboneConfig(**stored) == backbone.config
    assert backbone.geometry == ImageGeometry(rows=24, cols=24)
    assert backbone.codebook_size == 16
    assert sum(p.numel() for p in backbone.parameters()) > 1_000_000
