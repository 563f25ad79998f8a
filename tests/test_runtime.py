"""The run-time forms (engine/runtime.py, runtime_forms.py): each multiplies by what its layer decodes to, exactly
where it is exact and within the bf16 bound where PyTorch's int4 / int8 kernels round; what a prepared model holds,
counted; EntQuant decoded once (or block by block, its stream resident); the model's fused fast path; --weights on
the command line."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from engine import runtime, runtime_forms
from engine.checkpoints.models import file_tensor_bytes, load_model
from engine.formats import entropy as E, fp8, lattice, mx, nf4, trellis
from engine.formats.llama_cpp import ggml
from engine.formats.llama_cpp.gguf import HALVES
from engine.formats.llama_cpp.gguf_file import GGUFFile
from engine.formats.numerics.affine import AffineQuantLinear
from engine.layers import QuantEmbedding, decoded_weights, quantized_linears
from engine.qwen3 import KVCache, Qwen3, Qwen3Config
from test_gguf import U32, gguf_bytes, gguf_name, qwen3_metadata, random_blocks, raw_of

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]
U = 2.0 ** -8                    # bf16's unit roundoff: 8 significant bits


def _inputs(n, width, seed=0):
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


def _weight(out_f, in_f, seed=0):
    return torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)) * 0.05


def _ggml(type_name, out_f=48, in_f=256, seed=0):
    raw = random_blocks(type_name, out_f, in_f, seed=seed, scale=0.004).reshape(-1)
    return ggml.quantized_linear(raw, type_name, (out_f, in_f))


def _entquant(fmt):
    torch.manual_seed(0)
    model = Qwen3(Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, num_hidden_layers=2)).eval()
    E.quantize(model, lam=14.5, fmt=fmt, max_iter=20, super_weights=3)
    return model


def _trellis():
    codes, scales, _ = trellis.trellis_codes(_weight(32, 256), 8, 2, group=128, seed=3, tile=(16, 16))
    return trellis.TrellisLinear(codes, scales, 8, 2, tile=(16, 16), group=128, seed=3)


LAYERS = {
    "rtn int4 g32": lambda: AffineQuantLinear.from_weight(_weight(96, 192), 4, 32),
    "rtn int4 g64 sym": lambda: AffineQuantLinear.from_weight(_weight(96, 192), 4, 64, sym=True),
    "gptq int4 g128 over 192 inputs": lambda: AffineQuantLinear.from_weight(_weight(96, 192), 4, 128),
    "act order int4": lambda: AffineQuantLinear.from_weight(_weight(96, 192), 4, 64, perm=torch.randperm(192)),
    "ragged int4 g64 over 96": lambda: AffineQuantLinear.from_weight(_weight(40, 96), 4, 64),
    "int2": lambda: AffineQuantLinear.from_weight(_weight(40, 128), 2, 32),
    "int8 g64": lambda: AffineQuantLinear.from_weight(_weight(40, 128), 8, 64),
    **{t: (lambda t=t: _ggml(t)) for t in ggml.AFFINE},
    "fp8 block 128 ragged": lambda: fp8.FP8BlockLinear.from_linear(torch.nn.Linear(200, 150)),
    "fp8 block 64": lambda: fp8.FP8BlockLinear.from_linear(torch.nn.Linear(128, 96), block=64),
    "mxfp4": lambda: mx.MXFP4Linear.from_linear(torch.nn.Linear(128, 40)),
    "nvfp4": lambda: mx.NVFP4Linear.from_linear(torch.nn.Linear(128, 40)),
    "nf4": lambda: nf4.NF4Linear.from_weight(_weight(40, 192), 64),
    "nf4 ragged": lambda: nf4.NF4Linear.from_weight(_weight(40, 96), 64),
    "entquant float8": lambda: _entquant("float8").model.layers[1].mlp.down_proj,
    "entquant int8 super weights": lambda: _entquant("int8").model.layers[1].mlp.up_proj,
    "trellis (16, 16) tiles": _trellis,
    "lattice E8": lambda: lattice.quantize_weight(_weight(24, 128), "E8", tile=64),
}


def _stored(layer):
    """The weight in the basis decode_rows gives it (runtime_input's): stored column order, rotated codes."""
    if isinstance(layer, trellis.TrellisLinear):
        return layer.decode_rotated()
    if isinstance(layer, lattice.LatticeLinear):
        return layer.rotated_weight()
    w = layer.dequantize()
    return w if getattr(layer, "perm", None) is None else w[:, layer.perm]


@pytest.mark.parametrize("name", LAYERS)
def test_decode_rows_gives_dequantize_bit_for_bit(name):
    """Every format's row decode (into a shared buffer, the exact path) is its dequantize(), float for float, for
    the whole weight and for a run of rows (whole tiles where the format codes tiles)."""
    layer = LAYERS[name]()
    want = _stored(layer)
    align, out_f = layer.row_align, layer.out_features
    for start, stop in ((0, out_f), (align, min(out_f, 3 * align))):
        buffer = torch.full((stop - start, layer.in_features), float("nan"))
        scale = layer.compact().decode_rows(buffer, start, stop)
        assert torch.equal(buffer if scale is None else buffer * scale[:, None], want[start:stop]), (start, stop)


@pytest.mark.parametrize("name", LAYERS)
def test_decoded_form_is_the_dequantized_product(name, monkeypatch):
    """DecodedLinear, a few rows at a time (CHUNK made small), computes x @ dequantize()^T up to float32 rounding."""
    monkeypatch.setattr(runtime_forms, "CHUNK", 1024)
    layer = LAYERS[name]()
    form = runtime_forms.DecodedLinear(layer.compact(), runtime_forms.Workspace())
    x = _inputs(3, layer.in_features)
    want = x @ layer.dequantize().T + (0 if layer.bias is None else layer.bias)
    scale = x.abs() @ layer.dequantize().abs().T
    assert ((form(x) - want).abs() <= 1e-5 * scale + 1e-7).all()
    assert form.workspace.buffer.numel() <= max(1024, layer.in_features * layer.row_align)


INT4 = ["rtn int4 g32", "rtn int4 g64 sym", "gptq int4 g128 over 192 inputs", "act order int4", "Q4_0", "Q4_1",
        "Q4_K"]


@pytest.mark.parametrize("name", INT4)
def test_int4_kernel_is_within_its_bf16_bound(name):
    """PyTorch's int4 kernel rounds x, each scale s, each zero z = o + 8 s and its output to bf16 (unit roundoff
    u = 2^-8), so |y - x W^T| <= u (|y| + |x| |W|^T + |x| (8 |s| + |z|)^T); the test allows 2u. The error is real
    (it is not the exact path) and far inside the bound."""
    layer = LAYERS[name]().compact()
    form = runtime.form(layer, "compact", runtime_forms.Workspace())
    assert isinstance(form, runtime_forms.Int4Linear)
    x = _inputs(5, layer.in_features)
    w = layer.dequantize()
    y = x @ w.T
    g = layer.group_size
    s = layer.scales.repeat_interleave(g, 1)[:, :layer.in_features]
    z = (layer.offsets + 8 * layer.scales).repeat_interleave(g, 1)[:, :layer.in_features]
    if layer.perm is not None:
        s, z = s[:, torch.argsort(layer.perm)], z[:, torch.argsort(layer.perm)]
    bound = 2 * U * (y.abs() + x.abs() @ w.abs().T + x.abs() @ (8 * s.abs() + z.abs()).T)
    error = (form(x) - y).abs()
    assert (error <= bound).all() and 0 < error.max() < 0.25 * bound.max()


INT8 = ["Q8_0", "Q5_1", "Q5_K", "Q6_K", "IQ4_NL", "IQ2_XS", "int8 g64"]


def _shared_zero(layer):
    """The integer zero point every group of `layer` shares, None where its groups differ or it has free offsets."""
    zeros = getattr(layer, "zeros", None)
    return None if zeros is None or zeros.unique().numel() != 1 else int(zeros.flatten()[0])


@pytest.mark.parametrize("rows", [1, 5], ids=["one token (compiled)", "a prompt (decoded)"])
@pytest.mark.parametrize("name", INT8)
def test_int8_product_is_the_dequantized_product_and_its_rows_are_exact(name, rows):
    """8-bit codes with group scales, in float32 (one token through the compiled product, several through the
    decoded weight): within 2 n 2^-24 |x| |W|^T of x W^T (each side within float32's bound for a sum of n = `in`
    products, 2^-24 its unit roundoff); a grid whose groups share one integer zero point keeps no offsets; the rows
    an embedding reads are dequantize()'s, float for float."""
    original = LAYERS[name]()
    layer = original.compact()
    form = runtime.form(layer, "compact", runtime_forms.Workspace(), rows=True)     # a tied embedding's head
    assert isinstance(form, runtime_forms.Int8Linear)
    assert form.zero == _shared_zero(original) and (form.offsets is None) == (form.zero is not None)
    x = _inputs(rows, layer.in_features)
    w = layer.dequantize()
    bound = 2 * layer.in_features * 2.0 ** -24 * (x.abs() @ w.abs().T) + 1e-7    # each side within n u of the sum
    assert ((form(x) - x @ w.T).abs() <= bound).all()
    ids = torch.tensor([3, 0, 3, layer.out_features - 1])
    assert torch.equal(form.rows(ids), w[ids])


def test_int8_product_compiled_is_the_textbook_product():
    """compiled_int8_product computes int8_product (as written: an [M, groups, g, out] product, then two sums) up to
    float32's rounding, on a shape other than the one it was first built for (its shapes are symbolic)."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(-128, 128, (6, 16, 40), generator=gen, dtype=torch.int8)
    scales, x = torch.rand(6, 40, generator=gen), torch.randn(1, 96, generator=gen)
    want = runtime_forms.int8_product(x, codes, scales)
    terms = (x.abs().view(1, 6, 16, 1) * codes.abs() * scales[:, None]).sum((1, 2))
    bound = 2 * 96 * 2.0 ** -24 * terms + 1e-7                        # each side within n u of the exact sum
    assert ((runtime_forms.compiled_int8_product()(x, codes, scales) - want).abs() <= bound).all()


COMPILED_PRODUCT_CHECK = """
import torch
from engine import runtime_forms
gen = torch.Generator().manual_seed(0)
codes = torch.randint(-128, 128, (6, 16, 40), generator=gen, dtype=torch.int8)
scales, x = torch.rand(6, 40, generator=gen), torch.randn(1, 96, generator=gen)
error = (runtime_forms.compiled_int8_product()(x, codes, scales) - runtime_forms.int8_product(x, codes, scales)).abs()
terms = (x.abs().view(1, 6, 16, 1) * codes.abs() * scales[:, None]).sum((1, 2))
print(torch.backends.cpu.get_cpu_capability(), bool((error <= 2 * 96 * 2.0 ** -24 * terms + 1e-7).all()),
      float(error.max()))
"""


@pytest.mark.slow
def test_the_compiled_product_is_right_on_either_cpu_kernel_set_with_one_inductor_cache(tmp_path):
    """inductor writes its C++ for the vector width ATEN_CPU_CAPABILITY picks, but leaves that out of its cache key:
    a product built on AVX-512 and loaded from the cache under avx2 computed garbage, the reverse crashed. The engine
    pins the width (engine.kernels.compiled), so the cache keeps one build per width. (On a CPU without AVX-512 both
    runs are AVX2.)"""
    for capability in ("", "avx2", ""):
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
        run = subprocess.run([sys.executable, "-c", COMPILED_PRODUCT_CHECK], capture_output=True, text=True,
                             cwd=ROOT, env=env)
        assert run.returncode == 0, run.stderr[-2000:]
        kernels, right, error = run.stdout.split()
        assert right == "True", f"{kernels}: the compiled product is off by up to {error}"


def test_without_a_compiler_8_bit_layers_decode_with_a_warning(monkeypatch):
    """Where torch.compile cannot build the product (no C++ compiler), one warning says so and one token's product
    goes through the decoded weight: the same numbers up to float32 rounding."""
    layer = LAYERS["Q6_K"]().compact()
    form = runtime.form(layer, "compact", runtime_forms.Workspace())
    x = _inputs(1, layer.in_features)
    compiled = form(x)

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")
    monkeypatch.setattr(runtime_forms.torch, "compile", no_compiler)
    runtime_forms.compiled_int8_product.cache_clear()
    try:
        with pytest.warns(UserWarning, match="cannot build the int8 product here.*decode their weights"):
            decoded = form(x)
        assert runtime_forms.compiled_int8_product() is None
    finally:
        runtime_forms.compiled_int8_product.cache_clear()
    w = layer.dequantize()
    assert ((decoded - compiled).abs() <= 2 * layer.in_features * 2.0 ** -24 * (x.abs() @ w.abs().T) + 1e-7).all()


@pytest.mark.parametrize("name", ["Q8_0", "Q5_1", "Q5_K", "IQ4_NL"])
def test_int8_codes_as_two_int4_planes_are_within_the_int4_bound_of_each(name):
    """8-bit codes q = 16 hi + lo as two int4 layers (hi: scale 16 s, zero 0; lo: scale s, zero 136 s + o), each
    within the int4 kernel's bound u (|y_p| + |x| |W_p|^T + |x| (8 |s_p| + |z_p|)^T), the test allowing 2u on their
    sum; a symmetric code's zeros (0 and 8 s) are exact, so Q8_0's error is that of x and the outputs alone."""
    layer = LAYERS[name]().compact()
    form = runtime.form(layer, "compact", runtime_forms.Workspace())
    assert isinstance(form, runtime_forms.Int8PlanesLinear)
    x = _inputs(5, layer.in_features)
    q, g = layer.weight_codes.float(), layer.group_size
    s = layer.scales.float().repeat_interleave(g, 1)[:, :layer.in_features]
    o = layer.offsets.float().repeat_interleave(g, 1)[:, :layer.in_features]
    planes = ((torch.div(q, 16, rounding_mode="floor") * 16 * s, 16 * s, 0 * s), ((q % 16) * s + o, s, 136 * s + o))
    bound = sum(2 * U * ((x @ w.T).abs() + x.abs() @ w.abs().T + x.abs() @ (8 * sp.abs() + zp.abs()).T)
                for w, sp, zp in planes)
    y = x @ layer.dequantize().T
    error = (form(x) - y).abs()
    assert (error <= bound + 1e-7).all() and error.max() > 0
    ragged = LAYERS["int8 g64"]()                        # 40 rows: the int4 kernel's layout takes multiples of 16
    assert isinstance(runtime.form(ragged.compact(), "compact", runtime_forms.Workspace()), runtime_forms.Int8Linear)


@pytest.mark.parametrize("name", LAYERS)
def test_every_form_takes_an_input_of_any_strides(name):
    """A transposed view of x gives what x gives (PyTorch's int4 and int8 kernels refuse a non-contiguous input:
    the form makes it contiguous, as nn.Linear takes any strides)."""
    layer = LAYERS[name]().compact()
    form = runtime.form(layer, "compact", runtime_forms.Workspace())
    x = _inputs(layer.in_features, 5).T                      # [5, in], strides (1, 5)
    assert not x.is_contiguous() and torch.equal(form(x), form(x.contiguous()))


@pytest.mark.parametrize("name", ["Q5_0", "Q5_1", "Q5_K"])
def test_a_5_bit_high_plane_held_a_bit_a_weight_gives_the_packed_planes_product(name):
    """5-bit codes' high plane (0 or 1) is held a bit a weight, an eighth of its packed bytes, and expanded at each
    product back to the very bytes int4_parts packs: the same kernel calls, the same output bit for bit."""
    layer = LAYERS[name]().compact()
    workspace = runtime_forms.Workspace()
    form = runtime.form(layer, "compact", workspace)
    assert isinstance(form, runtime_forms.Int8PlanesLinear)
    assert form.hi.dtype == torch.uint8 and form.hi.numel() * 8 == layer.out_features * layer.in_features
    q, s, g = layer.weight_codes.to(torch.int32), layer.scales.float(), form.group_size
    hi, hi_sz = runtime_forms.int4_parts(q >> 4, 16 * s, torch.zeros_like(s), layer.group_size, g)
    assert torch.equal(runtime_forms.packed_plane(form.hi, workspace).view(hi.shape), hi)
    x = _inputs(3, layer.in_features)
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    lo = mm(x.bfloat16(), form.lo, g, form.lo_scales_zeros).float()
    assert torch.equal(form(x), mm(x.bfloat16(), hi, g, hi_sz).float() + lo)
    layer.weight_codes[0, 0] = 32                       # one code above 31: the high plane stays packed
    assert torch.equal(runtime.form(layer, "compact", workspace).hi,
                       runtime_forms.int4_parts(layer.weight_codes.to(torch.int32) >> 4, 16 * s, 0 * s,
                                                layer.group_size, g)[0])


# ---- a GGUF model, loaded to run ------------------------------------------------------------------------------

CFG = Qwen3Config(vocab_size=96, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, num_hidden_layers=2)


def _gguf(tmp_path, linear_type="Q4_0", embedding_type="Q8_0", arch="qwen3"):
    """A tiny GGUF file (qwen3, or llama: no q/k norms, SmolLM2's family): linears of linear_type, a tied embedding
    of embedding_type, norms F32."""
    torch.manual_seed(0)
    cfg = Qwen3Config(**{**vars(CFG), "model_type": arch})
    model = Qwen3(cfg).eval()
    tensors = []
    for i, (name, p) in enumerate(model.state_dict().items()):
        if name == "lm_head.weight":
            continue
        kind = name.rsplit(".", 2)[-2]
        chosen = embedding_type if kind == "embed_tokens" else linear_type if p.dim() == 2 else None
        if chosen in HALVES:                                    # F16 / BF16: the model's own values, rounded
            tensors.append((gguf_name(name), chosen, tuple(p.shape), raw_of(p.to(HALVES[chosen]))))
        elif chosen:
            raw = random_blocks(chosen, *p.shape, seed=i, scale=0.01 if chosen == embedding_type else 0.004)
            tensors.append((gguf_name(name), chosen, tuple(p.shape), raw_of(raw)))
        else:
            tensors.append((gguf_name(name), "F32", tuple(p.shape), raw_of(p)))
    path = tmp_path / "tiny.gguf"
    path.write_bytes(gguf_bytes(qwen3_metadata(cfg, arch) + [(f"{arch}.vocab_size", U32, CFG.vocab_size)], tensors))
    return path


IDS = torch.randint(0, CFG.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))


def _logits(model):
    with torch.no_grad():
        return model(IDS)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_gguf_model_runs_from_its_stored_types(tmp_path, arch):
    """Loaded to run, the Q8_0 embedding stays Q8_0 (its lookup exact) and is the tied head; the exact forms give
    the dequantized model's logits up to float32 rounding, the compact forms within their bf16 error, and greedy
    generation agrees with the dense model (q/k/v fused, with q/k norms between and without)."""
    path = _gguf(tmp_path, arch=arch)
    dense = load_model(path, dense=True)
    reference = _logits(dense)
    exact = runtime.prepare(load_model(path, to_run=True), "exact")
    assert isinstance(exact.model.embed_tokens, QuantEmbedding) and exact.lm_head is exact.model.embed_tokens.layer
    assert torch.equal(exact.model.embed_tokens(IDS), dense.model.embed_tokens(IDS))
    assert torch.allclose(_logits(exact), reference, rtol=1e-4, atol=1e-5)
    compact = runtime.prepare(load_model(path, to_run=True), "compact")
    assert isinstance(compact.lm_head, runtime_forms.Int8Linear)
    assert isinstance(compact.model.layers[0].self_attn.qkv, runtime_forms.Int4Linear)
    assert compact.model.layers[0].self_attn.q_proj is None and compact.model.layers[0].mlp.up_proj is None
    assert (_logits(compact) - reference).abs().max() < 0.02 * reference.abs().max()
    with torch.no_grad():
        assert torch.equal(exact.generate(IDS, 6), dense.generate(IDS, 6))


def test_prepare_builds_the_compiled_product_before_the_first_token(tmp_path, monkeypatch):
    """A model with an Int8Linear (the tied Q8_0 head) has its product built by prepare, for generate's inference
    tensors and eval's plain ones: the first token's time is no compile's."""
    model = load_model(_gguf(tmp_path), to_run=True)
    runtime_forms.compiled_int8_product.cache_clear()
    calls = []
    original = runtime_forms.Int8Linear.build
    monkeypatch.setattr(runtime_forms.Int8Linear, "build", lambda self: calls.append(self) or original(self))
    runtime.prepare(model, "compact")
    assert calls == [model.lm_head] and runtime_forms.compiled_int8_product.cache_info().currsize == 1
    built = dict(counters["stats"])
    model.generate(IDS, 3)                                           # under inference_mode
    with torch.no_grad():
        model(IDS[:, :1])                                            # one token outside it
    assert dict(counters["stats"]) == built                          # nothing compiled again


@pytest.mark.parametrize("group", [64, 32], ids=["one group a row", "several groups"])
def test_a_built_product_compiles_nothing_at_the_first_token(group):
    """build() compiles the product for the layer's own kind (torch.compile builds a single group apart from
    several), for activations made under inference_mode and outside it: a token after it compiles nothing."""
    form = runtime.form(AffineQuantLinear.from_weight(_weight(40, 64), 8, group), "compact",
                        runtime_forms.Workspace(), rows=True)
    assert isinstance(form, runtime_forms.Int8Linear) and form.codes.shape[0] == 64 // group
    form.build()
    built = dict(counters["stats"])
    with torch.inference_mode():
        form(_inputs(1, 64))
    with torch.no_grad():
        form(_inputs(1, 64))
    assert dict(counters["stats"]) == built


def _expected_bytes(weights):
    """What each form holds for _gguf's file (Q4_0 linears, Q8_0 tied embedding), from the shapes alone."""
    h, v, d = CFG.hidden_size, CFG.vocab_size, CFG.head_dim
    linears = [((CFG.num_attention_heads + 2 * CFG.num_key_value_heads) * d, h), (h, CFG.num_attention_heads * d),
               (2 * CFG.intermediate_size, h), (h, CFG.intermediate_size)]         # qkv, o, gate_up, down
    norms = 4 * (2 * h * CFG.num_hidden_layers + h + 2 * d * CFG.num_hidden_layers)  # f32: input, post, final, q/k
    if weights == "compact":      # int4 codes + bf16 scale and zero per 32; int8 codes + f32 scale per 32
        per_block = sum(o * i // 2 + 2 * 2 * o * i // 32 for o, i in linears)
        head = v * h + 4 * v * h // 32
    else:                         # 4-bit codes + f32 scale and offset per 32 (the zero points only a writer needs)
        per_block = sum(o * i // 2 + (4 + 4) * o * i // 32 for o, i in linears)
        head = v * h + (4 + 4) * v * h // 32
    return norms + CFG.num_hidden_layers * per_block + head


@pytest.mark.parametrize("linear_type", ["Q5_0", "Q8_0", "Q4_1"])
def test_a_gguf_layer_loaded_to_run_still_counts_its_files_bits(tmp_path, linear_type):
    """Loaded to run, a GGUF layer drops its blocks but not their size: `eval --quantized FILE.gguf` reports the
    file's bits a weight (Q5_0 5.5, Q8_0 8.5), not those of the 8-bit codes and float scales it holds (9)."""
    path = _gguf(tmp_path, linear_type)
    stored, to_run = quantized_linears(load_model(path)), quantized_linears(load_model(path, to_run=True))
    assert isinstance(to_run["model.layers.0.mlp.down_proj"], ggml.GGMLCodes)
    assert {name: stored[name].storage_bits() for name in stored} == {
        name: to_run[name].storage_bits() for name in stored}
    down = stored["model.layers.0.mlp.down_proj"]
    assert down.storage_bits() == down.raw.numel() * 8


@pytest.mark.parametrize("weights", ["compact", "exact"])
def test_held_bytes_count_each_forms_tensors(tmp_path, weights):
    """The counter: every parameter and buffer once (the tied head once), and the decode buffer beside; compact
    holds no more than 1.25x the file's tensor bytes, and neither keeps the GGML blocks."""
    path = _gguf(tmp_path)
    model = runtime.prepare(load_model(path, to_run=True), weights)
    held = runtime.held_bytes(model)
    assert held["weights"] == _expected_bytes(weights)
    assert held["weights"] <= 1.25 * file_tensor_bytes(path) or weights == "exact"
    _logits(model)
    decoded = [min(m.chunk, m.out_features) * m.in_features for m in model.modules()
               if isinstance(m, (runtime_forms.DecodedLinear, runtime_forms.Int8Linear))]   # a prompt's head decodes
    assert runtime.held_bytes(model)["workspace"] == 4 * max(decoded, default=0)


def test_float32_copies_are_counted_too(tmp_path):
    model = load_model(_gguf(tmp_path))
    stored = runtime.held_bytes(model)["weights"]
    with decoded_weights(model) as kept:
        assert kept and runtime.held_bytes(model)["weights"] == stored + 4 * sum(
            m.in_features * m.out_features for m in model.modules() if getattr(m, "_decoded", None) is not None)


# ---- EntQuant ---------------------------------------------------------------------------------------------------

def _count_decodes(monkeypatch):
    """A list that grows by one for each rANS stream decoded (a block's)."""
    from engine.formats import entropy_decoder
    calls, original = [], entropy_decoder.rans_decode
    monkeypatch.setattr(entropy_decoder, "rans_decode", lambda stream: (calls.append(1), original(stream))[1])
    return calls


def test_entquant_block_is_not_decoded_again_when_its_weights_are_held_decoded(monkeypatch):
    """red before: the pre-hook decoded every block's stream on every forward, also inside decoded_weights, where
    every layer already holds its float32 weight and nothing reads the buffer."""
    model = _entquant("float8")
    calls = _count_decodes(monkeypatch)
    with decoded_weights(model), torch.no_grad():
        calls.clear()
        model(IDS)
        model(IDS)
    assert calls == []


@pytest.mark.parametrize("weights", ["compact", "exact"])
def test_entquant_is_decoded_once_to_its_float8_bytes(weights, monkeypatch):
    """compact and exact: each block's stream decoded once when prepared, one byte a weight kept, the streams and
    the decoder dropped; the logits are the stream mode's (the same weights): exact's up to float32 rounding,
    compact's (the int8 kernel) within its bf16 error."""
    streamed = _entquant("float8")
    want = _logits(runtime.prepare(streamed, "stream"))
    calls = _count_decodes(monkeypatch)
    _logits(streamed)
    assert len(calls) == 2                              # stream mode: one decode per block per forward
    model = _entquant("float8")
    layers = [m for m in model.modules() if isinstance(m, E.EntQuantLinear)]
    runtime.prepare(model, weights)
    assert len(calls) == 4                              # each block once, when prepared
    _logits(model)
    assert len(calls) == 4
    assert not hasattr(model, "entquant_decoder") and all(m.stream.numel() == 0 for m in layers)
    codes = sum(m.held.numel() for m in layers)
    assert codes == sum(m.in_features * m.out_features for m in layers) and all(m.held.dtype == torch.uint8
                                                                                 for m in layers)
    tolerance = 1e-5 if weights == "exact" else 2e-2
    assert (_logits(model) - want).abs().max() <= tolerance * want.abs().max()


@pytest.mark.parametrize("fmt", ["float8", "int8"])
def test_entquant_runs_through_the_int8_kernel_where_its_codes_fit(fmt):
    """Int8 codes, and Float8 values under 0.25 (512 v, exact int8s), go through the int8 kernel with per-row scales
    (x and its output in bf16: |y - x W^T| <= 2u |x| |W|^T, the test allows 4u; super weights exact); one Float8
    value of 2.0 sends the layer to the exact decode."""
    from engine.formats.entropy_decoder import hold_codes
    model = _entquant(fmt)
    hold_codes(model)
    layer = model.model.layers[1].mlp.up_proj
    form = runtime.form(layer, "compact", runtime_forms.Workspace())
    assert isinstance(form, runtime_forms.Int8RowsLinear) and (form.super_rows is not None) == (fmt == "int8")
    x = _inputs(5, layer.in_features)
    w = layer.dequantize()
    assert ((form(x) - x @ w.T).abs() <= 4 * U * (x.abs() @ w.abs().T) + 1e-7).all()
    if fmt == "float8":
        layer.held[0, 0] = 0x40                                   # E4M3 2.0
        assert layer.int8_rows() is None
        assert isinstance(runtime.form(layer, "compact", runtime_forms.Workspace()), runtime_forms.DecodedLinear)


@pytest.mark.parametrize("name", ["E8", "D4", "Z", "A2"])
def test_lattice_codes_run_through_the_int8_kernel_in_their_rotated_basis(name):
    """E8, D4 and Z codes (one axis) are decoded once into int8 codes and row scales: the input rotated, then the
    int8 kernel, |y - x W^T| <= 4u |x R^T| |W'|^T (x R^T in bf16, the output too); A2's two axes (sqrt(3), 1) are
    no int8 multiples of one step: it stays on the exact decode."""
    layer = lattice.quantize_weight(_weight(24, 128), name, tile=64)
    form = runtime.form(layer, "compact", runtime_forms.Workspace())
    if name == "A2":
        assert layer.int8_rows() is None and isinstance(form, runtime_forms.DecodedLinear)
        return
    assert isinstance(form, runtime_forms.Int8RowsLinear) and form.codes.dtype == torch.int8
    x = _inputs(5, layer.in_features)
    y = x @ layer.dequantize().T
    bound = 4 * U * (layer.runtime_input(x).abs() @ layer.rotated_weight().abs().T) + 1e-6 * y.abs().max()
    error = (form(x) - y).abs()
    assert (error <= bound).all() and error.max() > 0


@pytest.mark.parametrize("chunk", [256 * 16, 1 << 20])
def test_trellis_states_decoded_once_give_the_exact_decode_bit_for_bit(chunk, monkeypatch):
    """A trellis layer (L = 8) runs from its states, replayed once into a byte per weight (int16 indices of
    neighbouring pairs): the same values and tile products as its exact decode, so the same outputs bit for bit, a
    few tile rows at a time or all at once; L = 16 keeps its streams (two bytes of states a weight would outgrow the
    stream 8x)."""
    monkeypatch.setattr(runtime_forms, "CHUNK", chunk)
    layer = _trellis()
    workspace = runtime_forms.Workspace()
    form = runtime.form(layer, "compact", workspace)
    assert isinstance(form, runtime_forms.DecodedLinear) and isinstance(form.layer, runtime_forms.TableRows)
    assert form.layer.indices.dtype == torch.int16 and form.layer.table.shape == (2 ** 10,)
    assert form.layer.indices.numel() * 2 == layer.in_features * layer.out_features    # a byte a weight
    x = _inputs(3, layer.in_features)
    assert torch.equal(form(x), runtime_forms.DecodedLinear(layer, runtime_forms.Workspace())(x))
    assert 2 * workspace.indices.numel() == workspace.buffer.numel() == min(form.chunk, layer.out_features) * 256
    assert workspace.nbytes() == 6 * workspace.buffer.numel()        # what held_bytes counts as the workspace
    codes, scales, _ = trellis.trellis_codes(_weight(16, 256), 16, 2, group=128, seed=3, tile=(16, 16))
    wide = trellis.TrellisLinear(codes, scales, 16, 2, tile=(16, 16), group=128, seed=3)
    assert wide.table_rows() is None and isinstance(runtime.form(wide, "compact", runtime_forms.Workspace()),
                                                    runtime_forms.DecodedLinear)


def test_a_shift_registers_pairs_decode_as_its_states_one_at_a_time():
    """shift_pairs' table at the pair index gives both neighbours' values, float for float, and the one-value gather
    stays for codes whose neighbours are not the register's (red if a pair's second value were table[b])."""
    table = torch.randn(256)
    states = torch.randint(0, 256, (4, 64))
    states[:, 1::2] = ((states[:, 0::2] << 2) | torch.randint(0, 4, (4, 32))) % 256     # s_{t+1} = (s_t << 2 | b)
    pairs, index = runtime_forms.shift_pairs(table, states, 2)
    assert index.dtype == torch.int16 and index.shape == (4, 32)
    assert torch.equal(pairs[index.long()].view(torch.float32).view(4, 64), table[states])
    broken = states.clone()
    broken[0, 1] = (broken[0, 1] + 4) % 256                                           # not the register's neighbour
    assert runtime_forms.shift_pairs(table, broken, 2) is None
    assert runtime_forms.shift_pairs(table, states[:, :63], 2) is None                # an odd row


@pytest.mark.parametrize("half, arch", [("F16", "qwen3"), ("BF16", "llama")])
def test_an_f16_or_bf16_gguf_runs_in_its_stored_type(tmp_path, half, arch):
    """Its linears and tied embedding were float32 copies at run time, twice the file's bytes (a 14 GB F16 file of a
    7B model: 28 GB). Now they hold their 2 bytes a weight, decoded a few rows at a time: the embedding's rows equal,
    the logits the float32 model's up to float32 rounding; --weights float32 still makes the copies."""
    path = _gguf(tmp_path, half, half, arch)
    dense = load_model(path)                                  # float32 copies
    model = runtime.prepare(load_model(path, to_run=True), "compact")
    layer = model.model.layers[0].mlp.down_proj
    assert isinstance(layer, runtime_forms.DecodedLinear) and layer.layer.stored.dtype == HALVES[half]
    assert isinstance(model.model.embed_tokens, QuantEmbedding) and model.lm_head is model.model.embed_tokens.layer
    assert runtime.held_bytes(model)["weights"] <= file_tensor_bytes(path) < runtime.held_bytes(dense)["weights"]
    assert torch.equal(model.model.embed_tokens(IDS), dense.model.embed_tokens(IDS))
    assert torch.allclose(_logits(model), _logits(dense), rtol=1e-5, atol=1e-6)
    data = bytearray(path.read_bytes())                       # a NaN in a weight: refused at load, as a float32 one
    with GGUFFile(path) as f:
        at = f.tensors["blk.1.ffn_down.weight"].offset
    data[at:at + 2] = torch.tensor([float("nan")], dtype=HALVES[half]).view(torch.uint8).numpy().tobytes()
    path.write_bytes(data)
    for to_run in (False, True):
        with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj.weight: checkpoint tensor holds NaN"):
            load_model(path, to_run=to_run)


def test_stream_mode_counts_the_decoder_and_is_refused_elsewhere(tmp_path):
    model = runtime.prepare(_entquant("float8"), "stream")
    _logits(model)
    assert runtime.held_bytes(model)["workspace"] >= max(model.entquant_decoder.sizes.values())
    with pytest.raises(ValueError, match="has no EntQuant layers"):
        runtime.prepare(load_model(_gguf(tmp_path), to_run=True), "stream")


def _run_twice(run):
    """run() under torch.inference_mode (generate's), then under no_grad (eval's): both outputs."""
    with torch.inference_mode():
        first = run()
    with torch.no_grad():
        return first, run()


@pytest.mark.parametrize("what", ["gguf Q5_0", "entquant stream", "trellis"])
def test_a_model_generating_first_can_still_be_evaluated(what, tmp_path):
    """The buffers forms share (the Workspace's, EntQuant's block buffer) are made as normal tensors even inside
    torch.inference_mode: an inference tensor refuses writes outside it, so `eval` after `generate` in one process
    would fail on the first layer that decodes into one."""
    if what == "trellis":
        form, x = runtime.form(_trellis(), "compact", runtime_forms.Workspace()), _inputs(2, 256)
        first, second = _run_twice(lambda: form(x))
    else:
        model = (runtime.prepare(load_model(_gguf(tmp_path, "Q5_0"), to_run=True)) if what == "gguf Q5_0" else
                 runtime.prepare(_entquant("float8"), "stream"))
        first, second = _run_twice(lambda: _logits(model))
    assert torch.equal(first, second)


# ---- the model's fast path --------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_the_fast_path_computes_the_same_model(model_type, tiny_cfg):
    """set_fast (fused norms, scaled_dot_product_attention, q/k/v from one product): the same logits up to float32
    rounding, cached generation included, under a KV transform too (engine/formats/kv/: its own path for the
    coded K/V, torch's attention where a query reads one K/V per column)."""
    torch.manual_seed(0)
    cfg = Qwen3Config(**{**vars(tiny_cfg), "model_type": model_type, "attention_bias": True})
    model = Qwen3(cfg).eval()
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, tokens = model(ids), model.generate(ids, 5)
        model.set_fast()
        assert torch.allclose(model(ids), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(model.generate(ids, 5), tokens)
        cache = KVCache(cfg.num_hidden_layers)                  # a prompt read in two pieces: the causal mask
        pieces = torch.cat((model(ids[:, :4], cache), model(ids[:, 4:], cache)), 1)
        assert torch.allclose(pieces, want, rtol=1e-5, atol=1e-5)
        cache = KVCache(cfg.num_hidden_layers)                  # one token at a time: a generated token's step
        steps = torch.cat([model(ids[:, i:i + 1], cache) for i in range(ids.shape[1])], 1)
        assert torch.allclose(steps, want, rtol=1e-5, atol=1e-5)
        model.set_kv_transform(lambda k, v, index: (k, v))
        assert torch.allclose(model(ids), want, rtol=1e-5, atol=1e-5)


# ---- the command line -------------------------------------------------------------------------------------------

def run(*args):
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args], capture_output=True, text=True, cwd=ROOT)


def test_a_choice_a_model_cannot_take_is_one_error_line(tmp_path):
    """--weights stream is EntQuant's; under --impl engine (the Triton kernels on the stored codes, unchanged) there
    is nothing to choose: the layers stay as they load."""
    assert runtime.choose(None, "engine", None) is None and runtime.choose(None, "torch", None) == "compact"
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text('{"quantization_config": {"quant_method": "lattice"}}')
    with pytest.raises(ValueError, match=r"ck is a lattice checkpoint, not an EntQuant one \(use compact"):
        runtime.choose("stream", "torch", tmp_path / "ck")
    model = load_model(_gguf(tmp_path))
    with runtime.running(model, None):
        assert isinstance(model.model.layers[0].mlp.up_proj, ggml.GGMLLinear)
    path = str(_gguf(tmp_path))
    for args, message in ((["--weights", "stream"], "is not an EntQuant checkpoint"),
                          (["--impl", "engine", "--weights", "compact"], "--impl engine runs each layer's Triton")):
        out = run("generate", "--model", path, "--prompt", "hi", *args)
        assert out.returncode == 1 and out.stderr.startswith("error: ") and message in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1


def test_generate_says_what_the_weights_hold(tmp_path):
    out = run("generate", "--prompt", "hi", "--steps", "1", "--max-new-tokens", "3")
    assert out.returncode == 0, out.stderr
    assert "compact: weights held " in out.stderr and "peak RSS" in out.stderr
    path = _gguf(tmp_path)
    model = runtime.prepare(load_model(path, to_run=True), "compact")
    line = runtime.memory_line(model, path)
    assert line.startswith(f"weights held {runtime.held_bytes(model)['weights'] / 1e6:.1f} MB (the file's tensors: "
                           f"{file_tensor_bytes(path) / 1e6:.1f} MB), peak RSS ")
