"""GPU memory of SSD head training and of decoding, per GPU, for each real experiment.

    python -m train.memory_estimate [--gpu-gb 80] [--batch N] [--prompt-tokens N] [--out outputs/memory_estimate.json]

Parameter counts come from the published model shapes, instantiated on the meta
device (no weights, no download). The rest is arithmetic over those shapes, one
term per line of the table:

- ``weights``: the frozen backbone in bf16 (2 bytes per parameter), every module
  of the transformers class (LLM, VQ model, vision encoder where the class has one);
- ``heads+adam``: the SSD heads (``head.width: null`` = as wide as the hidden state,
  depth 2) in fp32 with their gradients and AdamW's two moments: 16 bytes per parameter;
- ``teacher``: the no-grad teacher forward over the full sequence (prompt + grid with
  its end-of-line tokens) for ``twins * batch`` rows (``[cond; uncond]`` under CFG):
  its KV cache (``teacher_forced_hidden`` prefills and steps through a cache), the
  transient peak of one layer (residual, attention projections and the SwiGLU
  ``gate``/``up``/product, with SDPA/flash attention, i.e. no T x T score matrix) and
  the retained grid hidden states;
- ``student``: what backward keeps of the loss of train/ssd_module.py for each head
  prediction (vertical + ``horizontal_unroll`` horizontal steps): the head MLP
  activations in fp32 and, dominating for large codebooks, the logits over the
  image codebook of the predicted and target states (bf16 logits, fp32 guided
  scores, log-softmax and the KL terms);
- ``decode KV``: the KV cache of one full image at decode batch 1 and 16 (twins
  under CFG), in bf16.

CUDA context, allocator fragmentation and NCCL buffers (~1-3 GB) are not included.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from common.atomic_io import atomic_write_text
from common.paths import PROJECT_ROOT

GB = 1024**3
BF16, FP32 = 2, 4


@dataclass(frozen=True)
class TransformerShape:
    """What the memory arithmetic needs of a decoder-only backbone."""

    layers: int
    hidden: int
    intermediate: int  # SwiGLU inner width
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token of one row, in bf16."""
        return 2 * self.layers * self.kv_heads * self.head_dim * BF16


@dataclass
class Experiment:
    """One real experiment: the backbone (built on meta), its geometry and the training batch per GPU."""

    name: str
    build: Callable[[], nn.Module]  # the backbone module, on whatever device is current
    shape: Callable[[nn.Module], TransformerShape]
    rows: int
    cols: int
    end_of_line: bool
    prompt_tokens: int  # condition prefix: class token, or an upper bound for a prompt + image header
    codebook: int  # image vocabulary the logits (and the KL of the loss) run over
    batch_per_gpu: int  # images per GPU in head training
    cfg: bool = True  # training and decoding run [cond; uncond] twins
    head_depth: int = 2
    horizontal_unroll: int = 2
    source: str = ""

    @property
    def sequence(self) -> int:
        """Flat length of prompt + grid, end-of-line tokens included."""
        return self.prompt_tokens + self.rows * (self.cols + int(self.end_of_line))

    @property
    def twins(self) -> int:
        return 2 if self.cfg else 1


@dataclass
class Estimate:
    """Bytes per GPU of each term (see the module docstring); `table_row` gives GiB."""

    experiment: str
    backbone_params: int
    head_params: int
    batch_per_gpu: int
    sequence: int
    weights: int
    heads_adam: int
    teacher_kv: int
    teacher_activations: int
    student: int
    decode_kv: dict[int, int] = field(default_factory=dict)
    per_image: int = 0  # bytes that grow with each image of the training batch

    @property
    def train_total(self) -> int:
        return self.weights + self.heads_adam + self.teacher_kv + self.teacher_activations + self.student

    def max_batch(self, gpu_bytes: int) -> int:
        """Training images per GPU that fit in `gpu_bytes` (0: not even one)."""
        fixed = self.train_total - self.batch_per_gpu * self.per_image
        return max(0, math.floor((gpu_bytes - fixed) / self.per_image))

    def to_dict(self, gpu_bytes: int) -> dict:
        out = asdict(self)
        out["decode_kv"] = {str(k): v for k, v in self.decode_kv.items()}
        out["train_total"] = self.train_total
        out["decode_total"] = {str(b): self.weights + kv for b, kv in self.decode_kv.items()}
        out["max_batch_per_gpu"] = self.max_batch(gpu_bytes)
        return out


