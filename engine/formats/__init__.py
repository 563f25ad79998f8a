"""The book's quantization methods, one file each, and the numerics they share (base, affine, obq, calibration,
minifloats, hadamard, ggml); engine/checkpoints/ reads and writes them."""
