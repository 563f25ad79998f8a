"""llama.cpp's family: its GGML blocks, its quantizers, GPTQ on its grids, and the GGUF file.

  ggml.py          the block table (every GGML type's id, size, layout), the reference decoders, encode, GGMLLinear
  ggml_quants.py   llama.cpp's quantizers (ggml-quants.c), round-to-nearest and with an importance matrix, bit-exact
  bit_plan.py      spending a bits budget: each candidate's measured error, a greedy knapsack over the linears
  gptq_ggml.py     GPTQ's codes on these grids (K-quants, Q4_0 ... Q8_0, IQ4): gptq.py's method extended
  refit.py         each block's f16 fields refit to GPTQ's codes, by least squares in the layer error's norm
  gguf.py          a GGUF file read as the engine's model (names, RoPE rows, tied heads); gguf_experts.py: the
                   Qwen3-MoE experts stacked per layer
  gguf_file.py     the GGUF container: header, metadata, tensor table, the engine's digests
  gguf_tokenizer.py  the vocabulary: a GGUF file's as a `tokenizers.Tokenizer`, the byte model's as GGUF keys
  gguf_writer.py   a model (dense or quantized) written as a GGUF file llama.cpp runs
"""
