"""A ragged pass (`ARImageBackbone.step_ragged`) gives every image what `step` gives it alone, on the digits
backbone and every adapter; `replace_images` starts an image over inside a running batch."""

import pytest
import torch
from tiny_adapters import ADAPTERS

from backbones import ragged_attention
from backbones.base import Condition


def _batch_of(condition: Condition, batch: int) -> Condition:
    if condition.class_ids is not None:
        return Condition(class_ids=torch.tensor([1, 8, 3, 5])[:batch])
    return Condition(token_ids=condition.token_ids[[0, 1, 1, 0][:batch]])


def _four_images_of(family: str, tiny_backbone):
    """The backbone of `family` and a condition of four images for it."""
    if family == "digits":
        return tiny_backbone, _batch_of(Condition(class_ids=torch.tensor([1, 8])), 4)
    make_backbone, make_condition, _ = ADAPTERS[family]
    return make_backbone(), _batch_of(make_condition(), 4)


def _alone(backbone, condition: Condition, image: int, tokens: torch.Tensor, guided: bool) -> torch.Tensor:
    """The states `step` gives image `image` alone for `tokens` (1, n) from grid position 0 (its cond twin)."""
    one = Condition(
        class_ids=None if condition.class_ids is None else condition.class_ids[image : image + 1],
        token_ids=None if condition.token_ids is None else condition.token_ids[image : image + 1],
    )
    state, first = backbone.prefill(one, guided)
    return torch.cat([first, backbone.step(state, tokens)], dim=1)[:1]


@pytest.mark.filterwarnings("ignore:.*no codebook latents")
@pytest.mark.parametrize("attention", ["one call", "row by row"])
@pytest.mark.parametrize("guided", [False, True])
@pytest.mark.parametrize("family", ["digits", *sorted(ADAPTERS)])
def test_a_ragged_pass_gives_each_image_its_own_states(family, guided, attention, tiny_backbone, monkeypatch):
    """Attention in one call over every row, or (backbones/ragged_attention.py) in groups of rows over their own
    keys: with no cost to a call, every row whose end differs from its neighbour's is a group of its own."""
    groups_seen = []
    if attention == "row by row":
        monkeypatch.setattr(ragged_attention, "call_overhead_keys", lambda queries: 0.0)
        choose = ragged_attention.row_groups
        monkeypatch.setattr(
            ragged_attention, "row_groups", lambda *a: groups_seen.append(choose(*a)) or groups_seen[-1]
        )
    else:
        monkeypatch.setattr(
            ragged_attention, "row_groups", lambda row_ends, queries: [(0, len(row_ends), max(row_ends))]
        )
    backbone, condition = _four_images_of(family, tiny_backbone)
    n = backbone.geometry.num_tokens
    generator = torch.Generator().manual_seed(3)
    image_tokens = torch.randint(0, backbone.codebook_size, (4, n), generator=generator)
    state, _ = backbone.prefill(condition, guided)
    # Pass 1: ragged runs from 0 (lengths differ, the rest padding); pass 2: each image on from its own
    # frontier, one re-feeding over stale slots (image 2 goes back), one to the image's very end (image 3).
    lengths = [3, n - 2, 5, n - 1]
    run = torch.randint(0, backbone.codebook_size, (4, max(lengths)), generator=generator)
    for b, length in enumerate(lengths):
        run[b, :length] = image_tokens[b, :length]
    backbone.step_ragged(state, run, torch.zeros(4, dtype=torch.long))
    starts = torch.tensor([3, n - 2, 2, n - 1])
    width = 2
    second = torch.stack(
        [
            image_tokens[b, s : s + width]
            if s + width <= n
            else torch.cat([image_tokens[b, s:], torch.zeros(s + width - n, dtype=torch.long)])
            for b, s in enumerate(starts.tolist())
        ]
    )
    out = backbone.step_ragged(state, second, starts)
    for b, start in enumerate(starts.tolist()):
        fed = min(width, n - start)
        alone = _alone(backbone, condition, b, image_tokens[b : b + 1, : start + fed], guided)
        torch.testing.assert_close(out[b, :fed], alone[0, start + 1 : start + 1 + fed], atol=2e-4, rtol=1e-4)
    if attention == "row by row":  # each pass ran in groups, and the second pass's four ends all differ
        assert groups_seen and len(groups_seen[-1]) >= 4


def test_replace_images_starts_an_image_over_inside_the_batch(tiny_backbone):
    backbone = tiny_backbone
    n = backbone.geometry.num_tokens
    tokens = torch.randint(0, backbone.codebook_size, (2, 6), generator=torch.Generator().manual_seed(0))
    state, _ = backbone.prefill(Condition(class_ids=torch.tensor([1, 8])), guided=True)
    backbone.step_ragged(state, tokens, torch.zeros(2, dtype=torch.long))
    fresh, _ = backbone.prefill(Condition(class_ids=torch.tensor([4])), guided=True)
    backbone.replace_images(state, torch.tensor([1]), fresh)
    out = backbone.step_ragged(state, tokens[:, :3], torch.zeros(2, dtype=torch.long))
    alone = _alone(backbone, Condition(class_ids=torch.tensor([4])), 0, tokens[1:2, :3], guided=True)
    torch.testing.assert_close(out[1, :3], alone[0, 1:4], atol=2e-4, rtol=1e-4)
    kept = _alone(backbone, Condition(class_ids=torch.tensor([1])), 0, tokens[:1, :3], guided=True)
    torch.testing.assert_close(out[0, :3], kept[0, 1:4], atol=2e-4, rtol=1e-4)
    assert n > 6
    with pytest.raises(ValueError, match="one start per image"):
        backbone.step_ragged(state, tokens, torch.zeros(3, dtype=torch.long))


def test_replace_images_refuses_another_prompt_length_and_says_how_to_queue():
    make_backbone, make_condition, _ = ADAPTERS["janus"]
    backbone = make_backbone()
    state, _ = backbone.prefill(make_condition(), guided=True)
    longer, _ = backbone.prefill(Condition(token_ids=torch.tensor([[1, 10, 11, 12, 13, 14, 2]])), guided=True)
    with pytest.raises(ValueError, match="group the queue by prompt length"):
        backbone.replace_images(state, torch.tensor([0]), longer)


@pytest.mark.filterwarnings("ignore:.*no codebook latents")
@pytest.mark.parametrize("family", ["digits", *sorted(ADAPTERS)])
def test_keep_images_drops_finished_images_and_the_kept_ones_go_on_as_alone(family, tiny_backbone):
    """A drained batch (`keep_images`, images 3 and 1 of four, in that order) goes on from each kept image's own
    cache rows and prompt extras: its next ragged pass gives each what `step` gives it alone."""
    backbone, condition = _four_images_of(family, tiny_backbone)
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, backbone.codebook_size, (4, 7), generator=generator)
    state, _ = backbone.prefill(condition, guided=True)
    backbone.step_ragged(state, tokens[:, :4], torch.zeros(4, dtype=torch.long))
    kept = torch.tensor([3, 1])
    backbone.keep_images(state, kept)
    assert state.batch_size == 2 and state.cache_rows == 4
    out = backbone.step_ragged(state, tokens[kept, 4:], torch.full((2,), 4))
    for slot, image in enumerate(kept.tolist()):
        alone = _alone(backbone, condition, image, tokens[image : image + 1], guided=True)
        torch.testing.assert_close(out[slot], alone[0, 5:8], atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="keep_images needs 1 to 2 image indices"):
        backbone.keep_images(state, torch.tensor([0, 1, 0]))
