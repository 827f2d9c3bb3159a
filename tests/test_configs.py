"""Every option of every conf/ group composes and instantiates with tiny settings."""

from pathlib import Path

import hydra
import pytest
from conftest import CONF_DIR, compose_config
from omegaconf import OmegaConf

from decode.cli import sampling_from_config
from train.pipeline import needs_backbone

TINY = ["backbone=digits_tiny", "data=corpus_tiny", "head=ssd_tiny", "trainer=debug"]
# Options that load committed artefacts are instantiated for real too (they must exist on a fresh clone).
GROUPS_WITH_TARGETS = ["backbone", "data", "module", "trainer", "logger"]


def options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


# Options that need other tiny companions: the backbone recipe reads raw digits, not a corpus;
# the MuLo module trains a drafter, the EAGLE module a sequential head, not SSD heads.
TINY_SWAPS = {
    "backbone_digits": ["data=digits_tiny"],
    "mulo": ["head=mulo_tiny"],
    "mulo_digits": ["head=mulo_tiny"],
    # The continuous backbone's recipe and CSpD's drafter read continuous patches of the raw digits.
    "digits_continuous": ["backbone=digits_continuous_tiny"],
    "backbone_digits_continuous": ["data=digits_continuous_tiny"],
    "cspd": ["data=digits_continuous_tiny", "backbone=digits_continuous_tiny"],
    "cspd_digits": ["data=digits_continuous_tiny", "backbone=digits_continuous_tiny"],
    "cspd_rows": ["data=digits_continuous_tiny", "backbone=digits_continuous_tiny"],
    "cspd_rows_digits": ["data=digits_continuous_tiny", "backbone=digits_continuous_tiny"],
    "cspd_mar": ["backbone=mar_tiny"],  # MAR has no training: the experiment decodes (a random tiny instance here)
    "cspd_harmon": ["backbone=harmon_tiny"],  # nor Harmon
}


def tiny_for(option: str) -> list[str]:
    extra = ["head=eagle_tiny"] if option.startswith("eagle") else []  # every EAGLE experiment trains a sequential head
    swaps = {o.split("=")[0]: o for o in TINY_SWAPS.get(option, extra)}
    return [swaps.get(o.split("=")[0], o) for o in TINY]


def with_option(group: str, option: str) -> list[str]:
    return [o for o in tiny_for(option) if not o.startswith(f"{group}=")] + [f"{group}={option}"]


