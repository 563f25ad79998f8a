"""One file per quantization format; `checkpoints.py` is the registry that reads and writes them."""
