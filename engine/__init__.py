"""engine: quantized LLM checkpoints you can read (book chapter 39, EntQuant, HyperQuant)."""
