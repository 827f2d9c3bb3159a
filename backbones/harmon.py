"""Harmon (Wu et al., "Harmonizing Visual Representations for Unified Multimodal Understanding and Generation",
2025; code wusize/Harmon): text-to-image with a Qwen2.5 LLM inside a MAR.

Harmon is MAR (backbones/mar.py) whose encoder output passes through a causal LLM that has read the prompt: a
masked random-order generator of KL-16 VAE latents (16 channels, scale 0.2325) conditioned on text instead of
a class id.

Architecture (``src/models/harmon.py`` ``Harmon``; ``src/models/mar/mar.py`` is LTH14/mar's ``MAR``, names
unchanged, so ``mar.*`` weights load through `MARBackbone.load_official_state_dict`):

- the MAR encoder (``forward_mae_encoder``) reads the 64-position buffer, every buffer position holding the
  learned ``fake_latent`` (the class embedding is unused), and the known tokens, then ``encoder_norm``:
  x_enc (rows, 64 + known, encoder_dim);
- ``proj_in`` = Linear(encoder_dim, H) -> SiLU -> Linear(H, H) (H the LLM width) maps x_enc into the LLM,
  reordered as [known tokens ascending; buffer] and appended after the prompt's KV cache;
  the LLM (transformers' ``Qwen2Model``, i.e. ``Qwen2ForCausalLM.model``; its LM head is unused) is causal,
  with position ids continuing from each row's prompt length (``cumsum(attention_mask) - 1``) and the
  prompt's right padding masked out;
- its last hidden state (after the final norm), reordered back to [buffer; known], goes through ``proj_out``
  = Linear(H, H) -> SiLU -> Linear(H, encoder_dim) and is added to x_enc (a residual);
- then the MAR decoder and the diffusion head (`backbones.diffusion_head.DiffusionHead`) exactly as MAR.

Sampling (``Harmon.sample``, ``scripts/text2image.py``): the prompt "Generate an image: {prompt}" and the
classifier-free-guidance prompt "Generate an image." in Qwen's chat template
``<|im_start|>user\\n{input}<|im_end|>\\n<|im_start|>assistant\\n``, batched as [B cond; B uncond] and
right-padded with EOS; the prompt is prefilled once into a KV cache that every step extends and then crops
back (here: every step extends a fresh cache over the stored prompt keys and values, the same numbers).
The steps are MAR's (cosine mask schedule, the unconditional half copying the conditional half's orders,
masks and tokens; guidance ``cfg`` constant or linear as MAR). Tokens are VAE latents times 0.2325, decoded
by the KL-16 VAE (``kl16.ckpt``).

Released sizes (``configs/models/qwen2_5_{0_5b_kl16_mar_b,1_5b_kl16_mar_h}.py``; weights on Hugging Face
``wusize/harmon``):

    size   checkpoint         MAR (diffusion head)        LLM (config and tokenizer)
    0.5b   harmon_0.5b.pth    MAR-B 768/12/12 (6/1024)    Qwen/Qwen2.5-0.5B-Instruct, H = 896
    1.5b   harmon_1.5b.pth    MAR-H 1280/20/16 (12/1536)  Qwen/Qwen2.5-1.5B-Instruct, H = 1536

(``harmon_1.5b-o.pth``, fine-tuned on BLIP3o-60k, has the 1.5b layout.) Defaults of the official script:
64 steps, cfg 3.0 with the constant schedule, temperature 1.0, 512 px (a 32x32 grid), bf16.

What differs from MAR: the condition is a prompt (`HarmonCondition`: its [cond; uncond] KV cache, made once
per batch by `prompt_condition`); the buffer always holds ``fake_latent``; the LLM residual between encoder
and decoder; and the grid: MAR's 16x16 learned position embeddings (encoder, decoder, diffusion) are
bilinearly interpolated (``F.interpolate``, align_corners False; the buffer's kept) to the grid in use
(``get_{encoder,decoder,diffusion}_pos_embed``), `grid_size` here. MAR's ``sample_tokens`` is not usable in
Harmon's copy; ``Harmon.sample`` is the reference.

Checked once against the original code (wusize/Harmon at 4eb6087 with its pinned transformers 4.45.2 and
timm 0.9.12, a throwaway copy on CPU whose ``.cuda()`` calls were removed and whose orders and noise draws were
patched to read the same orders and per-position trajectory noise; tiny random weights loaded into both through
`official_state_dict` (the head at the official 256 time frequencies, its weights scaled by 0.3 to keep tokens
O(1e4) rather than 1e10), float64, prompts of 10 words and 1 word right-padded in one batch): the conditions z of one
encoder-LLM-decoder pass (8x8 grid, guided twins, 23 known tokens per row) are bit-identical (max |diff| 0.0);
the sampled tokens (8 steps; 8x8, 6x6 interpolated and 4x4 native grids; cfg 3.0 constant, 2.0 linear at
temperature 0.9, and 1.0) agree to 8.5e-8 of the largest token, 1.6e-8 when the original's diffusion schedule
coefficients are kept in float64 (guided-diffusion's ``_extract_into_tensor`` rounds them to float32; the first
reverse step divides by sqrt(alpha_bar_T) ~ 5e-5, which amplifies any rounding).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, Qwen2Config, Qwen2Model

from backbones.base import ImageGeometry
from backbones.diffusion_head import DiffusionHead
from backbones.hf_loading import load_torch_checkpoint
from backbones.mar import (
    MARBackbone,
    MARConfig,
    gather_positions,
    infer_size,
    mar_config,
    randomized,
    repeat_twin_blocks,
    reveal,
    reveal_steps,
)
from backbones.mar_vae import MARKLVAE, load_kl16_vae

log = logging.getLogger(__name__)

README = "https://github.com/wusize/Harmon#-checkpoints"
HF_REPO = "wusize/harmon"
PROMPT_TEMPLATE = "<|im_start|>user\n{input}<|im_end|>\n<|im_start|>assistant\n"  # Qwen chat, one user turn
GENERATE_PROMPT = "Generate an image: {prompt}"  # scripts/text2image.py
CFG_PROMPT = "Generate an image."  # the unconditional twin's prompt (--cfg_prompt)
VAE_SCALE = 0.2325

# The released sizes: the MAR size of `backbones.mar.MAR_SIZES`, the LLM whose config and tokenizer it uses.
HARMON_SIZES: dict[str, dict] = {
    "0.5b": {"mar": "base", "llm": "Qwen/Qwen2.5-0.5B-Instruct", "llm_hidden": 896, "file": "harmon_0.5b.pth"},
    "1.5b": {"mar": "huge", "llm": "Qwen/Qwen2.5-1.5B-Instruct", "llm_hidden": 1536, "file": "harmon_1.5b.pth"},
}
# Test-sized (`random_harmon_backbone`'s layout; tests save official-layout tiny checkpoints).
HARMON_SIZES["tiny"] = {"mar": "tiny", "llm": "a tiny random Qwen2", "llm_hidden": 32, "file": "harmon_tiny.pth"}


def harmon_mlp(dim_in: int, dim_out: int, hidden: int) -> nn.Sequential:
    """Harmon's ``build_mlp``: Linear -> SiLU -> Linear (names ``0.`` and ``2.`` as the checkpoints)."""
    return nn.Sequential(nn.Linear(dim_in, hidden), nn.SiLU(), nn.Linear(hidden, dim_out))


