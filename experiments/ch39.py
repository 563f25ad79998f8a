"""Chapter 39's stretch exercises 1 and 4, on any model the engine reads (`smollm2`, a Hugging Face folder, a GGUF).

  python experiments/ch39.py methods     --model smollm2 [--calib-samples 32 --calib-len 512 | --chapter-calibration]
      RTN, GPTQ (with and without act-order) and AWQ at 4 bits, g128: each row as it finishes, llama.cpp's KL
      statistics against the model and, downstream, next-token accuracy on the held-out text
  python experiments/ch39.py sensitivity --model PATH [--method rtn|gptq] [--bits 4] [--group-size 128] [--by layer|linear]
      which layers suffer most: the KL when only one decoder layer (or one kind of linear, in every layer) is quantized
  python experiments/ch39.py gpt-oss     [--model PATH]
      gpt-oss's MXFP4 expert tensors (*_blocks, *_scales) through engine.formats.mx.dequantize_mxfp4 against
      transformers' own converter (the one that made Hugging Face's published BF16 weights); PATH is a gpt-oss
      checkpoint folder or one of its .safetensors shards (--shard FILE is the same); without it, random tensors in
      gpt-oss-20b's layout. Needs transformers (`pip install transformers`).

The book asks for 128 calibration sequences of 2,048 tokens (--chapter-calibration); on a CPU the default 32 x 512
gives the same ranking in minutes. Held-out text is the last tenth of --text (default: Python's own reference
text), never seen by calibration. Exercises 2 and 3 are rows of `run.py quantformats` (README).
"""
import argparse
import copy
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import cli_checks  # noqa: E402
from engine.checkpoints.models import load_model  # noqa: E402
from engine.checkpoints.tokenizer import load_tokenizer  # noqa: E402
from engine.data import Corpus, load_corpus  # noqa: E402
from engine.evaluation import ReferenceLogits, compare_models, markdown_table  # noqa: E402
from engine.formats.numerics import affine, calibration  # noqa: E402
from engine.formats import awq, gptq, mx  # noqa: E402

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def setup(args):
    """(reference model, calibration ids, evaluation chunks, the reference's scored logits)."""
    print(f"{args.model}: the model in float32, {args.calib_samples} x {args.calib_len} calibration tokens, and the "
          f"reference's logits on {args.chunks} x {args.ctx} held-out tokens", file=sys.stderr, flush=True)
    tokenizer = load_tokenizer(args.model)
    corpus = Corpus.from_text(load_corpus(args.text), tokenizer)
    chunks = corpus.eval_chunks(args.ctx, args.chunks)
    ids = corpus.calibration(seq_len=args.calib_len, n=args.calib_samples)
    reference = load_model(args.model, torch.float32, dense=True)
    return reference, ids, chunks, ReferenceLogits(reference, chunks)


def row_line(label, row):
    """One finished row, as a reader scans it: KL with its standard error, same top token, next-token accuracy."""
    return (f"{label}: KL {row['kl_nats']:.5f} ± {row['kl_stderr']:.5f}, same top {row['same_top_pct']:.1f}%, "
            f"next-token accuracy {row['next_token_pct']:.2f}% (the model: {row['next_token_ref_pct']:.2f}%)")


def report(rows, label):
    print()
    print(markdown_table(rows, label=label))
    print()
    print(f"| {label} | next-token accuracy % | the model's % |\n|---|---:|---:|")
    for row in rows:
        print(f"| {row[label]} | {row['next_token_pct']:.2f} | {row['next_token_ref_pct']:.2f} |")


def methods(args):
    reference, ids, chunks, ref_logits = setup(args)
    runs = [("RTN int4, g128", affine.quantize, dict(bits=4, group_size=128)),
            ("GPTQ int4, g128", gptq.quantize, dict(group_size=128, order="natural")),
            ("GPTQ int4, g128, act-order", gptq.quantize, dict(group_size=128, order="act_order")),
            ("AWQ int4, g128", awq.quantize, dict(group_size=128))]
    rows = []
    bar = tqdm(runs, desc="methods", unit="method", file=sys.stderr)      # its ETA: from the methods done so far
    for label, quantize, options in bar:
        bar.set_postfix_str(label)
        model = copy.deepcopy(reference)
        quantize(model, ids, **options)
        rows.append({"method": label, **compare_models(ref_logits, model, chunks)})
        del model
        tqdm.write(row_line(label, rows[-1]), file=sys.stdout)
        print(json.dumps(rows[-1]), flush=True)
    report(rows, "method")


