"""A random-initialized checkpoint of Qwen3-0.6B's shape, as transformers writes it (runs in the peers venv):

    python make_checkpoint.py LAYERS OUT_DIR

28 layers is the real shape (hidden 1024, intermediate 3072, 16 heads x 128, 8 KV heads, vocabulary 151,936,
tied embeddings, bf16: 1.19 GB); fewer layers keep every tensor's shape (8 layers: 563 MB).
"""
import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def main(layers, out):
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=int(layers),
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                         rms_norm_eps=1e-6, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
