"""EntQuant: the rANS coder (exact, near the entropy, robust to corruption), the Triton decoder, the scale search,
the block-by-block runtime, rate control, the checkpoint, and the NF4 baseline."""
import copy

import numpy as np
import pytest
import torch

from engine.formats import base
from engine.evaluation import kl_stats
from engine.formats import entropy as E
from engine.kernels import stream_decoders
from engine.qwen3 import Qwen3, Qwen3Config


def _fp8_like(n, spread, seed=0):
    """E4M3 bytes of Laplace weights pushed into the subnormal range: what EntQuant codes look like."""
    g = torch.Generator().manual_seed(seed)
    w = -torch.rand(n, generator=g).log() * torch.sign(torch.rand(n, generator=g) - 0.5) * spread
    return E.encode_weight(w[None], torch.zeros(1)).reshape(-1)


STREAMS = {
    "empty": np.zeros(0, np.uint8),
    "one symbol once": np.array([42], np.uint8),
    "one symbol only": np.full(5000, 7, np.uint8),
    "all 256 symbols": np.random.default_rng(1).permutation(np.repeat(np.arange(256), 20)).astype(np.uint8),
    "uniform random": np.random.default_rng(2).integers(0, 256, 7001).astype(np.uint8),
    "very skewed": np.concatenate([np.zeros(20000, np.uint8), np.arange(1, 256, dtype=np.uint8)]),
}


@pytest.mark.parametrize("name", sorted(STREAMS))
@pytest.mark.parametrize("lanes", [None, 96])
def test_rans_round_trip_is_exact(name, lanes):
    symbols = STREAMS[name]
    data = E.rans_encode(symbols, lanes=lanes)
    assert np.array_equal(E.rans_decode(data).numpy(), symbols)


def test_frequency_table_sums_to_precision_and_keeps_every_symbol():
    counts = np.zeros(256, np.int64)
    counts[:200] = 1                               # 200 symbols seen once: each still needs f >= 1
    counts[200] = 10 ** 7
    f = E.quantize_frequencies(counts)
    assert f.sum() == 1 << E.PROB_BITS and (f[:201] >= 1).all() and (f[201:] == 0).all()
    f = E.quantize_frequencies(np.arange(256) ** 2)
    assert f.sum() == 1 << E.PROB_BITS and f[0] == 0 and (f[1:] >= 1).all()


@pytest.mark.parametrize("spread", [1 / 512, 1 / 64])     # about 2.3 and 5.3 bits per symbol
def test_rate_within_one_percent_of_entropy_all_metadata_counted(spread):
    symbols = _fp8_like(1 << 20, spread)
    data = E.rans_encode(symbols)
    entropy_bytes = E.empirical_entropy_bits(symbols) / 8
    assert 1.5 < 8 * entropy_bytes / symbols.numel() < 6.0
    assert entropy_bytes <= len(data) <= 1.01 * entropy_bytes
    assert torch.equal(E.rans_decode(data), symbols)


def test_corrupted_or_truncated_streams_raise_value_error():
    symbols = STREAMS["uniform random"]
    data = E.rans_encode(symbols, lanes=64)
    head = len(data) - 2 * len(E.RansStream(data).words)     # where the words begin
    for broken in (data[:-2], data[:10], data + b"\0\0", b"XXXX" + data[4:]):
        with pytest.raises(ValueError):
            E.rans_decode(broken)
    with pytest.raises(ValueError):
        E.rans_decode(data, n=len(symbols) + 1)                 # a header that lies about n is caught up front
    for pos in (head, head + 101, len(data) - 1):
        flipped = bytearray(data)
        flipped[pos] ^= 0x5A
        with pytest.raises(ValueError):
            E.rans_decode(bytes(flipped))
    states = bytearray(data)
    first = E._HEADER.size + 32 + 2 * 256                       # all 256 symbols occur: 256 frequencies
    states[first:first + 4] = b"\0\0\0\0"                       # first lane's state 0: below 2^16
    with pytest.raises(ValueError):
        E.rans_decode(bytes(states))


