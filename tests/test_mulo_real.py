"""MuLo-SD on the real backbone families: the generic drafter, the latent resampler, losslessness, export.

Every tiny adapter gets a 4x4 grid and a 2x2 drafter (r = 2). Greedy exact MuLo-SD
with an untrained drafter must return greedy AR's tokens, with and without CFG.
"""

import json

import pytest
import torch
from conftest import compose_config
from safetensors.torch import load_file, save_file
from tiny_adapters import ADAPTERS, tiny_tar

from backbones.base import Condition
from backbones.digits import random_digits_backbone
from backbones.emu3 import random_emu3_backbone
from backbones.janus import random_janus_backbone
from backbones.llamagen import random_llamagen_backbone
from backbones.lumina import random_lumina_backbone
from backbones.tar import random_tar_backbone
from decode import SamplingConfig, generate_ar
from decode.mulo import MuLoDecodeConfig, generate_mulo
from decode.mulo_resampling import downsample_latents, downsample_to_drafter, upsample_latents, upsample_to_backbone
from heads.export import HEADS_FILE, HeadsMismatchError, export_heads, load_heads
from heads.mulo import MuLoDrafter, MuLoDrafterConfig, MuLoLlamaDrafterModel

TINY_DRAFTER = dict(scale=2, hidden_size=16, num_layers=1, num_heads=1, intermediate_size=32)
NO_CODEBOOK = "ignore:.*no codebook latents"  # tiny LlamaGen has no VQ checkpoint: the embedding proxy is used


def random_drafter(backbone, seed: int = 1, std: float = 0.3) -> MuLoDrafter:
    """An untrained llama drafter with random (not near-zero) weights, bound to `backbone`."""
    torch.manual_seed(seed)
    drafter = MuLoDrafter(MuLoDrafterConfig.for_backbone(backbone, **TINY_DRAFTER))
    for parameter in drafter.parameters():
        torch.nn.init.normal_(parameter, std=std)
    drafter.bind(backbone)
    return drafter.eval()


# ---- the drafter follows its backbone ----------------------------------------------------------


@pytest.mark.filterwarnings(NO_CODEBOOK)
@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_drafter_is_conditioned_like_its_backbone_and_drafts_low_res_rows(name):
    make_backbone, make_condition, _ = ADAPTERS[name]
    backbone, condition = make_backbone(), make_condition()
    drafter = random_drafter(backbone)
    config = drafter.config
    assert config.design == "llama" and config.resample == "latents" and config.cfg_space == backbone.cfg_space
    assert (config.rows, config.cols, config.levels) == (2, 2, backbone.codebook_size)
    assert config.conditioning == ("class" if name == "llamagen" else "prompt")
    small = drafter.bind(backbone)
    assert isinstance(small, MuLoLlamaDrafterModel)
    # The drafter is an ARImageBackbone: greedy AR over its own 2x2 grid, with CFG.
    result = generate_ar(small, condition, SamplingConfig(greedy=True, cfg_scale=3.0))
    assert result.tokens.shape == (2, 2, 2) and int(result.tokens.max()) < backbone.codebook_size
    # The conditional and the null twin differ (the condition reaches the drafter).
    vectors = small.condition_vectors(condition, guided=True)
    assert vectors.shape == (4, 16) and not torch.allclose(vectors[:2], vectors[2:])


def test_prompt_drafter_needs_its_backbone_and_a_prompt():
    backbone = random_janus_backbone(seed=0)
    small = MuLoDrafter(MuLoDrafterConfig.for_backbone(backbone, **TINY_DRAFTER)).model
    with pytest.raises(RuntimeError, match="bind"):
        small.prefill(ADAPTERS["janus"][1](), guided=False)
    small.attach(backbone)
    with pytest.raises(ValueError, match="prompt-conditioned"):
        small.prefill(Condition(class_ids=torch.tensor([0])), guided=False)


def test_prompt_embedding_is_the_mean_of_the_frozen_input_embeddings_without_pads():
    backbone = random_tar_backbone(seed=0)
    ids = torch.tensor([[5, 21, 0, 30, 31]])  # 0 is the pad token
    expected = backbone.model.get_input_embeddings()(torch.tensor([[5, 21, 30, 31]])).mean(1)
    torch.testing.assert_close(backbone.condition_embedding(Condition(token_ids=ids)), expected)


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="head.resample=latents"):
        MuLoDrafterConfig(backbone_rows=4, backbone_cols=4, levels=8, scale=2, design="llama", resample="pixels")
    with pytest.raises(ValueError, match="divide"):
        MuLoDrafterConfig(backbone_rows=4, backbone_cols=6, levels=8, scale=4, design="llama")
    with pytest.raises(ValueError, match="condition_dim"):
        MuLoDrafterConfig(backbone_rows=4, backbone_cols=4, levels=8, scale=2, design="llama", conditioning="prompt")
    digits = random_digits_backbone(grid_size=8, levels=8, hidden_size=32, num_layers=1, num_heads=2)
    assert MuLoDrafterConfig.for_backbone(digits, scale=2).design == "digits"
    assert MuLoDrafterConfig.for_backbone(digits, scale=2).resample == "pixels"
    generic = MuLoDrafterConfig.for_backbone(digits, design="llama", scale=2)
    assert (generic.conditioning, generic.num_classes, generic.resample) == ("class", 10, "latents")


