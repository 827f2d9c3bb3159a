"""The method registry: names bound to a generator and its settings in configuration, no name parsing.

A method is a preset under ``decode.presets`` (one file per preset in
conf/method/, composed by conf/decode/default.yaml), for example::

    # conf/method/ssd_autocorrect.yaml
    generator: decode.ssd        # the generator module; it declares METHOD (decode/method.py)
    heads: ${decode.heads}       # the export it loads (METHOD.artefact names this key)
    mode: autocorrect            # every other key is a field of the module's settings dataclass
    rounds: 1

``decode.methods=[ar,ssd_exact]`` chooses presets; ``decode.presets.ssd_exact.window=4``
overrides a setting; ``+method@decode.presets.ssd_r4=ssd_autocorrect
decode.presets.ssd_r4.rounds=4`` adds a second preset of one method to run beside
the first. Every chosen preset is checked (its generator, unknown keys, types,
ranges) before any export is loaded or any image generated.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from backbones.base import ARImageBackbone, Condition
from decode.method import MethodSpec
from decode.result import GenerationResult
from decode.sampling import SamplingConfig
from decode.settings import settings_from

log = logging.getLogger(__name__)
BASELINE = "ar"


@dataclass
class Method:
    """A preset ready to run: its generator, checked settings and loaded export."""

    name: str
    generator: str  # the module path, e.g. decode.ssd
    spec: MethodSpec
    settings: Any
    artefact_path: str | None = None
    artefact: Any = None

    def generate(
        self,
        backbone: ARImageBackbone,
        condition: Condition,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        slots: int | None = None,
    ) -> GenerationResult:
        """Generate the condition's images; `slots`: a continuous-batching method whose settings leave its slots
        to the run (``slots: 0``) decodes that many images at once over the condition's queue."""
        settings = self.settings
        if slots and self.spec.continuous and not settings.slots:
            settings = dataclasses.replace(settings, slots=slots)
        return self.spec.generate(backbone, self.artefact, condition, sampling, generator, settings)

    @property
    def lossless(self) -> bool:
        return bool(self.spec.lossless(self.settings))

    def describe(self) -> dict:
        """What metrics.json records of the method: its generator, whether it is lossless, every setting."""
        return {
            "generator": self.generator,
            "lossless": self.lossless,
            "settings": vars(self.settings),
            **({self.spec.artefact: self.artefact_path} if self.spec.artefact else {}),
        }


def chosen_names(decode_cfg: DictConfig) -> list[str]:
    """`decode.methods` as a list of preset names, the baseline first (added when missing), duplicates dropped."""
    names = decode_cfg.methods
    if isinstance(names, str) or not isinstance(names, (list, ListConfig)):
        raise ValueError(
            f"decode.methods must be a list of preset names, e.g. decode.methods=[ar,ssd_exact]; got {names!r}"
        )
    names = [str(name) for name in dict.fromkeys(names)]
    if BASELINE not in names:
        log.info("adding the KV-cached baseline %r: every speedup is measured against it in the same run", BASELINE)
    return [BASELINE] + [name for name in names if name != BASELINE]


def check_methods(decode_cfg: DictConfig) -> list[Method]:
    """Every chosen preset, checked: its generator module exists and declares METHOD, its settings fit.

    Nothing is loaded yet (see `load_artefacts`).
    """
    presets = decode_cfg.get("presets") or {}
    methods = []
    for name in chosen_names(decode_cfg):
        if name not in presets:
            raise ValueError(
                f"unknown decode method {name!r}; the presets are {', '.join(sorted(presets))} "
                f"(conf/method/). A variant of one is a new preset: +method@decode.presets.{name}=<preset> "
                f"and decode.presets.{name}.<setting>=VALUE; several seeds: decode.seeds=N"
            )
        methods.append(_checked_method(name, presets[name]))
    return methods


def _checked_method(name: str, preset: DictConfig) -> Method:
    where = f"decode.presets.{name}"
    values = OmegaConf.to_container(preset, resolve=True)
    module_name = values.pop("generator", None)
    if not isinstance(module_name, str):
        raise ValueError(f"{where}.generator is missing: name the generator module, e.g. generator: decode.ssd")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise ValueError(f"{where}.generator: no generator module {module_name!r} ({error})") from None
    spec = getattr(module, "METHOD", None)
    if not isinstance(spec, MethodSpec):
        raise ValueError(f"{where}.generator: {module_name} declares no METHOD = MethodSpec(...) (decode/method.py)")
    artefact_path = None
    if spec.artefact is not None:
        artefact_path = values.pop(spec.artefact, None)
        if not artefact_path:
            # The preset usually reads a run-wide key (drafter: ${decode.mar_drafter}): name the key to set.
            raw = OmegaConf.to_container(preset, resolve=False).get(spec.artefact)
            key = raw[2:-1] if isinstance(raw, str) and raw.startswith("${") and raw.endswith("}") else None
            advice = f"set {key}=PATH (or {where}.{spec.artefact}=PATH)" if key else f"set {where}.{spec.artefact}=PATH"
            raise ValueError(f"{where}.{spec.artefact} is not set: give what {module_name} decodes with; {advice}")
    return Method(name, module_name, spec, settings_from(spec.settings, values, where), artefact_path)


def check_token_kinds(methods: list[Method], backbone) -> None:
    """Refuse a method whose generator speaks the other kind of tokens than the backbone (discrete/continuous)."""
    kind = getattr(backbone, "token_kind", "discrete")
    for method in methods:
        if method.spec.token_kind not in ("any", kind):
            raise ValueError(
                f"decode method {method.name!r} ({method.generator}) decodes {method.spec.token_kind} tokens, but "
                f"{backbone.name} has {kind} tokens; choose methods for it (continuous backbones: ar, cspd, "
                "cspd_ragged, cspd_relaxed, cspd_rows; masked (MAR): ar, cspd_mar, cspd_mar_reference, mar_grouped; "
                "discrete: ar, ssd_*, mulo*, sjd, gsd, zipar, eagle*, lantern)"
            )


def load_artefacts(methods: list[Method], backbone: ARImageBackbone) -> None:
    """Load each method's export (once per path), checked against the backbone (heads/export.py)."""
    from heads.export import load_heads, training_advice

    check_token_kinds(methods, backbone)
    device = next(backbone.parameters()).device
    loaded: dict[tuple[str, str], Any] = {}
    for method in methods:
        if method.spec.artefact is None:
            continue
        key = (str(method.artefact_path), method.spec.artefact_kind)
        if key not in loaded:
            load = method.spec.load_artefact or load_heads
            try:
                loaded[key] = load(method.artefact_path, backbone, device=device, kind=method.spec.artefact_kind)
            except FileNotFoundError:
                if method.spec.load_artefact is not None:  # its own loader's message says how to get the file
                    raise
                advice = training_advice(
                    Path(method.artefact_path),
                    method.spec.artefact_kind,
                    setting=f"decode.presets.{method.name}.{method.spec.artefact}",
                )
                raise FileNotFoundError(
                    f"decode method {method.name!r} needs the export at {method.artefact_path}, which does not "
                    f"exist; {advice}"
                ) from None
        method.artefact = loaded[key]