# This machine and CI have no GPU: GPU trainers are instantiated with their accelerator switched to CPU.
ON_CPU = {"gpu": ["trainer.accelerator=cpu"], "ddp": ["trainer.accelerator=cpu", "trainer.devices=2"], "fsdp": []}


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS_WITH_TARGETS for o in options(g)])
def test_group_option_instantiates(group, option, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    cfg = compose_config(with_option(group, option) + (ON_CPU.get(option, []) if group == "trainer" else []), tmp_path)
    if group == "backbone" and OmegaConf.is_missing(cfg.backbone, "path"):
        # Real backbones need local weights: without them, a clear error that says how to get them.
        cfg.backbone.path = str(tmp_path / "no-weights-here")
        from hydra.errors import InstantiationException

        with pytest.raises((FileNotFoundError, InstantiationException), match="huggingface-cli download"):
            hydra.utils.instantiate(cfg.backbone)
        return
    if (group, option) == ("trainer", "fsdp"):  # Lightning refuses FSDP without a GPU: build the strategy alone
        from pytorch_lightning.strategies import FSDPStrategy

        assert isinstance(hydra.utils.instantiate(cfg.trainer.strategy), FSDPStrategy)
        return
    extra = (
        {"backbone": hydra.utils.instantiate(cfg.backbone)}
        if group != "backbone" and needs_backbone(cfg[group])
        else {}
    )
    obj = hydra.utils.instantiate(cfg[group], **extra)
    assert obj is not None
    if group == "trainer" and option in ON_CPU:
        assert OmegaConf.load(CONF_DIR / "trainer" / f"{option}.yaml").get("accelerator", "gpu") == "gpu"
    if group == "logger" and option == "wandb":
        assert obj._offline  # no credentials here: offline, as the message says
    if group == "data" and option.startswith("digits"):
        obj.setup("fit")
        tokens, labels = next(iter(obj.train_dataloader()))
        assert labels.shape == (cfg.data.batch_size,)
        if cfg.data.get("patch_size"):  # continuous patches in [-1, 1]
            patch = cfg.data.patch_size
            assert tokens.shape == (cfg.data.batch_size, (cfg.data.grid_size // patch) ** 2, patch**2)
            assert -1 <= tokens.min() and tokens.max() <= 1 and tokens.is_floating_point()
        else:
            assert tokens.shape == (cfg.data.batch_size, cfg.data.grid_size**2)
            assert 0 <= tokens.min() and tokens.max() < cfg.data.levels


@pytest.mark.parametrize("option", options("callbacks"))
def test_callbacks_instantiate(option, tmp_path):
    cfg = compose_config(TINY + [f"callbacks={option}"], tmp_path)
    callbacks = [hydra.utils.instantiate(node) for node in cfg.callbacks.values() if node]
    assert callbacks


@pytest.mark.parametrize("option", options("decode"))
def test_decode_settings_are_valid(option, tmp_path):
    cfg = compose_config(TINY + [f"decode={option}"], tmp_path)
    sampling_from_config(cfg)  # raises on a bad value
    assert cfg.decode.methods[0] == "ar" or "ar" not in cfg.decode.methods


@pytest.mark.parametrize("experiment", options("experiment"))
def test_experiments_compose_and_resolve(experiment, tmp_path):
    cfg = compose_config([f"+experiment={experiment}"] + tiny_for(experiment), tmp_path)
    assert cfg.experiment_name == experiment
    OmegaConf.to_container(cfg.module, resolve=True)
    first_lines = (CONF_DIR / "experiment" / f"{experiment}.yaml").read_text().splitlines()[:2]
    assert first_lines[0] == "# @package _global_"
    # The first comment says how to run it: a training experiment, or a decode one (compare_digits).
    assert first_lines[1].startswith(
        (f"# python -m train +experiment={experiment}", f"# python -m decode +experiment={experiment}")
    )


def test_paths_are_absolute_and_independent_of_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = compose_config([], tmp_path)
    assert Path(cfg.paths.checkpoints_dir).is_absolute()
    assert (Path(cfg.paths.checkpoints_dir) / "digits-backbone").parent == CONF_DIR.parent / "checkpoints"


def test_slurm_launcher_config_composes(tmp_path):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=["hydra/launcher=slurm", "trainer=ddp", "trainer.num_nodes=4"],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.nodes == 4 and launcher.tasks_per_node == launcher.gpus_per_node == 8


def test_every_generator_base_lists_every_setting_so_any_can_be_overridden():
    from omegaconf import OmegaConf

    from decode.mulo import MuLoDecodeConfig
    from decode.ssd import SSDDecodeConfig

    for name, settings, artefact in (("ssd", SSDDecodeConfig, "heads"), ("mulo", MuLoDecodeConfig, "drafter")):
        base = OmegaConf.load(CONF_DIR / "method" / "base" / f"{name}.yaml")
        assert set(base) - {"generator", artefact} == set(settings.__dataclass_fields__), name


def test_the_comparison_runs_mulo_at_the_operating_point_its_experiment_measures(tmp_path):
    """compare_digits repeats mulo_digits' MuLo-SD settings (a preset left at its generic defaults would be another
    operating point than the README's MuLo-SD section measures)."""
    compare = compose_config(["+experiment=compare_digits"], tmp_path).decode.presets
    mulo = compose_config(["+experiment=mulo_digits"], tmp_path).decode.presets
    for name in ("mulo", "mulo_exact", "mulo_ragged"):
        assert OmegaConf.to_container(compare[name]) == OmegaConf.to_container(mulo[name]), name


def test_every_preset_file_is_bound_as_a_preset_and_builds_its_settings(tmp_path):
    """A file in conf/method/ is a preset only once conf/decode/default.yaml binds it (else `decode.methods` refuses
    its name); each one's generator and settings check out."""
    from decode.registry import check_methods

    files = sorted(path.stem for path in (CONF_DIR / "method").glob("*.yaml"))
    cfg = compose_config([f"decode.methods=[{','.join(files)}]", "decode.mar_drafter=/any/mar"], tmp_path)
    assert set(files) == set(cfg.decode.presets), "a preset file is not bound in conf/decode/default.yaml"
    assert [method.name for method in check_methods(cfg.decode)] == files