def count_parameters(module: nn.Module) -> int:
    """Distinct parameters of `module` (tied weights once), in elements; works on the meta device."""
    return sum(p.numel() for p in module.parameters())


def ssd_head_parameters(hidden: int, width: int | None = None, depth: int = 2) -> int:
    """Parameters of an SSD head pair (heads/ssd.py) at this hidden size (`width` None: = hidden)."""
    from heads.ssd import SSDHeadConfig, SSDHeads

    with torch.device("meta"):
        return count_parameters(SSDHeads(SSDHeadConfig(hidden_size=hidden, width=width or hidden, depth=depth)))


def estimate(
    experiment: Experiment,
    backbone_params: int,
    shape: TransformerShape,
    head_params: int,
    batch: int | None = None,
    decode_batches: tuple[int, ...] = (1, 16),
) -> Estimate:
    """The memory terms of `experiment` at `batch` training images per GPU (default: its own)."""
    batch = batch or experiment.batch_per_gpu
    rows = experiment.twins * batch  # teacher rows: [cond; uncond]
    length, grid = experiment.sequence, experiment.rows * experiment.cols
    teacher_kv = shape.kv_bytes_per_token * length * rows
    # One layer's transient peak under no_grad: residual + normed input + q/k/v/out (~4 hidden wide with
    # GQA rounding up) and SwiGLU gate, up and their product (3 intermediate), all bf16; plus the grid
    # states the heads learn from, kept for the whole step.
    teacher_activations = rows * length * (6 * shape.hidden + 3 * shape.intermediate) * BF16
    teacher_activations += rows * grid * shape.hidden * BF16
    predictions = 1 + experiment.horizontal_unroll
    width = shape.hidden  # head.width null
    head_activations = rows * grid * (6 * shape.hidden + 2 * experiment.head_depth * width) * FP32
    # student logits (bf16, all rows) -> guided scores, log-softmax, KL terms (fp32, B rows) + target log-probs
    logits = rows * grid * experiment.codebook * BF16 + batch * grid * experiment.codebook * 4 * FP32
    student = predictions * (head_activations + logits)
    per_image = (teacher_kv + teacher_activations + student) // batch
    decode_kv = {b: shape.kv_bytes_per_token * length * experiment.twins * b for b in decode_batches}
    return Estimate(
        experiment=experiment.name,
        backbone_params=backbone_params,
        head_params=head_params,
        batch_per_gpu=batch,
        sequence=length,
        weights=backbone_params * BF16,
        heads_adam=head_params * (FP32 + FP32 + 2 * FP32),
        teacher_kv=teacher_kv,
        teacher_activations=teacher_activations,
        student=student,
        decode_kv=decode_kv,
        per_image=per_image,
    )


# ---- the published shapes ---------------------------------------------------------------------------
# Numbers are those of each model card's config.json (named in `source`), written here because
# nothing can be downloaded on these machines. Prompt lengths are an upper bound for a
# one-sentence prompt with the family's template and image header (override with --prompt-tokens).


def _hf_shape(text_config) -> TransformerShape:
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return TransformerShape(
        layers=text_config.num_hidden_layers,
        hidden=text_config.hidden_size,
        intermediate=text_config.intermediate_size,
        heads=heads,
        kv_heads=text_config.num_key_value_heads or heads,
        head_dim=head_dim,
    )


def _emu3() -> nn.Module:
    # huggingface.co/BAAI/Emu3-Gen(-hf) config.json: Llama-style 8B, GQA 8 KV heads, 184,622-token vocabulary;
    # VQ tokenizer BAAI/Emu3-VisionTokenizer: 32,768 codes, 8x spatial downsampling (720 px -> 90 x 90).
    from transformers import Emu3Config, Emu3ForConditionalGeneration

    text = dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=184622,
        max_position_embeddings=9216,
        rope_theta=1_000_000.0,
    )
    # The vocabulary map only places the visual tokens in the vocabulary; the ids do not change any count.
    vocabulary = {f"<|visual token {i:06d}|>": 151854 + i for i in range(32768)} | {"<|extra_200|>": 151843}
    return Emu3ForConditionalGeneration(
        Emu3Config(text_config=text, vq_config={"codebook_size": 32768}, vocabulary_map=vocabulary)
    )


