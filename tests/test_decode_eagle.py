"""EAGLE and LANTERN: greedy EAGLE is greedy AR, sampled EAGLE has the backbone's distribution, LANTERN relaxes it,
the head exports, loads and refuses the wrong backbone, and the experiment trains, exports and decodes."""

import json

import pytest
import torch
from conftest import compose_config, random_eagle_head
from distribution_check import assert_sampled_from, enumerable_backbone, fit_pvalue, image_distribution

from backbones.base import Condition
from backbones.digits import random_digits_backbone
from decode.ar import generate_ar
from decode.eagle import EagleDecodeConfig, generate_eagle
from decode.lantern import LanternDecodeConfig, generate_lantern
from decode.rules import probability_of
from decode.sampling import SamplingConfig
from heads.export import HeadsMismatchError, export_heads, load_heads

CLASS_ID = 2


@pytest.fixture(scope="module")
def backbone8():
    return random_digits_backbone(
        seed=0, grid_size=8, levels=8, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
    )


@pytest.mark.parametrize("cfg_scale", [3.0, 1.0])
@pytest.mark.parametrize("depth", [1, 4, 70])
def test_greedy_eagle_is_greedy_ar_token_for_token(backbone8, cfg_scale, depth):
    condition = Condition(class_ids=torch.tensor([0, 3, 7, 9]))  # images progress at their own pace
    sampling = SamplingConfig(cfg_scale=cfg_scale, greedy=True)
    expected = generate_ar(backbone8, condition, sampling).tokens
    result = generate_eagle(
        backbone8, random_eagle_head(backbone8), condition, sampling, torch.Generator().manual_seed(0),
        EagleDecodeConfig(depth),
    )  # fmt: skip
    assert torch.equal(result.tokens, expected)
    assert result.forward_passes <= backbone8.geometry.num_tokens
    assert 0 < result.accepted_tokens <= result.drafted_tokens


class _CountingCache:
    """The head cache's interface (length, crop), holding nothing: the oracle head needs positions only."""

    def __init__(self):
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, count: int) -> None:
        self.length += count  # a negative count removes positions


class OracleHead(torch.nn.Module):
    """A 'head' that returns the backbone's own next states along a known image, but only from the pair EAGLE's
    head reads at grid position i: the state that predicted token i and token i's embedding (EAGLE's f_i with
    x_{i+1} in the reference's numbering). Any other pair (a state or token one position off) gives the negated
    state, whose draft is the argmin, so a mispaired chain is rejected; so are the positions `wrong` marks."""

    def __init__(self, true_states: torch.Tensor, true_embeddings: torch.Tensor, wrong: torch.Tensor):
        super().__init__()
        self.fc = torch.nn.Linear(1, 1)  # decoding reads the head's dtype from fc
        self.true = true_states  # (rows, N + 1, H): the entry at i predicts token i
        self.embedded = true_embeddings  # (rows, N, H)
        self.wrong = wrong  # (rows, N) bool: inputs at which the head predicts wrong anyway

    def new_cache(self):
        return _CountingCache()

    def forward(self, states, token_embeddings, cache):
        start = cache.get_seq_length()
        cache.length = start + states.shape[1]

        def same(a, b):  # (rows, T): equal up to the rounding of a pass of another length
            return (a - b).abs().amax(-1) <= 1e-4 * (1 + b.abs().amax(-1))

        paired = same(states, self.true[:, start : cache.length]) & same(
            token_embeddings, self.embedded[:, start : cache.length]
        )
        paired &= ~self.wrong[:, start : cache.length]
        following = self.true[:, start + 1 : cache.length + 1]  # the entry at i predicts the state at i + 1
        return torch.where(paired[..., None], following, -following)


