"""Lossless in bfloat16, defined and tested on every real adapter (tiny random-weight instances in bf16).

In bfloat16 a pass that feeds several tokens rounds differently from one that
feeds one (other matrix shapes, other summation orders), so a speculative
method's target logits at a position can differ from the baseline's by a few
units of rounding. Greedy decoding turns such a difference into another token
only where the two best scores are closer than that. What this project
guarantees in bfloat16 (norm, image head and guidance are computed as the
baseline computes them; the same SDPA attention on both paths):

    greedy speculative tokens equal greedy AR tokens up to the first position
    where they differ, and there greedy AR's guided top-two margin is within the
    rounding of one bf16 rounding of each logit:
    margin <= (|s| + |1 - s|) * 2**-8 * max |logit|  (s the CFG scale).

After that position the images are different images (another prefix); a method
that diverges where the baseline's choice was clear is wrong, and fails here.

The same holds with the final norm and image head in float32 (`float32_head`),
which is why it is not the default: it halves how much a position's guided scores
depend on the length of the pass that computes them (16x16 Lumina 0.0083 ->
0.0036, Janus 0.00067 -> 0.00029, Emu3 0.0048 -> 0.0025), but the transformer
layers' bf16 products remain, and the greedy methods leave greedy AR as often.
"""

import copy
import warnings

import pytest
import torch
from conftest import random_eagle_head, random_ssd_heads

from backbones.base import Condition
from decode import SamplingConfig, SSDDecodeConfig, generate_ar, generate_ssd
from decode.eagle import EagleDecodeConfig, generate_eagle
from decode.sjd import SJDDecodeConfig, generate_sjd
from decode.zipar import ZipARDecodeConfig, generate_zipar

BF16_UNIT_ROUNDOFF = 2.0**-8
CFG_SCALE = 3.0


def tiny_bf16(model: str):
    """(backbone in bf16, a batch of two conditions): each real family's tiny test instance, or (`*_16x16`) the
    same family at the 16 x 16 grid of backbones/published_sizes.py, long enough for rounding ties to occur."""
    if model.endswith("_16x16"):
        from backbones.published_sizes import published_backbones

        spec = published_backbones()[model.removesuffix("_16x16")]
        backbone = spec.backbone("tiny", "cpu", torch.bfloat16)
        return backbone, spec.condition(backbone, 2, 6)
    if model == "llamagen":
        from backbones.llamagen import random_llamagen_backbone

        return random_llamagen_backbone(seed=0).to(torch.bfloat16), Condition(class_ids=torch.tensor([1, 8]))
    module = __import__(f"test_backbone_{model}")  # the adapter tests' tiny instance and prompts
    build = getattr(__import__(f"backbones.{model}", fromlist=["_"]), f"random_{model}_backbone")
    return build(seed=module.SEED).to(torch.bfloat16), Condition(token_ids=module.PROMPTS)


def greedy_ar_with_margins(backbone, condition, cfg_scale: float):
    """Greedy AR's tokens (B, N), its guided top-two margin at each position (B, N) and the bf16 bound there."""
    state, hidden = backbone.prefill(condition, cfg_scale != 1.0)
    total = backbone.geometry.num_tokens
    tokens, margins, bounds = [], [], []
    for position in range(total):
        logits = backbone.logits(hidden[:, -1])  # (rows, V) in bf16
        scores = backbone.guide(logits, cfg_scale) if state.guided else logits.float()
        top = scores.topk(2, dim=-1).values
        margins.append(top[:, 0] - top[:, 1])
        largest = logits.float().abs().amax(-1).view(-1, condition.batch_size).amax(0)  # over the twins
        bounds.append((abs(cfg_scale) + abs(1 - cfg_scale)) * BF16_UNIT_ROUNDOFF * largest)
        tokens.append(scores.argmax(-1))
        if position + 1 < total:
            hidden = backbone.step(state, tokens[-1][:, None])
    return torch.stack(tokens, 1), torch.stack(margins, 1), torch.stack(bounds, 1)


def first_divergence(tokens: torch.Tensor, reference: torch.Tensor) -> list[int | None]:
    differ = tokens.flatten(1) != reference
    return [int(row.nonzero()[0]) if row.any() else None for row in differ]