def _janus() -> nn.Module:
    # huggingface.co/deepseek-ai/Janus-Pro-7B config.json (deepseek-community/Janus-Pro-7B in transformers
    # format): language model Llama 30 layers x 4096, MHA 32 heads, vocabulary 102,400; SigLIP-L/16 384 px
    # understanding encoder; generation VQ 16,384 codes of 8 dims, 384 px -> 24 x 24; gen head 4096 wide.
    from transformers import JanusConfig, JanusForConditionalGeneration

    text = dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=30,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=102400,
        max_position_embeddings=16384,
        tie_word_embeddings=False,
    )
    config = JanusConfig(
        text_config=text,
        vision_config={"projection_dim": 4096},
        vq_config={"projection_dim": 4096, "image_token_embed_dim": 4096, "num_patches": 24},
        tie_word_embeddings=False,
    )  # the language model's lm_head is its own matrix
    return JanusForConditionalGeneration(config)


def _lumina() -> nn.Module:
    # huggingface.co/Alpha-VLLM/Lumina-mGPT-7B-768 config.json (Chameleon-7B shape): 32 layers x 4096, MHA,
    # qk-layernorm, vocabulary 65,536 of which 8,192 Chameleon VQGAN codes; 768 px -> 48 x 48 + an EOL per row.
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    config = ChameleonConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=65536,
        max_position_embeddings=10240,
        qk_layernorm=True,
        vocabulary_map=_chameleon_vocabulary(),
    )
    return ChameleonForConditionalGeneration(config)


def _chameleon_vocabulary() -> dict[str, int]:
    """Chameleon's map of its 8,192 image-token names (IMGIMG<code in letters A-J>Z) to ids 4..8195."""
    letters = "ABCDEFGHIJ"
    names = {"IMGIMG" + "".join(letters[int(d)] for d in str(code)) + "Z": 4 + code for code in range(8192)}
    return names | {"<image>": 8711}


def _tar() -> nn.Module:
    # huggingface.co/csuhan/Tar-7B: Qwen2.5-7B-Instruct (28 layers x 3584, 28 heads, 4 KV heads, SwiGLU 18,944,
    # untied head) with TA-Tok's 65,536 image codes added to the 151,665-token Qwen2.5 vocabulary
    # (vocabulary size assumed, not read from the checkpoint); scale <S0> = 27 x 27 tokens.
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=151665 + 65536,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config)


def _tar_1_5b() -> nn.Module:
    # huggingface.co/csuhan/Tar-1.5B: Qwen2.5-1.5B-Instruct (28 layers x 1536, 12 heads, 2 KV heads, SwiGLU 8,960,
    # tied embeddings) with the same 65,536 image codes (vocabulary size assumed as for Tar-7B).
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151665 + 65536,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config)


def _llamagen(model: str) -> Callable[[], nn.Module]:
    # github.com/FoundationVision/LlamaGen gpt.py GPT_models (as backbones/llamagen.GPT_SIZES): GPT-XL 36 x 1280,
    # 20 heads; GPT-XXL 48 x 1536, 24 heads; VQ-16 codebook 16,384; 384 px -> 24 x 24; one class token.
    def build() -> nn.Module:
        from backbones.llamagen import LlamaGenBackbone, llamagen_config

        return LlamaGenBackbone(llamagen_config(model, 384))

    return build


def _llamagen_shape(backbone: nn.Module) -> TransformerShape:
    c = backbone.config
    return TransformerShape(
        layers=c.n_layer,
        hidden=c.dim,
        intermediate=c.ffn_hidden,
        heads=c.n_head,
        kv_heads=c.kv_heads,
        head_dim=c.head_dim,
    )


def _text_config(model: nn.Module):
    config = model.config
    return getattr(config, "text_config", None) or config


