"""The book's quantization methods, one file each; the chapter's loader and writer; and rooms a reader can skip.

The book's core:
  gptq.py                    GPTQ (chapter 39): gptq_quantize, the AutoGPTQ v1 / v2 layout, to_runtime
  gptq_order.py              GPTQ's column orders (natural, act-order, static groups, group-aware)
  awq.py                     AWQ: search_scale, apply_awq, the AutoAWQ GEMM layout
  fp8.py                     FP8 E4M3 with 128 x 128 block scales, w8a8_reference, FP8BlockLinear
  mx.py                      MXFP4 and NVFP4 (both byte layouts), their layers
  trellis.py                 trellis codes (QTIP / EXL3): codes, Viterbi coding, BlockLDLQ, TrellisLinear
  trellis_viterbi.py         the Viterbi search: the textbook loop and the fast batched one
  trellis_layout.py          a trellis layer's layout: rotation, tiles, bitstream, checksum
  quantized_checkpoints.py   the chapter's loader and writer (load_quantized, save_quantized, build, PARTS) and the
                             registry of methods (METHODS), each imported when first used
  method.py                  CheckpointMethod (how a method lives in a checkpoint) and Option (what it takes)
  numerics/                  what the methods share: affine, obq, calibration, input_stats, layer_runs, experts (a
                             sparse layer's experts: counts, starved ones), minifloats, hadamard, lattices, sensitivity

The papers' methods and other tools' layouts:
  entropy.py                 EntQuant: Float8 pushed to low entropy, rANS-coded per transformer block
  entropy_decoder.py         EntQuant at inference: each block's stream decoded into one shared buffer
  entropy_rate.py            EntQuant's rate: a lambda for a bits target, from the shipped table
  entropy_scales.py          EntQuant's per-channel scales: the L-BFGS search
  entropy_feedback.py        EntQuant with GPTQ's error feedback on its E4M3 grid
  lattice.py                 HyperQuant's weights: E8 / D4 / A2 / Z lattice codes in Rice sub-streams
  nf4.py                     bitsandbytes' NF4, the layout transformers' load_in_4bit reads
  compressed_tensors.py      llm-compressor's layouts (pack-quantized, float-quantized, NVFP4, MXFP4)

A method's file holds its format and its algorithm; what it needs only to quantize a whole model (the model walk,
numerics/calibration.py) or to run its Triton kernel (kernels/, the engine path) it imports where it does that, so
the book's core reads, and imports, without them.

Rooms a reader can skip (they import the core; the core never imports them):
  llama_cpp/                 llama.cpp's blocks: ggml (decoders), ggml_quants (quantizers), bit_plan, and
                             gptq_ggml (GPTQ's codes on llama.cpp's grids, extending gptq.py's method)
  kv/                        the KV cache: kv_cache (the lattice cache, the hook), kv_baselines (FP8, q8_0, q4_0, KIVI),
                             kv_store (the cache that holds codes: generate / eval --kv-cache)

Glossary (one meaning per word where the code names a thing; where a word has two meanings, the one meant here):
  weight [out, in]           a linear's matrix: rows are outputs, columns are inputs, as in the chapter
  codes                      the integers a format stores per weight (uint8 [out, in] unpacked), before scales apply
  scales, zeros              per group: w = scale * (code - zero); `offsets` = -zero * scale where a format stores
                             the product (AffineQuantLinear, AWQ's reader)
  group, group_size          the run of input columns sharing one scale (g128); not a process group (that is
                             distributed.py's Group, of ranks)
  block                      a format's fixed unit: FP8's 128 x 128 tile, a GGML block (32 or 256 weights), MXFP4's
                             32; GPTQ's lazy batch of columns is obq.py's `block` too (its keyword in the book)
  layer                      a decoder layer (calibration.LayerCalibration) unless said "quantized layer" or "linear"
  linear                     an nn.Linear, or the QuantLinear that replaces it
  quantization_config        config.json's object naming the method (quant_method) and its settings; a method's
                             `validate` checks it once
  options                    the keywords a method's quantize_layer takes, declared once (CheckpointMethod.options)
  quantize (a model)         a whole-model pass: each method's `quantize(model, calibration_ids, **options)`;
                             `quantize_layer` is one decoder layer of it
  H, hessian                 2 X^T X / n of a linear's calibration inputs X (GPTQ's Hessian); G = X^T X / n (AWQ)
  bits per weight (bpw)      every stored bit (codes, scales, offsets, tables) over the weights
"""
