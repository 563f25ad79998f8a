"""The KV cache.

  kv_cache.py      HyperQuant's lattice codes on K and V, the model's KV hook, the residual window, bit accounting
  kv_baselines.py  the serving engines' caches: FP8 (vLLM), q8_0 / q4_0 (llama.cpp), KIVI, bf16 / f16
  kv_store.py      a cache that holds the codes (checked pages of their bytes), read back in attention: --kv-cache
"""
