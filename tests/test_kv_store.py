"""The stored KV cache (engine/formats/kv/kv_store.py): it holds codes, attention reads them back, and what it
computes is exactly what the simulated hook computes; its pages are checked, its SPEC parsed strictly."""
import pytest
import torch
from helpers import random_ids as ids
from torch._dynamo.utils import counters

from engine.formats.kv import kv_baselines, kv_cache, kv_store
from engine.qwen3 import KVCache

pytestmark = pytest.mark.usefixtures("one_thread")

SPECS = ["e8:3,window=5,exact_keys=3", "e8:2,window=0,rotation=signs", "d4:3,rotation=none", "a2:3", "z:4",
         "q4_0", "q8_0,window=7", "fp8", "fp8:head", "kivi:2,group=8,window=10", "kivi:4", "bf16"]


@torch.no_grad()
def chunked(model, x, chunk, cache):
    return torch.cat([model(x[:, i:i + chunk], cache) for i in range(0, x.shape[1], chunk)], 1)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("chunk", [150, 16, 1])
def test_stored_cache_computes_what_the_simulated_hook_computes(model32, spec, chunk):
    """Same calls, same codes: the logits are those of the plain cache that keeps every exact and decoded value (a
    stored page decoding to anything else, or a window dropping a value still read, is red). Read as the simulated
    hook reads (no basis: the rotation back on every position, as decode does), equal bit for bit here; the
    tolerance is for BLAS libraries that sum the Haar rotation's float64 matmul in another order when the number of
    rows differs (one call's tokens vs a layer's pages): 1e-6 is far below what one changed code moves. Read in the
    basis: test_attention_reads_rotated_pages_in_their_basis."""
    x = ids(2, 150)
    simulated = kv_store.parse_kv_spec(spec)
    kv_cache.install(model32, simulated)
    expected = chunked(model32, x, chunk, KVCache(2))
    stored = kv_store.parse_kv_spec(spec)
    stored.basis = lambda d, which, layer=0: None
    cache = kv_store.install(model32, stored)
    torch.testing.assert_close(chunked(model32, x, chunk, cache), expected, atol=1e-6, rtol=0)
    assert stored.coded == simulated.coded                  # the same bits counted: the same codes
    assert cache.length == 150 and cache.nbytes()["pages"] > 0


@pytest.mark.parametrize("spec", ["q4_0", "q8_0,key_order=interleaved", "q4_0,window=3", "e8:3",
                                  "e8:3,window=5,exact_keys=3", "d4:3,rotation=signs,window=0"])
def test_attention_reads_rotated_pages_in_their_basis(spec):
    """With head_dim 64 llama.cpp's cache rotates each head, and the lattice's rotates each (Haar, or random signs):
    the cache hands attention the pages' values unrotated and their basis (a d x d matmul per query and output, not
    per position), K's with the interleaved order in it, the window's and the first keys' exact values put in it;
    the logits are the simulated hook's up to float rounding (which can flip a code of the second layer: 2e-5 here;
    a wrong basis, or an exact value left out of it, moves them by ~1)."""
    from engine.qwen3 import Qwen3, Qwen3Config
    torch.manual_seed(0)
    model = Qwen3(Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=64, num_hidden_layers=2)).eval()
    x = ids(1, 100)
    simulated = kv_store.parse_kv_spec(spec)
    kv_cache.install(model, simulated)
    expected = chunked(model, x, 30, KVCache(2))
    quantizer = kv_store.parse_kv_spec(spec)
    cache = kv_store.install(model, quantizer, page_tokens=32)
    torch.testing.assert_close(chunked(model, x, 30, cache), expected, atol=1e-4, rtol=0)
    m_k, m_v = cache.layers[1].basis
    if isinstance(quantizer, kv_cache.KVQuantizer):
        for which, m in enumerate((m_k, m_v)):
            assert torch.equal(m, quantizer._rotation(1, which, 64).float())
        return
    assert torch.equal(m_v, kv_baselines.hadamard_matrix(64))
    assert not torch.equal(m_k, m_v) if "interleaved" in spec else torch.equal(m_k, m_v)
    assert torch.allclose(m_k @ m_k.T, torch.eye(64), atol=1e-6)
    part = cache.layers[1].parts[1]                        # V's 3 pages of 32 tokens: kept as the pages hold them
    assert not part.unread and part.kept.shape[2] == 96
    blocks = torch.frombuffer(bytearray(part.arenas["blocks"].data), dtype=torch.uint8)
    blocks = blocks.reshape(96, 1, 2, -1).movedim(0, 2)                    # token-major pages -> [B, H, n, bytes]
    assert torch.equal(part.kept, kv_baselines.dequantize_blocks(blocks, quantizer.cache_type))