@pytest.mark.parametrize("symbols, lanes", [
    (np.concatenate([STREAMS["very skewed"][::7], STREAMS["uniform random"][:500]]), 64),  # partial last step
    (STREAMS["uniform random"], 96),                # 3 sub-streams: one program of 4 rows, the last masked
    (_fp8_like(1 << 15, 0.02).numpy(), 128),        # K divides n: full steps only
    (STREAMS["one symbol once"], 32),
    (STREAMS["empty"], 32),
])
def test_triton_decoder_equals_numpy_decoder(symbols, lanes):
    stream = E.RansStream(E.rans_encode(symbols, lanes=lanes))
    out = torch.empty(stream.n, dtype=torch.uint8)
    stream_decoders.rans_decode(*stream.tensors("cpu"), out, stream.prob_bits)
    assert torch.equal(out, E.rans_decode(stream)) and np.array_equal(out.numpy(), symbols)
    if stream.n < 100:
        return
    bad = list(stream.tensors("cpu"))
    bad[2] = bad[2].clone()
    bad[2][3] ^= 0x1234                                         # a flipped word
    with pytest.raises(ValueError):
        stream_decoders.rans_decode(*bad, out, stream.prob_bits)
    bad = list(stream.tensors("cpu"))
    bad[0] = bad[0].clone()
    bad[0][-1, -1] += 1                                         # the last lane's start state
    with pytest.raises(ValueError):
        stream_decoders.rans_decode(*bad, out, stream.prob_bits)
    bad = list(stream.tensors("cpu"))
    bad[1] = bad[1].clone()
    bad[1][1] -= 1                                              # a sub-stream boundary one word early
    with pytest.raises(ValueError):
        stream_decoders.rans_decode(*bad, out, stream.prob_bits)


def test_round_e4m3_equals_torch_cast():
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = values[values.isfinite()].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([torch.randn(20000) * 10.0 ** torch.randint(-4, 3, (20000,)), grid, mids,
                   mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9)), torch.tensor([470.0, -1e6])])
    assert torch.equal(E.round_e4m3(x), x.clamp(-448, 448).to(torch.float8_e4m3fn).float())


def test_larger_lambda_gives_lower_entropy_and_no_negative_zero():
    torch.manual_seed(0)
    w = torch.randn(64, 128) * 0.02
    rates = []
    for lam in (1.0, 14.5, 58.0):
        s = E.entquant_scales(w, lam, max_iter=50)
        codes = E.encode_weight(w, s)
        assert not (codes == 0x80).any()
        assert torch.equal(s, s.half().float())                # what the checkpoint stores (float16) is what was used
        rates.append(E.empirical_entropy_bits(codes) / codes.numel())
    assert rates[0] > rates[1] > rates[2]


def test_int8_super_weights_are_kept_exact():
    torch.manual_seed(0)
    w = torch.randn(32, 64) * 0.02
    w[3, 5], w[10, 60] = 2.0, -3.0
    model_like = torch.nn.Linear(64, 32, bias=False)
    model_like.weight.data = w
    per_layer, streams, bits, _ = E.compress_blocks({0: [("l", model_like)]}, 14.5, "int8", super_weights=2)
    s, idx, val = per_layer["l"]
    assert sorted(idx.tolist()) == [3 * 64 + 5, 10 * 64 + 60] and sorted(val.tolist()) == [-3.0, 2.0]
    layer = E.EntQuantLinear(64, 32, s, "int8", torch.frombuffer(bytearray(streams[0]), dtype=torch.uint8), idx, val)
    E.attach_decoder(_one_block(layer))
    assert layer.dequantize()[3, 5] == 2.0 and layer.dequantize()[10, 60] == -3.0
    assert layer.storage_bits() == bits


def _one_block(layer):
    """A minimal model.model.layers[0] around one layer."""
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList([torch.nn.Sequential(layer)])
    return root


