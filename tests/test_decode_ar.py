"""The KV-cached baseline equals a no-cache reference loop; sampling settings do what they say."""

import pytest
import torch

from backbones.base import Condition
from decode.ar import generate_ar
from decode.sampling import SamplingConfig, sample_tokens, token_distribution


@torch.no_grad()
def reference_ar_without_cache(backbone, class_ids, sampling, generator):
    """Re-run the whole sequence every step: slow, obviously right."""
    n = backbone.geometry.num_tokens
    tokens = torch.zeros(len(class_ids), n, dtype=torch.long)
    for position in range(n):
        logits = backbone(tokens[:, : position + 1], class_ids)[:, -1:]  # logits predicting `position`
        if sampling.guided:
            null = torch.full_like(class_ids, backbone.config.null_class)
            uncond = backbone(tokens[:, : position + 1], null)[:, -1:]
            logits = uncond + sampling.cfg_scale * (logits - uncond)
        tokens[:, position] = sample_tokens(logits, sampling, generator)[:, 0]
    return tokens.view(-1, backbone.geometry.rows, backbone.geometry.cols)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(greedy=True),
        SamplingConfig(greedy=True, cfg_scale=2.5),
        SamplingConfig(temperature=0.9, top_k=5, cfg_scale=2.0),
        SamplingConfig(top_p=0.8),
    ],
    ids=["greedy", "greedy-cfg", "sampled-cfg-topk", "sampled-topp"],
)
def test_kv_cached_decoding_equals_the_no_cache_loop(tiny_backbone, sampling):
    class_ids = torch.tensor([0, 4, 9])
    cached = generate_ar(tiny_backbone, Condition(class_ids=class_ids), sampling, torch.Generator().manual_seed(7))
    reference = reference_ar_without_cache(tiny_backbone, class_ids, sampling, torch.Generator().manual_seed(7))
    assert torch.equal(cached.tokens, reference)
    assert cached.forward_passes == 64


@pytest.mark.parametrize("greedy", [True, False])
def test_cfg_scale_one_equals_conditional_decoding(tiny_backbone, greedy):
    condition = Condition(class_ids=torch.tensor([1, 2]))
    sampling = SamplingConfig(cfg_scale=1.0, greedy=greedy)
    with_twin = generate_ar(tiny_backbone, condition, sampling, torch.Generator().manual_seed(3), guided=True)
    without = generate_ar(tiny_backbone, condition, sampling, torch.Generator().manual_seed(3), guided=False)
    assert torch.equal(with_twin.tokens, without.tokens)


def test_batched_greedy_equals_one_image_at_a_time(tiny_backbone):
    sampling = SamplingConfig(greedy=True, cfg_scale=2.0)
    class_ids = torch.tensor([3, 6, 8])
    batched = generate_ar(tiny_backbone, Condition(class_ids=class_ids), sampling).tokens
    singles = torch.cat([generate_ar(tiny_backbone, Condition(class_ids=c[None]), sampling).tokens for c in class_ids])
    assert torch.equal(batched, singles)


def test_top_k_and_top_p_keep_the_right_tokens():
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top2 = token_distribution(scores, SamplingConfig(top_k=2))
    torch.testing.assert_close(top2, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # Nucleus 0.7: 0.5 alone is short of it, 0.5 + 0.3 reaches it, so two tokens stay.
    nucleus = token_distribution(scores, SamplingConfig(top_p=0.7))
    torch.testing.assert_close(nucleus, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    greedy = token_distribution(scores, SamplingConfig(greedy=True))
    assert greedy.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    hot = token_distribution(scores, SamplingConfig(temperature=0.5))
    assert hot[0, 0] > 0.5  # a lower temperature sharpens


def test_inverse_cdf_sampling_draws_by_the_distribution_and_never_a_zero_token():
    from decode.sampling import sample_from, sample_with

    probs = torch.tensor([0.0, 0.1, 0.0, 0.6, 0.3, 0.0])
    draws = sample_from(probs.repeat(100_000, 1), torch.Generator().manual_seed(0))
    frequencies = torch.bincount(draws, minlength=6) / len(draws)
    assert frequencies[[0, 2, 5]].sum() == 0  # zero mass is never drawn, at either end or inside
    torch.testing.assert_close(frequencies, probs, atol=0.005, rtol=0)  # 3 sigma of 100k draws is < 0.005
    edges = torch.tensor([0.0, 0.1 - 1e-6, 0.1, 0.7 - 1e-6, 0.9999999])
    assert sample_with((2 * probs).repeat(5, 1), edges).tolist() == [1, 1, 3, 3, 4]  # unnormalised mass is fine


def test_seeded_sampling_is_reproducible(tiny_backbone):
    condition = Condition(class_ids=torch.tensor([5, 5]))
    sampling = SamplingConfig(cfg_scale=2.0)
    first = generate_ar(tiny_backbone, condition, sampling, torch.Generator().manual_seed(11)).tokens
    again = generate_ar(tiny_backbone, condition, sampling, torch.Generator().manual_seed(11)).tokens
    other = generate_ar(tiny_backbone, condition, sampling, torch.Generator().manual_seed(12)).tokens
    assert torch.equal(first, again) and not torch.equal(first, other)


@pytest.mark.parametrize("bad", [dict(temperature=0), dict(top_k=-1), dict(top_p=0), dict(cfg_scale=-1)])
def test_bad_sampling_values_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingConfig(**bad)
