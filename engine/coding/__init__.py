"""Lossless coding stages beneath the quantization formats: each coder file starts with a textbook reference coder,
the fast one beside it (tested equal), and a checksum over every byte of its stream and the side data bound to it."""