# ---- the latent resampler ------------------------------------------------------------------------


def test_latent_resampling_round_trips_piecewise_constant_grids():
    codebook = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    low = torch.randint(0, 16, (3, 3, 5))
    high = upsample_latents(low, codebook, scale=2)
    assert high.shape == (3, 6, 10)
    assert torch.equal(high[:, ::2, ::2], low) and torch.equal(high[:, 1::2, 1::2], low)  # constant 2x2 cells
    assert torch.equal(downsample_latents(high, codebook, 2), low)
    # bilinear interpolation of a constant grid stays on the same codebook entry
    constant = torch.full((1, 2, 2), 7)
    assert torch.equal(upsample_latents(constant, codebook, 3, mode="bilinear"), torch.full((1, 6, 6), 7))
    # area averaging takes the entry nearest the mean latent
    mixed = torch.tensor([[[0, 1], [0, 1]]])
    mean = codebook[[0, 1]].mean(0)
    assert downsample_latents(mixed, codebook, 2).item() == int(torch.cdist(mean[None], codebook).argmin())


@pytest.mark.filterwarnings(NO_CODEBOOK)
@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_latent_resampler_round_trips_on_each_adapter(name):
    backbone = ADAPTERS[name][0]()
    small = random_drafter(backbone).model
    low = torch.randint(0, backbone.codebook_size, (3, 2, 2))
    for mode in ("nearest", "bilinear"):
        high = upsample_to_backbone(low, small, backbone, 2, mode=mode, resample="latents")
        assert high.shape == (3, 4, 4) and int(high.min()) >= 0 and int(high.max()) < backbone.codebook_size
    high = upsample_to_backbone(low, small, backbone, 2, resample="latents")
    assert torch.equal(downsample_to_drafter(high, backbone, small, 2, resample="latents"), low)


def test_tiny_llamagen_without_a_codebook_warns_and_uses_its_input_embeddings():
    backbone = random_llamagen_backbone(seed=0)
    small = random_drafter(backbone).model
    with pytest.warns(UserWarning, match="vq_path"):
        downsample_to_drafter(torch.zeros(1, 4, 4, dtype=torch.long), backbone, small, 2, resample="latents")


# ---- decoding: lossless on every family --------------------------------------------------------


@pytest.mark.filterwarnings(NO_CODEBOOK)
@pytest.mark.parametrize("guided", [False, True])
@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_greedy_exact_mulo_equals_greedy_ar_with_a_random_drafter(name, guided):
    make_backbone, make_condition, cfg_scale = ADAPTERS[name]
    backbone, condition = make_backbone(), make_condition()
    sampling = SamplingConfig(greedy=True, cfg_scale=cfg_scale if guided else 1.0)
    baseline = generate_ar(backbone, condition, sampling)
    result = generate_mulo(
        backbone, random_drafter(backbone), condition, sampling, config=MuLoDecodeConfig(mode="exact")
    )
    assert torch.equal(result.tokens, baseline.tokens)
    assert result.forward_passes >= 1 + 4 // 2  # at least one pass per drafted block


def test_the_llama_design_also_drafts_for_the_digits_backbone_losslessly():
    backbone = random_digits_backbone(
        grid_size=8, levels=8, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
    )
    torch.manual_seed(1)
    drafter = MuLoDrafter(MuLoDrafterConfig.for_backbone(backbone, design="llama", **TINY_DRAFTER)).eval()
    condition, sampling = Condition(class_ids=torch.tensor([0, 3, 7])), SamplingConfig(greedy=True, cfg_scale=3.0)
    result = generate_mulo(backbone, drafter, condition, sampling, config=MuLoDecodeConfig(mode="exact"))
    assert torch.equal(result.tokens, generate_ar(backbone, condition, sampling).tokens)
    relaxed = generate_mulo(backbone, drafter, condition, sampling, config=MuLoDecodeConfig(upsample_mode="bilinear"))
    assert relaxed.forward_passes == 1 + 8 // 2


