"""The KV cache.

  kv_cache.py      HyperQuant's lattice codes on K and V, the model's KV hook, the residual window, bit accounting
  kv_baselines.py  the serving engines' caches: FP8 (vLLM), q8_0 / q4_0 (llama.cpp), KIVI
"""
