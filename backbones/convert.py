"""Published checkpoints -> the layout an adapter loads: ``python -m backbones.convert lumina RELEASED OUT``.

Only Lumina-mGPT needs it (docs/backbones.md has every adapter's published format). Its releases
(Alpha-VLLM/Lumina-mGPT-7B-768, -7B-512, -7B-1024, -7B-768-Omni, -34B-512) are safetensors written by
``save_pretrained`` of ``ChameleonXLLMXForConditionalGeneration`` (Lumina-mGPT's
``lumina_mgpt/model/modeling_xllmx_chameleon.py``), a training wrapper over Lumina-mGPT's own copy of
transformers' first Chameleon code (``lumina_mgpt/model/chameleon/modeling_chameleon.py``). The key
names are transformers' Chameleon names, the forward is the same, and two things differ from what
today's ``ChameleonForConditionalGeneration`` loads:

- q/k norms: ``model.layers.N.self_attn.{q,k}_norm.{weight,bias}`` are (model_parallel_size, head_dim),
  one row per model-parallel rank of Meta's training, each applied to all of that rank's heads
  (Lumina-mGPT's ``ChameleonLayerNorm``: statistics over head_dim, then the rank's row repeated with
  ``repeat_interleave(heads // model_parallel_size)``). transformers holds one row per head,
  (num_attention_heads, head_dim) and (num_key_value_heads, head_dim), applied the same way, so
  repeating each rank's row for its heads computes the same function. (The rotary reordering of
  head_dim was done when Meta's weights became these files; nothing is permuted here.)
- no VQ-VAE: Lumina-mGPT's ``finetune_solver.py`` deletes ``model.vqmodel`` before fine-tuning, so the
  releases have no ``model.vqmodel.*``. transformers would initialise it at random with only a
  warning, which breaks `codebook_latents` (LANTERN, relaxed SSD, MuLo-SD) and `pixels_to_tokens`
  without an error. `--vqgan` supplies it: Meta's Chameleon tokenizer checkpoint ``vqgan.ckpt`` (the
  file Lumina-mGPT's README also asks for, as ``ckpts/chameleon/tokenizer/vqgan.ckpt``; its
  ``state_dict`` keys are the module names under ``model.vqmodel.``) or a transformers Chameleon
  checkpoint directory (e.g. facebook/chameleon-7b).

Every other tensor is copied unchanged (shard by shard, so one shard at a time is in memory), the
config's architecture becomes ``ChameleonForConditionalGeneration`` (the training-only
``z_loss_weight`` is dropped), and the other files (tokenizer, generation config) are copied. The
output is written to a temporary directory beside OUT, checked (every tensor the transformers model
expects, with its shape; the q/k norms and VQ tensors read back) and renamed to OUT only then: an
interrupted or failed conversion leaves no OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
VQ_FILE = "model-vqmodel.safetensors"  # the tensors `--vqgan` adds, in a shard of their own
VQ_PREFIX = "model.vqmodel."
LUMINA_TRAINING_ONLY = ("z_loss_weight",)  # ChameleonXLLMXConfig's own field (its training loss)


class ConversionError(ValueError):
    """A checkpoint that cannot be converted; the message names the problem and the way out."""


# ---- reading a release (headers only) -------------------------------------------------------


def _read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise ConversionError(
            f"no config.json in {directory}: give the directory `huggingface-cli download "
            "Alpha-VLLM/Lumina-mGPT-7B-768 --local-dir <dir>` wrote"
        )
    return json.loads(path.read_text())


def _weight_files(directory: Path) -> dict[str, list[str]]:
    """Safetensors file name -> the tensor names it holds (from the index, else the single file)."""
    from safetensors import safe_open

    if (directory / INDEX_FILE).is_file():
        weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
        files: dict[str, list[str]] = {}
        for key, name in weight_map.items():
            files.setdefault(name, []).append(key)
        absent = [name for name in files if not (directory / name).is_file()]
        if absent:
            raise ConversionError(
                f"{directory / INDEX_FILE} names {absent}, which are not in {directory}: the download is "
                "incomplete; run the same `huggingface-cli download` again (it resumes)"
            )
        return files
    if (directory / SINGLE_FILE).is_file():
        with safe_open(directory / SINGLE_FILE, "pt") as handle:
            return {SINGLE_FILE: list(handle.keys())}
    others = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    raise ConversionError(
        f"no {INDEX_FILE} or {SINGLE_FILE} in {directory}"
        + (f" (found {others}: not a Lumina-mGPT Hub release)" if others else "")
        + "; download the release with `huggingface-cli download Alpha-VLLM/Lumina-mGPT-7B-768 --local-dir <dir>`"
    )


def _shapes(directory: Path, files: dict[str, list[str]]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, read from the safetensors headers (no tensor data is loaded)."""
    from safetensors import safe_open

    shapes = {}
    for name in files:
        with safe_open(directory / name, "pt") as handle:
            shapes.update({key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()})
    return shapes


