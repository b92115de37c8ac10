"""Hugging Face architectures as users bring them: each built from a small config (random init, no
download), trained a few steps through ``@flash_inductor.train_step``, without and with FP8, beside
the stock step, and what the backend made of each.

    python benchmarks/hf_zoo.py [--device cpu|cuda] [--size tiny|small] [--models qwen3,falcon,...]
                                [--rows stock,flashoptim,flashoptim_fp8] [--steps 8] [--compiler inductor|eager]
                                [--profile N] [--out benchmarks/results/hf_zoo_....json]

Rows: ``stock`` (fp32 parameters, torch's AdamW, fused on CUDA, with bf16 autocast and
``torch.compile(model)`` there; eager on the CPU), ``flashoptim`` (``train_step``: 24-bit masters,
8-bit states) and ``flashoptim_fp8`` (the same with ``fp8="tensorwise"``; every eligible linear at
``--size tiny``). Run when named: ``flashoptim_fp8+every`` (every eligible linear, whatever its size),
``flashoptim+cudagraphs`` and ``flashoptim_fp8+cudagraphs`` (``cudagraphs=True``), ``flashoptim+recompute``
and ``flashoptim_fp8+recompute`` (``recompute_elementwise=True``), ``flashoptim_fp8+rowwise`` (``fp8="rowwise"``),
``flashoptim_fp8+rowwise+tensorwisedw`` (also ``fp8_tensorwise_weight_gradient=True``).
Every row trains on
one fixed batch (random tokens; fp32 random images, mel features or waveforms for the vision and audio models;
the loss falls as the model memorizes it), dropout off, so the rows' losses are comparable step by
step.

Per architecture and row: whether it trains (else the error), the first and last losses, the FP8
decisions (how many matmuls on parameters run in FP8, the reasons of the others), the graph breaks
other than the train step's own two (``loss.backward()`` and the prepared ``optimizer.step()``), the
``PassFailed`` warnings, bytes per parameter (``memory_report``), and on CUDA the median step time
and the peak memory allocated and reserved after the first step (above what the process held before
the row); with ``--profile N``, where N more steps spend their time (``gpu_profile.step_profile``).
"""

import argparse
import collections
import gc
import json
import pathlib
import platform
import statistics
import sys
import time
import traceback
import warnings

import torch

import flash_inductor
from flash_inductor import inspection
from flash_inductor.pipeline import PassFailed

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from gpu_profile import print_profile, step_profile  # noqa: E402

# The dims of each size; each architecture's config takes them under its own names.
# Vision models take images of ``image`` pixels a side (``labels`` classes), audio models ``mel``
# bins by ``frames``; their inputs are fp32, as users load them.
SIZES = {
    "tiny": dict(vocab=512, hidden=64, inter=128, layers=2, heads=4, kv_heads=2, batch=2, seq=32,
                 image=32, patch=8, labels=10, mel=16, frames=64, samples=4000),
    "small": dict(vocab=32000, hidden=1024, inter=2816, layers=4, heads=16, kv_heads=4, batch=4, seq=1024,
                  image=224, patch=16, labels=1000, mel=80, frames=3000, samples=64000),
}


