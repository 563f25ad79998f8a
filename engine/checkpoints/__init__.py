"""Other tools' files and the big jobs: any model by its path, the layer-by-layer converter, tokenizer files, and
what loads where. The chapter's own loader and writer are engine/formats/'s; GGUF files are llama.cpp's room
(engine/formats/llama_cpp/)."""
