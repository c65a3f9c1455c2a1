"""Tiny configs of every decoder family tierlm is tested on: each exercises what sets the family
apart (rotary variants, q/k norms, sliding windows, soft-capping, multipliers, fused weights,
parallel residuals, biases, tied or untied heads), at sizes that run in a second."""
from __future__ import annotations

_BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
_NO_DROP = dict(attention_dropout=0.0)

FAMILIES = {
    # rope_scaling llama3: frequencies rescaled by wavelength
    "llama": dict(_BASE, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "mistral": dict(_BASE, sliding_window=None),
    "qwen2": dict(_BASE, tie_word_embeddings=True),                       # q/k/v biases, tied head
    "qwen3": dict(_BASE, head_dim=16, tie_word_embeddings=True),          # q/k RMSNorms
    "gemma": dict(_BASE, head_dim=16),                                    # scaled embeddings, (1 + w) norms
    # sliding layers beside global ones, attention and logit soft-capping, norms after blocks
    "gemma2": dict(_BASE, head_dim=16, sliding_window=6, attn_logit_softcapping=20.0,
                   final_logit_softcapping=10.0, query_pre_attn_scalar=16),
    "gemma3_text": dict(_BASE, head_dim=16, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
    # partial rotary, parallel attention + MLP residual, biases, dense gelu MLP
    "phi": dict(_BASE, partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0, **_NO_DROP),
    # fused qkv and gate_up weights
    "phi3": dict(_BASE, resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0, **_NO_DROP),
    "olmo": dict(_BASE, clip_qkv=8.0),                                    # non-parametric norms, qkv clipping
    "olmo2": dict(_BASE),                                                 # q/k norms, norms after blocks
    # fused qkv, partial rotary, parallel residual, untied embed_out
    "gpt_neox": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     vocab_size=128, max_position_embeddings=64, rotary_pct=0.25, use_parallel_residual=True,
                     hidden_dropout=0.0, attention_dropout=0.0),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
    # fused grouped qkv, one shared layer norm, parallel attention
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2, vocab_size=128,
                   new_decoder_architecture=True, parallel_attn=True, bias=False, alibi=False,
                   hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=64),
    "starcoder2": dict(_BASE, sliding_window=6, use_bias=True, residual_dropout=0.0, embedding_dropout=0.0,
                       **_NO_DROP),
    # embedding, residual, attention multipliers and logits scaling
    "granite": dict(_BASE, embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.2,
                    logits_scaling=2.0),
    # Command R: parallel attention + MLP on one LayerNorm, q/k norms, scaled logits, tied head
    "cohere": dict(_BASE, head_dim=16, use_qk_norm=True),
    # Command R7B: sliding layers beside global ones without rotary on the global ones
    "cohere2": dict(_BASE, head_dim=16, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
    "glm": dict(_BASE, pad_token_id=0, head_dim=16),                                      # partial interleaved rotary, fused gate_up
    "glm4": dict(_BASE, pad_token_id=0, head_dim=16),                                     # + norms after attention and MLP
    # NoPE layers (no rotary on layer 1), tied head
    "smollm3": dict(_BASE, pad_token_id=0, head_dim=16, no_rope_layers=[1, 0], layer_types=["full_attention", "full_attention"]),
    "ernie4_5": dict(_BASE, head_dim=16),                                 # interleaved rotary, tied head
    # q/k norms, norms after blocks, sliding layers beside global ones (NoPE on the global ones)
    "exaone4": dict(_BASE, head_dim=16, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
    "olmo3": dict(_BASE, head_dim=16, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
    "apertus": dict(_BASE, head_dim=16),                                  # xIELU activation, q/k norms, no gate
    "arcee": dict(_BASE, head_dim=16),                                    # ReLU² MLP without a gate
    # partial rotary, LayerNorms, per-head q/k LayerNorms, parallel residual
    "stablelm": dict(_BASE, qk_layernorm=True, use_parallel_residual=True, hidden_dropout=0.0, **_NO_DROP),
    "nemotron": dict(_BASE, head_dim=16),                                 # LayerNorm1P, ReLU², partial rotary
    # Gemma 2 without norms after blocks: soft-capping, sliding layers, tied scaled embeddings
    "vaultgemma": dict(_BASE, head_dim=16, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
    "hunyuan_v1_dense": dict(_BASE, head_dim=16),                         # q/k norms after rotary
    "ministral": dict(_BASE, head_dim=16, sliding_window=6, layer_types=["sliding_attention", "sliding_attention"]),
    # biases on q/k/v and on the output projection; dropout off (its config's default is 0.1)
    "seed_oss": dict(_BASE, head_dim=16, attention_out_bias=True, residual_dropout=0.0, **_NO_DROP),
    "helium": dict(_BASE, head_dim=16),
    "internlm3": dict(_BASE, head_dim=16, pad_token_id=0),
    "bitnet": dict(_BASE, head_dim=16),                                   # ternary-trained layers, sub-norms
    # one key/value head for all (multi-query) in a fused c_attn, learned positions
    "gpt_bigcode": dict(_BASE, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "nanochat": dict(_BASE, head_dim=16, pad_token_id=0),                 # ReLU² MLP, parameter-free norms
    "apertus1p5_text": dict(_BASE, head_dim=16, pad_token_id=0),
    "jais2": dict(_BASE, head_dim=16),                                    # biases, LayerNorms
    "hyperclovax": dict(_BASE, head_dim=16),                              # norms after blocks too
    "iquestcoder": dict(_BASE, head_dim=16),
    # full attention beside sliding layers
    "cwm": dict(_BASE, head_dim=16, sliding_window=6, layer_types=["full_attention", "sliding_attention"]),
    # sinusoidal positions, its own attention inline: the mask added to its scores (it gets
    # additive masks: infer.packed._eager_by_name), scaled embeddings
    "xglm": dict(d_model=64, num_layers=2, attention_heads=4, ffn_dim=96, vocab_size=128, max_position_embeddings=64,
                 dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0),
    # OPT-350m's shape: embeddings narrower than the layers, projected in before them (a weight the
    # fine-tuning engine holds through the step) and out after; LayerNorms after the blocks, learned
    # positions offset by 2, tied head
    "opt": dict(hidden_size=64, word_embed_proj_dim=32, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=128, max_position_embeddings=64, do_layer_norm_before=False, dropout=0.0,
                attention_dropout=0.0, layerdrop=0.0),
    # ModernBERT's decoder: a LayerNorm on the embeddings before the layers (held through the step),
    # sliding layers beside global ones, no biases, a dense head before the tied decoder
    "modernbert-decoder": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                               vocab_size=128, max_position_embeddings=64, local_attention=6, global_attn_every_n_layers=2,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=3, sep_token_id=4,
                               embedding_dropout=0.0, attention_dropout=0.0, mlp_dropout=0.0),
    # mixtures of experts: stacked expert weights (one file tensor per expert), top-k routing, the
    # router's load-balancing loss added to the loss (output_router_logits)
    "mixtral": dict(_BASE, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                    router_aux_loss_coef=0.1),
    # a shared expert beside the routed ones, its sigmoid gate, unnormalised top-k weights
    "qwen2_moe": dict(_BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, output_router_logits=True, router_aux_loss_coef=0.1),
    # q/k norms, normalised top-k weights, a dense MLP layer beside the sparse one (mlp_only_layers)
    "qwen3_moe": dict(_BASE, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, mlp_only_layers=[0], output_router_logits=True,
                      router_aux_loss_coef=0.1),
    "olmoe": dict(_BASE, num_experts=4, num_experts_per_tok=2, output_router_logits=True,
                  router_aux_loss_coef=0.1, eos_token_id=None),
    # latent attention (compressed KV, split rope/nope heads), grouped top-k routing with a
    # correction bias, a shared expert, a dense first layer
    "deepseek_v3": dict(_BASE, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=24, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_shared_experts=1,
                        rope_scaling=None),
    # attention sinks, biased experts in one fused tensor, alternating sliding layers
    "gpt_oss": dict(_BASE, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                    layer_types=["sliding_attention", "full_attention"], output_router_logits=True,
                    router_aux_loss_coef=0.1, rope_scaling=None),
    # sigmoid routing with a correction bias, a shared expert, a dense first layer, q/k norms
    "glm4_moe": dict(_BASE, head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     n_shared_experts=1, first_k_dense_replace=1, use_qk_norm=True),
    "hunyuan_v1_moe": dict(_BASE, head_dim=16, num_experts=4, moe_topk=2),  # a shared MLP beside the experts
    # sigmoid routing with a correction bias, q/k norms over all heads together
    "minimax_m2": dict(_BASE, head_dim=16, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                       router_aux_loss_coef=0.1),
    # lightning (linear) attention layers beside softmax ones, in blocks of 4 positions, their
    # states in a cache of the model's own (MiniMax refuses any other): generating keeps it a sequence
    "minimax": dict(_BASE, head_dim=16, num_local_experts=4, num_experts_per_tok=2, block_size=4,
                    layer_types=["linear_attention", "full_attention"], full_attn_alpha_factor=0.5,
                    linear_attn_beta_factor=2.0, output_router_logits=True, router_aux_loss_coef=0.1),
    # compressed attention (a sliding window of 6 beside keys compressed 2:1 and picked by a sparse
    # indexer, or 4:1), hyper-connections, hash-routed first layer; its cache layers its own
    "deepseek_v4": dict(_BASE, num_hidden_layers=4, num_key_value_heads=1, head_dim=16, q_lora_rank=32, o_lora_rank=32,
                        o_groups=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        index_n_heads=4, index_head_dim=16, index_topk=4, sliding_window=6, hc_mult=2,
                        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
                        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"] * 2,
                        mlp_layer_types=["hash_moe", "moe", "moe", "moe"]),
    # Qwen4-Exp: gated delta-net layers beside attention whose keys a QSA indexer picks from blocks
    # compressed 2:1, hashed n-gram embeddings (PLE) read from the token ids on the first layer,
    # hyper-connections (2 residual streams), experts with a shared one
    "qwen4_exp_text": dict(_BASE, num_hidden_layers=2, head_dim=16, layer_types=["linear_attention", "indexed_attention"],
                           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                           linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=48, hc_count=2, hc_lowrank=8, ple_layer_ids=[1],
                           ple_embed_dim=32, heads_per_ngram=2, ngram_vocab_size_base=97, eos_token_id=1,
                           indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4,
                           indexer_compress_ratio=2, output_router_logits=True, router_aux_loss_coef=0.1),
    # Cohere's compass text model: sliding layers with multimodal rotary sections beside full layers
    # without rotary, LayerNorms without bias, parallel attention and MLP, a scaled tied head
    "cohere_compass_text": dict(_BASE, head_dim=16, sliding_window=6, logit_scale=0.5,
                                layer_types=["sliding_attention", "full_attention"],
                                rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0,
                                                                           mrope_section=[4, 2, 2]),
                                                 "full_attention": None}),
    # dots3-note's text model: latent attention with a sparse indexer beside sliding layers of their
    # own shape (half the heads: per-layer config values), experts with a shared one after a dense layer
    "dots3_note_text": dict(_BASE, num_hidden_layers=3, num_key_value_heads=4, head_dim=16, q_lora_rank=32,
                            kv_lora_rank=32, qk_nope_head_dim=12, qk_rope_head_dim=4, v_head_dim=16,
                            index_n_heads=2, index_head_dim=16, index_topk=4, n_routed_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32, shared_experts_intermediate_size=48,
                            sliding_window=6, swa_num_attention_heads=2, swa_num_key_value_heads=2,
                            swa_q_lora_rank=32, swa_kv_lora_rank=32, swa_head_dim=16, swa_qk_nope_head_dim=12,
                            swa_v_head_dim=16, pad_token_id=0, bos_token_id=None, eos_token_id=None),
    # a mixture of attention experts (MoA) beside the MLP's, its own auxiliary loss
    "jetmoe": dict(_BASE, kv_channels=16, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                   aux_loss_coef=0.1),
    "flex_olmo": dict(_BASE, pad_token_id=0, head_dim=16, num_experts=4, num_experts_per_tok=2),  # OLMo 2's norms, experts
    # a shared expert averaged with the routed ones, sliding layers beside global ones
    "cohere2_moe": dict(_BASE, head_dim=16, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
                        sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
    "exaone_moe": dict(_BASE, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       num_shared_experts=1, first_k_dense_replace=1, sliding_window=6,
                       layer_types=["sliding_attention", "full_attention"]),
    # Granite's multipliers around experts in one fused tensor; the shared variant adds a dense MLP
    "granitemoe": dict(_BASE, head_dim=16, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=4.0,
                       residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0),
    "granitemoeshared": dict(_BASE, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=48),
    # DeepSeek-V2's latent attention and grouped routing, without V3's correction bias
    "deepseek_v2": dict(_BASE, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=24,
                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_shared_experts=1,
                        rope_scaling=None, head_dim=8),
    "dots1": dict(_BASE, head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  first_k_dense_replace=1, n_shared_experts=1, n_group=1, topk_group=1),
    # nested attention and MLP configs, fused Wqkv with clipping, experts as one tensor per projection
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, vocab_size=128, max_seq_len=64, resid_pdrop=0.0, emb_pdrop=0.0,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=96, moe_num_experts=4, moe_top_k=2)),
    # a dense first layer, sparse ones with a shared expert, the combine in fp32
    "hy_v3": dict(_BASE, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  num_shared_experts=1),
    # routers whose score-correction bias the modules keep fixed (requires_grad=False): fine-tuning
    # leaves it as the checkpoint has it. Ernie: a dense first layer, shared experts
    "ernie4_5_moe": dict(_BASE, moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1,
                         moe_layer_start_index=1, moe_layer_end_index=1, moe_layer_interval=1),
    # per-layer head counts, a dense layer then a sparse one with a shared expert, sliding layers
    "laguna": dict(_BASE, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=32, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                   num_attention_heads_per_layer=[4, 4], mlp_layer_types=["dense", "sparse"]),
    # a dense first layer, shared experts, sliding layers beside global ones
    "afmoe": dict(_BASE, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  num_shared_experts=1, num_dense_layers=1, sliding_window=6,
                  layer_types=["sliding_attention", "full_attention"]),
    # sparse attention (DSA): latent attention whose queries attend to the top-k keys an indexer
    # scores (its own keys cached beside the latent KV); fewer keys than the prompt, so it selects
    "deepseek_v32": dict(_BASE, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=24, kv_lora_rank=16,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_shared_experts=1, rope_scaling=None,
                         index_n_heads=16, index_head_dim=16, index_topk=4),
    # GLM-5's: a layer that reuses the previous layer's choice of keys (indexer_types "shared"),
    # handed on as the decoder layers' second output
    "glm_moe_dsa": dict(_BASE, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                        v_head_dim=16, head_dim=8, n_shared_experts=1, index_n_heads=16, index_head_dim=16, index_topk=4,
                        indexer_types=["full", "shared"]),
    # Sarvam-MoE: q, k and v cut from one fused `query_key_value` file tensor (read and written a
    # slice at a time: hf.split_tensors), q/k norms, sigmoid routing with a shared expert, a dense
    # first layer
    "sarvam_moe": dict(_BASE, head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       n_shared_experts=1, first_k_dense_replace=1, use_qk_norm=True),
    # MiMo-V2-Flash: sliding layers with twice the config's KV heads (sized from the modules'
    # forward, hf.kv_layout) and attention sinks, values narrower than keys and scaled, partial
    # rotary with per-layer-type thetas, a dense first layer then experts
    "mimo_v2_flash": dict(_BASE, head_dim=16, v_head_dim=8, sliding_window=6, n_routed_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=32,
                          layer_types=["full_attention", "sliding_attention"]),
    # LongCat-Flash: two attention sublayers and two MLPs a layer (its config counts the sublayers
    # as layers: hf.structure.find_layers), latent attention, routed experts beside "zero" experts
    # that return their input
    "longcat_flash": dict(hidden_size=64, num_layers=2, num_attention_heads=4, vocab_size=128,
                          max_position_embeddings=64, ffn_hidden_size=96, q_lora_rank=24, kv_lora_rank=16,
                          qk_nope_head_dim=8, qk_rope_head_dim=8, head_dim=8, v_head_dim=16, moe_topk=2,
                          n_routed_experts=4, zero_expert_num=2, expert_ffn_hidden_size=32),
    # Gemma 4 (the 26B-A4B and 31B shapes): per-layer head dims and KV heads (global layers wider,
    # one KV head), keys as values on the global layers, a dense MLP beside routed experts in every
    # layer, norms after blocks, soft-capped logits; the per-layer embeddings and shared KV of the
    # small E2B/E4B shapes are off here (fine-tuned: tests/test_families.py, generated:
    # tests/hf/test_kv_layout.py)
    "gemma4_text": dict(_BASE, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                        sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                        hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
                        moe_intermediate_size=32, final_logit_softcapping=30.0, pad_token_id=0),
    # Gemma 3n (E2B/E4B): per-layer inputs, the last layers attending with earlier layers' keys and
    # values, AltUp's four hidden-state streams through every layer, LAuReL, an MLP width a layer
    "gemma3n_text": dict(_BASE, intermediate_size=[96] * 4, num_hidden_layers=4, head_dim=16,
                         vocab_size_per_layer_input=128, hidden_size_per_layer_input=16, num_kv_shared_layers=2,
                         layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=[0.0] * 4,
                         laurel_rank=8, sliding_window=6, altup_num_inputs=4, pad_token_id=0),
    # ZAYA: convolutional attention keeping conv states, a router whose states each layer hands
    # the next (a tensor with a gradient beside the hidden states: engine.block_fn.BlockCall)
    # Kolibri 1.1: sliding layers with rotary beside indexed ones without (NoPE) whose indexer
    # keeps a few keys of a pool; the last layer reads the second's keys and values and reuses its
    # indexer's pool (tensors a layer hands a later one, by name: engine.block_fn.BlockCall); a
    # dense first layer, then experts beside a shared one
    "kolibri1_1": dict(_BASE, head_dim=16, num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[0],
                       layer_types=["sliding_attention", "indexed_attention"] * 2, index_layers=[1],
                       kv_source_layers=[0, 1, 2, 1], index_num_heads=1, index_topk=3, index_pool_size=6,
                       index_compression=2, index_num_local_tokens=2, index_num_sink_tokens=1, sliding_window=4),
    "zaya": dict(_BASE, head_dim=16, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=32,
                 router_hidden_size=16, layer_types=["hybrid", "hybrid"], pad_token_id=0, bos_token_id=2,
                 eos_token_id=106),
    # ALiBi biases built from a 2-D padding mask (inference: the model makes its own masks,
    # infer.generic), a LayerNorm on the embeddings before the layers (held through the step), fused
    # qkv, tied head
    "bloom": dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0),
    # ALiBi over max_seq_len positions, a mask turned to booleans True where masked (it runs under
    # transformers' eager name: infer.packed.install), fused qkv, no biases, qkv clipping
    "mpt": dict(d_model=64, n_layers=2, n_heads=4, expansion_ratio=2, vocab_size=128, max_seq_len=64,
                attn_config={"clip_qkv": 8.0}, resid_pdrop=0.0, emb_pdrop=0.0),
    # dynamic mask attention (a mask a head from the values, added to the causal one: inference
    # passes the model's own masks, infer.generic). Left at their defaults: keep_window_size (past
    # it a query keeps its top keys, chosen before the causal mask) and is_moe (its product-key
    # router splits the router's logits across tokens): either makes a token's logits depend on
    # later tokens in transformers' own forward, which generating token by token cannot equal
    "doge": dict(_BASE, num_key_value_heads=4),
    # GPT-Neo: local attention (a window of 4) beside global layers, learned positions, unscaled
    # attention scores
    "gpt_neo": dict(hidden_size=64, num_layers=2, num_heads=4, vocab_size=128, max_position_embeddings=64,
                    attention_types=[[["global", "local"], 1]], window_size=4, intermediate_size=96,
                    embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0),
    # GPT-J: interleaved partial rotary (rotary_dim), attention and MLP in parallel from one norm
    "gptj": dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_inner=96, vocab_size=128, n_positions=64,
                 bos_token_id=0, eos_token_id=0),
    # CodeGen: GPT-J's layer with q, k and v fused in a layout of its own (mp_num blocks)
    "codegen": dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_inner=96, vocab_size=128, n_positions=64,
                    n_ctx=64, bos_token_id=0, eos_token_id=0),
    # Persimmon: partial rotary, q/k LayerNorms, squared-ReLU MLP
    "persimmon": dict(_BASE, num_key_value_heads=4, hidden_act="relu2", qk_layernorm=True,
                      rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5, "rope_type": "default"}),
    # partial rotary, fused qkv, a bias added after the attention's output, an MLP width a multiple
    "gpt_neox_japanese": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
                              max_position_embeddings=64, intermediate_multiple_size=2,
                              rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                               "rope_type": "default"},
                              attention_dropout=0.0, hidden_dropout=0.0),
}


