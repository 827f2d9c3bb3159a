"""MuLo-SD low-resolution drafter: a small AR model over the image at 1/r of the backbone's resolution.

Multi-Scale Local Speculative Decoding (Peruzzo et al., CVPR 2026) drafts with a
cheap model that generates the image at a lower resolution; one drafted
low-resolution row, upsampled by r and re-tokenised, proposes r backbone rows
at once. The drafter implements the backbone interface (prefill/step/rollback/
logits/guide), so the decoder drives it with the same calls as the backbone.

Two designs (``MuLoDrafterConfig.design``):

- ``digits``: for the embedded digits backbone, the same class-conditional Llama
  design (backbones/digits.py) at grid ``rows / r``, with the digits intensity
  codec, so up/downsampling can go through pixel space.
- ``llama``: for any backbone (LlamaGen, Janus-Pro, Lumina-mGPT, Emu3, Tar, and
  digits too): a small transformers Llama whose vocabulary is the backbone's
  image codebook, conditioned the backbone's way, with the condition vector added
  at every position (one prefix token conditions too weakly, see digits.py):
  class ids with a null class (class-conditional backbones), or the backbone's
  frozen input embeddings of the prompt, mean-pooled and projected, with a
  learned null vector as the unconditional twin (text-to-image backbones).

How a drafted low-res row becomes backbone rows (``MuLoDrafterConfig.resample``:
``pixels`` or ``latents``) is the decoder's training-free upsampler,
decode/mulo_resampling.py; the drafter only records which one it was trained with.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from transformers import LlamaConfig, LlamaModel
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from backbones.base import ARImageBackbone, Condition, DecodeState, ImageGeometry
from backbones.digits import DigitsBackbone, DigitsBackboneConfig
from backbones.hf_loading import positional_arguments

DESIGNS = ("digits", "llama")
CONDITIONINGS = ("class", "prompt")
RESAMPLERS = ("pixels", "latents")


@dataclass
class MuLoDrafterConfig:
    """Shape of a low-resolution drafter; stored in the export's heads.json.

    Exports written before the ``llama`` design carry only the first eight fields;
    the defaults of the others reproduce that drafter (digits design, pixel path).
    """

    backbone_rows: int  # the backbone's grid (the drafter's is rows / scale x cols / scale)
    backbone_cols: int
    levels: int  # the drafter's vocabulary = the backbone's image codebook size
    scale: int = 3  # r: one drafted low-res row becomes r backbone rows
    hidden_size: int = 128
    num_layers: int = 3
    num_heads: int = 2
    intermediate_size: int = 352
    design: str = "digits"  # digits: the digits backbone's own design; llama: any backbone (module doc)
    conditioning: str = "class"  # class: class ids + a null class; prompt: pooled prompt embeddings + a learned null
    num_classes: int = 10  # class conditioning: the backbone's classes (the null class is id num_classes)
    condition_dim: int = 0  # prompt conditioning: the width of the backbone's input embeddings
    cfg_space: str = "logits"  # the backbone's: the drafter mixes its CFG twins the same way
    resample: str = "auto"  # pixels | latents; auto: pixels for the digits design, latents otherwise
    rope_theta: float = 10000.0
    backbone_family: str = ""  # the backbone's class name (bind refuses another family; "" in first-format exports)

    def __post_init__(self):
        if self.scale < 1 or self.backbone_rows % self.scale or self.backbone_cols % self.scale:
            raise ValueError(
                f"head.scale must be >= 1 and divide the backbone grid {self.backbone_rows}x"
                f"{self.backbone_cols}, got {self.scale}"
            )
        if self.design not in DESIGNS:
            raise ValueError(f"head.design must be one of {DESIGNS} (or auto), got {self.design!r}")
        if self.conditioning not in CONDITIONINGS:
            raise ValueError(f"drafter conditioning must be one of {CONDITIONINGS}, got {self.conditioning!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"head.hidden_size {self.hidden_size} is not divisible by head.num_heads {self.num_heads}")
        if self.resample == "auto":
            self.resample = "pixels" if self.design == "digits" else "latents"
        if self.resample not in RESAMPLERS:
            raise ValueError(f"head.resample must be one of {RESAMPLERS} or auto, got {self.resample!r}")
        if self.design == "digits":
            if self.backbone_rows != self.backbone_cols:
                raise ValueError("the digits drafter needs a square grid; use head.design=llama")
            if self.conditioning != "class" or self.num_classes != 10:
                raise ValueError("the digits drafter is conditioned on the 10 digit classes; use head.design=llama")
        elif self.resample == "pixels":
            raise ValueError(
                "the llama drafter has no pixel codec of its own: set head.resample=latents "
                "(or head.design=digits on the digits backbone)"
            )
        if self.conditioning == "prompt" and self.condition_dim < 1:
            raise ValueError("prompt conditioning needs condition_dim, the backbone's input-embedding width")
        if self.conditioning == "class" and self.num_classes < 1:
            raise ValueError(f"class conditioning needs num_classes >= 1, got {self.num_classes}")

    @property
    def rows(self) -> int:
        """The drafter's grid rows."""
        return self.backbone_rows // self.scale

    @property
    def cols(self) -> int:
        """The drafter's grid columns."""
        return self.backbone_cols // self.scale

    @classmethod
    def for_backbone(cls, backbone: ARImageBackbone, design: str = "auto", **hparams) -> MuLoDrafterConfig:
        """A drafter config fitted to `backbone`: its grid, codebook, conditioning and CFG space.

        `design="auto"` picks the digits design on the digits backbone and llama elsewhere.
        Class-conditional backbones expose ``num_classes``; the others are conditioned on prompts.
        """
        if design == "auto":
            design = "digits" if isinstance(backbone, DigitsBackbone) else "llama"
        num_classes = getattr(backbone, "num_classes", None)
        conditioning = (
            {"conditioning": "class", "num_classes": int(num_classes)}
            if num_classes is not None
            else {"conditioning": "prompt", "condition_dim": backbone.hidden_size}
        )
        geometry = backbone.geometry
        return cls(
            backbone_rows=geometry.rows,
            backbone_cols=geometry.cols,
            levels=backbone.codebook_size,
            design=design,
            cfg_space=backbone.cfg_space,
            backbone_family=type(backbone).__name__,
            **conditioning,
            **hparams,
        )

    def to_dict(self) -> dict:
        return asdict(self)