@pytest.mark.parametrize("spec", ["q4_0", "q8_0,window=7"])
def test_with_no_window_attention_gets_the_coded_values_once(model32, spec):
    """With no window no query reads an exact value, so a step hands attention one tensor of coded K (and V), not
    a second copy of the whole cache with the newest exact values in it (a copy per layer per step); with a window
    the newest positions are exact there."""
    quantizer = kv_store.parse_kv_spec(spec)
    cache = kv_store.install(model32, quantizer)
    chunked(model32, ids(1, 40), 8, cache)
    cfg = model32.cfg
    k, v = torch.randn(2, 1, cfg.num_key_value_heads, 1, cfg.head_dim)
    k_all, v_all, k_hat, v_hat, _ = cache.windowed(0, k, v, quantizer, quantizer.window)
    assert (k_all is k_hat and v_all is v_hat) == (quantizer.window == 0)
    assert torch.equal(k_all[:, :, -1:], k) == bool(quantizer.window)


@pytest.mark.parametrize("spec", ["q8_0", "e8:3,window=0", "e8:3,window=5", "kivi:2,group=8,window=10"])
def test_fast_attention_reads_a_stored_cache_as_the_eager_one_does(spec):
    """A fast model's attention reads a prompt's chunks over a coded cache through torch's fused kernel, a window's
    band of columns (coded for the queries far from them, exact for the near ones) as two masked copies: the eager
    logits up to float rounding (a wrong causal mask, or exact values read where coded ones belong, moves them by
    ~0.1). One layer, only attention fast: the same codes on both sides (a layer's input rounded otherwise can flip
    a code)."""
    from engine.qwen3 import Attention, Qwen3, Qwen3Config
    torch.manual_seed(0)
    model = Qwen3(Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=32, num_hidden_layers=1)).eval()
    x = ids(1, 120)
    eager = chunked(model, x, 40, kv_store.install(model, kv_store.parse_kv_spec(spec)))
    for module in model.modules():
        if isinstance(module, Attention):
            module.fast = True
    fast = chunked(model, x, 40, kv_store.install(model, kv_store.parse_kv_spec(spec)))
    torch.testing.assert_close(fast, eager, atol=1e-5, rtol=0)


def test_the_cache_holds_codes_not_values(model32):
    """E8 at 3 bps with no window: pages of Rice sub-streams plus f16 scales, well under a bf16 cache; the exact
    window holds exactly the last `window` positions."""
    x = ids(1, 256)
    cache = kv_store.install(model32, kv_store.parse_kv_spec("e8:3,window=0"))
    chunked(model32, x, 64, cache)
    held = cache.nbytes()
    assert held["exact"] == 0 and held["tail"] == 0                         # 256 = 4 pages of 64 tokens
    assert held["pages"] < 0.3 * cache.bf16_bytes()                          # ~3.5 bits of 16
    windowed = kv_store.install(model32, kv_store.parse_kv_spec("e8:3,window=32"))
    chunked(model32, x, 64, windowed)
    assert windowed.nbytes()["exact"] == 2 * 2 * 32 * 2 * 32 * 4              # layers, K+V, positions, heads, d, f32


def test_generate_with_a_stored_cache_equals_the_simulated_one(model32):
    x = ids(1, 40)
    spec = "e8:3,window=4"
    kv_cache.install(model32, kv_store.parse_kv_spec(spec))
    expected = model32.generate(x, 30, cache=KVCache(2), prefill_chunk=16)
    quantizer = kv_store.parse_kv_spec(spec)
    cache = kv_store.install(model32, quantizer)
    assert torch.equal(model32.generate(x, 30, cache=cache, prefill_chunk=16), expected)
    assert cache.length == 69                                                 # the last token is never fed back