def quantize_one(model, ids, args, index=None, linear=None):
    """Quantize decoder layer `index` only, or the linear `linear` of every layer, in place. GPTQ sees the float
    model's inputs to that layer (what it would see if it were the first layer quantized)."""
    names = None if linear is None else {f"model.layers.{i}.{linear}" for i in range(model.cfg.num_hidden_layers)}
    inputs_from = None if args.method == "rtn" else "float"
    for layer in calibration.decoder_layers(model, ids, method=args.method, inputs_from=inputs_from):
        if index is not None and layer.index != index:
            continue
        if args.method == "rtn":
            layer.replace(lambda name, lin: affine.AffineQuantLinear.from_linear(lin, args.bits, args.group_size),
                          names=names and {n for n in names if n.startswith(layer.prefix)})
        else:
            hessians = {name: s.hessian for name, s in layer.capture([linear] if linear else None).items()}

            def make(name, lin, hessians=hessians):
                codes, scales, zeros, g_idx = gptq.gptq_quantize(lin.weight.detach(), hessians[name], args.bits,
                                                                 args.group_size, min_zero=1,
                                                                 order=gptq.DEFAULTS["order"])
                return gptq.to_runtime(codes, scales, zeros, g_idx, args.group_size, lin.bias, bits=args.bits)
            layer.replace(make, names=set(hessians))
        if index is not None:
            return


def sensitivity(args):
    reference, ids, chunks, ref_logits = setup(args)
    targets = ([("layer", i) for i in range(reference.cfg.num_hidden_layers)] if args.by == "layer"
               else [("linear", name) for name in LINEARS])
    rows = []
    for kind, target in targets:
        model = copy.deepcopy(reference)
        quantize_one(model, ids, args, index=target if kind == "layer" else None,
                     linear=target if kind == "linear" else None)
        rows.append({kind: target, **compare_models(ref_logits, model, chunks)})
        print(f"{kind} {target}: KL {rows[-1]['kl_nats']:.6f}", file=sys.stderr, flush=True)
    rows.sort(key=lambda r: -r["kl_nats"])
    for row in rows:
        print(json.dumps(row))
    report(rows, args.by)


def gpt_oss(args):
    """engine's dequantize_mxfp4 against transformers' convert_moe_packed_tensors (gpt-oss layout: blocks
    [experts, out, in / 32, 16] uint8, two E2M1 codes per byte, element 2j in the low nibble; scales
    [experts, out, in / 32] E8M0; transformers returns [experts, in, out] in bfloat16)."""
    try:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    except ImportError:
        raise ValueError("exercise 4 compares with transformers' own converter: `pip install transformers` installs "
                         "it") from None
    pairs = []
    if args.model:
        from engine.safetensors_io import TensorReader
        if not Path(args.model).exists():
            raise ValueError(f"--model {args.model}: no such gpt-oss folder or .safetensors shard")
        reader = TensorReader(args.model)
        for name in reader.names():
            if name.endswith("_blocks") and name.removesuffix("_blocks") + "_scales" in reader.names():
                pairs.append((name.removesuffix("_blocks"), reader.read(name), reader.read(name[:-7] + "_scales")))
    else:                                       # gpt-oss-20b: 32 experts, hidden 2880, 2 x intermediate 2880
        g = torch.Generator().manual_seed(0)
        for name, out_f, in_f in (("gate_up_proj", 5760, 2880), ("down_proj", 2880, 2880)):
            blocks = torch.randint(0, 256, (4, out_f, in_f // 32, 16), dtype=torch.uint8, generator=g)
            scales = torch.randint(112, 132, (4, out_f, in_f // 32), dtype=torch.uint8, generator=g)
            pairs.append((f"synthetic {name} (4 of 32 experts)", blocks, scales))
    for name, blocks, scales in pairs:
        ours = mx.dequantize_mxfp4(blocks, scales, "interleaved")                   # [experts, out, in] float32
        theirs = convert_moe_packed_tensors(blocks, scales).transpose(1, 2)          # back to [experts, out, in]
        same = torch.equal(ours.to(torch.bfloat16), theirs)
        print(json.dumps({"tensor": name, "shape": list(ours.shape), "equal_in_bf16": same,
                          "first_values": ours.reshape(-1)[:4].tolist()}))
        if not same:
            raise SystemExit(f"{name}: the engine's dequantization differs from transformers'")


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("methods", "sensitivity"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True, help="smollm2, a Hugging Face folder or a .gguf file")
        p.add_argument("--text", default=None)
        p.add_argument("--calib-samples", type=int, default=32)
        p.add_argument("--calib-len", type=int, default=512)
        p.add_argument("--chapter-calibration", action="store_true",
                       help="the chapter's 128 sequences of 2,048 tokens (about 16x the default's work)")
        p.add_argument("--ctx", type=int, default=512)
        p.add_argument("--chunks", type=int, default=8)
        if name == "sensitivity":
            p.add_argument("--method", choices=["rtn", "gptq"], default="rtn")
            p.add_argument("--bits", type=int, default=4)
            p.add_argument("--group-size", type=int, default=128)
            p.add_argument("--by", choices=["layer", "linear"], default="layer")
    o = sub.add_parser("gpt-oss")
    o.add_argument("--model", "--shard", dest="model", metavar="PATH",
                   help="a gpt-oss checkpoint folder, or one .safetensors shard, holding *_blocks / *_scales tensors")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "chapter_calibration", False):
            args.calib_samples, args.calib_len = 128, 2048
        if args.command != "gpt-oss" or args.model:
            args.model = cli_checks.model_argument(args.model)
        if args.command != "gpt-oss":
            cli_checks.check_model_path(args.model)
        {"methods": methods, "sensitivity": sensitivity, "gpt-oss": gpt_oss}[args.command](args)
    except ValueError as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    main()