def _norm_heads(key: str, config: dict) -> int | None:
    """How many heads a q/k norm tensor serves (None: not a q/k norm)."""
    if ".self_attn.q_norm." in key:
        return int(config["num_attention_heads"])
    if ".self_attn.k_norm." in key:
        return int(config.get("num_key_value_heads") or config["num_attention_heads"])
    return None


def lumina_release_problems(directory: str | Path) -> list[str]:
    """Why transformers' Chameleon cannot load `directory` as it is (empty: nothing found).

    Reads config.json and the safetensors headers only. The adapter's loader calls it to refuse a
    release before transformers would fail on the norms or fill the VQ-VAE with random weights.
    """
    directory = Path(directory)
    try:
        config = _read_config(directory)
        files = _weight_files(directory)
    except ConversionError:
        return []  # not a safetensors checkpoint at all: transformers' own error says more
    shapes = _shapes(directory, files)
    problems = []
    per_rank = sorted(
        {
            f"{key.split('.self_attn.')[1].split('.')[0]} {shape[0]} rows"
            for key, shape in shapes.items()
            if (heads := _norm_heads(key, config)) is not None and shape[0] != heads
        }
    )
    if per_rank:
        problems.append(
            f"its q/k norms hold one row per model-parallel rank ({', '.join(per_rank)}; "
            f"model_parallel_size={config.get('model_parallel_size')}), transformers wants one per head"
        )
    if not any(key.startswith(VQ_PREFIX) for key in shapes):
        problems.append("it has no VQ-VAE weights (model.vqmodel.*; transformers would make them up at random)")
    return problems


# ---- the plan: everything checked before anything is written --------------------------------


@dataclass
class LuminaPlan:
    """What the conversion of one release will do, checked against the transformers model."""

    released: Path
    config: dict  # the output's config.json
    files: dict[str, list[str]]  # the release's safetensors file -> tensor names
    repeats: dict[str, int]  # q/k norm tensor -> heads per rank (repeat_interleave count)
    expected: dict[str, tuple[int, ...]]  # every tensor of ChameleonForConditionalGeneration, its shape
    vq: dict[str, torch.Tensor] = field(default_factory=dict)  # model.vqmodel.* from --vqgan
    vq_source: str | None = None
    notes: list[str] = field(default_factory=list)


def _transformers_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The tensor names and shapes transformers' ChameleonForConditionalGeneration has for `config`."""
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    with torch.device("meta"):
        model = ChameleonForConditionalGeneration(ChameleonConfig.from_dict(config))
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


