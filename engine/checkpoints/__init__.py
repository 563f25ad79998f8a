"""Reading and writing checkpoints: the method registry, the loaders, safetensors and GGUF files, the layer-by-layer
converter, tokenizer files, and what loads where."""