def _reference_with(model, quantized):
    """The dense model with each quantized linear's dequantized weight: what the quantized model must compute."""
    for name, layer in quantized.items():
        model.get_submodule(name).weight.data = layer.dequantize()
    return model


def test_model_runs_block_by_block_from_one_shared_buffer(tiny_model, tiny_cfg, monkeypatch):
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    dense = Qwen3(tiny_cfg).eval()
    dense.load_state_dict(tiny_model.state_dict())
    qcfg = E.quantize_entquant(tiny_model, lam=14.5, max_iter=30)
    quantized = {n: m for n, m in tiny_model.named_modules() if isinstance(m, E.EntQuantLinear)}
    assert len(quantized) == 14 and qcfg["quant_method"] == "entquant"
    decoder = tiny_model.entquant_decoder
    decoded = []
    original = decoder.decode
    decoder.decode = lambda i: (decoded.append(i), original(i))[1]
    with torch.no_grad():
        logits = tiny_model(ids)
    decoder.decode = original
    assert decoded[0] == 0 and decoded[-1] == 1 and set(decoded) == {0, 1}   # each block decoded as it runs
    assert decoder.buffer.numel() == max(decoder.sizes.values())
    with torch.no_grad():
        reference = _reference_with(dense, quantized)(ids)
        assert torch.allclose(logits, reference, atol=1e-4, rtol=1e-4)
        calls = []
        triton_decode = stream_decoders.rans_decode
        monkeypatch.setattr(stream_decoders, "rans_decode", lambda *a: (calls.append(1), triton_decode(*a))[1])
        with base.impl("engine"):                        # the Triton decoder, also without a GPU
            assert torch.allclose(tiny_model(ids), logits, atol=1e-4, rtol=1e-4)
        assert len(calls) == 2
    streams = sum(len(m.stream) for m in quantized.values())
    bits = 8 * streams + sum(16 * m.out_features for m in quantized.values())
    assert sum(m.storage_bits() for m in quantized.values()) == bits
    assert abs(bits / sum(m.in_features * m.out_features for m in quantized.values()) - qcfg["bits_per_weight"]) < 1e-9
    mem = E.resident_bytes(tiny_model)
    assert mem["resident"] == streams + sum(2 * m.out_features for m in quantized.values()) + decoder.buffer.numel()


def test_bpw_target_is_met_within_tolerance(tiny_model):
    qcfg = E.quantize_entquant(tiny_model, bpw=3.0, max_iter=30)
    layers = [m for m in tiny_model.modules() if isinstance(m, E.EntQuantLinear)]
    bpw = sum(m.storage_bits() for m in layers) / sum(m.in_features * m.out_features for m in layers)
    assert abs(bpw - 3.0) <= 0.05 and bpw == pytest.approx(qcfg["bits_per_weight"])


def test_lambda_search_brackets_and_bisects():
    measure = lambda lam: 6.0 - 0.9 * np.log(lam)                # log-linear, as the paper observes
    table = [(1.0, 4.0), (10.0, 2.0)]                             # a poor start: the search must still get there
    lam, bpw = E.lambda_for_bpw(2.1, measure, table, tol=0.01)
    assert abs(bpw - 2.1) <= 0.01 and abs(measure(lam) - bpw) < 1e-12
    with pytest.raises(ValueError):
        E.lambda_for_bpw(2.1, lambda lam: 5.0, table)


