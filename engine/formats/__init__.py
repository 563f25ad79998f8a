"""The book's quantization methods, one file each; the chapter's loader and writer; and three rooms of shared parts.

  gptq.py                    GPTQ (chapter 39): gptq_quantize, the AutoGPTQ v1 / v2 layout, to_runtime
  gptq_order.py              GPTQ's column orders (natural, act-order, static groups, group-aware), both GPTQs'
  awq.py                     AWQ: search_scale, apply_awq, the AutoAWQ GEMM layout
  fp8.py                     FP8 E4M3 with 128 x 128 block scales, w8a8_reference, FP8BlockLinear
  mx.py                      MXFP4 and NVFP4 (both byte layouts), their layers
  nf4.py                     bitsandbytes' NF4, the layout transformers' load_in_4bit reads
  trellis.py                 trellis codes (QTIP / EXL3): codes, bitstream, BlockLDLQ, TrellisLinear
  trellis_viterbi.py         the Viterbi search: the textbook loop and the fast batched one
  trellis_stream.py          a trellis layer's bitstream and its checksum
  entropy.py                 EntQuant: Float8 pushed to low entropy, rANS-coded per transformer block
  entropy_decoder.py         EntQuant at inference: each block's stream decoded into one shared buffer
  entropy_rate.py            EntQuant's rate: a lambda for a bits target, from the shipped table
  entropy_scales.py          EntQuant's per-channel scales: the L-BFGS search
  entropy_feedback.py        EntQuant with GPTQ's error feedback on its E4M3 grid
  lattice.py                 HyperQuant's weights: E8 / D4 / A2 / Z lattice codes in Rice sub-streams
  compressed_tensors.py      llm-compressor's layouts (pack-quantized, float-quantized, NVFP4, MXFP4)
  quantized_checkpoints.py   the chapter's loader and writer: load_quantized, save_quantized, build, PARTS
  numerics/                  what the methods share: base, affine, obq, calibration, layer_runs, minifloats,
                             hadamard, sensitivity
  llama_cpp/                 llama.cpp's blocks: ggml (decoders), ggml_quants (quantizers), bit_plan, and
                             gptq_ggml (GPTQ's codes on llama.cpp's grids, held as GGML blocks)
  kv/                        the KV cache: kv_cache (the lattice cache, the hook), kv_baselines (FP8, q8_0, q4_0, KIVI),
                             kv_store (the cache that holds codes: generate / eval --kv-cache)
"""