def interpolate_grid(learned: torch.Tensor, extra: int, source: int, target: int) -> torch.Tensor:
    """Learned position embeddings (1, extra + source**2, dim) on a `target` x `target` grid.

    Harmon's ``get_*_pos_embed``: the first `extra` (the buffer) are kept, the grid part is resized bilinearly
    (align_corners False); at the learned size they are returned as they are.
    """
    if target == source:
        return learned
    kept, grid = learned.split([extra, source * source], dim=1)
    grid = grid.view(1, source, source, -1).permute(0, 3, 1, 2)  # (1, dim, source, source)
    grid = F.interpolate(grid, size=(target, target), mode="bilinear", align_corners=False)
    return torch.cat([kept, grid.flatten(2).transpose(1, 2)], dim=1)  # (1, extra + target**2, dim)


@dataclass(frozen=True)
class HarmonCondition:
    """A batch's prompts prefilled once, read by every step: rows = [B cond; B uncond] when `guided`, else B."""

    input_ids: torch.Tensor  # (rows, P) templated prompts, right-padded with EOS
    attention_mask: torch.Tensor  # (rows, P) bool: the valid prompt tokens
    past: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per LLM layer: keys, values (rows, kv_heads, P, head_dim)
    guided: bool

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def batch(self) -> int:
        return self.rows // 2 if self.guided else self.rows

    def __len__(self) -> int:
        return self.rows

    def cache(self) -> DynamicCache:
        """A fresh cache over the prompt: the LLM extends a copy, the prompt's tensors stay as they are (what
        Harmon's ``curtail_cache`` restores after every step)."""
        return DynamicCache(ddp_cache_data=self.past)


