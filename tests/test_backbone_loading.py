"""What every Hugging Face backbone adapter promises before any weights exist: its Hydra configs and its errors.

The per-model files test behaviour on tiny random instances; this file checks, for
each family at once, that the tiny config builds the adapter, that the real config
points at the family's loader with the weights path left for the user, and that a
missing weights folder names the model and the download command.
"""

import importlib
import re

import pytest
from conftest import CONF_DIR
from hydra.utils import instantiate
from omegaconf import OmegaConf

from backbones.base import ImageGeometry
from backbones.hf_loading import require_model_type

# family: (adapter class, the Hub id the docs and errors name, the tiny config's geometry)
FAMILIES = {
    "emu3": ("Emu3Backbone", "BAAI/Emu3-Gen-hf", ImageGeometry(3, 4, end_of_line=True)),
    "janus": ("JanusBackbone", "deepseek-community/Janus-Pro-7B", ImageGeometry(4, 4, end_of_line=False)),
    "lumina": ("LuminaBackbone", "Alpha-VLLM/Lumina-mGPT-7B-768", ImageGeometry(3, 4, end_of_line=True)),
    "tar": ("TarBackbone", "csuhan/Tar-1.5B", ImageGeometry(3, 4, end_of_line=False)),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_missing_weights_name_the_model_and_how_to_get_them(family, tmp_path):
    module = importlib.import_module(f"backbones.{family}")
    model_id = FAMILIES[family][1]
    assert module.MODEL_ID == model_id
    with pytest.raises(FileNotFoundError, match=re.escape(model_id)) as error:
        getattr(module, f"load_{family}_backbone")(str(tmp_path / "nowhere"))
    assert f"huggingface-cli download {model_id} --local-dir" in str(error.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_hydra_configs_build_the_tiny_backbone_and_leave_the_real_weights_path_to_the_user(family):
    adapter, _, geometry = FAMILIES[family]
    tiny = instantiate(OmegaConf.load(CONF_DIR / "backbone" / f"{family}_tiny.yaml"))
    assert type(tiny).__name__ == adapter and tiny.geometry == geometry
    real = OmegaConf.load(CONF_DIR / "backbone" / f"{family}.yaml")
    assert real._target_ == f"backbones.{family}.load_{family}_backbone" and OmegaConf.is_missing(real, "path")


# The authors' own releases of the two families whose adapter needs transformers' conversion (docs/backbones.md):
# family -> (their config.json model_type, the model id the error must name).
AUTHORS_RELEASES = {"emu3": ("Emu3", "BAAI/Emu3-Gen"), "janus": ("multi_modality", "deepseek-ai/Janus-Pro-7B")}


@pytest.mark.parametrize("family", AUTHORS_RELEASES)
def test_the_authors_remote_code_release_is_refused_naming_the_transformers_conversion(family, tmp_path):
    module = importlib.import_module(f"backbones.{family}")
    tiny = instantiate(OmegaConf.load(CONF_DIR / "backbone" / f"{family}_tiny.yaml"))
    tiny.model.config.save_pretrained(tmp_path / "converted")  # transformers' conversion passes the check
    require_model_type(tmp_path / "converted", family, module.MODEL_ID, original=AUTHORS_RELEASES[family][1])

    release = tmp_path / "release"  # the authors' layout: their config names a remote-code model type
    release.mkdir()
    model_type, original = AUTHORS_RELEASES[family]
    (release / "config.json").write_text(f'{{"model_type": "{model_type}", "architectures": ["X"]}}')
    with pytest.raises(ValueError, match=re.escape(original)) as error:
        getattr(module, f"load_{family}_backbone")(str(release), device="cpu", dtype="float32")
    assert f"huggingface-cli download {module.MODEL_ID} --local-dir" in str(error.value)
