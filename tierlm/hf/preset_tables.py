"""The architecture presets' tables: published models' shapes (copied from each source model's
config.json) and the tiny variants tests use. Building a config from them is hf/presets.py's."""
from __future__ import annotations

from dataclasses import dataclass, field

# Names, not classes: the command line builds its choices from them without importing transformers
# (seconds); ARCHS, the config classes, is made on first use (presets.py's module __getattr__). These four
# have hand-written tiny shapes and closed-form parameter counts; every other decoder family
# transformers builds works too (`make_config` shrinks its default config, `param_count` counts it
# on `meta`), and FAMILIES lists those tested through every verb (tests/test_families.py).
ARCH_CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig", "gpt2": "GPT2Config"}
ARCH_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "mistral": "MistralForCausalLM", "gpt2": "GPT2LMHeadModel"}
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "olmo",
            "olmo2", "gpt_neox", "gpt2", "falcon", "starcoder2", "granite")


@dataclass(frozen=True)
class Shape:
    """A model's shape in the short keys' terms (hidden, heads, ...), whatever its family calls them."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class Preset:
    arch: str
    source: str  # where the numbers come from
    shape: Shape
    tie_embeddings: bool
    dtype: str = "bfloat16"
    extra: dict = field(default_factory=dict)  # native config fields (rope, eps, token ids...)


_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_LLAMA2 = {"rope_theta": 10000.0, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2}
_QWEN25 = {"rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "bos_token_id": 151643, "eos_token_id": 151643}

PRESETS: dict[str, Preset] = {
    "qwen2.5-0.5b": Preset("qwen2", "Qwen/Qwen2.5-0.5B", Shape(24, 896, 14, 2, 4864, 151936, 32768), True,
                           extra=_QWEN25),
    "qwen2.5-1.5b": Preset("qwen2", "Qwen/Qwen2.5-1.5B", Shape(28, 1536, 12, 2, 8960, 151936, 131072), True,
                           extra=_QWEN25),
    "qwen2.5-7b": Preset("qwen2", "Qwen/Qwen2.5-7B", Shape(28, 3584, 28, 4, 18944, 152064, 131072), False,
                         extra=_QWEN25),
    "tinyllama-1.1b": Preset("llama", "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T",
                             Shape(22, 2048, 32, 4, 5632, 32000, 2048), False, extra=_LLAMA2),
    "llama-3.2-1b": Preset("llama", "meta-llama/Llama-3.2-1B", Shape(16, 2048, 32, 8, 8192, 128256, 131072), True,
                           extra={"rope_parameters": _LLAMA3_ROPE, "rms_norm_eps": 1e-5,
                                  "bos_token_id": 128000, "eos_token_id": 128001}),
    "llama-3.2-3b": Preset("llama", "meta-llama/Llama-3.2-3B", Shape(28, 3072, 24, 8, 8192, 128256, 131072), True,
                           extra={"rope_parameters": _LLAMA3_ROPE, "rms_norm_eps": 1e-5,
                                  "bos_token_id": 128000, "eos_token_id": 128001}),
    "llama-2-7b": Preset("llama", "meta-llama/Llama-2-7b-hf", Shape(32, 4096, 32, 32, 11008, 32000, 4096), False,
                         "float16", extra=_LLAMA2),
    "llama-2-13b": Preset("llama", "meta-llama/Llama-2-13b-hf", Shape(40, 5120, 40, 40, 13824, 32000, 4096), False,
                          "float16", extra=_LLAMA2),
    "mistral-7b": Preset("mistral", "mistralai/Mistral-7B-v0.1", Shape(32, 4096, 32, 8, 14336, 32000, 32768), False,
                         extra={**_LLAMA2, "sliding_window": 4096}),
    "gpt2": Preset("gpt2", "openai-community/gpt2", Shape(12, 768, 12, 12, 3072, 50257, 1024), True, "float32",
                   extra={"bos_token_id": 50256, "eos_token_id": 50256}),
    # Never released; shapes from Brown et al. 2020, Table 2.1. For planning at 175B scale only.
    "gpt3-175b": Preset("gpt2", "GPT-3 175B (Brown et al. 2020, 'Language Models are Few-Shot Learners')",
                        Shape(96, 12288, 96, 96, 49152, 50257, 2048), True,
                        extra={"bos_token_id": 50256, "eos_token_id": 50256}),
}


@dataclass(frozen=True)
class NativePreset:
    """A published model's config.json fields as they are (any family): nothing derived."""
    arch: str
    source: str
    fields: dict

    def config(self):
        from transformers import CONFIG_MAPPING
        return CONFIG_MAPPING[self.arch](**self.fields)


_QWEN3 = dict(vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, head_dim=128,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, hidden_act="silu",
              bos_token_id=151643, eos_token_id=151645, attention_bias=False, dtype="bfloat16")
