"""Export trained draft heads as safetensors + config, and load them back with a compatibility check.

An export is a directory holding

- ``heads.safetensors``: the trainable parameters only, with the full config
  embedded in the file's metadata, so that one atomic rename publishes weights
  and config together (an interrupted export leaves the previous one loadable);
- ``heads.json``: the same config, for people and other tools to read.

The config records the head kind and hyperparameters, the dtype, and the
backbone's identity (name, hidden size, codebook size, geometry, weights
fingerprint). `load_heads` refuses heads whose backbone does not match.

Use from your own inference script::

    from heads.export import load_heads
    heads = load_heads("checkpoints/ssd_digits", backbone)
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from common.atomic_io import atomic_save_safetensors, atomic_write_text, remove_leftover_temporaries
from common.paths import PROJECT_ROOT
from heads.cspd import ContinuousRowHeads, CSpDDrafter, CSpDDrafterConfig
from heads.eagle import EagleHead, EagleHeadConfig
from heads.mulo import MuLoDrafter, MuLoDrafterConfig
from heads.ssd import SSDHeadConfig, SSDHeads

HEADS_FILE = "heads.safetensors"
CONFIG_FILE = "heads.json"
FORMAT_VERSION = 1
# kind -> (module class, config class); a new head family registers here.
HEAD_KINDS: dict[str, tuple[type[nn.Module], type]] = {
    "ssd": (SSDHeads, SSDHeadConfig),
    "mulo": (MuLoDrafter, MuLoDrafterConfig),
    "eagle": (EagleHead, EagleHeadConfig),
    "cspd": (CSpDDrafter, CSpDDrafterConfig),
    "cspd_rows": (ContinuousRowHeads, SSDHeadConfig),
}
HIDDEN_STATE_KINDS = frozenset({"ssd", "eagle", "cspd_rows"})  # heads that run on the backbone's hidden states


class HeadsMismatchError(ValueError):
    """Heads were trained for another backbone, geometry or vocabulary."""


def export_heads(heads: nn.Module, directory: str | Path, backbone_identity: dict, extra: dict | None = None) -> Path:
    """Write `heads` (trainable parameters only) and their config into `directory`; return the directory."""
    directory = Path(directory)
    tensors = {name: p.detach().cpu().contiguous() for name, p in heads.named_parameters() if p.requires_grad}
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    config = {
        "format_version": FORMAT_VERSION,
        "kind": heads.kind,
        "head": heads.config.to_dict(),
        "dtype": dtype,
        "backbone": backbone_identity,
        **(extra or {}),
    }
    text = json.dumps(config, indent=2) + "\n"
    for name in (HEADS_FILE, CONFIG_FILE):  # an export killed mid-write left its temporary files here
        remove_leftover_temporaries(directory / name)
    atomic_save_safetensors(tensors, directory / HEADS_FILE, metadata={"config": text})
    atomic_write_text(directory / CONFIG_FILE, text)
    return directory


# The digits experiment that trains each kind of export: named when an export is missing from a directory that is
# not an experiment's own (each experiment exports to checkpoints/<experiment_name>, conf/config.yaml's export.dir).
DIGITS_EXPERIMENTS = {
    "ssd": "ssd_digits",
    "mulo": "mulo_digits",
    "eagle": "eagle_digits",
    "cspd": "cspd_digits",
    "cspd_rows": "cspd_rows_digits",
}


def training_command(experiment: str) -> str:
    """The command that runs `experiment` (the default job, ssd_digits, needs no +experiment)."""
    return "python -m train" if experiment == "ssd_digits" else f"python -m train +experiment={experiment}"


def training_advice(directory: Path, kind: str | None = None, setting: str = "the setting") -> str:
    """How to make the export `directory` should hold: the experiment of the same name (a training exports to
    checkpoints/<experiment_name>); else, for a known `kind`, the digits experiment that trains it, told to export
    there; else any training pointed at it. `setting`: what the user can point at another export instead."""
    experiment = directory.name
    if (PROJECT_ROOT / "conf" / "experiment" / f"{experiment}.yaml").is_file():
        return (
            f"train it first (`{training_command(experiment)}`, which exports there) or point {setting} at another "
            "export directory"
        )
    if kind in DIGITS_EXPERIMENTS:
        return (
            f"train it first (`{training_command(DIGITS_EXPERIMENTS[kind])} export.dir={directory}` for the digits "
            f"backbone; for another backbone, its own experiment with the same export.dir) "
            f"or point {setting} at an export directory"
        )
    return (
        f"train heads first (`python -m train +experiment=NAME export.dir={directory}`) or point {setting} at an "
        "export directory"
    )


def read_heads_config(directory: str | Path, kind: str | None = None) -> dict:
    """The config embedded in an export (the authoritative copy, written with the weights). `kind`: the kind of
    export expected there, for the advice when there is none."""
    path = Path(directory) / HEADS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no exported heads at {path}; {training_advice(Path(directory), kind)}")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except (SafetensorError, OSError) as error:
        raise ValueError(
            f"{path} is not a readable safetensors file ({error}); it may be truncated: re-export it"
        ) from error
    if "config" not in metadata:
        raise ValueError(f"{path} carries no head config in its metadata: it was not written by heads.export")
    return json.loads(metadata["config"])


def check_compatible(config: dict, backbone_identity: dict, where: str) -> None:
    """Raise HeadsMismatchError when heads do not fit the backbone; warn when only its weights differ."""
    trained_for = config["backbone"]
    problems = []
    for key in ("hidden_size", "codebook_size", "token_dim", "geometry"):
        if trained_for.get(key) != backbone_identity.get(key):
            problems.append(f"{key}: heads {trained_for.get(key)}, backbone {backbone_identity.get(key)}")
    if trained_for.get("family") != backbone_identity.get("family"):
        problems.append(f"family: heads {trained_for.get('family')}, backbone {backbone_identity.get('family')}")
    if problems:
        raise HeadsMismatchError(
            f"the heads at {where} were trained for {trained_for.get('name')!r}, not for this backbone "
            f"{backbone_identity.get('name')!r} ({'; '.join(problems)}). Train heads for this backbone "
            "(python -m train +experiment=...) or load the backbone they were trained on."
        )
    if trained_for.get("weights_fingerprint") != backbone_identity.get("weights_fingerprint"):
        warnings.warn(
            f"the heads at {where} were trained on other weights of {trained_for.get('name')!r} "
            "(fingerprint differs): exact decoding stays lossless, but acceptance may be lower",
            stacklevel=3,
        )


def load_heads(
    directory: str | Path, backbone=None, device: str | torch.device = "cpu", kind: str | None = None
) -> nn.Module:
    """Load exported heads, frozen and in eval mode; with `backbone`, check that they belong to it.

    `kind` ("ssd", "mulo", "eagle", "cspd") refuses an export of another kind. A MuLo drafter records its
    backbone's grid, r, codebook and conditioning (``head`` in heads.json) and is bound to `backbone`.
    """
    directory = Path(directory)
    config = read_heads_config(directory, kind)
    if config.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{directory} has head format {config.get('format_version')}, this code reads {FORMAT_VERSION}"
        )
    if kind is not None and config["kind"] != kind:
        raise ValueError(
            f"{directory} holds {config['kind']!r} heads, but {kind!r} heads are needed here; "
            "point decode.heads / decode.mulo.drafter at the right export"
        )
    if config["kind"] not in HEAD_KINDS:
        raise ValueError(f"{directory} holds heads of unknown kind {config['kind']!r}; known: {sorted(HEAD_KINDS)}")
    if backbone is not None:
        check_compatible(config, backbone.identity(), str(directory))
    module_class, config_class = HEAD_KINDS[config["kind"]]
    head_config = config_class(**config["head"])
    with safe_open(str(directory / HEADS_FILE), framework="pt", device="cpu") as handle:
        # The embedded config is untrusted: compare the shapes it implies (on the meta device, nothing
        # allocated) with the stored tensors' before building anything.
        _check_shapes(directory, module_class, head_config, {n: handle.get_slice(n).get_shape() for n in handle.keys()})
        heads = module_class(head_config)
        state = {name: handle.get_tensor(name) for name in handle.keys()}
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{directory}: tensor {name!r} holds NaN or infinite values; re-export the heads")
    heads.load_state_dict(state, strict=True)
    if backbone is not None and isinstance(heads, (MuLoDrafter, CSpDDrafter)):
        # The drafter's own record (grid, r, codebook, conditioning; CSpD: token size and diffusion steps) must fit
        # too; a MuLo drafter's bind also attaches the backbone whose prompt embeddings condition a prompt drafter.
        try:
            heads.bind(backbone)
        except ValueError as error:
            raise HeadsMismatchError(f"{directory}: {error}") from error
    if backbone is not None and config["kind"] in HIDDEN_STATE_KINDS:
        # They read the backbone's hidden states and hand theirs to its image head: in its dtype (bf16 for the real
        # backbones; trained in float32 or bf16-mixed, whose weights are float32).
        heads = heads.to(next(backbone.parameters()).dtype)
    return heads.to(device).eval().requires_grad_(False)


def _check_shapes(directory: Path, module_class, head_config, stored: dict[str, list[int]]) -> None:
    """Refuse an export whose config does not describe its tensors (names and shapes), naming the first."""
    try:
        with torch.device("meta"):
            expected = {name: list(t.shape) for name, t in module_class(head_config).state_dict().items()}
    except (RuntimeError, ValueError, OverflowError) as error:  # e.g. a width too large to describe
        raise ValueError(
            f"{directory}: the config embedded in {HEADS_FILE} describes heads that cannot be built "
            f"({str(error).splitlines()[0]}); re-export the heads"
        ) from None
    missing, unexpected = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{directory}: {HEADS_FILE} does not match heads.json (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}); re-export the heads"
        )
    for name, shape in expected.items():
        if list(stored[name]) != shape:
            raise ValueError(
                f"{directory}: tensor {name!r} has shape {list(stored[name])} but heads.json describes {shape}; "
                "re-export the heads"
            )
