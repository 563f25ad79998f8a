"""The book's quantization methods, one file each, the chapter's loader and writer (quantized_checkpoints), and the
numerics they share (base, affine, obq, calibration, minifloats, hadamard, ggml)."""
