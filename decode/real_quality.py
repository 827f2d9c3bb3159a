"""Quality of images from the real backbones: FID against reference images and CLIP score against prompts.

The digits backbone is scored by its own classifier (decode/quality.py). Real
backbones are scored the way their papers report them, with torchmetrics:

- FID (`FrechetInceptionDistance`) between the generated images and a folder of
  reference images the user provides (e.g. ImageNet val for LlamaGen, COCO for
  text-to-image models). The features come from torchmetrics' InceptionV3 (needs
  the ``torch-fidelity`` and ``torchvision`` packages and its weights file) or from any ``nn.Module``
  mapping (B, 3, H, W) images in [0, 1] to (B, D) features.
- CLIP score (`CLIPScore`) between each image and its prompt, with a CLIP model
  loaded from a local directory (transformers format).

No weights are downloaded here: everything must be on disk, and a missing piece
is reported when `RealQuality` is built (before any image is generated) with the
command that fetches it and the config key that points at it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

INCEPTION_WEIGHTS_FILE = "weights-inception-2015-12-05-6726825d.pth"
INCEPTION_WEIGHTS_URL = f"https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/{INCEPTION_WEIGHTS_FILE}"
CLIP_DEFAULT = "openai/clip-vit-large-patch14"
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}


class QualitySetupError(RuntimeError):
    """A requested quality metric cannot run: its weights or reference images are missing."""


def inception_weights_path(configured: str | Path | None) -> Path:
    """The local InceptionV3 FID weights: `configured`, else torch-fidelity's copy in the torch hub cache.

    Raises `QualitySetupError` naming the download and the config key when neither exists,
    and when the ``torch-fidelity`` package (torchmetrics' Inception implementation) is missing.
    """
    try:
        import torch_fidelity  # noqa: F401 - torchmetrics' InceptionV3 is torch-fidelity's (which imports torchvision)
    except ImportError as error:
        raise QualitySetupError(
            f"FID with the InceptionV3 features needs torch-fidelity and torchvision ({error}): pip install "
            "torch-fidelity torchvision (torchvision matching your torch); or give your own feature extractor "
            "as decode.quality.fid_features"
        ) from error
    path = Path(configured) if configured else Path(torch.hub.get_dir()) / "checkpoints" / INCEPTION_WEIGHTS_FILE
    if not path.is_file():
        raise QualitySetupError(
            f"FID InceptionV3 weights not found at {path}. Download them with\n"
            f"  wget {INCEPTION_WEIGHTS_URL} -O <dir>/{INCEPTION_WEIGHTS_FILE}\n"
            f"and set decode.quality.fid_weights=<dir>/{INCEPTION_WEIGHTS_FILE} "
            "(or decode.quality.reference_dir=null to skip FID)"
        )
    return path


def _clip_help(path: str | Path) -> str:
    return (
        f"Download a CLIP model with\n  huggingface-cli download {CLIP_DEFAULT} --local-dir <dir>\n"
        f"and set decode.quality.clip=<dir> (or decode.quality.clip=null to skip the CLIP score); got {path}"
    )


class CLIPFeatures(nn.Module):
    """A `CLIPModel` whose feature getters return tensors.

    transformers 5 returns a `BaseModelOutputWithPooling` from ``get_image_features`` /
    ``get_text_features`` (the projected embedding in ``pooler_output``); torchmetrics 1.9's
    `CLIPScore` expects the tensor itself.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.config = model.config

    @staticmethod
    def _tensor(output) -> torch.Tensor:
        return output if isinstance(output, torch.Tensor) else output.pooler_output

    def get_image_features(self, *args, **kwargs) -> torch.Tensor:
        """(B, 3, h, w) CLIP pixel values -> (B, projection_dim)."""
        return self._tensor(self.model.get_image_features(*args, **kwargs))

    def get_text_features(self, *args, **kwargs) -> torch.Tensor:
        """(B, L) input ids (and attention mask) -> (B, projection_dim)."""
        return self._tensor(self.model.get_text_features(*args, **kwargs))


def load_clip(path: str | Path) -> tuple[CLIPFeatures, object]:
    """(model, processor) of the CLIP model saved (``save_pretrained``) in the local directory `path`."""
    from transformers import CLIPModel, CLIPProcessor

    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise QualitySetupError(f"no CLIP model at {directory} (config.json missing). " + _clip_help(path))
    try:
        model = CLIPModel.from_pretrained(directory, local_files_only=True)
        processor = CLIPProcessor.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as error:
        raise QualitySetupError(
            f"could not load the CLIP model at {directory} ({error}). " + _clip_help(path)
        ) from error
    return CLIPFeatures(model.eval().requires_grad_(False)), processor


def reference_image_files(directory: str | Path, limit: int | None = None) -> list[Path]:
    """The image files (png/jpg/jpeg/webp/bmp) under `directory`, recursively, sorted, at most `limit`."""
    root = Path(directory)
    if not root.is_dir():
        raise QualitySetupError(
            f"FID reference folder {root} does not exist; set decode.quality.reference_dir to a "
            "folder of real images (e.g. ImageNet val for LlamaGen, COCO val for text-to-image), "
            "or decode.quality.reference_dir=null to skip FID"
        )
    files = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if len(files) < 2:
        raise QualitySetupError(
            f"FID needs at least 2 reference images, found {len(files)} in {root} (suffixes {sorted(IMAGE_SUFFIXES)})"
        )
    return files[:limit] if limit else files


def load_reference_images(files: list[Path], height: int, width: int) -> torch.Tensor:
    """Images as (N, 3, height, width) floats in [0, 1]: RGB, shorter side resized, centre-cropped."""
    from PIL import Image

    out = torch.empty(len(files), 3, height, width)
    for index, file in enumerate(files):
        with Image.open(file) as image:
            image = image.convert("RGB")
            scale = max(height / image.height, width / image.width)
            size = (max(width, round(image.width * scale)), max(height, round(image.height * scale)))
            image = image.resize(size, Image.BICUBIC)
            left, top = (image.width - width) // 2, (image.height - height) // 2
            image = image.crop((left, top, left + width, top + height))
            array = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(height, width, 3)
        out[index] = array.permute(2, 0, 1).float() / 255  # (3, H, W)
    return out


def _rgb(images: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) in [0, 1] -> (N, 3, H, W) float: grey images are repeated over the channels."""
    images = images.float().clamp(0, 1)
    return images.expand(-1, 3, -1, -1) if images.shape[1] == 1 else images


class RealQuality:
    """FID against reference images and/or CLIP score against prompts, for generated (N, C, H, W) images.

    Build it before generating: missing weights, packages or reference images raise
    `QualitySetupError` here. Reference features are computed once, at the first call
    (when the generated resolution is known), and reused for every method.
    """

    def __init__(
        self,
        reference_dir: str | Path | None = None,
        fid_features: nn.Module | str | None = "inception",
        fid_weights: str | Path | None = None,
        clip: str | Path | None = None,
        max_reference_images: int | None = None,
        batch_size: int = 32,
        device: str | torch.device = "cpu",
    ):
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.fid = self.clip = None
        self.reference_files: list[Path] = []
        self._reference_size: tuple[int, int] | None = None
        if reference_dir is not None:
            self.reference_files = reference_image_files(reference_dir, max_reference_images)
            inception = fid_features is None or fid_features == "inception"
            weights = inception_weights_path(fid_weights) if inception else None
            try:
                from torchmetrics.image.fid import FrechetInceptionDistance
            except ImportError as error:  # torch-fidelity installed without torchvision breaks this import
                raise QualitySetupError(
                    f"torchmetrics' FID cannot be imported ({error}); pip install torch-fidelity "
                    "torchvision, or pip uninstall torch-fidelity to use your own features"
                ) from error
            if inception:
                self.fid = FrechetInceptionDistance(
                    feature=2048, normalize=True, reset_real_features=False, feature_extractor_weights_path=str(weights)
                )
            elif isinstance(fid_features, nn.Module):
                fid_features = fid_features.eval().requires_grad_(False)
                self.fid = FrechetInceptionDistance(
                    feature=fid_features, normalize=True, reset_real_features=False, input_img_size=(3, 64, 64)
                )
            else:
                raise ValueError(
                    f"decode.quality.fid_features must be 'inception' or an nn.Module, got {fid_features!r}"
                )
            self.fid = self.fid.to(self.device)
        if clip is not None:
            from torchmetrics.multimodal.clip_score import CLIPScore

            model, processor = load_clip(clip)
            self.clip = CLIPScore(model_name_or_path=lambda: (model, processor)).to(self.device)

    @property
    def measures(self) -> list[str]:
        """The metrics this instance computes, by their metrics.json key."""
        return [name for name, metric in (("fid", self.fid), ("clip_score", self.clip)) if metric is not None]

    def _update_reference(self, height: int, width: int) -> None:
        if self._reference_size == (height, width):
            return
        if self._reference_size is not None:  # another resolution: the reference statistics must be redone
            self.fid.reset_real_features = True
            self.fid.reset()
            self.fid.reset_real_features = False
        for start in range(0, len(self.reference_files), self.batch_size):
            chunk = load_reference_images(self.reference_files[start : start + self.batch_size], height, width)
            self.fid.update(chunk.to(self.device), real=True)
        self._reference_size = (height, width)
        log.info(
            "FID reference: %d images from %s at %dx%d",
            len(self.reference_files),
            self.reference_files[0].parent,
            height,
            width,
        )

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str] | None = None) -> dict:
        """images (N, C, H, W) in [0, 1] (and their N prompts) -> {"fid": ..., "clip_score": ...} for those measured.

        The CLIP score is skipped (absent) when no prompts are given (class-conditional models).
        """
        images = _rgb(images)
        result = {}
        if self.fid is not None:
            if len(images) < 2:
                raise ValueError("FID needs at least 2 generated images; raise decode.num_images")
            self._update_reference(images.shape[2], images.shape[3])
            self.fid.reset()  # keeps the reference features (reset_real_features=False)
            for start in range(0, len(images), self.batch_size):
                self.fid.update(images[start : start + self.batch_size].to(self.device), real=False)
            result["fid"] = float(self.fid.compute())
        if self.clip is not None and prompts is not None:
            if len(prompts) != len(images):
                raise ValueError(f"{len(images)} images but {len(prompts)} prompts for the CLIP score")
            self.clip.reset()
            pixels = (images * 255).round().to(torch.uint8)  # CLIP's processor rescales from [0, 255]
            for start in range(0, len(images), self.batch_size):
                self.clip.update(
                    list(pixels[start : start + self.batch_size].to(self.device)),
                    prompts[start : start + self.batch_size],
                )
            result["clip_score"] = float(self.clip.compute())
        return result
