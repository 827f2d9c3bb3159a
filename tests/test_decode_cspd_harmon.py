"""The masked generators on Harmon (decode/masked_baseline.py, decode/cspd_mar.py): prompts in place of class ids.

Tiny random Harmons (backbones/harmon.py) in float64; CSpD itself (its rules and their statistics) is tested on
MAR in tests/test_decode_cspd_mar.py: here, what Harmon adds, its prompt conditions in every pass and row layout.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from backbones.base import Condition
from backbones.harmon import random_harmon_backbone
from backbones.mar import random_mar_backbone
from decode.cspd_mar import CSpDMARConfig, check_compatible, generate_cspd_mar
from decode.masked_baseline import generate_masked
from decode.sampling import SamplingConfig

PROMPTS = ["a red cat on the tree with a blue car", "dog"]  # different token counts in one batch
NUM_ITER = 6


@pytest.fixture(scope="module")
def target():
    return random_harmon_backbone(seed=0, dtype="float64", grid_size=4, num_iter=NUM_ITER, final_step_noise=True)


def draws(model, batch: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    orders = torch.stack([torch.randperm(model.seq_len, generator=generator) for _ in range(batch)])
    shape = (batch, model.seq_len, model.diffusion.noise_steps, model.token_dim)
    return orders, torch.randn(shape, generator=generator, dtype=torch.float64)


# The window verification's target sees only the tokens before the round: equal to the drafter's view at gamma 1.
@pytest.mark.parametrize("verification,gamma", [("prefix", 3), ("window", 1)])
def test_a_drafter_equal_to_the_target_keeps_every_draft_and_gives_the_targets_tokens(target, verification, gamma):
    """Every pass (pre-fill, drafts, the prefix rows of the verification) must condition on the right prompt and
    row: any row given another prompt's or twin's KV cache changes a Gaussian, and a draft is rejected."""
    orders, noise = draws(target, len(PROMPTS))
    settings = CSpDMARConfig(verification=verification, gamma=gamma)
    result = generate_cspd_mar(
        target, copy.deepcopy(target), PROMPTS, settings, NUM_ITER, 3.0, "constant",
        orders=orders, noise=noise, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    own = target.sample(PROMPTS, NUM_ITER, 3.0, "constant", orders=orders, noise=noise)
    assert result.drafted_tokens > 0 and result.accepted_tokens == result.drafted_tokens
    torch.testing.assert_close(result.tokens.view(len(PROMPTS), target.seq_len, -1), own, rtol=1e-9, atol=1e-9)
    if gamma > 1:  # whole rounds kept: fewer target passes than steps (at gamma 1, one each)
        assert result.forward_passes < NUM_ITER


def test_a_smaller_harmon_drafts_and_the_result_has_the_targets_shape(target):
    drafter = random_harmon_backbone(seed=5, dtype="float64", grid_size=4, num_iter=NUM_ITER, final_step_noise=True)
    orders, noise = draws(target, len(PROMPTS), seed=2)
    result = generate_cspd_mar(
        target, drafter, PROMPTS, CSpDMARConfig(), NUM_ITER, 3.0, "constant",
        orders=orders, noise=noise, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert result.tokens.shape == (2, 4, 4, target.token_dim) and torch.isfinite(result.tokens).all()
    assert result.accepted_tokens < result.drafted_tokens  # another model's drafts: some rejected, resampled


def test_only_a_harmon_of_the_same_grid_drafts_for_harmon(target):
    with pytest.raises(ValueError, match="cannot draft for"):
        check_compatible(target, random_mar_backbone(seed=0, final_step_noise=True))
    with pytest.raises(ValueError, match="has seq_len=64, the target harmon-tiny-random 16"):
        check_compatible(target, random_harmon_backbone(seed=0, grid_size=8, final_step_noise=True))


def test_the_baseline_is_harmons_own_sampler_and_refuses_class_ids(target):
    sampling = SamplingConfig(cfg_scale=3.0, temperature=1.0, top_k=0, top_p=1.0, greedy=False)
    result = generate_masked(target, Condition(prompts=PROMPTS), sampling, torch.Generator().manual_seed(4))
    own = target.sample(PROMPTS, NUM_ITER, 3.0, "constant", generator=torch.Generator().manual_seed(4))
    assert torch.equal(result.tokens.view(2, target.seq_len, -1), own) and result.forward_passes == NUM_ITER
    with pytest.raises(ValueError, match="text-to-image: give prompts"):
        generate_masked(target, Condition(class_ids=torch.tensor([1])), sampling)


def test_decode_experiment_compares_cspd_on_harmon_with_the_baseline(tmp_path, target, monkeypatch):
    """`python -m decode +experiment=cspd_harmon` on tiny random Harmons: the drafter is a directory holding its
    checkpoint beside its LLM's config and tokenizer; prompts of any length share a batch; PNGs from the VAE."""
    import transformers
    from conftest import compose_config

    from decode.cli import run_decode

    # Beside a qwen2 config.json, AutoTokenizer rebuilds the tiny word-level tokenizer as Qwen's byte-level BPE
    # (every word becomes one id): read it as saved. Real Qwen2.5 directories load as they are.
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", transformers.PreTrainedTokenizerFast.from_pretrained
    )

    drafter_dir = tmp_path / "drafter"
    torch.save(target.official_state_dict(), drafter_dir.mkdir() or drafter_dir / "harmon_tiny.pth")
    target.llm.config.save_pretrained(drafter_dir)
    target.tokenizer.save_pretrained(drafter_dir)
    out = tmp_path / "out"
    cfg = compose_config(
        [
            "+experiment=cspd_harmon",
            "backbone=harmon_tiny",
            "backbone.grid_size=4",
            f"backbone.num_iter={NUM_ITER}",
            "backbone.dtype=float64",  # float32 rounding, amplified by the random head, would reject equal drafts
            "decode.methods=[ar,cspd_mar,cspd_mar_reference]",
            f"decode.mar_drafter={drafter_dir}",
            "decode.num_images=3",
            "decode.batch_size=3",
            f"decode.out={out}",
        ],
        tmp_path / "run",
    )
    report = run_decode(cfg)
    methods = report["methods"]
    assert methods["ar"]["forward_passes_per_image"] == NUM_ITER
    assert methods["cspd_mar"]["lossless"] and methods["cspd_mar"]["draft_acceptance_rate"] == 1.0
    assert methods["cspd_mar"]["forward_passes_per_image"] < NUM_ITER
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["backbone"]["family"] == "HarmonBackbone"
    assert {p.name for p in out.glob("*.png")} >= {"ar.png", "cspd_mar.png", "cspd_mar_reference.png"}
