"""Loading frozen transformers models from local weights, shared by the transformers-based adapters."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch


def require_weights(path: str | Path, model_id: str, how_to_get: str | None = None) -> Path:
    """The weights directory, or a FileNotFoundError naming the model id and how to get the weights."""
    directory = Path(path)
    if not (directory / "config.json").is_file():
        how_to_get = how_to_get or (f"get them with `huggingface-cli download {model_id} --local-dir {directory}`")
        raise FileNotFoundError(
            f"no weights of {model_id} at {directory} (expected config.json and safetensors "
            f"in transformers format); {how_to_get}"
        )
    return directory


def require_model_type(directory: Path, model_type: str, model_id: str, original: str) -> None:
    """Refuse a weights directory whose config.json names another model type, before any weights load.

    The authors' own releases of Emu3 and Janus-Pro (`original`) are remote-code models of another type;
    transformers would build a default-shaped model with random weights and fail only later, on a missing
    config field. The error names the transformers conversion (`model_id`) to download instead.
    """
    import json

    try:
        found = json.loads((directory / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as error:
        raise ValueError(f"{directory / 'config.json'} is not a readable JSON config ({error})") from error
    if found != model_type:
        raise ValueError(
            f"{directory} holds a {found!r} model (config.json model_type), not transformers' {model_type!r}; "
            f"{original}'s own release is not in transformers format: download its conversion with "
            f"`huggingface-cli download {model_id} --local-dir <dir>` and give path=<dir>"
        )


def load_pretrained(model_class, directory: Path, dtype: str | torch.dtype, trust_remote_code: bool = False):
    """`model_class.from_pretrained` in the given dtype; remote code runs only when the config opts in."""
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return model_class.from_pretrained(directory, dtype=torch_dtype, trust_remote_code=trust_remote_code)


def load_processor(directory: Path, trust_remote_code: bool = False):
    """The model's processor (tokenizer), or None when the directory has no tokenizer files."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):  # token_ids conditions still work without it
        return None


def display_name(directory: Path, model_id: str) -> str:
    """The model id when the folder is named after it, else the path (shown in errors, stored with heads)."""
    return model_id if directory.name in model_id else str(directory)


def positional_arguments(
    rows: int, slots: torch.Tensor, visible: torch.Tensor, positions: torch.Tensor | None = None
) -> dict:
    """A transformers model's arguments for a position-addressed pass (ZipAR's `ARImageBackbone.step_at`, a token
    tree's `step_tree`, a ragged pass's `step_ragged`): position ids = `positions` (T,) for every row, or (rows,
    T) row by row (default: the cache slots), and `visible` (T, capacity), or (rows, T, capacity), as a 4D mask
    (used as is)."""
    positions = slots if positions is None else positions
    return {
        "position_ids": positions[None].expand(rows, -1) if positions.dim() == 1 else positions,
        "attention_mask": visible[None, None].expand(rows, 1, -1, -1) if visible.dim() == 2 else visible[:, None],
    }


def load_torch_checkpoint(path: Path, trust_pickle: bool, what: str, redownload: str) -> dict:
    """A .pth/.pt file's contents, read with ``weights_only=True`` unless `trust_pickle` (LlamaGen, MAR).

    Only the weights-only loader's own refusal (the file pickles more than
    tensors) suggests `trust_pickle`; any other failure means the file is
    damaged (a truncated download) or not `what`, which no unsafe loading would
    fix: `damaged_checkpoint` says so and how to download it again.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except pickle.UnpicklingError as error:
        if not trust_pickle and "Weights only load failed" in str(error):
            raise RuntimeError(
                f"{path} holds more than tensors and cannot be read with weights_only=True; "
                "if you trust the file, pass trust_pickle=true"
            ) from error
        raise damaged_checkpoint(path, error, what, redownload) from error
    except (RuntimeError, EOFError, OSError, ValueError) as error:
        raise damaged_checkpoint(path, error, what, redownload) from error


def damaged_checkpoint(path: Path, error: Exception, what: str, redownload: str) -> RuntimeError:
    """The error for a file that is truncated or not `what`; `redownload` ends it (where to get it again)."""
    return RuntimeError(
        f"{path} is damaged or not {what} ({type(error).__name__}: {str(error).splitlines()[0]}); "
        f"download it again {redownload}"
    )


def load_safetensors_checkpoint(path: Path, what: str, redownload: str) -> dict:
    """A .safetensors file's tensors on the CPU; a truncated or foreign file is `damaged_checkpoint`'s error."""
    from safetensors.torch import load_file

    try:
        return load_file(path, device="cpu")
    except Exception as error:  # safetensors raises its own error types for truncated or foreign files
        raise damaged_checkpoint(path, error, what, redownload) from error