def _listed(items, limit: int = 4) -> str:
    items = list(items)
    return ", ".join(str(i) for i in items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def plan_lumina_conversion(released: str | Path, vqgan: str | Path | None = None, trust_pickle: bool = False):
    """Check a Lumina-mGPT release (and `vqgan`) against transformers' Chameleon; a `LuminaPlan` or an error."""
    released = Path(released)
    if not released.is_dir():
        raise ConversionError(
            f"{released} is not a directory; download the release first: "
            f"`huggingface-cli download Alpha-VLLM/Lumina-mGPT-7B-768 --local-dir {released}`"
        )
    source_config = _read_config(released)
    if source_config.get("model_type") != "chameleon":
        raise ConversionError(
            f"{released}/config.json has model_type={source_config.get('model_type')!r}, not 'chameleon': "
            "this is not a Lumina-mGPT release (Alpha-VLLM/Lumina-mGPT-7B-768 and its siblings)"
        )
    config = {k: v for k, v in source_config.items() if k not in LUMINA_TRAINING_ONLY}
    config["architectures"] = ["ChameleonForConditionalGeneration"]
    files = _weight_files(released)
    shapes = _shapes(released, files)
    expected = _transformers_shapes(config)

    ranks = int(source_config.get("model_parallel_size") or 1)
    repeats, wrong = {}, []
    for key, shape in shapes.items():
        want = expected.get(key)
        if want is None or shape == want:
            continue
        heads = _norm_heads(key, config)
        if heads is not None and shape == (ranks, *want[1:]) and heads % ranks == 0:
            repeats[key] = heads // ranks
        else:
            wrong.append(f"{key} {shape} (transformers: {want})")
    if wrong:
        raise ConversionError(
            f"{released}: tensors whose shape no conversion explains: {_listed(wrong)}; "
            f"config.json (heads, hidden size, model_parallel_size={ranks}) does not describe these weights. "
            "Re-download the release; if it is intact, this converter does not know its layout"
        )
    unexpected = sorted(set(shapes) - set(expected))
    if unexpected:
        raise ConversionError(
            f"{released} has tensors transformers' Chameleon does not: {_listed(unexpected)}; "
            "this is not a plain Lumina-mGPT text-to-image release"
        )
    missing = sorted(set(expected) - set(shapes))
    missing_vq = [key for key in missing if key.startswith(VQ_PREFIX)]
    if len(missing_vq) != len(missing):
        raise ConversionError(
            f"{released} lacks {_listed(k for k in missing if not k.startswith(VQ_PREFIX))}: "
            "the download is incomplete; run the same `huggingface-cli download` again (it resumes)"
        )

    plan = LuminaPlan(released, config, files, repeats, expected)
    if repeats:
        plan.notes.append(
            f"q/k norms: {len(repeats)} tensors from one row per rank (model_parallel_size={ranks}) to one per head"
        )
    if missing_vq and vqgan is None:
        raise ConversionError(
            f"{released} has no VQ-VAE weights (model.vqmodel.*: Lumina-mGPT's finetune_solver.py deletes "
            "them before training); pass --vqgan PATH with Meta's Chameleon tokenizer checkpoint vqgan.ckpt "
            "(Lumina-mGPT's README: ckpts/chameleon/tokenizer/vqgan.ckpt, from github.com/facebookresearch/"
            "chameleon) or a transformers Chameleon checkpoint directory (facebook/chameleon-7b)"
        )
    if vqgan is not None:
        if not missing_vq:
            raise ConversionError(f"{released} already has its VQ-VAE weights (model.vqmodel.*); drop --vqgan")
        wanted = {key: expected[key] for key in missing_vq}
        plan.vq, plan.vq_source = _vq_tensors(Path(vqgan), wanted, trust_pickle), str(vqgan)
        plan.notes.append(f"VQ-VAE: {len(plan.vq)} tensors from {vqgan}")
    if repeats or plan.vq:
        if not any(released.glob("tokenizer*")):
            plan.notes.append(
                "no tokenizer files: Condition(token_ids=...) works, prompts need tokenizer.json, "
                "tokenizer_config.json and special_tokens_map.json copied into the output from "
                "Alpha-VLLM/Lumina-mGPT-7B-768 (whose tokenizer Lumina-mGPT's item processor uses for every model)"
            )
    if not plan.notes:
        raise ConversionError(
            f"{released} is already in transformers' Chameleon layout; load it as it is (nothing to convert)"
        )
    return plan


def _vq_tensors(vqgan: Path, wanted: dict[str, tuple[int, ...]], trust_pickle: bool) -> dict[str, torch.Tensor]:
    """The ``model.vqmodel.*`` tensors from Meta's vqgan.ckpt or a transformers Chameleon directory."""
    from backbones.hf_loading import load_torch_checkpoint

    if vqgan.is_dir():
        from safetensors import safe_open

        found = {}
        for path in sorted(vqgan.glob("*.safetensors")):
            with safe_open(path, "pt") as handle:
                found.update({key: handle.get_tensor(key) for key in handle.keys() if key in wanted})
        what = "a transformers Chameleon checkpoint directory"
    elif vqgan.is_file():
        what = "Meta's Chameleon VQGAN checkpoint (vqgan.ckpt)"
        try:
            checkpoint = load_torch_checkpoint(
                vqgan, trust_pickle, what, "from Meta's Chameleon release (github.com/facebookresearch/chameleon)"
            )
        except RuntimeError as error:
            if "trust_pickle" in str(error):
                raise ConversionError(f"{error} (on this command line: --trust-pickle)") from error
            raise ConversionError(str(error)) from error
        state = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else None
        if not isinstance(state, dict):
            raise ConversionError(f"{vqgan} holds no state_dict; give Meta's Chameleon tokenizer vqgan.ckpt")
        found = {VQ_PREFIX + key: value for key, value in state.items() if VQ_PREFIX + key in wanted}
    else:
        raise ConversionError(
            f"--vqgan {vqgan} does not exist; give Meta's Chameleon tokenizer vqgan.ckpt or a transformers "
            "Chameleon checkpoint directory"
        )
    missing = sorted(set(wanted) - set(found))
    wrong = [
        f"{k} {tuple(v.shape)} (config.json's vq_config: {wanted[k]})"
        for k, v in found.items()
        if tuple(v.shape) != wanted[k]
    ]
    if missing or wrong:
        raise ConversionError(
            f"{vqgan} ({what}) does not match the release's VQ-VAE: "
            + (f"missing {_listed(missing)}" if missing else "")
            + ("; " if missing and wrong else "")
            + (f"shapes {_listed(wrong)}" if wrong else "")
            + "; give Chameleon's own tokenizer vqgan.ckpt (the one Lumina-mGPT's README names)"
        )
    return {key: value.contiguous() for key, value in found.items()}


# ---- writing and checking ---------------------------------------------------------------------


def _durable(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def _write_lumina(plan: LuminaPlan, out: Path) -> dict[str, str]:
    """Write the converted checkpoint into `out` (an empty directory); the weight map written."""
    from safetensors.torch import load_file, save_file

    weight_map, total = {}, 0
    for number, (name, keys) in enumerate(plan.files.items(), start=1):
        print(f"converting {name} ({number}/{len(plan.files)})", flush=True)
        tensors = load_file(plan.released / name, device="cpu")  # one shard in memory at a time
        for key in keys:
            if key in plan.repeats:  # (ranks, head_dim) -> (heads, head_dim): each rank's row for its heads
                tensors[key] = tensors[key].repeat_interleave(plan.repeats[key], dim=0).contiguous()
        save_file(tensors, out / name, metadata={"format": "pt"})
        _durable(out / name)
        weight_map.update({key: name for key in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    if plan.vq:
        save_file(plan.vq, out / VQ_FILE, metadata={"format": "pt"})
        _durable(out / VQ_FILE)
        weight_map.update({key: VQ_FILE for key in plan.vq})
        total += sum(t.numel() * t.element_size() for t in plan.vq.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(plan.config, indent=2) + "\n")
    note = {"converted_by": "python -m backbones.convert lumina", "source": str(plan.released)}
    note.update(changes=plan.notes, vqgan=plan.vq_source)
    (out / "conversion.json").write_text(json.dumps(note, indent=2) + "\n")
    for path in sorted(plan.released.iterdir()):  # tokenizer, generation config, model card
        skip = path.name.startswith(".") or path.suffix == ".safetensors" or path.name in (INDEX_FILE, "config.json")
        if path.is_file() and not skip:
            shutil.copy2(path, out / path.name)
    for path in out.iterdir():
        _durable(path)
    return weight_map


def _verify_lumina(plan: LuminaPlan, out: Path) -> None:
    """Read the written checkpoint back: the tensors transformers expects, their shapes, the changed values."""
    from safetensors import safe_open
    from transformers import ChameleonConfig

    config = ChameleonConfig.from_pretrained(out)
    if config.architectures != ["ChameleonForConditionalGeneration"]:
        raise ConversionError(f"verification: {out}/config.json names {config.architectures}")
    files = _weight_files(out)
    shapes = _shapes(out, files)
    if set(shapes) != set(plan.expected):
        extra, absent = sorted(set(shapes) - set(plan.expected)), sorted(set(plan.expected) - set(shapes))
        raise ConversionError(f"verification: written tensors differ from transformers': +{extra} -{absent}")
    wrong = [key for key, shape in shapes.items() if shape != plan.expected[key]]
    if wrong:
        raise ConversionError(f"verification: written shapes differ from transformers': {_listed(wrong)}")
    for name, keys in plan.files.items():  # the changed tensors, and each shard's first tensor, read back
        with safe_open(plan.released / name, "pt") as source, safe_open(out / name, "pt") as written:
            for key in [k for k in keys if k in plan.repeats] + keys[:1]:
                want = source.get_tensor(key).repeat_interleave(plan.repeats.get(key, 1), dim=0)
                if not torch.equal(written.get_tensor(key), want):
                    raise ConversionError(f"verification: {key} in {out / name} is not what was meant to be written")
    if plan.vq:
        with safe_open(out / VQ_FILE, "pt") as written:
            if any(not torch.equal(written.get_tensor(k), v) for k, v in plan.vq.items()):
                raise ConversionError(f"verification: {out / VQ_FILE} does not hold the --vqgan tensors")


def convert_lumina(
    released: str | Path, out: str | Path, vqgan: str | Path | None = None, trust_pickle: bool = False
) -> Path:
    """Convert a Lumina-mGPT release into a directory `load_lumina_backbone` (and transformers) loads.

    Everything is checked before a byte is written; the output appears at `out` only once written and
    read back (a temporary directory beside it is renamed), and an existing `out` is never touched.
    """
    plan = plan_lumina_conversion(released, vqgan, trust_pickle)
    out = Path(out)
    if out.exists():
        raise ConversionError(f"{out} exists; remove it or give another output directory (nothing is overwritten)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".converting", dir=out.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide the weights from colleagues
        _write_lumina(plan, tmp)
        _verify_lumina(plan, tmp)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after the rename
    for line in plan.notes:
        print(line)
    print(f"wrote {out}: load it with backbone.path={out}")
    return out


# ---- command line -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backbones.convert", description=__doc__.split("\n\n")[0])
    families = parser.add_subparsers(dest="family", required=True)
    lumina = families.add_parser("lumina", help="a Lumina-mGPT Hub release -> transformers' Chameleon layout")
    lumina.add_argument("released", type=Path, help="the downloaded release (huggingface-cli download ...)")
    lumina.add_argument("out", type=Path, help="the new directory to write (must not exist)")
    lumina.add_argument(
        "--vqgan",
        type=Path,
        help="Meta's Chameleon tokenizer vqgan.ckpt, or a transformers Chameleon checkpoint directory "
        "(the releases have no VQ-VAE)",
    )
    lumina.add_argument(
        "--trust-pickle", action="store_true", help="read --vqgan with full unpickling (only a file you trust)"
    )
    args = parser.parse_args(argv)
    try:
        convert_lumina(args.released, args.out, args.vqgan, args.trust_pickle)
    except ConversionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
