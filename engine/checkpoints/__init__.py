"""Other tools' files and the big jobs: GGUF (reader, writer, tokenizer), any model by its path, the layer-by-layer
converter, tokenizer files, and what loads where. The chapter's own loader and writer are engine/formats/'s."""