def _decoder(config_class, model_class, **extra):
    """A Llama-like decoder's builder; ``extra``: more config fields."""
    def build(T, d):
        config = getattr(T, config_class)(
            vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"],
            num_hidden_layers=d["layers"], num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"],
            head_dim=d["hidden"] // d["heads"], max_position_embeddings=max(64, d["seq"]), **extra)
        return getattr(T, model_class)(config)
    return build


def _moe(config_class, model_class, experts_key, **extra):
    """A mixture of experts (4, 2 per token) of a Llama-like decoder."""
    return _decoder(config_class, model_class, num_experts_per_tok=2, **{experts_key: 4}, **extra)


def _alternating(first, second, d):
    """A per-layer config list: ``first`` and ``second`` in turn over the ``layers``."""
    return [first, second] * (d["layers"] // 2)


def _mrope_sections(d):
    """Qwen2.5-VL's rotary frequencies of a head split between time, height and width (1 : 1.5 : 1.5)."""
    half = d["hidden"] // d["heads"] // 2
    time = half // 4
    return [time, (half - time) // 2, half - time - (half - time) // 2]


def _qwen_vl_token_ids(d):
    """Qwen2.5-VL's special tokens, the vocabulary's last four: image, video, vision start and end."""
    return dict(image_token_id=d["vocab"] - 1, video_token_id=d["vocab"] - 2, vision_start_token_id=d["vocab"] - 3,
                vision_end_token_id=d["vocab"] - 4)


def _t5gemma_stack(d):
    """T5Gemma's encoder or decoder config fields."""
    return dict(vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"],
                num_hidden_layers=d["layers"], num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"],
                head_dim=d["hidden"] // d["heads"])


def _stage_widths(d):
    """Channels of a convolutional network's ``layers`` stages, doubling up to ``hidden``."""
    return [d["hidden"] // 2 ** (d["layers"] - 1 - i) for i in range(d["layers"])]


ARCHITECTURES = {
    "llama": _decoder("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": _decoder("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": _decoder("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": _decoder("MistralConfig", "MistralForCausalLM"),
    "gemma2": _decoder("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": _decoder("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": _decoder("Phi3Config", "Phi3ForCausalLM", pad_token_id=0),
    "mixtral": _moe("MixtralConfig", "MixtralForCausalLM", "num_local_experts"),
    "qwen3_moe": _moe("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "num_experts"),
    "gpt_neox": lambda T, d: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"], max_position_embeddings=max(64, d["seq"]))),
    "opt": lambda T, d: T.OPTForCausalLM(T.OPTConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], ffn_dim=d["inter"], num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"], word_embed_proj_dim=d["hidden"], max_position_embeddings=max(64, d["seq"]))),
    "bloom": lambda T, d: T.BloomForCausalLM(T.BloomConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], n_layer=d["layers"], n_head=d["heads"])),
    "falcon": lambda T, d: T.FalconForCausalLM(T.FalconConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], num_hidden_layers=d["layers"], num_attention_heads=d["heads"])),
    "bert": lambda T, d: T.BertForMaskedLM(T.BertConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"], max_position_embeddings=max(64, d["seq"]))),
    "t5": lambda T, d: T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=d["vocab"], d_model=d["hidden"], d_ff=d["inter"], num_layers=d["layers"], num_heads=d["heads"],
        d_kv=d["hidden"] // d["heads"], decoder_start_token_id=0, pad_token_id=0)),
    "vit": lambda T, d: T.ViTForImageClassification(T.ViTConfig(
        hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"], image_size=d["image"], patch_size=d["patch"], num_labels=d["labels"])),
    "siglip": lambda T, d: T.SiglipForImageClassification(T.SiglipConfig(  # an nn.MultiheadAttention pooling head
        vision_config=dict(hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
                           num_attention_heads=d["heads"], image_size=d["image"], patch_size=d["patch"]),
        text_config=dict(vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"],
                         num_hidden_layers=1, num_attention_heads=d["heads"], bos_token_id=1, eos_token_id=2,
                         pad_token_id=0),
        num_labels=d["labels"])),
    "resnet": lambda T, d: T.ResNetForImageClassification(T.ResNetConfig(  # BatchNorm2d
        embedding_size=d["hidden"] // 4, hidden_sizes=_stage_widths(d),
        depths=[1] * d["layers"], num_labels=d["labels"])),
    "convnext": lambda T, d: T.ConvNextForImageClassification(T.ConvNextConfig(  # depthwise convolutions
        num_stages=d["layers"], hidden_sizes=_stage_widths(d),
        depths=[1] * d["layers"], num_labels=d["labels"])),
    "whisper": lambda T, d: T.WhisperForConditionalGeneration(T.WhisperConfig(  # 1-D convolutions over mel features
        vocab_size=d["vocab"], d_model=d["hidden"], encoder_layers=d["layers"], decoder_layers=d["layers"],
        encoder_attention_heads=d["heads"], decoder_attention_heads=d["heads"], encoder_ffn_dim=d["inter"],
        decoder_ffn_dim=d["inter"], num_mel_bins=d["mel"], max_source_positions=d["frames"] // 2,
        max_target_positions=max(64, d["seq"]), pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1)),
    # a weight-normed convolution (a parametrization) for its positions, CTC's loss; its feature encoder's
    # default strides (5, 2, ..., 2: 320 samples a frame) at size small, two at size tiny (10 samples a frame)
    "wav2vec2": lambda T, d: T.Wav2Vec2ForCTC(T.Wav2Vec2Config(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"], pad_token_id=0, mask_time_prob=0.0, ctc_loss_reduction="mean",
        **({} if d["samples"] > 10000 else dict(conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
                                                num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)))),
    # multi-head latent attention (low-rank q and kv projections with norms between), a first dense layer, then
    # routed and shared experts; its router multiplies by its weight in fp32 (F.linear on .float())
    "deepseek_v3": lambda T, d: T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"], moe_intermediate_size=d["inter"] // 2,
        num_hidden_layers=d["layers"], num_attention_heads=d["heads"], num_key_value_heads=d["heads"],
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
        q_lora_rank=d["hidden"] // 2, kv_lora_rank=d["hidden"] // 2, qk_rope_head_dim=d["hidden"] // d["heads"] // 2,
        qk_nope_head_dim=d["hidden"] // d["heads"], v_head_dim=d["hidden"] // d["heads"],
        max_position_embeddings=max(64, d["seq"]))),
    # a state-space model: no attention, a depthwise causal convolution, parameters A_log and D used elementwise
    "mamba": lambda T, d: T.MambaForCausalLM(T.MambaConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], num_hidden_layers=d["layers"], state_size=16, expand=2)),
    # encoder-decoder, embeddings shared by encoder, decoder and lm_head, learned positions
    "bart": lambda T, d: T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=d["vocab"], d_model=d["hidden"], encoder_layers=d["layers"], decoder_layers=d["layers"],
        encoder_attention_heads=d["heads"], decoder_attention_heads=d["heads"], encoder_ffn_dim=d["inter"],
        decoder_ffn_dim=d["inter"], max_position_embeddings=max(64, d["seq"]))),
    # experts in one 3-D parameter each (ParallelExperts), embedding, attention and logits multipliers;
    # its FP8 backward reads the attention inputs transposed (bf16 tiles in Inductor's C++ code)
    "granitemoe": _moe("GraniteMoeConfig", "GraniteMoeForCausalLM", "num_local_experts"),
    # an encoder that drops padding inside the model (unpadded attention), global and local layers
    "modernbert": lambda T, d: T.ModernBertForMaskedLM(T.ModernBertConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"], max_position_embeddings=max(64, d["seq"]), pad_token_id=0, bos_token_id=1,
        eos_token_id=2, cls_token_id=1, sep_token_id=2)),
    # norms after attention and MLP (not before), q and k normalized over all heads
    "olmo2": _decoder("Olmo2Config", "Olmo2ForCausalLM"),
    # attention and MLP in parallel from one LayerNorm, rotary on part of each head
    "gptj": lambda T, d: T.GPTJForCausalLM(T.GPTJConfig(
        vocab_size=d["vocab"], n_embd=d["hidden"], n_layer=d["layers"], n_head=d["heads"],
        rotary_dim=d["hidden"] // d["heads"] // 2, n_positions=max(64, d["seq"]))),
    # embeddings narrower than the hidden size, projected up by a linear
    "electra": lambda T, d: T.ElectraForMaskedLM(T.ElectraConfig(
        vocab_size=d["vocab"], embedding_size=d["hidden"] // 2, hidden_size=d["hidden"], intermediate_size=d["inter"],
        num_hidden_layers=d["layers"], num_attention_heads=d["heads"], max_position_embeddings=max(64, d["seq"]))),
    # a vision tower (CLIP) whose patch features a projector puts in place of the image tokens of a
    # Llama's input; CLIP's post_layernorm feeds nothing the loss reads
    "llava": lambda T, d: T.LlavaForConditionalGeneration(T.LlavaConfig(
        vision_config=T.CLIPVisionConfig(hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
                                         num_attention_heads=d["heads"], image_size=d["image"], patch_size=d["patch"]),
        text_config=T.LlamaConfig(vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"],
                                  num_hidden_layers=d["layers"], num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"],
                                  max_position_embeddings=max(64, d["seq"])),
        image_token_index=d["vocab"] - 1, vision_feature_layer=-1, vision_feature_select_strategy="full")),
    # one layer's weights shared by every layer, embeddings projected up to the hidden size
    "albert": lambda T, d: T.AlbertForMaskedLM(T.AlbertConfig(
        vocab_size=d["vocab"], embedding_size=d["hidden"] // 2, hidden_size=d["hidden"], intermediate_size=d["inter"],
        num_hidden_layers=d["layers"], num_attention_heads=d["heads"], max_position_embeddings=max(64, d["seq"]))),
    # disentangled attention: content and relative-position projections, positions in buckets
    "deberta_v2": lambda T, d: T.DebertaV2ForMaskedLM(T.DebertaV2Config(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"], max_position_embeddings=max(64, d["seq"]), relative_attention=True,
        position_buckets=16, pos_att_type=["p2c", "c2p"])),
    "olmoe": _moe("OlmoeConfig", "OlmoeForCausalLM", "num_experts"),
    # state-space duality: a chunked scan (torch ops without the mamba_ssm kernels), grouped heads
    "mamba2": lambda T, d: T.Mamba2ForCausalLM(T.Mamba2Config(
        vocab_size=d["vocab"], hidden_size=d["hidden"], num_hidden_layers=d["layers"], state_size=16, expand=2,
        num_heads=d["hidden"] * 2 // 16, head_dim=16, n_groups=1, chunk_size=16)),
    "stablelm": _decoder("StableLmConfig", "StableLmForCausalLM"),
    # LayerNorm without bias, attention and MLP in parallel, logits scaled
    "cohere": _decoder("CohereConfig", "CohereForCausalLM"),
    # windowed attention with a relative position bias table (a parameter gathered by a buffer of indices)
    "swin": lambda T, d: T.SwinForImageClassification(T.SwinConfig(
        image_size=d["image"], patch_size=d["patch"] // 2, embed_dim=d["hidden"] // 2, depths=[1, 1],
        num_heads=[d["heads"] // 2, d["heads"]], window_size=d["image"] // d["patch"], num_labels=d["labels"])),
    # two towers and a contrastive loss over the batch's image-text pairs, scaled by exp of a 0-dim parameter
    "clip": lambda T, d: T.CLIPModel(T.CLIPConfig(
        text_config=dict(vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"],
                         num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
                         max_position_embeddings=max(64, d["seq"]), bos_token_id=1, eos_token_id=2, pad_token_id=0),
        vision_config=dict(hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
                           num_attention_heads=d["heads"], image_size=d["image"], patch_size=d["patch"]),
        projection_dim=d["hidden"] // 2)),
    # RMSNorm scaling by (1 + weight), embeddings multiplied by sqrt(hidden)
    "gemma": _decoder("GemmaConfig", "GemmaForCausalLM"),
    # attention and MLP in parallel, rotary on half of each head, a dense output with a bias
    "phi": lambda T, d: T.PhiForCausalLM(T.PhiConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"], partial_rotary_factor=0.5, max_position_embeddings=max(64, d["seq"]))),
    "starcoder2": _decoder("Starcoder2Config", "Starcoder2ForCausalLM", bos_token_id=1, eos_token_id=2),
    # squared-ReLU MLP, LayerNorm scaling by (1 + weight)
    "nemotron": _decoder("NemotronConfig", "NemotronForCausalLM"),
    # experts of attention heads as well as of MLPs
    "jetmoe": lambda T, d: T.JetMoeForCausalLM(T.JetMoeConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], num_hidden_layers=d["layers"], num_key_value_heads=d["kv_heads"],
        kv_channels=d["hidden"] // d["heads"], intermediate_size=d["inter"], num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=max(64, d["seq"]))),
    # experts stored as one fused parameter per projection, viewed per expert
    "dbrx": lambda T, d: T.DbrxForCausalLM(T.DbrxConfig(
        vocab_size=d["vocab"], d_model=d["hidden"], n_layers=d["layers"], n_heads=d["heads"], max_seq_len=max(64, d["seq"]),
        attn_config=dict(kv_n_heads=d["kv_heads"], rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=d["inter"], moe_num_experts=4, moe_top_k=2))),
    # Mamba and attention layers in turn, experts in every other layer (torch's scan, no CUDA kernels)
    "jamba": lambda T, d: T.JambaForCausalLM(T.JambaConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"], num_experts=4, num_experts_per_tok=2,
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8,
        mamba_dt_rank=8)),
    "roberta": lambda T, d: T.RobertaForMaskedLM(T.RobertaConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"], max_position_embeddings=max(64, d["seq"]) + 2)),
    # bottlenecks around each block, NoNorm (an elementwise scale and shift, no statistics)
    "mobilebert": lambda T, d: T.MobileBertForMaskedLM(T.MobileBertConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], embedding_size=d["hidden"] // 2, intermediate_size=d["inter"],
        num_hidden_layers=d["layers"], num_attention_heads=d["heads"], intra_bottleneck_size=d["hidden"] // 2,
        true_hidden_size=d["hidden"] // 2, max_position_embeddings=max(64, d["seq"]))),
    # two-stream relative attention: projections are 3-D parameters multiplied through einsum
    "xlnet": lambda T, d: T.XLNetLMHeadModel(T.XLNetConfig(
        vocab_size=d["vocab"], d_model=d["hidden"], n_layer=d["layers"], n_head=d["heads"], d_inner=d["inter"])),
    # token mixing by a 2-D Fourier transform in place of attention
    "fnet": lambda T, d: T.FNetForMaskedLM(T.FNetConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
        max_position_embeddings=max(64, d["seq"]), use_tpu_fourier_optimizations=False)),
    # layer scales (1-D parameters that multiply each block's output), a mask token parameter
    "dinov2": lambda T, d: T.Dinov2ForImageClassification(T.Dinov2Config(
        hidden_size=d["hidden"], num_hidden_layers=d["layers"], num_attention_heads=d["heads"], image_size=d["image"],
        patch_size=d["patch"], num_labels=d["labels"])),
    # overlapping convolutional patches, attention over spatially reduced keys and values
    "segformer": lambda T, d: T.SegformerForImageClassification(T.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[d["hidden"] // 2, d["hidden"]],
        num_attention_heads=[d["heads"] // 2, d["heads"]], num_labels=d["labels"])),
    "hubert": lambda T, d: T.HubertForCTC(T.HubertConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"], pad_token_id=0, mask_time_prob=0.0, ctc_loss_reduction="mean",
        **({} if d["samples"] > 10000 else dict(conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
                                                num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)))),
    # multi-query attention (one key/value head), fused c_attn
    "gpt_bigcode": lambda T, d: T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(
        vocab_size=d["vocab"], n_embd=d["hidden"], n_layer=d["layers"], n_head=d["heads"], n_positions=max(64, d["seq"]),
        multi_query=True)),
    # ALiBi position biases, no LayerNorm biases
    "mpt": lambda T, d: T.MptForCausalLM(T.MptConfig(
        vocab_size=d["vocab"], d_model=d["hidden"], n_layers=d["layers"], n_heads=d["heads"], max_seq_len=max(64, d["seq"]))),
    # one fused qkv projection split by mp_num, rotary on part of each head, parallel blocks
    "codegen": lambda T, d: T.CodeGenForCausalLM(T.CodeGenConfig(
        vocab_size=d["vocab"], n_embd=d["hidden"], n_layer=d["layers"], n_head=d["heads"], rotary_dim=8,
        n_positions=max(64, d["seq"]), n_ctx=max(64, d["seq"]))),
    # recurrent (RG-LRU, block-diagonal per-head gates) and local-attention layers in turn
    "recurrent_gemma": lambda T, d: T.RecurrentGemmaForCausalLM(T.RecurrentGemmaConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=3,
        num_attention_heads=d["heads"], num_key_value_heads=1, lru_width=d["hidden"], attention_window_size=16,
        head_dim=d["hidden"] // d["heads"])),
    # multipliers on the embeddings, residuals, attention and logits
    "granite": _decoder("GraniteConfig", "GraniteForCausalLM"),
    "glm": _decoder("GlmConfig", "GlmForCausalLM", pad_token_id=0),
    # squared-ReLU MLP, LayerNorms on queries and keys, rotary on half of each head
    "persimmon": lambda T, d: T.PersimmonForCausalLM(T.PersimmonConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"], max_position_embeddings=max(64, d["seq"]))),
    # attention sinks (a learned logit per head), sliding-window layers, experts as 3-D parameters with biases
    "gpt_oss": lambda T, d: _moe("GptOssConfig", "GptOssForCausalLM", "num_local_experts", sliding_window=16,
                                 layer_types=_alternating("sliding_attention", "full_attention", d))(T, d),
    # gated DeltaNet linear attention (torch's chunked recurrence) in turn with gated attention; experts and
    # a shared expert
    "qwen3_next": lambda T, d: _moe("Qwen3NextConfig", "Qwen3NextForCausalLM", "num_experts",
                                    moe_intermediate_size=d["inter"] // 2, shared_expert_intermediate_size=d["inter"] // 2,
                                    linear_num_value_heads=d["heads"], linear_num_key_heads=d["kv_heads"],
                                    linear_key_head_dim=d["hidden"] // d["heads"],
                                    linear_value_head_dim=d["hidden"] // d["heads"],
                                    layer_types=_alternating("linear_attention", "full_attention", d))(T, d),
    # gated short convolutions in place of attention in some layers
    "lfm2": lambda T, d: T.Lfm2ForCausalLM(T.Lfm2Config(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"], max_position_embeddings=max(64, d["seq"]),
        layer_types=_alternating("conv", "full_attention", d))),
    # Mamba-2 and attention side by side in every layer, muP multipliers
    "falcon_h1": lambda T, d: _decoder("FalconH1Config", "FalconH1ForCausalLM", mamba_d_ssm=d["hidden"],
                                       mamba_n_heads=d["heads"], mamba_d_head=d["hidden"] // d["heads"], mamba_d_state=8,
                                       mamba_n_groups=1, mamba_chunk_size=16)(T, d),
    # rotary embeddings off in some layers (NoPE)
    "smollm3": lambda T, d: _decoder("SmolLM3Config", "SmolLM3ForCausalLM", no_rope_layers=_alternating(1, 0, d),
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2)(T, d),
    # xIELU activation (learned scalars inside the MLP's activation), norms on queries and keys
    "apertus": _decoder("ApertusConfig", "ApertusForCausalLM"),
    # sliding-window attention with global tokens, built from chunked matmuls
    "longformer": lambda T, d: T.LongformerForMaskedLM(T.LongformerConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"], attention_window=8, max_position_embeddings=max(64, d["seq"]) + 2)),
    # an encoder-decoder of Gemma 2 layers
    "t5gemma": lambda T, d: T.T5GemmaForConditionalGeneration(T.T5GemmaConfig(
        encoder=_t5gemma_stack(d), decoder=dict(_t5gemma_stack(d), cross_attention_hidden_size=d["hidden"]),
        vocab_size=d["vocab"])),
    # AltUp's parallel streams, LAuReL's low-rank residuals, per-layer token embeddings
    "gemma3n": lambda T, d: T.Gemma3nForCausalLM(T.Gemma3nTextConfig(
        vocab_size=d["vocab"], vocab_size_per_layer_input=d["vocab"], hidden_size=d["hidden"],
        hidden_size_per_layer_input=16, intermediate_size=d["inter"], num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"], head_dim=d["hidden"] // d["heads"],
        max_position_embeddings=max(64, d["seq"]), layer_types=_alternating("sliding_attention", "full_attention", d),
        num_kv_shared_layers=0, activation_sparsity_pattern=[0.0] * d["layers"], laurel_rank=8, altup_num_inputs=2)),
    # a vision tower of window attention over patches merged 2 x 2, multimodal rotary positions (its data-dependent
    # window indices break the graph)
    "qwen2_5_vl": lambda T, d: T.Qwen2_5_VLForConditionalGeneration(T.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"],
                         num_hidden_layers=d["layers"], num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"],
                         max_position_embeddings=max(128, 2 * d["seq"]),
                         rope_scaling={"type": "mrope", "mrope_section": _mrope_sections(d)}),
        vision_config=dict(depth=d["layers"], hidden_size=d["hidden"] // 2, intermediate_size=d["inter"] // 2,
                           num_heads=d["heads"] // 2, out_hidden_size=d["hidden"], patch_size=d["patch"],
                           spatial_merge_size=2, temporal_patch_size=2, window_size=4 * d["patch"],
                           fullatt_block_indexes=[d["layers"] - 1]),
        **_qwen_vl_token_ids(d))),
    # Mamba-2 layers with one attention layer among them (attn_layer_indices), no rotary in the Mamba layers
    "bamba": lambda T, d: _decoder("BambaConfig", "BambaForCausalLM", attn_layer_indices=[d["layers"] - 1],
                                   mamba_n_heads=d["heads"] * 2, mamba_d_head=d["hidden"] // d["heads"], mamba_n_groups=1,
                                   mamba_d_state=8, mamba_chunk_size=16)(T, d),
    # Mamba-2 layers and one attention-and-MLP block whose weights all hybrid layers share, with a LoRA adapter each
    "zamba2": lambda T, d: T.Zamba2ForCausalLM(T.Zamba2Config(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"], num_key_value_heads=d["heads"], layers_block_type=_alternating("mamba", "hybrid", d),
        mamba_d_state=8, n_mamba_heads=d["heads"] * 2, mamba_ngroups=1, chunk_size=16, num_mem_blocks=1,
        use_shared_attention_adapter=True, adapter_rank=8, max_position_embeddings=max(64, d["seq"]),
        pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Mamba-2 and attention layers in turn, experts as 3-D parameters and a shared MLP, Granite's multipliers
    "granitemoehybrid": lambda T, d: _moe("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", "num_local_experts",
                                          shared_intermediate_size=d["inter"], layer_types=_alternating("mamba", "attention", d),
                                          mamba_n_heads=d["heads"] * 2, mamba_d_head=d["hidden"] // d["heads"],
                                          mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16)(T, d),
    # sliding-window layers with rotary, full-attention layers without (NoPE), parallel blocks, logits scaled
    "cohere2": lambda T, d: _decoder("Cohere2Config", "Cohere2ForCausalLM", sliding_window=16,
                                     layer_types=_alternating("sliding_attention", "full_attention", d))(T, d),
    # sigmoid router with a per-expert bias for selection, shared experts, a first dense layer, norms on q and k
    "glm4_moe": lambda T, d: _decoder("Glm4MoeConfig", "Glm4MoeForCausalLM", n_routed_experts=4, num_experts_per_tok=2,
                                      n_shared_experts=1, moe_intermediate_size=d["inter"] // 2, first_k_dense_replace=1,
                                      n_group=1, topk_group=1, use_qk_norm=True, pad_token_id=0)(T, d),
    # lightning attention (linear attention in blocks, a decay per head) in turn with full attention; experts,
    # residuals scaled by alpha and beta
    "minimax": lambda T, d: _moe("MiniMaxConfig", "MiniMaxForCausalLM", "num_local_experts", block_size=16,
                                 layer_types=_alternating("linear_attention", "full_attention", d))(T, d),
    # RMSNorms inside attention (before o_proj) and the MLP (before down_proj), squared-ReLU gated MLP; unquantized
    "bitnet": _decoder("BitNetConfig", "BitNetForCausalLM"),
    # an encoder-decoder like BART with pre-norm layers and a LayerNorm after each stack, embeddings scaled
    "mbart": lambda T, d: T.MBartForConditionalGeneration(T.MBartConfig(
        vocab_size=d["vocab"], d_model=d["hidden"], encoder_layers=d["layers"], decoder_layers=d["layers"],
        encoder_attention_heads=d["heads"], decoder_attention_heads=d["heads"], encoder_ffn_dim=d["inter"],
        decoder_ffn_dim=d["inter"], max_position_embeddings=max(64, d["seq"]), scale_embedding=True, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=2)),
    # a relative position bias table per layer (no absolute positions), layer scales, mean pooling of the patches
    "beit": lambda T, d: T.BeitForImageClassification(T.BeitConfig(
        hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"], image_size=d["image"], patch_size=d["patch"], num_labels=d["labels"],
        use_relative_position_bias=True, use_absolute_position_embeddings=False, layer_scale_init_value=0.1,
        use_mean_pooling=True)),
    # gated relative position bias (buckets, gates computed from each query), CTC's loss
    "wavlm": lambda T, d: T.WavLMForCTC(T.WavLMConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"], num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"], pad_token_id=0, mask_time_prob=0.0, ctc_loss_reduction="mean", num_buckets=32,
        max_bucket_distance=64,
        **({} if d["samples"] > 10000 else dict(conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
                                                num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)))),
}
IMAGE_MODELS = {"vit", "siglip", "resnet", "convnext", "swin", "dinov2", "segformer", "beit"}
AUDIO_MODELS = {"whisper"}  # mel features
WAVEFORM_MODELS = {"wav2vec2", "hubert", "wavlm"}
CONTRASTIVE_MODELS = {"clip"}  # tokens and images in pairs
IMAGE_TEXT_MODELS = {"llava"}  # one image's patch features in place of its tokens, then text
QWEN_VL_MODELS = {"qwen2_5_vl"}  # an image's flattened patches and its grid; its merged patches' tokens in the text
# Modules that call ops without a bf16 kernel, kept fp32 (prepare's keep_fp32): FNet's torch.fft.fftn
KEEP_FP32 = {"fnet": ["*.fourier.self"]}
ROWS = ("stock", "flashoptim", "flashoptim_fp8", "flashoptim_fp8+every", "flashoptim+cudagraphs", "flashoptim_fp8+cudagraphs",
        "flashoptim+recompute", "flashoptim_fp8+recompute", "flashoptim_fp8+rowwise", "flashoptim_fp8+rowwise+tensorwisedw")
DEFAULT_ROWS = ROWS[:3]
# A train step's own graph breaks: at loss.backward(), and where the prepared optimizer's step runs.
OWN_BREAKS = ("Tensor.backward()", "torch.compiler.disable()")


def build_model(name, size, device):
    import transformers

    torch.manual_seed(0)
    model = ARCHITECTURES[name](transformers, SIZES[size])
    for module in model.modules():  # dropout off: the rows compare step by step
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    for key, value in vars(model.config).items():  # layer drop too (wav2vec2's default is 0.1)
        if ("dropout" in key or "layerdrop" in key) and isinstance(value, float):
            setattr(model.config, key, 0.0)
    return model.to(device)


def fixed_batch(name, size, device):
    """The one batch every row of model ``name`` trains on: random tokens (their ids are also the
    labels), or fp32 random images with random classes, or fp32 random mel features or waveforms with random
    tokens, or random tokens and images as pairs, or an image and tokens that hold its image tokens."""
    d = SIZES[size]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, d["vocab"], (d["batch"], d["seq"]), generator=gen)
    if name in CONTRASTIVE_MODELS:
        batch = dict(input_ids=ids, pixel_values=torch.randn(d["batch"], 3, d["image"], d["image"], generator=gen),
                     return_loss=True)
    elif name in IMAGE_MODELS:
        batch = dict(pixel_values=torch.randn(d["batch"], 3, d["image"], d["image"], generator=gen),
                     labels=torch.randint(0, d["labels"], (d["batch"],), generator=gen))
    elif name in AUDIO_MODELS:
        batch = dict(input_features=torch.randn(d["batch"], d["mel"], d["frames"], generator=gen), labels=ids)
    elif name in IMAGE_TEXT_MODELS:  # after the first token, one image token per patch and CLIP's class token
        image_tokens = (d["image"] // d["patch"]) ** 2 + 1
        ids = ids.clamp(max=d["vocab"] - 2)
        ids[:, 1:1 + image_tokens] = d["vocab"] - 1
        batch = dict(input_ids=ids, pixel_values=torch.randn(d["batch"], 3, d["image"], d["image"], generator=gen),
                     labels=ids.masked_fill(ids == d["vocab"] - 1, -100))
    elif name in QWEN_VL_MODELS:  # each image: a grid of patches, merged 2 x 2 into its tokens after the first two
        side = d["image"] // d["patch"]
        image_tokens = side * side // 4
        ids = ids.clamp(max=d["vocab"] - 5)
        ids[:, 1] = d["vocab"] - 3
        ids[:, 2:2 + image_tokens] = d["vocab"] - 1
        ids[:, 2 + image_tokens] = d["vocab"] - 4
        patch = 3 * 2 * d["patch"] ** 2  # channels x 2 frames (an image repeated) x pixels
        batch = dict(input_ids=ids, pixel_values=torch.randn(d["batch"] * side * side, patch, generator=gen),
                     image_grid_thw=torch.tensor([[1, side, side]] * d["batch"]),
                     labels=ids.masked_fill(ids >= d["vocab"] - 4, -100))
    elif name in WAVEFORM_MODELS:  # CTC's labels: fewer than the frames, none the blank (0)
        batch = dict(input_values=torch.randn(d["batch"], d["samples"], generator=gen),
                     labels=ids[:, :d["seq"] // 8].clamp(min=1))
    else:
        batch = dict(input_ids=ids, labels=ids)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def make_step(row, model, args, keep_fp32=()):
    """``step(batch) -> loss`` for ``row``, and its optimizer; ``keep_fp32``: prepare's."""
    cuda = args.device.startswith("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, fused=cuda if row == "stock" else None)

    def step(batch):
        with torch.autocast(args.device.split(":")[0], torch.bfloat16, enabled=cuda and row == "stock"):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    if row == "stock":
        if cuda and args.compiler == "inductor":
            model.compile()
        return step, opt
    base, *flags = row.split("+")
    options = dict(keep_fp32=keep_fp32)
    if base == "flashoptim_fp8":
        options["fp8"] = "tensorwise"
    if "every" in flags or base == "flashoptim_fp8" and args.size == "tiny":
        options.update(fp8_min_weight_numel=0, fp8_min_gemm_size=0)
    if "cudagraphs" in flags:
        options["cudagraphs"] = True
    if "recompute" in flags:
        options["recompute_elementwise"] = True
    if "rowwise" in flags:
        options["fp8"] = "rowwise"
    if "tensorwisedw" in flags:
        options["fp8_tensorwise_weight_gradient"] = True
    if args.compiler == "eager":
        options["compiler"] = "eager"
    return flash_inductor.train_step(step, model=model, optimizer=opt, **options), opt


def run_row(name, row, args):
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    result = dict(ok=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PassFailed)
        try:
            torch._dynamo.reset()
            gc.collect()  # the earlier rows' models, held by reference cycles until a collection
            if cuda:
                torch.cuda.empty_cache()
                allocated_before, reserved_before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
            model = build_model(name, args.size, device)
            result["num_params"] = sum(p.numel() for p in model.parameters())
            step, opt = make_step(row, model, args, KEEP_FP32.get(name, ()))
            batch = fixed_batch(name, args.size, device)
            losses, seconds, report = [], [], inspection.Report()
            for i in range(args.steps):
                if cuda:
                    torch.cuda.synchronize()
                    if i == 1:  # what the first step cached and left free goes back: reserved = what the steps hold
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                if i == 0:
                    with inspection.collecting(report):
                        loss = step(batch)
                else:
                    loss = step(batch)
                losses.append(loss.item())
                seconds.append(time.perf_counter() - start)
            result.update(ok=True, losses=losses, first_step_s=seconds[0], median_step_ms=1e3 * statistics.median(seconds[1:]))
            decisions = [d for g in report.graphs for p, _, d in g.decisions if p == "fp8_linear"]
            result["fp8"] = sum(d.startswith("fp8") for d in decisions)
            result["bf16"] = dict(collections.Counter(d for d in decisions if not d.startswith("fp8")))
            result["other_graph_breaks"] = sorted({f"{b.location}: {b.headline}" for b in report.graph_breaks
                                                   if not any(own in b.headline for own in OWN_BREAKS)})
            if row != "stock":
                result["bytes_per_param"] = flash_inductor.memory_report(model, opt).total_per_param
            if cuda:
                result["steady_peak_bytes"] = torch.cuda.max_memory_allocated() - allocated_before
                # With cudagraphs the graphs' pool: replays allocate nothing, so only reserved memory shows it.
                result["steady_reserved_bytes"] = torch.cuda.max_memory_reserved() - reserved_before
                if args.profile:
                    result["profile"] = step_profile(lambda: step(batch).item(), calls=args.profile, top=args.profile_top)
                    print(f"{name} {row}:")
                    print_profile(result["profile"])
        except Exception as error:  # noqa: BLE001 - a row that fails is a finding, reported
            result["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
            result["traceback"] = traceback.format_exc(limit=-4)
        finally:
            if cuda:
                torch.cuda.empty_cache()
    result["pass_failed"] = sorted({str(w.message)[:300] for w in caught if issubclass(w.category, PassFailed)})
    return result


def print_table(results):
    print(f"\n{'model':10s} {'row':26s} {'status':6s} {'loss first→last':>17s} {'vs stock':>8s} {'fp8':>4s} "
          f"{'B/param':>7s} {'ms/step':>8s} {'peak MiB':>9s} {'reserved':>9s}  notes")
    for name, rows in results.items():
        stock = rows.get("stock", {})
        for row, r in rows.items():
            if not r["ok"]:
                print(f"{name:10s} {row:26s} FAILED {r['error']}")
                continue
            vs = f"{100 * (r['losses'][-1] / stock['losses'][-1] - 1):+.1f}%" if stock.get("ok") and row != "stock" else ""
            peak = " ".join(f"{r[k] / 2**20:9.0f}" if k in r else f"{'':9s}"
                            for k in ("steady_peak_bytes", "steady_reserved_bytes"))
            notes = [f"{n}x {reason}" for reason, n in r.get("bf16", {}).items()] + r["other_graph_breaks"] + [
                f"PassFailed: {m}" for m in r["pass_failed"]]
            print(f"{name:10s} {row:26s} ok     {r['losses'][0]:7.3f}→{r['losses'][-1]:7.3f} {vs:>8s} {r.get('fp8', 0):4d} "
                  f"{r.get('bytes_per_param', 0):7.2f} {r['median_step_ms']:8.1f} {peak}  " + " | ".join(notes))


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="default: small on CUDA, tiny on the CPU")
    parser.add_argument("--models", default=",".join(ARCHITECTURES))
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"of {', '.join(ROWS)}")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--compiler", choices=("inductor", "eager"), default="inductor")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="CUDA: after the steps, N more timed and then profiled (wall against GPU busy, top kernels "
                             "and CPU operators)")
    parser.add_argument("--profile-top", type=int, default=12)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.size = args.size or ("small" if args.device.startswith("cuda") else "tiny")
    for model in args.models.split(","):
        if model not in ARCHITECTURES:
            parser.error(f"--models: unknown {model!r}; known: {', '.join(ARCHITECTURES)}")
    for row in args.rows.split(","):
        if row not in ROWS:
            parser.error(f"--rows: unknown {row!r}; known: {', '.join(ROWS)}")
    return args


def main(argv=None):
    """Run every row of every model; returns {model: {row: result}}."""
    import transformers

    args = parse_args(argv)
    info = dict(device=torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
                torch=torch.__version__, transformers=transformers.__version__, size=args.size, dims=SIZES[args.size],
                steps=args.steps, lr=args.lr, compiler=args.compiler, date=time.strftime("%Y-%m-%d %H:%M"))
    results = {}
    for name in args.models.split(","):
        results[name] = {}
        for row in args.rows.split(","):
            results[name][row] = run_row(name, row, args)
            r = results[name][row]
            print(f"{name} {row}: " + (f"losses {r['losses'][0]:.3f} → {r['losses'][-1]:.3f}" if r["ok"] else r["error"]),
                  flush=True)
            if args.out:  # after each row: a run cut short keeps what it measured
                pathlib.Path(args.out).write_text(json.dumps(dict(info=info, results=results), indent=1))
    print_table(results)
    return results


if __name__ == "__main__":
    main()