EXPERIMENTS = [
    Experiment(
        "emu3-gen-8b-720px",
        _emu3,
        lambda m: _hf_shape(_text_config(m)),
        90,
        90,
        True,
        128,
        32768,
        batch_per_gpu=1,
        source="BAAI/Emu3-Gen",
    ),
    Experiment(
        "janus-pro-7b-384px",
        _janus,
        lambda m: _hf_shape(_text_config(m)),
        24,
        24,
        False,
        128,
        16384,
        batch_per_gpu=8,
        source="deepseek-ai/Janus-Pro-7B",
    ),
    Experiment(
        "lumina-mgpt-7b-768px",
        _lumina,
        lambda m: _hf_shape(_text_config(m)),
        48,
        48,
        True,
        128,
        8192,
        batch_per_gpu=2,
        source="Alpha-VLLM/Lumina-mGPT-7B-768",
    ),
    Experiment(
        "llamagen-gpt-xl-384px",
        _llamagen("GPT-XL"),
        _llamagen_shape,
        24,
        24,
        False,
        1,
        16384,
        batch_per_gpu=16,
        source="FoundationVision/LlamaGen c2i_XL_384.pt",
    ),
    Experiment(
        "llamagen-gpt-xxl-384px",
        _llamagen("GPT-XXL"),
        _llamagen_shape,
        24,
        24,
        False,
        1,
        16384,
        batch_per_gpu=16,
        source="FoundationVision/LlamaGen c2i_XXL_384.pt",
    ),
    Experiment(
        "tar-7b-s0",
        _tar,
        lambda m: _hf_shape(_text_config(m)),
        27,
        27,
        False,
        128,
        65536,
        batch_per_gpu=8,
        source="csuhan/Tar-7B",
    ),
    Experiment(
        "tar-1.5b-s0",
        _tar_1_5b,
        lambda m: _hf_shape(_text_config(m)),
        27,
        27,
        False,
        128,
        65536,
        batch_per_gpu=8,
        source="csuhan/Tar-1.5B",
    ),
]


def estimate_experiment(experiment: Experiment, batch: int | None = None) -> Estimate:
    """Build `experiment`'s backbone on the meta device, count it and its heads, and estimate its memory."""
    with torch.device("meta"):
        model = experiment.build()
    shape = experiment.shape(model)
    return estimate(
        experiment,
        count_parameters(model),
        shape,
        ssd_head_parameters(shape.hidden, depth=experiment.head_depth),
        batch,
    )


def format_table(estimates: list[Estimate], gpu_bytes: int) -> str:
    """The estimates as a fixed-width table in GiB."""
    header = (
        f"{'experiment':<24}{'params':>8}{'heads':>7}{'batch':>6}{'seq':>6}{'weights':>9}{'heads+adam':>11}"
        f"{'teacher':>9}{'student':>9}{'train':>8}{f'max@{gpu_bytes / GB:.0f}G':>9}"
        f"{'dec KV b1':>10}{'dec KV b16':>11}"
    )
    lines = [header, "-" * len(header)]
    for e in estimates:
        lines.append(
            f"{e.experiment:<24}{e.backbone_params / 1e9:>7.2f}B{e.head_params / 1e6:>6.0f}M{e.batch_per_gpu:>6}"
            f"{e.sequence:>6}{e.weights / GB:>9.1f}{e.heads_adam / GB:>11.2f}"
            f"{(e.teacher_kv + e.teacher_activations) / GB:>9.1f}{e.student / GB:>9.1f}{e.train_total / GB:>8.1f}"
            f"{e.max_batch(gpu_bytes):>9}{e.decode_kv[1] / GB:>10.2f}{e.decode_kv[16] / GB:>11.2f}"
        )
    lines.append(
        "GiB per GPU; train = weights + heads+adam + teacher (KV + activations) + student; "
        "max = training images per GPU that fit; dec KV: decode KV cache at batch 1 / 16 (CFG twins). "
        "CUDA context and fragmentation (~1-3 GB) not included."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Print the table and write it as JSON; returns the JSON payload."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-gb", type=float, default=80.0, help="GPU memory for the max-batch column (GiB)")
    parser.add_argument("--batch", type=int, default=None, help="training images per GPU for every experiment")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="prompt length of the text-to-image models")
    parser.add_argument("--only", nargs="*", default=None, help="experiment names to estimate (default: all)")
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "outputs" / "memory_estimate.json")
    args = parser.parse_args(argv)
    gpu_bytes = int(args.gpu_gb * GB)
    chosen = [e for e in EXPERIMENTS if not args.only or e.name in args.only]
    if args.only and len(chosen) != len(args.only):
        raise SystemExit(f"unknown experiment in --only {args.only}; available: {[e.name for e in EXPERIMENTS]}")
    estimates = []
    for experiment in chosen:
        if args.prompt_tokens is not None and experiment.prompt_tokens > 1:
            experiment = replace(experiment, prompt_tokens=args.prompt_tokens)
        estimates.append(estimate_experiment(experiment, args.batch))
    print(format_table(estimates, gpu_bytes))
    payload = {
        "gpu_gib": args.gpu_gb,
        "units": "bytes",
        "experiments": {e.experiment: e.to_dict(gpu_bytes) for e in estimates},
    }
    atomic_write_text(args.out, json.dumps(payload, indent=2) + "\n")
    print(f"[memory] wrote {args.out}")
    return payload


if __name__ == "__main__":
    main()