class HarmonBackbone(nn.Module):
    """A frozen Harmon generator behind `MARBackbone`'s interface, prompts in place of class ids.

    ``sample`` reproduces ``Harmon.sample`` with the generation orders and every token's trajectory noise
    passed in; ``conditions`` / ``predict_conditions`` are one encoder-LLM-decoder pass for a verifier.
    The MAR part is a `MARBackbone` (``self.mar``, its learned 16x16 grid); this model generates on
    ``grid_size`` x ``grid_size`` (its own ``seq_len`` and ``geometry``).
    """

    # Continuous tokens in a masked random order, as MAR (decode/masked_baseline.py, decode/cspd_mar.py).
    token_kind = "masked"
    num_classes = None  # text-to-image
    pads_prompts = True  # prompts of any lengths share a batch (backbones.base.group_by_prompt_length)

    def __init__(
        self,
        mar: MARConfig,
        llm: Qwen2Config,
        tokenizer=None,
        grid_size: int = 32,
        num_iter: int = 64,
        cfg_schedule: str = "constant",
        name: str = "harmon",
    ):
        super().__init__()
        if grid_size < 1:
            raise ValueError(f"grid_size must be >= 1, got {grid_size}")
        reveal_steps(grid_size * grid_size, num_iter, cfg_schedule=cfg_schedule)  # refuses bad values now
        self.mar = MARBackbone(mar, num_iter, cfg_schedule)
        self.llm = Qwen2Model(llm)
        self.proj_in = harmon_mlp(mar.encoder_dim, llm.hidden_size, llm.hidden_size)
        self.proj_out = harmon_mlp(llm.hidden_size, mar.encoder_dim, llm.hidden_size)
        self.tokenizer = tokenizer
        # How `python -m decode` generates with this model: Harmon's steps and CFG schedule.
        self.num_iter, self.cfg_schedule = num_iter, cfg_schedule
        self.name, self.config, self.grid_size = name, mar, grid_size
        self.geometry = ImageGeometry(rows=grid_size, cols=grid_size, end_of_line=False)
        self.seq_len, self.token_dim, self.hidden_size = grid_size * grid_size, mar.token_dim, mar.decoder_dim
        self.buffer_size, self.llm_hidden_size = mar.buffer_size, llm.hidden_size

    # MAR's, reading this model's seq_len, token_dim and diffusion (the grid in use, not MAR's learned one).
    sample_positions = MARBackbone.sample_positions
    check_orders = MARBackbone.check_orders
    check_noise = MARBackbone.check_noise
    conditions_at = MARBackbone.conditions_at  # (a guided condition has twice the tokens' rows)
    weights_fingerprint = MARBackbone.weights_fingerprint  # (of every weight: MAR, LLM, projections)
    drafter_settings = MARBackbone.drafter_settings

    @property
    def diffusion(self) -> DiffusionHead:
        return self.mar.diffusion

    @property
    def z_proj(self) -> nn.Linear:  # (callers read the model's dtype and device off z_proj.weight, as MAR's)
        return self.mar.z_proj

    def identity(self) -> dict:
        """What a run records and a drafter is checked against: MAR's, and the LLM's width."""
        return {**MARBackbone.identity(self), "llm_hidden_size": self.llm_hidden_size}

    # ---- official weights ------------------------------------------------------------------

    def official_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under the released checkpoints' names (``Harmon.state_dict()`` without ``vae.*`` and
        the unused ``llm.lm_head``): ``mar.*`` (LTH14/mar names), ``llm.model.*``, ``proj_in.*``, ``proj_out.*``."""
        state = {f"mar.{name}": value for name, value in self.mar.official_state_dict().items()}
        state.update({f"llm.model.{name}": value for name, value in self.llm.state_dict().items()})
        for part in ("proj_in", "proj_out"):
            state.update({f"{part}.{name}": value for name, value in getattr(self, part).state_dict().items()})
        return state

    def load_official_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a released checkpoint's state dict (``harmon_*.pth``) strictly.

        Every key of `official_state_dict` must be there with its shape, no other, except the ones Harmon
        saves but this adapter does not use (``llm.lm_head.weight``, the VAE's ``vae.*``), which are skipped;
        the first offending key is named in the ValueError. Values are cast to this module's dtype and device.
        """
        skipped = [name for name in state if name == "llm.lm_head.weight" or name.startswith("vae.")]
        if skipped:
            log.info("Harmon state dict: %d unused keys skipped (e.g. %s)", len(skipped), skipped[0])
        parts = {"mar.": {}, "llm.model.": {}, "proj_in.": {}, "proj_out.": {}}
        for name, value in state.items():
            if name in skipped:
                continue
            prefix = next((p for p in parts if name.startswith(p)), None)
            if prefix is None:
                raise ValueError(f"unexpected key {name!r} in the Harmon state dict (not a parameter of {self.name})")
            parts[prefix][name.removeprefix(prefix)] = value
        try:
            self.mar.load_official_state_dict(parts.pop("mar."))
        except ValueError as error:
            raise ValueError(f"Harmon's mar.*: {error}") from error
        for prefix, module in (("llm.model.", self.llm), ("proj_in.", self.proj_in), ("proj_out.", self.proj_out)):
            _load_strict(module, parts[prefix], prefix, self.name)

    # ---- the condition ----------------------------------------------------------------------

    def prompt_condition(self, prompts: Sequence[str], guided: bool) -> HarmonCondition:
        """The prompts' [cond; uncond] KV cache (``Harmon.prepare_text_conditions`` + its prefill).

        Row i reads ``PROMPT_TEMPLATE`` around "Generate an image: {prompt}", its guidance twin (row B + i,
        when `guided`) around ``CFG_PROMPT``; rows are right-padded with EOS and the padding is masked in
        every step (its keys are computed, never read).
        """
        if self.tokenizer is None:
            raise ValueError(f"{self.name} was built without a tokenizer: load it with the LLM's (llm_path)")
        if isinstance(prompts, str) or not len(prompts):
            raise ValueError(f"prompts must be a non-empty list of strings, got {prompts!r}")
        texts = [GENERATE_PROMPT.format(prompt=p) for p in prompts] + ([CFG_PROMPT] * len(prompts) if guided else [])
        ids = [self.tokenizer.encode(PROMPT_TEMPLATE.format(input=t), add_special_tokens=True) for t in texts]
        return self.condition_from_ids(ids, guided)

    @torch.no_grad()
    def condition_from_ids(self, ids: Sequence[Sequence[int]], guided: bool) -> HarmonCondition:
        """The condition of already templated and tokenized rows ([cond; uncond] when `guided`)."""
        device = self.z_proj.weight.device
        if guided and len(ids) % 2:
            raise ValueError(f"guided rows come in [cond; uncond] pairs, got {len(ids)} rows")
        lengths = torch.tensor([len(row) for row in ids], device=device)
        if int(lengths.min()) < 1:
            raise ValueError("every prompt must tokenize to at least one token")
        pad = self.tokenizer.eos_token_id if self.tokenizer is not None else 0
        input_ids = torch.full((len(ids), int(lengths.max())), pad, dtype=torch.long, device=device)
        for row, tokens in enumerate(ids):
            input_ids[row, : len(tokens)] = torch.as_tensor(list(tokens), device=device)
        attention_mask = torch.arange(input_ids.shape[1], device=device)[None] < lengths[:, None]
        # As Harmon: no mask and default positions; the prompt is causal and right-padded, so its valid keys
        # are exact and the padding's are masked out later.
        cache = DynamicCache()
        self.llm(input_ids=input_ids, cache=cache, use_cache=True)
        past = tuple((layer.keys, layer.values) for layer in cache.layers)
        return HarmonCondition(input_ids, attention_mask, past, guided)

    # ---- the encoder-LLM-decoder ------------------------------------------------------------

    def position_embeddings(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Encoder (1, buffer + seq_len, enc), decoder (1, buffer + seq_len, dec), diffusion (1, seq_len, dec)
        position embeddings on this model's grid (interpolated from MAR's learned grid)."""
        m, source, target = self.mar, self.config.grid_size, self.grid_size
        return (
            interpolate_grid(m.encoder_pos_embed_learned, self.buffer_size, source, target),
            interpolate_grid(m.decoder_pos_embed_learned, self.buffer_size, source, target),
            interpolate_grid(m.diffusion_pos_embed_learned, 0, source, target),
        )

    def conditions(self, tokens: torch.Tensor, known: torch.Tensor, condition: HarmonCondition) -> torch.Tensor:
        """One encoder-LLM-decoder pass (``Harmon.forward_mae_encoder`` + ``mar.forward_mae_decoder``):
        z (rows, seq_len, decoder_dim).

        tokens (rows, seq_len, token_dim) read where `known` (rows, seq_len) is True; rows must be the
        condition's (twins stacked by the caller). Rows may know different numbers of tokens (MAR's encoder
        pads them; the LLM sees each row's [known; padding; buffer] with the padding masked and not counted
        in the position ids, so a row's result does not depend on the others).
        """
        rows, buffer = tokens.shape[0], self.buffer_size
        if tokens.shape[1:] != (self.seq_len, self.token_dim) or known.shape != (rows, self.seq_len):
            raise ValueError(
                f"tokens must be (rows, {self.seq_len}, {self.token_dim}) and known (rows, {self.seq_len}); "
                f"got {tuple(tokens.shape)} and {tuple(known.shape)}"
            )
        if rows != condition.rows:
            raise ValueError(f"{rows} rows of tokens for a condition of {condition.rows} rows")
        encoder_pos, decoder_pos, diffusion_pos = self.position_embeddings()
        # The buffer holds the fake latent in every row, conditional or not: the prompt enters through the LLM.
        null = self.mar.fake_latent.expand(rows, -1)
        encoded = self.mar.encode_known(tokens, known, null, encoder_pos)
        # encoded.x (rows, width, enc): [buffer; known ascending; padding] -> the LLM's [known; padding; buffer].
        z = self.proj_in(encoded.x)
        z = torch.cat([z[:, buffer:], z[:, :buffer]], dim=1)
        visible = torch.cat([encoded.valid[:, buffer:], encoded.valid[:, :buffer]], dim=1)
        mask = torch.cat([condition.attention_mask, visible], dim=1)  # (rows, P + width)
        positions = (mask.long().cumsum(1) - 1).clamp(min=0)[:, condition.attention_mask.shape[1] :]
        hidden = self.llm(
            inputs_embeds=z.to(self.llm.embed_tokens.weight.dtype),
            attention_mask=mask,
            position_ids=positions,
            cache=condition.cache(),
            use_cache=True,
        ).last_hidden_state  # (rows, width, H)
        hidden = torch.cat([hidden[:, -buffer:], hidden[:, :-buffer]], dim=1)  # back to [buffer; known; padding]
        x = encoded.x + self.proj_out(hidden).to(encoded.x.dtype)  # Harmon's residual
        return self.mar.decode_conditions(replace(encoded, x=x), decoder_pos, diffusion_pos)

    def prompt_token_ids(self, condition) -> torch.Tensor:
        """(B, P) the templated conditional prompts' token ids, right-padded with EOS (what the LLM reads)."""
        return self.prompt_condition(condition.prompts, guided=False).input_ids

    def condition_state(self, prompts: Sequence[str], guided: bool) -> HarmonCondition:
        """What `conditions` reads for these prompts: their [cond; uncond] KV cache (`prompt_condition`; the
        masked generators' name for it, MAR's being its class embeddings)."""
        return self.prompt_condition(prompts, guided)

    def repeat_condition(self, state: HarmonCondition, times: int, guided: bool) -> HarmonCondition:
        """`state` for `times` copies of the batch: [cond x times; uncond x times], the twins' row layout."""
        if state.guided != guided:
            raise ValueError(f"the condition was made with guided={state.guided}, this call needs {guided}")
        twins = 2 if guided else 1
        past = tuple(tuple(repeat_twin_blocks(t, times, twins) for t in layer) for layer in state.past)
        ids, mask = (repeat_twin_blocks(t, times, twins) for t in (state.input_ids, state.attention_mask))
        return HarmonCondition(ids, mask, past, guided)

    def load_drafter(self, path: str | Path, device: str | torch.device | None = None) -> HarmonBackbone:
        """A Harmon checkpoint at `path` (its directory also holding its LLM's config and tokenizer) loaded to
        draft for this model: MAR's `drafter_settings` and this model's grid."""
        return load_harmon_backbone(path, grid_size=self.grid_size, **self.drafter_settings(device))

    def _condition(self, prompts: Sequence[str] | HarmonCondition, guided: bool) -> HarmonCondition:
        if not isinstance(prompts, HarmonCondition):
            return self.prompt_condition(prompts, guided)
        if prompts.guided != guided:
            raise ValueError(f"the condition was made with guided={prompts.guided}, this call needs {guided}")
        return prompts

    @torch.no_grad()
    def predict_conditions(
        self,
        tokens: torch.Tensor,
        known_mask: torch.Tensor,
        prompts: Sequence[str] | HarmonCondition,
        guided: bool,
    ) -> torch.Tensor:
        """The diffusion head's condition z of every position given the known tokens: (rows, seq_len, dim).

        tokens (B, seq_len, token_dim), read where ``known_mask`` (B, seq_len) is True; `prompts` B strings
        or their `prompt_condition`. rows = 2B as [cond; uncond] when `guided`, else B.
        """
        batch = tokens.shape[0]
        if known_mask.shape != (batch, self.seq_len):
            raise ValueError(f"known_mask must be (B={batch}, {self.seq_len}), got {tuple(known_mask.shape)}")
        condition = self._condition(prompts, guided)
        known = known_mask.bool()
        if guided:
            tokens, known = torch.cat([tokens, tokens]), torch.cat([known, known])
        return self.conditions(tokens.to(self.z_proj.weight.dtype), known, condition)

    # ---- sampling ---------------------------------------------------------------------------

    @torch.no_grad()
    def sample(
        self,
        prompts: Sequence[str] | HarmonCondition,
        num_iter: int = 64,
        cfg_scale: float = 3.0,
        cfg_schedule: str = "constant",
        temperature: float = 1.0,
        orders: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Harmon's masked random-order generation (``Harmon.sample``): tokens (B, seq_len, token_dim).

        The steps are MAR's (`MARBackbone.sample`): step s runs the encoder-LLM-decoder on the tokens known
        so far and samples the positions ``orders[:, mask_len:masked]`` of the cosine schedule with the
        diffusion head. Guidance (``cfg_scale != 1``, default 3.0 constant as ``scripts/text2image.py``)
        runs the [prompt; "Generate an image."] twins. The prompts are prefilled once.

        `orders` (B, seq_len) one permutation per row, `noise` (B, seq_len, noise_steps, token_dim) every
        position's trajectory noise; whichever is missing is drawn from `generator`. Rows are independent
        of each other (prompts of any lengths).
        """
        guided = cfg_scale != 1.0  # as the reference: guidance twins only when the scale is not exactly 1
        condition = self._condition(prompts, guided)
        batch, device = condition.batch, self.z_proj.weight.device
        steps = reveal_steps(self.seq_len, num_iter, cfg_scale, cfg_schedule)
        orders = self.check_orders(orders, batch, generator, device)
        noise = self.check_noise(noise, batch, generator, device)
        tokens = torch.zeros(batch, self.seq_len, self.token_dim, device=device, dtype=self.z_proj.weight.dtype)
        known = torch.zeros(batch, self.seq_len, dtype=torch.bool, device=device)
        for step in steps:
            positions = orders[:, step.start : step.end]  # (B, n): the same count in every row
            z = self.conditions_at(tokens, known, condition, positions)
            drawn = self.sample_positions(z, gather_positions(noise, positions), step.cfg_scale, temperature)
            tokens, known = reveal(tokens, known, positions, drawn.tokens)
        return tokens

    # ---- pixels: MAR's KL-16 VAE, attached to the MAR part (kept out of the weights) --------------

    def attach_vae(self, vae: MARKLVAE | None) -> None:
        """Decode pixels through `vae` (``kl16.ckpt``, backbones/mar_vae.py); see `MARBackbone.attach_vae`."""
        self.mar.attach_vae(vae)

    def tokens_to_pixels(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens (B, rows, cols, token_dim) -> images (B, 3, 16 rows, 16 cols) in [0, 1] by the KL-16 VAE
        (``Harmon.decode``: latents / 0.2325); NotImplementedError without one (``backbone.vae_path``)."""
        return self.mar.tokens_to_pixels(tokens)

    def pixels_to_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1] -> tokens (B, H / 16, W / 16, token_dim) (``Harmon.encode``: the
        posterior's mode times 0.2325)."""
        return self.mar.pixels_to_tokens(images)


def _load_strict(module: nn.Module, state: dict[str, torch.Tensor], prefix: str, name: str) -> None:
    """`state` (names without `prefix`) into `module`: every key, none other, the same shapes, else a ValueError
    naming the first offending key under its checkpoint name."""
    own = module.state_dict()
    for key, value in state.items():
        if key not in own:
            raise ValueError(f"unexpected key {prefix + key!r} in the Harmon state dict (not a parameter of {name})")
        if tuple(value.shape) != tuple(own[key].shape):
            raise ValueError(
                f"Harmon state dict key {prefix + key!r} has shape {tuple(value.shape)}, "
                f"{name} expects {tuple(own[key].shape)}"
            )
    missing = [key for key in own if key not in state]
    if missing:
        raise ValueError(f"Harmon state dict lacks {prefix + missing[0]!r} ({len(missing)} keys missing)")
    module.load_state_dict({key: value.to(own[key]) for key, value in state.items()}, strict=True)


# ---- loading ----------------------------------------------------------------------------------


def _download_advice(size: str) -> str:
    file = HARMON_SIZES.get(size, HARMON_SIZES["0.5b"])["file"]
    return (
        f"get it from Hugging Face {HF_REPO} ({README}):\n"
        f"  huggingface-cli download {HF_REPO} {file} --local-dir <dir>\n"
        f"and set backbone.path=<dir>/{file} (harmon_0.5b.pth or harmon_1.5b.pth)"
    )


def _llm_advice(size: str) -> str:
    llm = HARMON_SIZES[size]["llm"] if size in HARMON_SIZES else "Qwen/Qwen2.5-0.5B-Instruct"
    return (
        f"Harmon reads its LLM's config and tokenizer from {llm} (the weights come from the Harmon checkpoint):\n"
        f"  huggingface-cli download {llm} --include '*.json' merges.txt vocab.json --local-dir <dir>\n"
        "(Qwen/Qwen2.5-1.5B-Instruct for harmon_1.5b) and set backbone.llm_path=<dir>, or put them beside the "
        "checkpoint (the only way for a drafter: decode.mar_drafter=<that dir>)"
    )


def load_harmon_backbone(
    path: str | Path,
    llm_path: str | Path | None = None,
    size: str = "auto",
    device: str = "cpu",
    dtype: str = "bfloat16",
    grid_size: int = 32,
    num_iter: int = 64,
    cfg_schedule: str = "constant",
    final_step_noise: bool = False,
    vae_path: str | Path | None = None,
    trust_pickle: bool = False,
    attn_implementation: str = "sdpa",
) -> HarmonBackbone:
    """Hydra entry point: a frozen Harmon from a released checkpoint (Wu et al. 2025; wusize/Harmon).

    `path` is ``harmon_0.5b.pth`` / ``harmon_1.5b.pth`` (or a directory holding one; HF ``wusize/harmon``), a
    plain state dict read with ``torch.load(weights_only=True)`` unless `trust_pickle`. `llm_path` is a local
    directory of the matching Qwen2.5-Instruct model: its config.json and tokenizer are used (its weights
    are not: Harmon's checkpoint holds the trained LLM); None: the checkpoint's own directory, if it holds
    them (how `load_drafter` finds a drafter's). `size` "auto" reads it off the weights. `grid_size`
    is the token grid (image size / 16: 32 for the official 512 px), `num_iter` and `cfg_schedule` how this
    model generates in `python -m decode` (the official script: 64, constant); `final_step_noise` see
    `MARConfig`; `vae_path` the KL-16 VAE (``kl16.ckpt``) for pixels; `attn_implementation` the LLM's
    ("sdpa" or "eager"). Raises FileNotFoundError saying where to get what is missing.
    """
    from transformers import AutoTokenizer

    if size != "auto" and size not in HARMON_SIZES:
        raise ValueError(f"unknown Harmon size {size!r}; choose from auto, {', '.join(HARMON_SIZES)}")
    path = Path(path)
    if path.is_dir():
        candidates = [path / HARMON_SIZES[s]["file"] for s in (HARMON_SIZES if size == "auto" else [size])]
        path = next((p for p in candidates if p.is_file()), candidates[0])
    if not path.is_file():
        raise FileNotFoundError(f"no Harmon checkpoint at {path}: {_download_advice(size)}")
    if llm_path is None and (path.parent / "config.json").is_file():
        llm_path = path.parent  # the checkpoint beside its LLM's config and tokenizer (how a drafter is given)
    if llm_path is None:  # (a config default, so that a missing checkpoint is reported first)
        raise FileNotFoundError(f"no LLM directory given: {_llm_advice(size)}")
    llm_path = Path(llm_path)
    if not (llm_path / "config.json").is_file():
        raise FileNotFoundError(f"no LLM config at {llm_path / 'config.json'}: {_llm_advice(size)}")
    state = load_torch_checkpoint(path, trust_pickle, "a Harmon checkpoint", f"from {HF_REPO}")
    if not all(isinstance(value, torch.Tensor) for value in state.values()):
        raise ValueError(f"{path}: not a plain state dict (keys: {sorted(state)[:8]}); is it a harmon_*.pth?")
    mar_state = {k.removeprefix("mar."): v for k, v in state.items() if k.startswith("mar.")}
    mar_size = infer_size(mar_state, path)
    found = next((s for s, spec in HARMON_SIZES.items() if spec["mar"] == mar_size), None)
    if found is None or (size != "auto" and size != found):
        raise ValueError(f"{path}: its MAR is MAR-{mar_size}, which is Harmon {found or 'none'}, not {size}")
    llm_config = Qwen2Config.from_pretrained(llm_path, attn_implementation=attn_implementation)
    proj = state.get("proj_in.0.weight")
    if proj is not None and proj.shape[0] != llm_config.hidden_size:
        raise ValueError(
            f"{path} was trained with an LLM of width {proj.shape[0]}, {llm_path} has {llm_config.hidden_size}: "
            f"Harmon {found} needs {HARMON_SIZES[found]['llm']}"
        )
    tokenizer = AutoTokenizer.from_pretrained(llm_path)
    backbone = HarmonBackbone(
        mar_config(mar_size, final_step_noise=final_step_noise),
        llm_config,
        tokenizer,
        grid_size,
        num_iter,
        cfg_schedule,
        name=f"harmon-{found}",
    )
    backbone.load_official_state_dict(state)
    if vae_path is not None:  # read now, so that a missing VAE stops the run before any image is generated
        backbone.attach_vae(load_kl16_vae(vae_path, device=device, dtype=dtype, trust_pickle=trust_pickle))
    return backbone.to(device=device, dtype=getattr(torch, dtype)).eval().requires_grad_(False)


# ---- a tiny random model (tests) -------------------------------------------------------------

TINY_VOCAB = 64


def tiny_harmon_llm_config(hidden_size: int = 32, num_layers: int = 2, vocab_size: int = TINY_VOCAB) -> Qwen2Config:
    """A test-sized Qwen2 (4 heads, 2 KV heads: grouped-query attention as the real ones)."""
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=2,
        pad_token_id=0,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def tiny_harmon_tokenizer(vocab_size: int = TINY_VOCAB):
    """A word-level tokenizer with Qwen's chat markers: ``<|endoftext|>`` 0, ``<|im_start|>`` 1, ``<|im_end|>``
    2 (EOS, Harmon's padding); words take the other ids (backbones/tiny_tokenizer.py)."""
    from backbones.tiny_tokenizer import tiny_word_tokenizer

    fixed = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    free = [i for i in range(vocab_size) if i not in fixed.values()]
    return tiny_word_tokenizer(fixed, special=list(fixed), free_ids=free, eos_token="<|im_end|>")


def random_harmon_backbone(
    seed: int = 0,
    device: str = "cpu",
    grid_size: int = 8,
    num_iter: int = 8,
    cfg_schedule: str = "constant",
    dtype: str = "float32",
    final_step_noise: bool = False,
    llm_hidden_size: int = 32,
    vae_seed: int | None = None,
    **mar_overrides,
) -> HarmonBackbone:
    """Hydra entry point: a tiny random-weight Harmon (tests; nothing to download).

    MAR is `mar_config("tiny")` (learned 4x4 grid, 4-channel tokens), generating on `grid_size` (8: twice
    the learned grid, as 512 px is for the released 16x16); the LLM a 2-layer Qwen2 of width
    `llm_hidden_size` with `tiny_harmon_tokenizer`. Weights as `random_mar_backbone`'s (norms centred on 1).
    `vae_seed`: attach a tiny random KL VAE (`backbones.mar_vae.random_kl_vae`, 2 pixels per token).
    """
    torch.manual_seed(seed)
    backbone = HarmonBackbone(
        mar_config("tiny", final_step_noise=final_step_noise, **mar_overrides),
        tiny_harmon_llm_config(llm_hidden_size),
        tiny_harmon_tokenizer(),
        grid_size,
        num_iter,
        cfg_schedule,
        name="harmon-tiny-random",
    )
    return randomized(backbone, device, dtype, vae_seed)


__all__ = [
    "CFG_PROMPT",
    "GENERATE_PROMPT",
    "HARMON_SIZES",
    "PROMPT_TEMPLATE",
    "HarmonBackbone",
    "HarmonCondition",
    "interpolate_grid",
    "load_harmon_backbone",
    "random_harmon_backbone",
    "tiny_harmon_llm_config",
    "tiny_harmon_tokenizer",
]