def family_config(family: str, **over):
    from transformers import AutoConfig
    kw = dict(FAMILIES[family])
    kw.update(over)
    return AutoConfig.for_model(family, **kw)


# Inkling 2: its layers attend over the outputs of every earlier block of layers; it fine-tunes to
# fp32 rounding, not to the bit (tests/test_families.py), so it is not among FAMILIES. Generating
# runs on the cache its forward makes (its masks read the cache's own attributes).
def inkling2_config(vocab: int = 128, **over):
    from transformers import AutoConfig
    kw = dict(vocab_size=vocab, unpadded_vocab_size=vocab, hidden_size=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4,
              swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=8, d_rel=4, rel_extent=16,
              log_scaling_n_floor=64, layer_types=["hybrid_sliding", "hybrid"] * 2, max_position_embeddings=256,
              moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_layers_per_attn_res_block=2,
              eos_token_id=1, initializer_range=0.02)
    kw.update(over)
    return AutoConfig.for_model("inkling2_text", **kw)


# initializer_range at which each tiny random model's greedy continuation varies (so a wrong token
# shows): wide for most; Gemma 2/3/4's scaled embeddings and soft-capping repeat the last token there.
GREEDY_INIT = {"gemma2": 0.02, "gemma3_text": 0.02, "gemma4_text": 0.02, "gemma3n_text": 0.02}


def greedy_init(family: str) -> float:
    return GREEDY_INIT.get(family, 0.3)