def test_checkpoint_parts_round_trip(tiny_model, tiny_cfg):
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(1))
    qcfg = E.quantize_entquant(tiny_model, lam=58.0, max_iter=20)
    with torch.no_grad():
        logits = tiny_model(ids)
    parts = {n: E.CHECKPOINT.write(m, qcfg) for n, m in tiny_model.named_modules()
             if isinstance(m, E.EntQuantLinear)}
    assert all(set(p) == set(E.CHECKPOINT.parts(qcfg)) for p in parts.values())
    assert parts["model.layers.0.self_attn.q_proj"]["weight_stream"].numel() > 0
    assert parts["model.layers.0.mlp.down_proj"]["weight_stream"].numel() == 0
    fresh = Qwen3(tiny_cfg).eval()
    fresh.load_state_dict({k: v for k, v in tiny_model.state_dict().items() if k in fresh.state_dict()},
                          strict=False)
    for name, p in parts.items():
        parent, _, child = name.rpartition(".")
        setattr(fresh.get_submodule(parent), child, E.CHECKPOINT.read(p, qcfg))
    with pytest.raises(ValueError):
        fresh(ids)                                                # not yet linked to its decoder
    E.finish_loading(fresh, qcfg)
    with torch.no_grad():
        assert torch.equal(fresh(ids), logits)
    broken = dict(parts["model.layers.1.self_attn.q_proj"])
    broken["weight_stream"] = broken["weight_stream"][:-3]
    fresh.model.layers[1].self_attn.q_proj = E.CHECKPOINT.read(broken, qcfg)
    with pytest.raises(ValueError):
        E.attach_decoder(fresh)


def test_save_load_through_registry_gives_identical_logits(tiny_model, tmp_path):
    from engine.formats import checkpoints
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(2))
    checkpoints.save_quantized(tiny_model, tmp_path / "ckpt", "entquant", lam=14.5, max_iter=20)
    with torch.no_grad():
        logits = tiny_model(ids)
        loaded = checkpoints.load_quantized(tmp_path / "ckpt")            # its finish hook re-attaches the decoder
        assert torch.equal(loaded(ids), logits)
    assert {m.stream.numel() > 0 for m in loaded.modules() if isinstance(m, E.EntQuantLinear)} == {True, False}