def test_the_triton_decoder_reads_the_pages_as_numpy_does(model32):
    x = ids(1, 96)
    logits = []
    for kernel in (False, True):
        cache = kv_store.install(model32, kv_store.parse_kv_spec("e8:3,window=8"), kernel=kernel, page_tokens=32)
        logits.append(chunked(model32, x, 48, cache))
    assert torch.equal(*logits)


def test_a_long_q4_0_cache_reads_its_pages_through_the_compiled_decode(model32, monkeypatch):
    """From COMPILE_FROM values at once (lowered here to one page's), q4_0's pages decode through the compiled
    q4_0_into: a chunked prefill's logits and generate's tokens are the tensor ops' bit for bit, with few builds
    (generate's inference_mode, a forward's no_grad: at most 4 of dynamo's 8)."""
    x = ids(1, 150)
    logits = chunked(model32, x, 16, kv_store.install(model32, kv_store.parse_kv_spec("q4_0")))
    tokens = model32.generate(x[:, :40], 30, cache=kv_store.install(model32, kv_store.parse_kv_spec("q4_0")),
                              prefill_chunk=16)
    monkeypatch.setattr(kv_baselines, "COMPILE_FROM", 2 * 64 * 32)
    compiled_calls, built_once = [], kv_baselines.compiled_q4_0_into
    monkeypatch.setattr(kv_baselines, "compiled_q4_0_into", lambda: compiled_calls.append(1) or built_once())
    built_once()
    graphs = counters["stats"]["unique_graphs"]
    assert torch.equal(chunked(model32, x, 16, kv_store.install(model32, kv_store.parse_kv_spec("q4_0"))), logits)
    cache = kv_store.install(model32, kv_store.parse_kv_spec("q4_0"))
    assert torch.equal(model32.generate(x[:, :40], 30, cache=cache, prefill_chunk=16), tokens)
    assert compiled_calls and counters["stats"]["unique_graphs"] - graphs <= 4


def pages_read(quantizer):
    """Count the pages a stored cache reads back (quantizer.unpack_many's pages): [count]."""
    count, unpack_many = [0], quantizer.unpack_many

    def counting(items, **options):
        count[0] += sum(len(pages.starts[next(iter(pages))]) for pages, _ in items)
        return unpack_many(items, **options)
    quantizer.unpack_many = counting
    return count


@pytest.mark.parametrize("spec", ["e8:3,window=4", "q4_0"])
def test_one_token_steps_decode_each_page_once(model32, spec):
    """136 one-token steps fill 4 pages of 32 tokens per layer's K and V: each is read back once, not again on
    every later step (912 page reads here, growing as N^2: a long prompt read one token at a time hung)."""
    quantizer = kv_store.parse_kv_spec(spec)
    read = pages_read(quantizer)
    cache = kv_store.install(model32, quantizer, page_tokens=32)
    chunked(model32, ids(1, 136), 1, cache)
    assert read[0] == 16
    assert [len(arena.starts) for s in cache.layers for part in s.parts for arena in part.arenas.values()] == [4] * (
        2 * 2 * len(cache.layers[0].parts[0].arenas))
    assert cache.nbytes()["decoded"] == 16 * 32 * 2 * 32 * 4                 # pages, tokens, heads, d, float32