@pytest.mark.parametrize("lagging", [False, True])
def test_a_head_that_predicts_the_backbone_states_is_accepted_everywhere(backbone8, lagging):
    """The chain's bookkeeping (which state, which token, which position): a head that returns the backbone's
    own next states from correctly paired inputs makes every greedy draft pass, so the image costs one pass per
    depth + 1 tokens; a state or token one position off is drafted wrong and rejected. `lagging`: the head is
    wrong once for image 0 (its draft of position 11), which falls behind; image 1, ahead, then feeds the head
    its own committed states and tokens, and only that one draft is rejected."""
    condition = Condition(class_ids=torch.tensor([1, 4]))
    sampling = SamplingConfig(cfg_scale=3.0, greedy=True)
    baseline = generate_ar(backbone8, condition, sampling)
    tokens = baseline.tokens.flatten(1)  # (B, N)
    state, first = backbone8.prefill(condition, True)
    true = torch.cat([first, backbone8.step(state, tokens[:, :-1])], dim=1)  # (rows, N, H)
    embedded = backbone8.embed_image_tokens(tokens.repeat(true.shape[0] // len(tokens), 1))  # (rows, N, H)
    wrong = torch.zeros(embedded.shape[:2], dtype=torch.bool)
    wrong[:: len(tokens), 10] = lagging  # image 0's cache rows (cond, uncond): the input that drafts position 11
    oracle = OracleHead(torch.cat([true, true[:, -1:]], dim=1), embedded, wrong)
    result = generate_eagle(backbone8, oracle, condition, sampling, None, EagleDecodeConfig(depth=7))
    assert torch.equal(result.tokens, baseline.tokens)
    if not lagging:
        assert result.accepted_tokens == result.drafted_tokens == 2 * 56  # 2 images, 8 passes of 7 drafts
        assert result.forward_passes == 1 + 64 // 8  # the prefill, then 8 tokens per pass
    else:
        assert result.accepted_tokens == result.drafted_tokens - 1


def test_the_heads_prediction_at_t_reads_state_t_and_token_t(backbone8):
    """EagleHead fuses the state and the token embedding of the same position: its prediction at t changes with
    either input at t and not with anything later, teacher-forced (training) and through its cache (drafting)."""
    head = random_eagle_head(backbone8)
    generator = torch.Generator().manual_seed(0)
    states, embedded = torch.randn(2, 1, 6, backbone8.hidden_size, generator=generator)  # each (1, T=6, H)
    with torch.no_grad():
        base = head(states, embedded)
        cache = head.new_cache()
        stepped = torch.cat([head(states[:, i : i + 1], embedded[:, i : i + 1], cache) for i in range(6)], dim=1)
        torch.testing.assert_close(stepped, base, atol=1e-5, rtol=1e-5)
        for changed in (0, 1):  # the state at t = 3, then the token at t = 3
            inputs = [states.clone(), embedded.clone()]
            inputs[changed][:, 3] += 1.0
            out = head(*inputs)
            torch.testing.assert_close(out[:, :3], base[:, :3], msg=f"input {changed} at t = 3 reached t < 3")
            assert (out[:, 3] - base[:, 3]).abs().amax() > 1e-3, f"input {changed} at t = 3 did not reach t = 3"


@pytest.mark.slow
@pytest.mark.parametrize("depth", [2, 5])
def test_sampled_eagle_has_the_backbone_distribution(depth):
    """40,000 3x3 images in one batch: chains pass and fail, and images ahead re-feed their committed tokens."""
    backbone = enumerable_backbone(grid_size=3, levels=2)
    sampling = SamplingConfig(cfg_scale=2.0)
    truth = image_distribution(backbone, CLASS_ID, sampling)
    result = generate_eagle(
        backbone, random_eagle_head(backbone, std=0.5), Condition(class_ids=torch.full((40_000,), CLASS_ID)),
        sampling, torch.Generator().manual_seed(0), EagleDecodeConfig(depth),
    )  # fmt: skip
    assert 0.2 < result.accepted_tokens / result.drafted_tokens < 0.95  # drafts pass and fail: the rules run
    assert_sampled_from(result.tokens.flatten(1).tolist(), truth)


def test_the_distribution_check_catches_a_test_that_ignores_the_draft_distribution():
    """The chi-square test has the power to fail: accepting with p(x) alone (as if every draft were a point
    proposal) biases the images towards what the head proposes."""
    backbone = enumerable_backbone(grid_size=3, levels=2)
    sampling = SamplingConfig(cfg_scale=2.0)
    truth = image_distribution(backbone, CLASS_ID, sampling)

    def point_proposal_test(p, q, drafts, uniforms):
        return uniforms < probability_of(p, drafts)

    result = generate_eagle(
        backbone, random_eagle_head(backbone, std=0.5), Condition(class_ids=torch.full((40_000,), CLASS_ID)),
        sampling, torch.Generator().manual_seed(0), EagleDecodeConfig(3), point_proposal_test,
    )  # fmt: skip
    assert fit_pvalue(result.tokens.flatten(1).tolist(), truth) < 1e-6


def test_lantern_with_no_budget_is_eagle_and_with_one_accepts_more(backbone8):
    condition = Condition(class_ids=torch.arange(8))
    sampling = SamplingConfig(cfg_scale=3.0)
    head = random_eagle_head(backbone8, std=0.2)

    def run(generate, config):
        return generate(backbone8, head, condition, sampling, torch.Generator().manual_seed(3), config)

    eagle = run(generate_eagle, EagleDecodeConfig(4))
    exact = run(generate_lantern, LanternDecodeConfig(depth=4, k=1000, delta=0.0))
    assert torch.equal(eagle.tokens, exact.tokens) and eagle.forward_passes == exact.forward_passes
    relaxed = run(generate_lantern, LanternDecodeConfig(depth=4, k=1000, delta=0.3))
    assert relaxed.accepted_tokens / relaxed.drafted_tokens > eagle.accepted_tokens / eagle.drafted_tokens + 0.05
    greedy = SamplingConfig(cfg_scale=3.0, greedy=True)  # greedy decoding is not relaxed
    assert torch.equal(
        generate_lantern(backbone8, head, condition, greedy, None, LanternDecodeConfig(depth=4)).tokens,
        generate_ar(backbone8, condition, greedy).tokens,
    )


def test_out_of_range_settings_are_refused():
    with pytest.raises(ValueError, match="depth must be >= 1"):
        EagleDecodeConfig(0)
    with pytest.raises(ValueError, match="delta in"):
        LanternDecodeConfig(delta=5)


def test_head_export_round_trip_and_refusal(backbone8, tmp_path):
    head = random_eagle_head(backbone8)
    export_heads(head, tmp_path, backbone8.identity())
    loaded = load_heads(tmp_path, backbone8, kind="eagle")
    assert loaded.config == head.config
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="'eagle' heads, but 'ssd' heads are needed"):
        load_heads(tmp_path, backbone8, kind="ssd")
    other = random_digits_backbone(
        seed=0, grid_size=6, levels=8, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
    )
    with pytest.raises(HeadsMismatchError, match="geometry"):
        load_heads(tmp_path, other)


def test_eagle_experiment_trains_exports_and_decodes(tmp_path, classifier_cache):
    export = tmp_path / "export"
    tiny = [
        "+experiment=eagle_digits",
        "backbone=digits_tiny",
        "data=corpus_tiny",
        "head=eagle_tiny",
        "trainer=debug",
        "trainer.max_steps=3",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1",
        f"export.dir={export}",
        f"paths.root_dir={tmp_path}",
        f"paths.checkpoints_dir={classifier_cache}",
        "train.evaluate.num_images=2",
        "train.evaluate.seeds=1",
    ]
    from train.pipeline import run_training

    metrics = run_training(compose_config(tiny, tmp_path / "run"))
    assert 0 < metrics["val/acceptance"] <= 1 and "val/top1_next" in metrics
    assert load_heads(export, kind="eagle").config.intermediate_size == 64
    report = json.loads((tmp_path / "run" / "evaluation" / "metrics.json").read_text())
    assert report["methods"]["eagle"]["lossless"] and not report["methods"]["lantern"]["lossless"]
    assert report["methods"]["eagle"]["settings"] == {"depth": 6}
    assert report["methods"]["lantern"]["settings"] == {"depth": 6, "k": 1000, "delta": 0.1}