def test_nf4_levels_bits_and_kernel():
    torch.manual_seed(0)
    w = torch.randn(48, 130)
    layer = E.NF4Linear.from_weight(w)
    deq = layer.dequantize()
    groups = -(-130 // 64)
    assert layer.storage_bits() == 48 * 130 * 4 + 48 * groups * 16
    absmax = torch.nn.functional.pad(w, (0, groups * 64 - 130)).reshape(48, groups, 64).abs().amax(-1).half().float()
    a = absmax.repeat_interleave(64, 1)[:, :130]
    levels = E.NF4_TABLE[None, None, :] * a[..., None]
    nearest = levels.gather(-1, (levels - w[..., None]).abs().argmin(-1, keepdim=True))[..., 0]
    assert torch.allclose(deq, nearest)
    x = torch.randn(5, 130)
    with base.impl("engine"):
        assert torch.allclose(layer(x), x @ deq.T, atol=1e-4, rtol=1e-4)


def test_a_corrupted_symbol_count_is_refused_before_decoding():
    data = bytearray(E.rans_encode(np.random.default_rng(0).integers(0, 7, 10000).astype(np.uint8)))
    magic, version, prob_bits, lanes, n, streams = E._HEADER.unpack_from(data)
    E._HEADER.pack_into(data, 0, magic, version, prob_bits, lanes, 300_000_000, streams)
    with pytest.raises(ValueError, match="claims 300000000 symbols"):
        E.rans_decode(bytes(data))
    with pytest.raises(ValueError, match="lanes"):
        E.rans_encode(np.zeros(10, np.uint8), lanes=0)
    with pytest.raises(ValueError, match="expected 10001"):
        E.rans_decode(E.RansStream(bytes(E.rans_encode(np.zeros(10000, np.uint8)))), n=10001)
    one = bytearray(E.rans_encode(np.zeros(10000, np.uint8)))              # one symbol: its words bound nothing
    magic, version, prob_bits, lanes, n, streams = E._HEADER.unpack_from(one)
    E._HEADER.pack_into(one, 0, magic, version, prob_bits, lanes, 1 << 40, streams)
    with pytest.raises(ValueError, match="pass the n you expect"):
        E.rans_decode(bytes(one))


def _textbook_decode(data):
    """The plain decoder, one symbol at a time: slot = x mod 2^p, s = sym(slot), x = f[s] (x >> p) + slot - c[s],
    and a 16-bit word from the lane's sub-stream whenever x falls below 2^16."""
    st = E.RansStream(data)
    streams, width = st.states.shape
    lanes, mask = streams * width, (1 << st.prob_bits) - 1
    sym, f, bias = E._slot_tables(st.f, st.prob_bits)
    x, ptr = [int(v) for v in st.states.reshape(-1)], [int(v) for v in st.starts[:-1]]
    out = np.empty(st.n, np.uint8)
    for i in range(st.n):
        lane = i % lanes
        slot = x[lane] & mask
        out[i] = sym[slot]
        x[lane] = int(f[slot]) * (x[lane] >> st.prob_bits) + int(bias[slot])
        if x[lane] < E.STATE_LOW:
            x[lane] = x[lane] << 16 | int(st.words[ptr[lane // width]])
            ptr[lane // width] += 1
    assert x == [E.STATE_LOW] * lanes and ptr == list(st.starts[1:])
    return out


@pytest.mark.parametrize("chunk", [32, 96, 160, 1 << 15])
def test_fast_decoder_equals_the_textbook_decoder(chunk, monkeypatch):
    monkeypatch.setattr(E, "DECODE_CHUNK", chunk)         # 1, 3, 5, all of the 157 full steps per batch
    data = E.rans_encode(_fp8_like(5049, spread=0.01), lanes=32)                # and a partial last step of 25
    assert np.array_equal(E.rans_decode(data).numpy(), _textbook_decode(data))


# ---- the Fisher-weighted loss (our addition) --------------------------------------------------------------------

def test_self_generated_ids_are_reproducible_and_in_vocabulary(tiny_model):
    a = E.self_generated_ids(tiny_model, samples=3, seq_len=10, seed=4)
    assert a.shape == (3, 10) and a.dtype == torch.long and int(a.min()) >= 0 and int(a.max()) < 256
    assert torch.equal(a, E.self_generated_ids(tiny_model, samples=3, seq_len=10, seed=4))
    assert not torch.equal(a, E.self_generated_ids(tiny_model, samples=3, seq_len=10, seed=5))


def _exact_row_fisher(model, names, ids, label_probs=None):
    """{name: [out]}: row means of sum over positions of E_y (d log p(y) / dW)^2 with every label y enumerated,
    y ~ the model's own p (the quantity the sampled, summed-then-squared estimate is unbiased for) or ~ label_probs."""
    weights = [model.get_submodule(n).weight for n in names]
    exact = [torch.zeros_like(w) for w in weights]
    logp = model(ids).log_softmax(-1)
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1]):
            for y in range(logp.shape[-1]):
                grads = torch.autograd.grad(logp[b, t, y], weights, retain_graph=True)
                prob = logp[b, t, y].exp().detach() if label_probs is None else label_probs[y]
                for e, g in zip(exact, grads):
                    e += prob * g.square()
    return {n: e.mean(1) for n, e in zip(names, exact)}


def _normalized(model, row_fisher):
    k = sum((f * model.get_submodule(n).weight.detach().square().sum(1)).sum() for n, f in row_fisher.items())
    k = k / sum(model.get_submodule(n).weight.numel() for n in row_fisher)
    return {n: f / k for n, f in row_fisher.items()}


def _relative_error(got, want):
    return max(float((got[n] - want[n]).abs().sum() / want[n].sum()) for n in want)


def test_fisher_estimate_matches_the_exact_expectation():
    torch.manual_seed(0)
    model = Qwen3(Qwen3Config(vocab_size=8, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=8, num_hidden_layers=1))
    with torch.no_grad():
        model.model.norm.weight.mul_(20.0)                  # peaked predictions: the labels' law matters
    model.model.embed_tokens.weight.requires_grad_(False)  # a frozen parameter must stay frozen
    names = ["model.layers.0.self_attn.v_proj", "model.layers.0.mlp.down_proj"]
    ids = torch.tensor([[1, 5, 2], [7, 0, 3]])
    want = _normalized(model, _exact_row_fisher(model, names, ids))
    uniform = _normalized(model, _exact_row_fisher(model, names, ids, torch.full((8,), 1 / 8)))
    assert _relative_error(uniform, want) > 0.3             # labels not drawn from the model would be caught
    got = E.fisher_importance(model, names, ids, draws=3000, seed=1)
    # 3000 draws over 6 positions: seeds 1-6 give 0.010-0.028 (the estimate's spread); uniform labels give 0.35.
    assert _relative_error(got, want) < 0.08
    assert not model.model.embed_tokens.weight.requires_grad and model.model.layers[0].mlp.up_proj.weight.requires_grad
    assert model.training                                   # eval mode while estimating, then restored


def test_fisher_importance_is_relative_to_the_whole_model(tiny_model):
    names = [n for n, m in tiny_model.named_modules() if isinstance(m, torch.nn.Linear) and "layers" in n]
    imp = E.fisher_importance(tiny_model, names, E.self_generated_ids(tiny_model, samples=4, seq_len=16))
    total = sum((imp[n] * tiny_model.get_submodule(n).weight.detach().square().sum(1)).sum() for n in names)
    assert total == pytest.approx(sum(tiny_model.get_submodule(n).weight.numel() for n in names), rel=1e-4)
    assert all(imp[n].shape == (tiny_model.get_submodule(n).out_features,) and (imp[n] > 0).all() for n in names)
    ids = torch.zeros(1, 4, dtype=torch.long)
    for bad_names, bad_ids, kwargs, match in [
            (["model.layers.0.mlp"], ids, {}, "not linears"), ([], ids, {}, "non-empty"),
            ([names[0], names[0]], ids, {}, "distinct"), (names, ids.float(), {}, "integer"),
            (names, ids[:, :0], {}, "non-empty"), (names, ids, {"draws": 0}, "draws")]:
        with pytest.raises(ValueError, match=match):
            E.fisher_importance(tiny_model, bad_names, bad_ids, **kwargs)
    with torch.inference_mode(), pytest.raises(ValueError, match="inference_mode"):
        E.fisher_importance(tiny_model, names, ids)


def test_fisher_weighted_loss_lowers_kl_at_the_same_rate(tiny_model):
    ids = E.self_generated_ids(tiny_model, samples=4, seq_len=64, seed=5)     # not the Fisher's own samples (seed 0)
    with torch.no_grad():
        reference = tiny_model(ids)
    kl, bits = {}, {}
    for sensitivity in (None, "fisher"):
        model = copy.deepcopy(tiny_model)
        qcfg = E.quantize_entquant(model, bpw=2.5, tol=0.02, sensitivity=sensitivity, fisher_samples=16)
        with torch.no_grad():
            kl[sensitivity] = kl_stats(reference, model(ids))["kl_nats"]
        bits[sensitivity] = qcfg["bits_per_weight"]
    assert abs(bits[None] - 2.5) <= 0.02 and abs(bits["fisher"] - 2.5) <= 0.02
    assert kl["fisher"] < 0.8 * kl[None]                                  # seen 0.58x


def test_bad_sensitivity_or_importance_is_refused(tiny_model):
    with pytest.raises(ValueError, match="sensitivity"):
        E.quantize_entquant(tiny_model, lam=10.0, sensitivity="hessian")
    w = torch.randn(4, 8)
    with pytest.raises(ValueError, match="importance"):
        E.entquant_scales(w, 10.0, importance=torch.ones(3))
    with pytest.raises(ValueError, match="importance"):
        E.entquant_scales(w, 10.0, importance=torch.tensor([1.0, float("nan"), 1.0, 1.0]))