class MuLoLlamaDrafterModel(ARImageBackbone):
    """The ``llama`` design: a small Llama over the low-res grid of the backbone's codebook tokens.

    Layout of one sequence: ``[BOS, t_0, ..., t_{n-1}]`` with the condition vector
    (class embedding, or projected pooled prompt embedding) added at every position.
    Prompt conditioning asks the backbone for the prompt's embedding, so the model
    must be `attach`ed to its backbone first (`MuLoDrafter.bind` does it).
    """

    def __init__(self, config: MuLoDrafterConfig):
        super().__init__()
        self.config = config
        self.name = f"mulo-drafter-{config.rows}x{config.cols}"
        self.geometry = ImageGeometry(rows=config.rows, cols=config.cols)
        self.codebook_size = config.levels
        self.hidden_size = config.hidden_size
        self.cfg_space = config.cfg_space
        llama_config = LlamaConfig(
            vocab_size=1,  # inputs arrive as embeddings; LlamaModel's own table is unused
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_heads,
            num_key_value_heads=config.num_heads,
            max_position_embeddings=config.rows * config.cols + 1,
            rope_theta=config.rope_theta,
            attn_implementation="sdpa",
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
        self.token_embed = nn.Embedding(config.levels + 1, config.hidden_size)  # + BOS (id = levels)
        if config.conditioning == "class":
            self.class_embed = nn.Embedding(config.num_classes + 1, config.hidden_size)  # + null class
        else:
            self.condition_proj = nn.Linear(config.condition_dim, config.hidden_size)
            self.null_condition = nn.Parameter(torch.zeros(config.hidden_size))  # the empty prompt's vector
        self.transformer = LlamaModel(llama_config)
        self.transformer.norm = nn.Identity()  # pre-norm states out, like every backbone
        self.norm = LlamaRMSNorm(config.hidden_size, eps=llama_config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.levels, bias=False)
        object.__setattr__(self, "_backbone", None)  # not a submodule: never saved, moved or trained

    def attach(self, backbone: ARImageBackbone) -> None:
        """Remember the frozen backbone whose prompt embeddings condition this drafter."""
        object.__setattr__(self, "_backbone", backbone)

    # ---- conditioning ---------------------------------------------------------------------

    def condition_vectors(
        self, condition: Condition, guided: bool = False, drop: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The vector added at every position: (B, hidden), or (2B, hidden) [cond; null] when `guided`.

        `drop` (B,) bool replaces those rows by the null condition (condition dropout in training).
        """
        device = self.token_embed.weight.device
        if self.config.conditioning == "class":
            if condition.class_ids is None:
                raise ValueError(
                    f"this drafter is class-conditional ({self.config.num_classes} classes): "
                    "give Condition(class_ids=...)"
                )
            ids = condition.class_ids.to(device).long()
            null = torch.full_like(ids, self.config.num_classes)
            if drop is not None:
                ids = torch.where(drop.to(device), null, ids)
            if guided:
                ids = torch.cat([ids, null])
            return self.class_embed(ids)
        if condition.class_ids is not None:
            raise ValueError(
                "this drafter is prompt-conditioned: give Condition(prompts=...) or Condition(token_ids=...)"
            )
        if self._backbone is None:
            raise RuntimeError(
                "a prompt-conditioned drafter needs its backbone for the prompt embeddings: "
                "call drafter.bind(backbone) first"
            )
        with torch.no_grad():
            pooled = self._backbone.condition_embedding(condition)  # (B, condition_dim), frozen
        vectors = self.condition_proj(pooled.to(device=device, dtype=self.condition_proj.weight.dtype))
        null = self.null_condition.expand_as(vectors)
        if drop is not None:
            vectors = torch.where(drop.to(device)[:, None], null, vectors)
        return torch.cat([vectors, null]) if guided else vectors

    # ---- training -------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, condition_vectors: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits (B, n, levels) for low-res images (B, n) under condition vectors (B, hidden)."""
        bos = torch.full_like(tokens[:, :1], self.config.levels)
        inputs = torch.cat([bos, tokens[:, :-1]], dim=1)  # (B, n)
        embeds = self.token_embed(inputs) + condition_vectors[:, None]
        return self.logits(self.transformer(inputs_embeds=embeds, use_cache=False).last_hidden_state)

    # ---- ARImageBackbone ----------------------------------------------------------------------

    def prefill(self, condition: Condition, guided: bool) -> tuple[DecodeState, torch.Tensor]:
        vectors = self.condition_vectors(condition, guided)  # (rows, hidden)
        state = DecodeState(
            cache=self.image_cache(self.transformer.config.num_hidden_layers, 1),
            batch_size=condition.batch_size,
            guided=guided,
            prefix_length=1,
            extras={"condition": vectors},
        )
        bos = torch.full((vectors.shape[0], 1), self.config.levels, device=vectors.device)
        return state, self._run(state, bos)

    def _forward_flat(self, state: DecodeState, flat_tokens: torch.Tensor) -> torch.Tensor:
        return self._run(state, flat_tokens)

    def _forward_flat_at(self, state, flat_tokens, slots, visible, positions=None) -> torch.Tensor:
        """Position-addressed and ragged passes (ragged MuLo-SD drafts each image at its own low-res row)."""
        return self._run(state, flat_tokens, **positional_arguments(flat_tokens.shape[0], slots, visible, positions))

    def _run(self, state: DecodeState, inputs: torch.Tensor, **positional) -> torch.Tensor:
        embeds = self.token_embed(inputs) + state.extras["condition"][:, None]
        return self.transformer(inputs_embeds=embeds, cache=state.cache, use_cache=True, **positional).last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden))

    def embed_image_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.token_embed(tokens)

    def codebook_latents(self) -> torch.Tensor:
        if self._backbone is None:
            raise RuntimeError("the drafter shares its backbone's codebook: call drafter.bind(backbone) first")
        return self._backbone.codebook_latents()

    def tokens_to_pixels(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("the llama MuLo drafter has no pixel decoder; resample with head.resample=latents")


class MuLoDrafter(nn.Module):
    """The trainable drafter (its `model` is an ARImageBackbone at low resolution)."""

    kind = "mulo"

    def __init__(self, config: MuLoDrafterConfig):
        super().__init__()
        self.config = config
        if config.design == "digits":
            self.model = DigitsBackbone(
                DigitsBackboneConfig(
                    grid_size=config.rows,
                    levels=config.levels,
                    hidden_size=config.hidden_size,
                    num_layers=config.num_layers,
                    num_heads=config.num_heads,
                    intermediate_size=config.intermediate_size,
                    rope_theta=config.rope_theta,
                    name="mulo-drafter",
                )
            )
        else:
            self.model = MuLoLlamaDrafterModel(config)

    def bind(self, backbone: ARImageBackbone) -> ARImageBackbone:
        """Check that the drafter belongs to `backbone`, attach it, and return the low-res model to decode with."""
        config, geometry = self.config, backbone.geometry
        problems = []
        if config.backbone_family and config.backbone_family != type(backbone).__name__:
            problems.append(f"family: drafter {config.backbone_family}, backbone {type(backbone).__name__}")
        if (config.backbone_rows, config.backbone_cols) != (geometry.rows, geometry.cols):
            problems.append(
                f"grid: drafter {config.backbone_rows}x{config.backbone_cols}, backbone {geometry.rows}x{geometry.cols}"
            )
        if config.levels != backbone.codebook_size:
            problems.append(f"codebook: drafter {config.levels}, backbone {backbone.codebook_size}")
        if config.conditioning == "prompt" and config.condition_dim != backbone.hidden_size:
            problems.append(f"prompt embedding width: drafter {config.condition_dim}, backbone {backbone.hidden_size}")
        if (
            config.conditioning == "class"
            and config.design == "llama"
            and getattr(backbone, "num_classes", None) not in (None, config.num_classes)
        ):
            problems.append(f"classes: drafter {config.num_classes}, backbone {backbone.num_classes}")
        if problems:
            raise ValueError(
                f"this MuLo drafter was built for another backbone than {backbone.name!r} "
                f"({'; '.join(problems)}); train a drafter for it (python -m train +experiment=mulo_...)"
            )
        if isinstance(self.model, MuLoLlamaDrafterModel):
            self.model.attach(backbone)
        return self.model