@pytest.mark.parametrize(
    "model",
    [
        "janus",
        "emu3",
        "lumina",
        "llamagen",
        "tar",
        # Greedy AR meets rounding ties here (at position 83 of both images on one CPU, margin 0.001, bound 0.09; at
        # 210 on an AVX-512 EPYC, margin 0.0: two bf16 logits equal):
        pytest.param("lumina_mgpt_7b_16x16", marks=pytest.mark.slow),
        pytest.param("janus_pro_7b_16x16", marks=pytest.mark.slow),
        pytest.param("emu3_gen_16x16", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("float32_head", [False, True], ids=["bf16_head", "float32_head"])
def test_greedy_lossless_methods_in_bf16_diverge_only_at_rounding_ties(model, float32_head):
    backbone, condition = tiny_bf16(model)
    backbone.float32_head = float32_head
    sampling = SamplingConfig(cfg_scale=CFG_SCALE, greedy=True)
    reference, margins, bounds = greedy_ar_with_margins(backbone, condition, CFG_SCALE)
    assert torch.equal(reference, generate_ar(backbone, condition, sampling).tokens.flatten(1))  # the baseline
    ssd_heads = random_ssd_heads(backbone.hidden_size, seed=1, std=0.3).to(torch.bfloat16)
    eagle_head = random_eagle_head(backbone).to(torch.bfloat16)
    methods = {
        "ssd_exact lookahead": lambda: generate_ssd(
            backbone, ssd_heads, condition, sampling, config=SSDDecodeConfig(lookahead=True, grid_steps=6)
        ),
        "sjd": lambda: generate_sjd(backbone, condition, sampling, torch.Generator().manual_seed(0), SJDDecodeConfig()),
        "eagle": lambda: generate_eagle(backbone, eagle_head, condition, sampling, None, EagleDecodeConfig(6)),
        "zipar whole rows": lambda: generate_zipar(
            backbone, condition, sampling, config=ZipARDecodeConfig(window=backbone.geometry.cols)
        ),
    }
    for name, generate in methods.items():
        result = generate()
        assert result.forward_passes <= backbone.geometry.num_tokens, name
        for image, position in enumerate(first_divergence(result.tokens, reference)):
            if position is None:
                continue
            margin, bound = float(margins[image, position]), float(bounds[image, position])
            assert margin <= bound, (
                f"{name} on {model}: image {image} leaves greedy AR at position {position}, where AR's top-two "
                f"margin {margin:.4f} exceeds the bf16 rounding bound {bound:.4f}"
            )


@pytest.mark.parametrize("model", ["janus", "emu3", "lumina", "llamagen", "tar"])
def test_the_float32_head_is_the_models_head_computed_in_float32(model):
    """`float32_head`: the bf16 model's final norm and image-token rows, in float32, in codebook order; copies
    that follow `load_state_dict` and stay out of the state dict and the weights fingerprint."""
    backbone, _ = tiny_bf16(model)
    hidden = torch.randn(2, 5, backbone.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    native_logits, fingerprint = backbone.logits(hidden), backbone.weights_fingerprint()
    keys = set(backbone.state_dict())
    backbone.float32_head = True
    in_float32 = copy.deepcopy(backbone).float()  # the same bf16 weights, widened
    expected = in_float32.logits(hidden.float())
    got = backbone.logits(hidden)
    assert got.dtype == torch.float32 and native_logits.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert not torch.equal(got, native_logits.float())  # it is not the bf16 head widened afterwards
    assert set(backbone.state_dict()) == keys and backbone.weights_fingerprint() == fingerprint

    other, _ = tiny_bf16(model)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.mul_(1.5)
    backbone.load_state_dict(other.state_dict())
    other.float32_head = True
    torch.testing.assert_close(backbone.logits(hidden), other.logits(hidden), rtol=0, atol=0)
    assert not torch.allclose(backbone.logits(hidden), got)


@pytest.mark.parametrize("model", ["janus", "emu3", "lumina", "llamagen", "tar"])
def test_heads_trained_on_bf16_weights_load_on_the_same_weights_in_float32(model, tmp_path):
    """One fingerprint per set of weights, whatever dtype they are loaded in; other weights are still told apart."""
    from heads.export import export_heads, load_heads

    backbone, _ = tiny_bf16(model)
    exported = export_heads(random_ssd_heads(backbone.hidden_size), tmp_path / "heads", backbone.identity())
    widened = copy.deepcopy(backbone).float()
    assert widened.weights_fingerprint() == backbone.weights_fingerprint()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "trained on other weights" warning
        load_heads(exported, widened, kind="ssd")
    with torch.no_grad():
        next(iter(widened.final_norm.parameters())).mul_(1.01)
    with pytest.warns(UserWarning, match="fingerprint differs"):
        load_heads(exported, widened, kind="ssd")