def test_the_decoded_pages_kept_stay_within_their_bound(model32):
    """decoded_bytes bounds the values kept (the first pages that fit); the others are read back on every step,
    and what attention sees is the same whatever the bound."""
    x, page = ids(1, 136), 32 * 2 * 32 * 4                                  # one page's values: 8 KiB
    logits, reads = [], []
    for bound in (0, 5 * page + 100, kv_store.DECODED_BYTES):
        quantizer = kv_store.parse_kv_spec("q4_0")
        reads.append(pages_read(quantizer))
        cache = kv_store.install(model32, quantizer, page_tokens=32, decoded_bytes=bound)
        logits.append(chunked(model32, x, 1, cache))
        assert cache.nbytes()["decoded"] == min(bound // page, 16) * page
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
    assert reads[0][0] > reads[1][0] > reads[2][0] == 16
    with pytest.raises(ValueError, match="decoded_bytes=-1: must be an integer >= 0"):
        kv_store.install(model32, kv_store.parse_kv_spec("q4_0"), decoded_bytes=-1)


def test_a_corrupted_page_is_detected_by_its_checksum(model32):
    """Pages read back on every step (decoded_bytes=0; a kept page is read once, when it is written)."""
    x = ids(1, 130)
    cache = kv_store.install(model32, kv_store.parse_kv_spec("e8:3,window=0"), decoded_bytes=0)
    chunked(model32, x[:, :128], 64, cache)
    cache.layers[1].parts[0].arenas["payload"].data[10] ^= 0x40
    with pytest.raises(ValueError, match="layer 1 K payload, page 0: checksum mismatch"):
        chunked(model32, x[:, 128:], 2, cache)
    q4 = kv_store.install(model32, kv_store.parse_kv_spec("q4_0"), decoded_bytes=0)
    chunked(model32, x[:, :128], 64, q4)
    q4.layers[0].parts[1].arenas["blocks"].data[-1] ^= 1
    with pytest.raises(ValueError, match="layer 0 V blocks, page 1: checksum mismatch"):
        chunked(model32, x[:, 128:], 2, q4)


@pytest.mark.parametrize("spec, message", [
    ("", "needs a SPEC"), ("e9:3", "unknown cache 'e9'"), ("e8", "needs its bits per scalar"),
    ("e8:x", "needs its bits per scalar"), ("e8:9", "outside the calibrated range"),
    ("e8:3,window", "'window' is not an option"), ("e8:3,depth=2", "'depth=2' is not an option"),
    ("e8:3,window=-1", "window=-1: must be an integer >= 0"), ("e8:3,window=a", "window='a' is not int"),
    ("e8:3,rotation=haar", "rotation must be one of"), ("q4_0:2", "q4_0 takes no ':' value"),
    ("kivi:3", "kivi takes 2 or 4 bits"), ("fp8:channel", "fp8 scale must be one of"),
    ("kivi:2,group=32,window=8", "need window >= 31"), ("bf16,exact_keys=2", "not an option of bf16"),
    ("e8:3,window=4,window=8", "window is given twice"), ("q4_0,rotation=none,rotation=none", "rotation is given twice"),
    (f"e8:3,seed={2 ** 70}", rf"seed={2 ** 70}: must be an integer from 0 to 2\*\*32 - 1"),
    ("e8:3,seed=-1", r"seed=-1: must be an integer from 0 to 2\*\*32 - 1")])
def test_bad_specs_are_refused_naming_the_problem(spec, message):
    with pytest.raises(ValueError, match=message) as refused:
        kv_store.parse_kv_spec(spec)
    assert str(refused.value).startswith(f"--kv-cache {spec}".rstrip())           # the line names the SPEC too


def test_what_a_stored_cache_cannot_hold_is_refused(model32):
    with pytest.raises(ValueError, match="dithered lattice cache cannot be stored"):
        kv_store.install(model32, kv_cache.KVQuantizer("E8", 3.0, dither=True))
    with pytest.raises(ValueError, match="kernel=True decodes lattice pages"):
        kv_store.install(model32, kv_baselines.GGMLKV("q4_0"), kernel=True)
    cache = kv_store.install(model32, kv_store.parse_kv_spec("e8:3"), page_tokens=12)
    with pytest.raises(ValueError, match="whole 512-symbol sub-streams"):
        chunked(model32, ids(1, 40), 40, cache)
    cache = kv_store.install(model32, kv_store.parse_kv_spec("q4_0"))
    model32.set_kv_transform(kv_store.parse_kv_spec("q4_0"), window=0)
    with pytest.raises(ValueError, match="not this cache's quantizer"):
        chunked(model32, ids(1, 4), 4, cache)
    with pytest.raises(ValueError, match="needs an empty cache"):
        cache = kv_store.install(model32, kv_store.parse_kv_spec("q4_0"))
        chunked(model32, ids(1, 4), 4, cache)
        model32.generate(ids(1, 4), 2, cache=cache)