@pytest.mark.parametrize("name", ["janus", "tar"])
def test_relaxed_mulo_runs_one_pass_per_block_on_backbones_with_a_codebook(name):
    make_backbone, make_condition, cfg_scale = ADAPTERS[name]
    backbone = make_backbone()
    result = generate_mulo(
        backbone,
        random_drafter(backbone),
        make_condition(),
        SamplingConfig(cfg_scale=cfg_scale),
        torch.Generator().manual_seed(0),
        MuLoDecodeConfig(k=4, delta=0.2, radius=1),
    )
    assert result.tokens.shape == (2, 4, 4) and result.forward_passes == 1 + 4 // 2


def test_a_drafter_of_another_backbone_is_refused_when_decoding():
    janus, lumina = random_janus_backbone(seed=0), random_lumina_backbone(seed=0, rows=4, cols=4)
    with pytest.raises(ValueError, match="family: drafter LuminaBackbone"):
        generate_mulo(
            janus,
            random_drafter(lumina),
            ADAPTERS["janus"][1](),
            SamplingConfig(greedy=True),
            config=MuLoDecodeConfig(mode="exact"),
        )
    with pytest.raises(ValueError, match="grid: drafter 4x4, backbone 3x4"):
        random_drafter(lumina).bind(random_lumina_backbone(seed=0))


# ---- training ----------------------------------------------------------------------------------


def test_prompt_drafter_learns_through_its_projection_only():
    from train.mulo_module import MuLoDistillation

    backbone = tiny_tar()
    module = MuLoDistillation(backbone, drafter=dict(TINY_DRAFTER), optimizer=torch.optim.AdamW)
    small = module.drafter.bind(backbone)
    condition = ADAPTERS["tar"][1]()
    low = torch.randint(0, 32, (2, 4))
    logits = small(low, small.condition_vectors(condition, drop=torch.tensor([False, True])))
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), low.flatten()).backward()
    assert small.condition_proj.weight.grad.abs().sum() > 0 and small.null_condition.grad.abs().sum() > 0
    assert all(p.grad is None for p in backbone.parameters())
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    assert trainable and all(name.startswith("drafter.") for name in trainable)


@pytest.mark.filterwarnings(NO_CODEBOOK)
def test_class_drafter_loss_on_a_corpus_batch():
    from train.mulo_module import MuLoDistillation

    backbone = random_llamagen_backbone(seed=0)
    module = MuLoDistillation(backbone, drafter=dict(TINY_DRAFTER), optimizer=torch.optim.AdamW)
    batch = {"tokens": torch.randint(0, 64, (3, 16)), "class_id": torch.tensor([0, 4, 9])}
    bits = module.bits_per_token(batch, drop_classes=True)
    assert torch.isfinite(bits) and 0 < bits.item() < 12


# ---- export --------------------------------------------------------------------------------------


def test_drafter_export_round_trip_and_refusal_of_another_backbone(tmp_path):
    janus = random_janus_backbone(seed=0)
    drafter = random_drafter(janus)
    export_heads(drafter, tmp_path, janus.identity())
    head = json.loads((tmp_path / "heads.json").read_text())["head"]
    assert (head["design"], head["scale"], head["backbone_rows"], head["conditioning"]) == ("llama", 2, 4, "prompt")
    loaded = load_heads(tmp_path, janus, kind="mulo")
    assert loaded.config == drafter.config
    assert drafter.state_dict().keys() == loaded.state_dict().keys()
    for name, value in drafter.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name
    condition = ADAPTERS["janus"][1]()
    sampling = SamplingConfig(greedy=True, cfg_scale=3.0)
    exact = MuLoDecodeConfig(mode="exact")
    assert torch.equal(
        generate_mulo(janus, loaded, condition, sampling, config=exact).tokens,
        generate_mulo(janus, drafter, condition, sampling, config=exact).tokens,
    )
    with pytest.raises(HeadsMismatchError, match="family"):
        load_heads(tmp_path, random_lumina_backbone(seed=0, rows=4, cols=4))
    with pytest.raises(HeadsMismatchError, match="grid|geometry"):
        load_heads(tmp_path, random_emu3_backbone(seed=0))


def test_a_drafter_record_that_contradicts_the_backbone_is_refused(tmp_path):
    llamagen = random_llamagen_backbone(seed=0)
    drafter = random_drafter(llamagen)
    export_heads(drafter, tmp_path, llamagen.identity())
    other = random_llamagen_backbone(seed=0, num_classes=20)  # same sizes, other classes
    with pytest.raises(HeadsMismatchError, match="classes"):
        load_heads(tmp_path, other)