_GEMMA2 = dict(vocab_size=256000, max_position_embeddings=8192, head_dim=256, sliding_window=4096,
               attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256,
               hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, tie_word_embeddings=True,
               bos_token_id=2, eos_token_id=1, pad_token_id=0, dtype="bfloat16")
_GEMMA3 = dict(head_dim=256, query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
               tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0, dtype="bfloat16")

_QWEN3_MOE = dict(vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, head_dim=128,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, hidden_act="silu",
                  num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[], router_aux_loss_coef=0.001, tie_word_embeddings=False,
                  bos_token_id=151643, eos_token_id=151645, attention_bias=False, dtype="bfloat16")
# Shapes from each model's published config.json (the fields that set its shape and arithmetic).
NATIVE_PRESETS: dict[str, NativePreset] = {
    "qwen3-0.6b": NativePreset("qwen3", "Qwen/Qwen3-0.6B", dict(
        _QWEN3, num_hidden_layers=28, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
        intermediate_size=3072, tie_word_embeddings=True)),
    "qwen3-1.7b": NativePreset("qwen3", "Qwen/Qwen3-1.7B", dict(
        _QWEN3, num_hidden_layers=28, hidden_size=2048, num_attention_heads=16, num_key_value_heads=8,
        intermediate_size=6144, tie_word_embeddings=True)),
    "qwen3-4b": NativePreset("qwen3", "Qwen/Qwen3-4B", dict(
        _QWEN3, num_hidden_layers=36, hidden_size=2560, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=9728, tie_word_embeddings=True)),
    "qwen3-8b": NativePreset("qwen3", "Qwen/Qwen3-8B", dict(
        _QWEN3, num_hidden_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=12288, tie_word_embeddings=False)),
    "gemma-2-2b": NativePreset("gemma2", "google/gemma-2-2b", dict(
        _GEMMA2, num_hidden_layers=26, hidden_size=2304, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=9216)),
    "gemma-2-9b": NativePreset("gemma2", "google/gemma-2-9b", dict(
        _GEMMA2, num_hidden_layers=42, hidden_size=3584, num_attention_heads=16, num_key_value_heads=8,
        intermediate_size=14336)),
    "gemma-3-1b": NativePreset("gemma3_text", "google/gemma-3-1b-pt", dict(
        _GEMMA3, num_hidden_layers=26, hidden_size=1152, num_attention_heads=4, num_key_value_heads=1,
        intermediate_size=6912, vocab_size=262144, max_position_embeddings=32768, sliding_window=512,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # the text model of the multimodal google/gemma-3-4b-pt (its text_config)
    "gemma-3-4b": NativePreset("gemma3_text", "google/gemma-3-4b-pt text_config", dict(
        _GEMMA3, num_hidden_layers=34, hidden_size=2560, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=10240, vocab_size=262208, max_position_embeddings=131072, sliding_window=1024,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "phi-3-mini": NativePreset("phi3", "microsoft/Phi-3-mini-4k-instruct", dict(
        num_hidden_layers=32, hidden_size=3072, num_attention_heads=32, num_key_value_heads=32,
        intermediate_size=8192, vocab_size=32064, max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=32000, pad_token_id=32000, dtype="bfloat16")),
    "phi-4": NativePreset("phi3", "microsoft/phi-4", dict(
        num_hidden_layers=40, hidden_size=5120, num_attention_heads=40, num_key_value_heads=10,
        intermediate_size=17920, vocab_size=100352, max_position_embeddings=16384, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 250000.0}, tie_word_embeddings=False,
        bos_token_id=100257, eos_token_id=100265, pad_token_id=100349, dtype="bfloat16")),
    "olmo-2-1b": NativePreset("olmo2", "allenai/OLMo-2-0425-1B", dict(
        num_hidden_layers=16, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
        intermediate_size=8192, vocab_size=100352, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=100257, pad_token_id=100277, dtype="float32")),
    "smollm2-135m": NativePreset("llama", "HuggingFaceTB/SmolLM2-135M", dict(
        num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, dtype="bfloat16")),
    # Mixtures of experts: shapes for planning (`tierlm plan`), too large to build on a small machine.
    # Published totals: Mixtral-8x7B 46.7B (12.9B active a token), Qwen3-30B-A3B 30.5B (3.3B),
    # Qwen3-235B-A22B 235B (22B), DeepSeek-V3 671B (37B) without its multi-token-prediction layer,
    # which transformers does not build (tests/hf/test_presets.py checks each against its preset).
    "mixtral-8x7b": NativePreset("mixtral", "mistralai/Mixtral-8x7B-v0.1", dict(
        num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=32768, sliding_window=None, rms_norm_eps=1e-5, router_aux_loss_coef=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, dtype="bfloat16")),
    "qwen3-30b-a3b": NativePreset("qwen3_moe", "Qwen/Qwen3-30B-A3B", dict(
        _QWEN3_MOE, num_hidden_layers=48, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
        intermediate_size=6144, moe_intermediate_size=768)),
    "qwen3-235b-a22b": NativePreset("qwen3_moe", "Qwen/Qwen3-235B-A22B", dict(
        _QWEN3_MOE, num_hidden_layers=94, hidden_size=4096, num_attention_heads=64, num_key_value_heads=4,
        intermediate_size=12288, moe_intermediate_size=1536)),
    "deepseek-v3": NativePreset("deepseek_v3", "deepseek-ai/DeepSeek-V3", dict(
        num_hidden_layers=61, hidden_size=7168, num_attention_heads=128, num_key_value_heads=128,
        intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8,
        n_shared_experts=1, first_k_dense_replace=3, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        norm_topk_prob=True, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, vocab_size=129280, max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096},
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, dtype="bfloat16")),
}

# What `arch` alone means: a model small enough for unit tests, with GQA where the arch has it.
TINY: dict[str, Preset] = {
    "llama": Preset("llama", "tiny test model", Shape(2, 64, 4, 2, 176, 512, 256), False, "float32",
                    extra={"rms_norm_eps": 1e-5}),
    "qwen2": Preset("qwen2", "tiny test model", Shape(2, 64, 4, 2, 344, 512, 256), True, "float32",
                    extra={"rms_norm_eps": 1e-6}),
    "mistral": Preset("mistral", "tiny test model", Shape(2, 64, 4, 2, 224, 512, 256), False, "float32",
                      extra={"rms_norm_eps": 1e-5, "sliding_window": 128}),
    "gpt2": Preset("gpt2", "tiny test model", Shape(2, 64, 4, 4, 256, 512, 256), True, "float32"),
}


# What a family's default config (transformers') leaves unset, or sets so its small shape is
# rejected, that its modules need: the tiny model's values (`make_config(arch)`: `tierlm init
# --arch`), set after shrinking. Config data, not code: the family's own modules still compute.
TINY_FIELDS: dict[str, dict] = {
    # expert counts None by default
    "dots1": dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2),
    # its default attention config has no rotary base; kv heads and experts live in sub-configs
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0),
                 ffn_config=dict(ffn_hidden_size=176, moe_num_experts=4, moe_top_k=2)),
    # layer types None by default: a short convolution layer, then an attention one
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    # hidden * expand must equal heads * head_dim
    "mamba2": dict(head_dim=16, expand=1, n_groups=2),
    # a compressed pattern of layer types: one global layer, one local, repeated once
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=8),
    # its indexer's heads per key head must not exceed the query heads per key head (12 of 12 by
    # default; 2 at the tiny shape): one is valid at every shape
    "kolibri1_1": dict(index_num_heads=1),
    # its default rotary parameters are empty, where its rotary embedding reads those of its full
    # attention layers (multimodal sections summing to half the tiny head, 16)
    "cohere_compass_text": dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=10000.0,
                                                                        mrope_section=[4, 2, 2])}),
    # latent attention whose sliding layers have a shape of their own (half the heads, as published):
    # shrinking leaves their head at the published 192 + 64, which its check wants equal to the rest
    "dots3_note_text": dict(
        per_layer_config={2: dict(num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=32,
                                  head_dim=16, qk_nope_head_dim=12, qk_rope_head_dim=4, v_head_dim=16)},
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, head_dim=16, qk_nope_head_dim=12,
        qk_rope_head_dim=4, v_head_dim=16, index_n_heads=2, index_head_dim=16, index_topk=4, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_experts_intermediate_size=48),
    # Mamba layers and hybrid ones that run one shared attention block: two hybrid layers after two
    # Mamba ones (a two-layer copy keeps one hybrid, whose shared block ties to none); its attention
    # heads are twice hidden / heads wide, where shrinking sets the usual hidden / heads
    "zamba": dict(layers_block_type=["linear_attention", "linear_attention", "hybrid", "hybrid"], num_hidden_layers=4,
                  attention_head_dim=32),
    # a recurrent-depth model: input layers, recurrent ones run n_recurrent_loops times, output
    # layers; shrinking the layer count leaves the sections' published sizes (8 + 8 of 8 layers)
    "dory": dict(num_hidden_layers=4, n_input_layers=1, n_recurrent_layers=2, n_output_layers=1, n_recurrent_loops=2),
    # its own width and depth fields (embedding_dim, num_blocks) beside the hidden_size and
    # num_hidden_layers shrinking sets
    "xlstm": dict(embedding_dim=64, num_blocks=2),
    # its decoder attends both ways unless told it decodes
    "bert-generation": dict(is_decoder=True),
    # its QSA indexer's fields are None by default, which its indexed attention layers divide by:
    # one key head (the only count it takes), blocks of 2 keys, 4 keys picked a query
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4,
                           indexer_compress_ratio=2),
}
