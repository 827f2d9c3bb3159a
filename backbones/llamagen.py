"""LlamaGen (FoundationVision/LlamaGen): class-conditional ImageNet GPT over VQ-16 tokens.

LlamaGen is not in transformers, so its GPT is re-implemented here as `LlamaGenGPT`,
whose parameter names match the official checkpoints (``c2i_B_256.pt``,
``c2i_L_384.pt``, ``c2i_XL_384.pt``, ... with the weights under a "model" entry, or a
bare state dict for the FSDP-trained XXL/3B),
so those load unchanged. Layout of one sequence (c2i, ``cls_token_num = 1``):

    [class embedding, t_0, t_1, ..., t_{N-1}]

- the class embedding (``cls_embedding.embedding_table``) has ``num_classes + 1``
  rows: the last one, id ``num_classes`` (1000), is the null class used for the
  unconditional twin of classifier-free guidance (and class dropout in training);
- image tokens are embedded by ``tok_embeddings`` (vocabulary = the VQ-16 codebook,
  16,384 entries, 8-dim latents); there is no BOS and no end-of-line token;
- rotary embedding is 2-D: half of each head's pairs rotate with the row index,
  half with the column index of the token's own grid cell; the class prefix
  positions get a zero (cos = sin = 0) table entry, exactly as the source builds it;
- the hidden state of the class token predicts t_0; that of t_i predicts t_{i+1};
- blocks are pre-norm Llama blocks (RMSNorm, fused ``wqkv``, SwiGLU ``w1/w2/w3``),
  then final ``norm`` and the ``output`` head (vocabulary = codebook: no slicing).

Sampling in the official code: CFG on logits ``u + s * (c - u)`` with the batch
``[cond; null]`` (only when the scale is > 1); defaults cfg-scale 4.0, top-k 2000,
temperature 1.0. 256px images are 16x16 grids, 384px images 24x24. Not reproduced:
the official ``cfg_interval`` option (guidance switched off after N tokens).

With ``vq_path`` (``vq_ds16_c2i.pt``) the backbone also gives the L2-normalised
codebook latents and decodes tokens to pixels with its own VQ-16 decoder
(`VQ16Decoder`, keys as in the official VQModel).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from backbones.base import ARImageBackbone, Condition, DecodeState, ImageGeometry
from backbones.conv_autoencoder import AttnBlock, ResBlock, Upsample, group_norm, run_level, swish
from backbones.hf_loading import load_torch_checkpoint
from backbones.kv_cache import PreallocatedLayer
from backbones.ragged_attention import attention

RELEASES = "https://huggingface.co/FoundationVision/LlamaGen"
VQ_FILE = "vq_ds16_c2i.pt"
DOWNSAMPLE = 16  # VQ-16: one token per 16x16 pixels


def _round_up(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - n % k


@dataclass
class LlamaGenConfig:
    """Shape of a LlamaGen c2i GPT (field names follow the official ModelArgs)."""

    dim: int = 1280
    n_layer: int = 36
    n_head: int = 20
    n_kv_head: int | None = None
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    num_classes: int = 1000
    vocab_size: int = 16384  # = VQ codebook size
    cls_token_num: int = 1
    grid_size: int = 24  # image_size // 16: 16 for 256px, 24 for 384px
    name: str = "llamagen-GPT-XL-384"

    def __post_init__(self):
        if self.dim % self.n_head:
            raise ValueError(f"dim {self.dim} is not divisible by n_head {self.n_head}")
        if (self.dim // self.n_head) % 4:
            raise ValueError("2-D rotary embedding needs a head dim divisible by 4")
        if self.cls_token_num != 1:
            raise ValueError("class-conditional LlamaGen uses one class token (cls_token_num=1)")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return _round_up(hidden, self.multiple_of)

    @property
    def null_class(self) -> int:
        return self.num_classes


# The official class-conditional sizes (autoregressive/models/gpt.py, GPT_models).
GPT_SIZES = {
    "GPT-B": {"n_layer": 12, "n_head": 12, "dim": 768},  # 111M
    "GPT-L": {"n_layer": 24, "n_head": 16, "dim": 1024},  # 343M
    "GPT-XL": {"n_layer": 36, "n_head": 20, "dim": 1280},  # 775M
    "GPT-XXL": {"n_layer": 48, "n_head": 24, "dim": 1536},  # 1.4B
    "GPT-XXXL": {"n_layer": 48, "n_head": 40, "dim": 2560},  # 3.9B, no released c2i checkpoint
    "GPT-3B": {"n_layer": 24, "n_head": 32, "dim": 3200},  # 3.1B, "LlamaGen-3B" (c2i_3B_384.pt)
    # Test-sized: 4x4 grid, 64-entry codebook, 10 classes.
    "tiny": {
        "n_layer": 2,
        "n_head": 2,
        "dim": 32,
        "multiple_of": 16,
        "num_classes": 10,
        "vocab_size": 64,
        "grid_size": 4,
    },
}

# Released c2i files (huggingface FoundationVision/LlamaGen): c2i_B_256, c2i_B_384, c2i_L_256, c2i_L_384,
# c2i_XL_384, c2i_XXL_384, c2i_3B_384 (.pt). XXL and 3B were trained with FSDP: bare state dicts.
CHECKPOINT_NAMES = {"GPT-B": "B", "GPT-L": "L", "GPT-XL": "XL", "GPT-XXL": "XXL", "GPT-3B": "3B"}


def rope_table_2d(grid_size: int, head_dim: int, base: float, prefix: int) -> torch.Tensor:
    """(prefix + grid_size**2, head_dim // 2, 2) cos/sin table; prefix rows are zeros (as in the source)."""
    quarter = head_dim // 4
    inv_freq = 1.0 / (base ** (torch.arange(quarter, dtype=torch.float32) * 2 / (head_dim // 2)))
    angles = torch.arange(grid_size, dtype=torch.float32)[:, None] * inv_freq[None]  # (G, quarter)
    rows = angles[:, None, :].expand(grid_size, grid_size, quarter)
    cols = angles[None, :, :].expand(grid_size, grid_size, quarter)
    grid = torch.cat([rows, cols], dim=-1).reshape(grid_size * grid_size, 2 * quarter)
    table = torch.stack([grid.cos(), grid.sin()], dim=-1)
    return torch.cat([torch.zeros(prefix, 2 * quarter, 2), table])


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D) with interleaved pairs, table (T, D // 2, 2) or per row (B, T, D // 2, 2) -> rotated x
    (float32 maths)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    table = table[None] if table.dim() == 3 else table
    cos, sin = table[:, :, None, :, 0], table[:, :, None, :, 1]
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class LabelEmbedder(nn.Module):
    """Class embedding table with one extra row (id = num_classes) for the null class."""

    def __init__(self, num_classes: int, dim: int):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + 1, dim)

    def forward(self, class_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding_table(class_ids).unsqueeze(1)


class LlamaGenCache:
    """Per-layer key/value buffers (rows, kv_heads, capacity, head_dim), filled in place and cropped back.

    One `PreallocatedLayer` per layer (backbones/kv_cache.py), addressed by layer index as LlamaGen's own
    attention calls it: appending writes into the buffers instead of concatenating (which copied the whole
    cache on every pass), and ZipAR's `writing_at` works on it as on the transformers adapters' caches.
    """

    def __init__(self, num_layers: int, capacity: int):
        self.layers = [PreallocatedLayer(capacity) for _ in range(num_layers)]

    def get_seq_length(self) -> int:
        return self.layers[0].get_seq_length()

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this pass's keys and values (rows, kv_heads, T, head_dim) after the cached ones; views of all."""
        return self.layers[layer].update(k, v)

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` positions; a negative value removes that many (transformers' convention)."""
        length = self.get_seq_length()
        remove = -max_length if max_length < 0 else max(0, length - max_length)
        for layer in self.layers:
            layer.crop(-remove)


class Attention(nn.Module):
    def __init__(self, config: LlamaGenConfig):
        super().__init__()
        self.config = config
        self.wqkv = nn.Linear(config.dim, (config.n_head + 2 * config.kv_heads) * config.head_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x, rope, layer: int, cache: LlamaGenCache | None, past: int, mask=None) -> torch.Tensor:
        c = self.config
        batch, length, _ = x.shape
        kv = c.kv_heads * c.head_dim
        q, k, v = self.wqkv(x).split([c.dim, kv, kv], dim=-1)
        q = apply_rope(q.view(batch, length, c.n_head, c.head_dim), rope).transpose(1, 2)
        k = apply_rope(k.view(batch, length, c.kv_heads, c.head_dim), rope).transpose(1, 2)
        v = v.view(batch, length, c.kv_heads, c.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        if c.kv_heads != c.n_head:
            k = k.repeat_interleave(c.n_head // c.kv_heads, dim=1)
            v = v.repeat_interleave(c.n_head // c.kv_heads, dim=1)
        if mask is None:
            total = k.shape[2]
            query_pos = torch.arange(past, past + length, device=x.device)
            mask = torch.arange(total, device=x.device)[None, :] <= query_pos[:, None]  # (T, past + T)
        out = attention(q, k, v, mask)  # in a ragged pass, each row group over its own keys
        return self.wo(out.transpose(1, 2).reshape(batch, length, c.dim))


class FeedForward(nn.Module):
    def __init__(self, config: LlamaGenConfig):
        super().__init__()
        hidden = config.ffn_hidden
        self.w1 = nn.Linear(config.dim, hidden, bias=False)
        self.w3 = nn.Linear(config.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaGenConfig):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x, rope, layer, cache, past, mask=None):
        h = x + self.attention(self.attention_norm(x), rope, layer, cache, past, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaGenGPT(nn.Module):
    """The class-conditional LlamaGen transformer; state-dict keys match the official checkpoints."""

    def __init__(self, config: LlamaGenConfig):
        super().__init__()
        self.config = config
        self.cls_embedding = LabelEmbedder(config.num_classes, config.dim)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        table = rope_table_2d(config.grid_size, config.head_dim, config.rope_base, config.cls_token_num)
        # A plain float32 tensor, not a buffer: not in the checkpoints, and kept float32 when the model
        # is cast to bfloat16 (the official freqs_cis table stays float32 as well).
        self.rope = table

    @property
    def max_length(self) -> int:
        return self.config.cls_token_num + self.config.grid_size**2

    def run(
        self,
        embeds: torch.Tensor,
        cache: LlamaGenCache | None = None,
        slots: torch.Tensor | None = None,
        visible: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Input embeddings (B, T, dim) appended after the cache -> pre-norm hidden states (B, T, dim).

        With `slots` (T,) and `visible` (T, capacity) (ZipAR, a token tree; inside `writing_at`), or row by row
        (rows, T) and (rows, T, capacity) (a ragged pass): the inputs are written at those slots, sit at sequence
        positions `positions` (default: the slots) and each attends to the slots `visible` marks."""
        past = 0 if cache is None else cache.get_seq_length()
        if slots is None and past + embeds.shape[1] > self.max_length:
            raise ValueError(f"sequence of {past + embeds.shape[1]} exceeds {self.max_length} positions")
        if self.rope.device != embeds.device:
            self.rope = self.rope.to(embeds.device)
        rope = (
            self.rope[past : past + embeds.shape[1]]
            if slots is None
            else self.rope[slots if positions is None else positions]
        )
        if visible is not None and visible.dim() == 3:  # row by row: (rows, 1, T, capacity) for the heads
            visible = visible[:, None]
        h = embeds
        for i, layer in enumerate(self.layers):
            h = layer(h, rope, i, cache, past, visible)
        return h

    def forward(self, tokens: torch.Tensor, class_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits (B, N, vocab) for image tokens (B, N) of classes (B,); no cache."""
        embeds = torch.cat([self.cls_embedding(class_ids), self.tok_embeddings(tokens[:, :-1])], dim=1)
        return self.output(self.norm(self.run(embeds))).float()


class LlamaGenBackbone(ARImageBackbone):
    """A frozen LlamaGen c2i generator behind the ARImageBackbone interface."""

    cfg_space = "logits"

    def __init__(self, config: LlamaGenConfig, vq_path: str | Path | None = None):
        super().__init__()
        self.config = config
        self.name = config.name
        self.model = LlamaGenGPT(config)
        self.geometry = ImageGeometry(rows=config.grid_size, cols=config.grid_size)
        self.codebook_size = config.vocab_size
        self.hidden_size = config.dim
        self.vq_path = None if vq_path is None else Path(vq_path)
        self._codebook: torch.Tensor | None = None
        self._decoder: VQ16Decoder | None = None  # built on first use, kept out of the module tree
        self.vq_architecture: dict = {}  # VQ16Decoder overrides (tests use a tiny one)

    @property
    def num_classes(self) -> int:
        """Class-conditional: ids 0..num_classes-1 (the null class, id num_classes, is the CFG twin)."""
        return self.config.num_classes

    def forward(self, tokens: torch.Tensor, class_ids: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, class_ids)

    def prefill(self, condition: Condition, guided: bool) -> tuple[DecodeState, torch.Tensor]:
        if condition.class_ids is None:
            raise ValueError("LlamaGen c2i is class-conditional: give Condition(class_ids=...)")
        class_ids = condition.class_ids.to(self._device()).long()
        if (class_ids < 0).any() or (class_ids >= self.config.num_classes).any():
            raise ValueError(f"class ids must lie in [0, {self.config.num_classes})")
        if guided:
            class_ids = torch.cat([class_ids, torch.full_like(class_ids, self.config.null_class)])
        state = DecodeState(
            cache=LlamaGenCache(self.config.n_layer, self.cache_capacity(self.config.cls_token_num)),
            batch_size=condition.batch_size,
            guided=guided,
            prefix_length=self.config.cls_token_num,
            extras={"class_ids": class_ids},
        )
        embeds = self.model.cls_embedding(class_ids).to(self._dtype())
        return state, self.model.run(embeds, state.cache)[:, -1:]

    def pass_module(self) -> nn.Module:
        return self.model

    def _compile_pass_module(self) -> None:
        """LlamaGen's passes call the GPT's `run`, not its forward: that is what is compiled."""
        self.model.run = torch.compile(self.model.run, dynamic=True)

    def _forward_flat(self, state: DecodeState, flat_tokens: torch.Tensor) -> torch.Tensor:
        return self.model.run(self.model.tok_embeddings(flat_tokens), state.cache)

    def _forward_flat_at(self, state, flat_tokens, slots, visible, positions=None) -> torch.Tensor:
        return self.model.run(self.model.tok_embeddings(flat_tokens), state.cache, slots, visible, positions)

    @property
    def final_norm(self) -> nn.Module:
        return self.model.norm

    def image_head_weight(self) -> torch.Tensor:
        return self.model.output.weight

    def embed_image_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.tok_embeddings(tokens)

    def codebook_latents(self) -> torch.Tensor:
        if self._codebook is None:
            if self.vq_path is None:
                raise NotImplementedError(
                    f"{self.name}: codebook latents need the VQ-16 tokenizer checkpoint ({VQ_FILE} from {RELEASES}); "
                    "pass vq_path=<path>"
                )
            self._codebook = read_vq_codebook(self.vq_path)
            if self._codebook.shape[0] != self.codebook_size:
                raise ValueError(
                    f"{self.vq_path}: codebook has {self._codebook.shape[0]} entries, "
                    f"the GPT expects {self.codebook_size}"
                )
        return self._codebook.to(self._device())

    def tokens_to_pixels(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, rows, cols) codes -> (B, 3, 16 rows, 16 cols) in [0, 1], through the VQ-16 decoder of `vq_path`."""
        if self.vq_path is None:
            raise NotImplementedError(
                f"{self.name}: decoding tokens to pixels needs LlamaGen's VQ-16 decoder weights ({VQ_FILE} from "
                f"{RELEASES}); pass vq_path=<path>"
            )
        if self._decoder is None:
            object.__setattr__(self, "_decoder", load_vq16_decoder(self.vq_path, **self.vq_architecture))
        device = tokens.device
        decoder = self._decoder.to(device)
        latents = self.codebook_latents().to(device)[tokens].permute(0, 3, 1, 2)  # (B, 8, rows, cols)
        images = decoder(latents.to(next(decoder.parameters()).dtype)).float()
        return ((images + 1) / 2).clamp(0, 1)  # the official samples are saved with value_range (-1, 1)

    def _dtype(self) -> torch.dtype:
        return self.model.tok_embeddings.weight.dtype


class VQ16Decoder(nn.Module):
    """LlamaGen's VQ decoder side (``post_quant_conv`` + ``decoder.*``); keys match the VQ checkpoints.

    VQ-16: ch 128, ch_mult (1, 1, 2, 2, 4), z_channels 256, 2 res blocks per level
    (+1 on the way up), attention at the lowest resolution, GroupNorm(32).
    """

    def __init__(
        self,
        embed_dim: int = 8,
        z_channels: int = 256,
        ch: int = 128,
        ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4),
        num_res_blocks: int = 2,
    ):
        super().__init__()
        self.post_quant_conv = nn.Conv2d(embed_dim, z_channels, 1)
        self.decoder = nn.Module()
        d = self.decoder
        block_in = ch * ch_mult[-1]
        d.conv_in = nn.Conv2d(z_channels, block_in, 3, padding=1)
        d.mid = nn.ModuleList([ResBlock(block_in, block_in), AttnBlock(block_in), ResBlock(block_in, block_in)])
        d.conv_blocks = nn.ModuleList()
        levels = len(ch_mult)
        for level in reversed(range(levels)):
            block = nn.Module()
            block.res, block.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(num_res_blocks + 1):
                block.res.append(ResBlock(block_in, ch * ch_mult[level]))
                block_in = ch * ch_mult[level]
                if level == levels - 1:
                    block.attn.append(AttnBlock(block_in))
            if level != 0:
                block.upsample = Upsample(block_in)
            d.conv_blocks.append(block)
        d.norm_out = group_norm(block_in)
        d.conv_out = nn.Conv2d(block_in, 3, 3, padding=1)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, embed_dim, rows, cols) quantized latents -> (B, 3, H, W) images in [-1, 1] (unclamped)."""
        d = self.decoder
        h = d.conv_in(self.post_quant_conv(latents))
        for module in d.mid:
            h = module(h)
        for block in d.conv_blocks:
            h = run_level(h, block.res, block.attn)
            if hasattr(block, "upsample"):
                h = block.upsample(h)
        return d.conv_out(swish(d.norm_out(h)))


def load_vq16_decoder(path: str | Path, **architecture) -> VQ16Decoder:
    """The decoder half of a LlamaGen VQ checkpoint (encoder, quant_conv and quantizer buffers are skipped)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no LlamaGen VQ checkpoint at {path}: get {VQ_FILE} with\n"
            f"  huggingface-cli download FoundationVision/LlamaGen {VQ_FILE} --local-dir <dir>"
        )
    state = _unwrap(_load_checkpoint(path))
    decoder = VQ16Decoder(**architecture)
    wanted = set(decoder.state_dict())
    decoder.load_state_dict({k: v for k, v in state.items() if k in wanted}, strict=True)
    return decoder.eval().requires_grad_(False)


def read_vq_codebook(path: str | Path) -> torch.Tensor:
    """The (16384, 8) codebook of a LlamaGen VQ checkpoint, L2-normalised as its quantizer uses it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no LlamaGen VQ checkpoint at {path}: get {VQ_FILE} with\n"
            f"  huggingface-cli download FoundationVision/LlamaGen {VQ_FILE} --local-dir <dir>"
        )
    state = _unwrap(_load_checkpoint(path))
    key = "quantize.embedding.weight"
    if key not in state:
        raise KeyError(f"{path}: no {key!r} in the VQ checkpoint")
    return F.normalize(state[key].float(), p=2, dim=-1)


def _load_checkpoint(path: Path, trust_pickle: bool = False) -> dict:
    """The checkpoint's contents (backbones/hf_loading.py `load_torch_checkpoint`)."""
    return load_torch_checkpoint(path, trust_pickle, "a PyTorch checkpoint", f"from {RELEASES}")


def _unwrap(checkpoint: dict) -> dict:
    """The state dict inside an official checkpoint ("model", "module" or "state_dict" entry, or bare)."""
    for key in ("model", "module", "state_dict"):
        if key in checkpoint and isinstance(checkpoint[key], dict):
            return checkpoint[key]
    return checkpoint


def llamagen_config(model: str = "GPT-XL", image_size: int = 384, **overrides) -> LlamaGenConfig:
    if model not in GPT_SIZES:
        raise ValueError(f"unknown LlamaGen model {model!r}; choose from {sorted(GPT_SIZES)}")
    sizes = dict(GPT_SIZES[model])
    if model != "tiny":
        if image_size % DOWNSAMPLE:
            raise ValueError(f"image_size {image_size} is not a multiple of {DOWNSAMPLE}")
        sizes["grid_size"] = image_size // DOWNSAMPLE
        sizes["name"] = f"llamagen-{model}-{image_size}"
    else:
        sizes["name"] = "llamagen-tiny-random"
    sizes.update(overrides)
    return LlamaGenConfig(**sizes)


def load_llamagen_backbone(
    path: str | Path,
    model: str = "GPT-XL",
    image_size: int = 384,
    vq_path: str | Path | None = None,
    device: str = "cuda",
    dtype: str = "bfloat16",
    trust_pickle: bool = False,
    float32_head: bool = False,
) -> LlamaGenBackbone:
    """Hydra entry point: a frozen LlamaGen c2i GPT from an official checkpoint file (e.g. c2i_XL_384.pt).

    `path` is the .pt file or the directory holding it. The file is read with
    ``torch.load(weights_only=True)``; `trust_pickle=True` allows arbitrary pickled
    objects (only for files from a source you trust).
    """
    path = Path(path)
    expected = f"c2i_{CHECKPOINT_NAMES.get(model, model)}_{image_size}.pt"
    if path.is_dir():
        path = path / expected
    if not path.is_file():
        raise FileNotFoundError(
            f"no LlamaGen checkpoint at {path} (expected {expected} from {RELEASES}); get it with\n"
            f"  huggingface-cli download FoundationVision/LlamaGen {expected} --local-dir <dir>\n"
            f"and pass backbone.path=<dir>/{expected}"
        )
    config = llamagen_config(model, image_size)
    backbone = LlamaGenBackbone(config, vq_path=vq_path)
    state = _unwrap(_load_checkpoint(path, trust_pickle))
    state = {k.removeprefix("_orig_mod."): v for k, v in state.items() if not k.endswith("freqs_cis")}
    backbone.model.load_state_dict(state, strict=True)
    backbone.float32_head = float32_head
    return backbone.to(device=device, dtype=getattr(torch, dtype)).eval().requires_grad_(False)


def random_llamagen_backbone(
    seed: int = 0, device: str = "cpu", model: str = "tiny", image_size: int = 64, **overrides
) -> LlamaGenBackbone:
    """Hydra entry point: a LlamaGen backbone with seeded random weights (tiny by default; for tests)."""
    torch.manual_seed(seed)
    backbone = LlamaGenBackbone(llamagen_config(model, image_size, **overrides))
    for parameter in backbone.parameters():  # the official init zeroes `output`; random logits test more
        nn.init.normal_(parameter, std=0.5 if parameter.dim() == 1 else 0.2)
    with torch.no_grad():
        for name, parameter in backbone.named_parameters():
            if "norm" in name:
                parameter.add_(1.0)
    return backbone.to(device).eval().requires_grad_(False)


__all__ = [
    "GPT_SIZES",
    "LlamaGenBackbone",
    "LlamaGenCache",
    "LlamaGenConfig",
    "LlamaGenGPT",
    "VQ16Decoder",
    "llamagen_config",
    "load_llamagen_backbone",
    "load_vq16_decoder",
    "random_llamagen_backbone",
    "read_vq_codebook",
]