def test_exports_of_the_first_digits_drafter_format_still_load(tmp_path):
    backbone = random_digits_backbone(
        grid_size=12, levels=8, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
    )
    drafter = MuLoDrafter(
        MuLoDrafterConfig(
            backbone_rows=12,
            backbone_cols=12,
            levels=8,
            scale=3,
            hidden_size=16,
            num_layers=1,
            num_heads=1,
            intermediate_size=32,
        )
    )
    export_heads(drafter, tmp_path, backbone.identity())
    # Rewrite the export as the first format wrote it: the eight original head fields only.
    path = tmp_path / HEADS_FILE
    config = json.loads((tmp_path / "heads.json").read_text())
    legacy = [
        "backbone_rows",
        "backbone_cols",
        "levels",
        "scale",
        "hidden_size",
        "num_layers",
        "num_heads",
        "intermediate_size",
    ]
    config["head"] = {key: config["head"][key] for key in legacy}
    save_file(load_file(path), path, metadata={"config": json.dumps(config)})
    loaded = load_heads(tmp_path, backbone, kind="mulo")
    assert (loaded.config.design, loaded.config.resample) == ("digits", "pixels")
    for name, value in drafter.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name


# ---- the experiments ---------------------------------------------------------------------------

# The real experiments, shrunk: tiny backbone on the CPU, tiny corpus, tiny drafter, two steps.
TINY_RUN = [
    "backbone.device=cpu",
    "data=corpus_tiny",
    "head=mulo_tiny",
    "trainer=debug",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "data.batch_size=4",
    "data.spec.num_images=16",
    "data.spec.shard_size=8",
    "data.spec.batch_size=8",
]


def _tiny_run(tmp_path, experiment: str, overrides: list[str]):
    from train.pipeline import run_training

    cfg = compose_config(
        [
            f"+experiment={experiment}",
            *overrides,
            *TINY_RUN,
            f"export.dir={tmp_path / 'drafter'}",
            f"paths.root_dir={tmp_path}",
            f"paths.checkpoints_dir={tmp_path / 'checkpoints'}",
        ],
        tmp_path / "run",
    )
    assert cfg.module.drafter.scale == 2 and cfg.train.evaluate is None
    run_training(cfg)


@pytest.mark.filterwarnings(NO_CODEBOOK)
def test_mulo_llamagen_experiment_trains_and_exports_on_the_tiny_backbone(tmp_path):
    _tiny_run(
        tmp_path,
        "mulo_llamagen",
        ["backbone=llamagen_tiny", "data.spec.num_classes=10", "callbacks.samples.every_n_steps=2"],
    )
    assert (tmp_path / "run" / "samples" / "step_000002.png").is_file()  # token ids as grey levels (no VQ decoder)
    backbone = random_llamagen_backbone(seed=0)
    drafter = load_heads(tmp_path / "drafter", backbone, kind="mulo")
    assert (drafter.config.design, drafter.config.conditioning, drafter.config.num_classes) == ("llama", "class", 10)
    condition, sampling = Condition(class_ids=torch.tensor([2, 5])), SamplingConfig(greedy=True, cfg_scale=4.0)
    result = generate_mulo(backbone, drafter, condition, sampling, config=MuLoDecodeConfig(mode="exact"))
    assert torch.equal(result.tokens, generate_ar(backbone, condition, sampling).tokens)


@pytest.mark.filterwarnings(NO_CODEBOOK)
def test_mulo_tar_experiment_trains_on_a_prompt_corpus_and_exports(tmp_path):
    _tiny_run(tmp_path, "mulo_tar", ["backbone=tar_tiny", "+backbone.tokenizer=true", "+backbone.rows=4"])
    backbone = random_tar_backbone(seed=0, rows=4, tokenizer=True)
    drafter = load_heads(tmp_path / "drafter", backbone, kind="mulo")
    assert (drafter.config.design, drafter.config.conditioning) == ("llama", "prompt")
    # The sample grid of a prompt run decodes the first prompts of one token length.
    from train.mulo_module import MuLoDistillation

    module = MuLoDistillation(backbone, drafter=dict(TINY_DRAFTER), optimizer=torch.optim.AdamW)
    module._sample_condition = Condition(prompts=["a red cube", "a small blue ball", "a green cat"])
    images, figures = module.sample_images(3)
    assert images.shape[0] >= 1 and images.shape[1:] == (1, 4, 4) and figures["forward_passes_per_image"] >= 3
    condition, sampling = Condition(prompts=["a red cube", "a blue ball"]), SamplingConfig(greedy=True)
    result = generate_mulo(backbone, drafter, condition, sampling, config=MuLoDecodeConfig(mode="exact"))
    assert torch.equal(result.tokens, generate_ar(backbone, condition, sampling).tokens)
