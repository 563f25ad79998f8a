"""Extract llama.cpp's IQ lookup tables from ggml-common.h into the JSON file engine/formats/llama_cpp/iq_low.py
reads (engine/formats/llama_cpp/ggml_iq_grids.json).

    python scripts/extract_ggml_iq_grids.py path/to/ggml/src/ggml-common.h \
        --commit 0c1e57098bba43ac29e6e3b677cdceebdd22334f --ggml-version 0.25.3

Each table `GGML_TABLE_BEGIN(type, name, size) ... GGML_TABLE_END()` is stored as its bytes as they lie in memory on
a little-endian machine (what ggml's `(const uint8_t *)(grid + i)` reads): a uint64 entry is 8 bytes, byte j = the
level of weight j; a uint32 entry 4 bytes; base64-encoded. `dtype` says how to read the bytes (iq1s_grid's are int8:
0xff = -1). The tables are llama.cpp's (MIT license), copied unchanged.
"""
import argparse
import base64
import json
import re
from pathlib import Path

TABLES = ("iq2xxs_grid", "iq2xs_grid", "iq2s_grid", "iq3xxs_grid", "iq3s_grid", "iq1s_grid", "ksigns_iq2xs",
          "kmask_iq2xs")
WIDTH = {"uint8_t": 1, "int8_t": 1, "uint32_t": 4, "uint64_t": 8}
LICENSE = ("The tables are llama.cpp's (ggml/src/ggml-common.h), MIT License, Copyright (c) 2023-2026 The ggml "
           "authors: https://github.com/ggml-org/llama.cpp/blob/master/LICENSE")
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "engine" / "formats" / "llama_cpp" / "ggml_iq_grids.json"


def parse(header_text):
    """ggml-common.h's text -> {name: (c_type, [int values])} for every name in TABLES. (The macro's own #define
    lines match the pattern too, as a table named `name`: not one of TABLES, skipped.)"""
    defines = dict(re.findall(r"^#define\s+(\w+)\s+(\d+)\s*$", header_text, re.M))
    pattern = re.compile(r"GGML_TABLE_BEGIN\(\s*(\w+)\s*,\s*(\w+)\s*,\s*(\w+)\s*\)(.*?)GGML_TABLE_END\(\)", re.S)
    found = {}
    for c_type, name, size, body in pattern.findall(header_text):
        if name not in TABLES or name in found:
            continue
        body = re.sub(r"//[^\n]*", "", body)
        values = [int(tok, 0) for tok in re.findall(r"0x[0-9a-fA-F]+|\d+", body)]
        size = int(defines.get(size, size))
        if len(values) != size:
            raise ValueError(f"{name}: {len(values)} values, the header declares {size}")
        found[name] = (c_type, values)
    missing = [name for name in TABLES if name not in found]
    if missing:
        raise ValueError(f"tables not found in the header: {', '.join(missing)}")
    return found


def to_json(tables, source, commit=None, ggml_version=None):
    out = {"source": source, "llama_cpp_commit": commit, "ggml_version": ggml_version, "license": LICENSE,
           "made_by": "scripts/extract_ggml_iq_grids.py", "layout": "each table's bytes as in memory, little-endian "
           "(byte j of a grid entry = weight j), base64", "tables": {}}
    for name in TABLES:
        c_type, values = tables[name]
        width = WIDTH[c_type]
        raw = b"".join((v % 2 ** (8 * width)).to_bytes(width, "little") for v in values)
        out["tables"][name] = {"c_type": c_type, "entries": len(values), "bytes_per_entry": width,
                               "dtype": "int8" if name == "iq1s_grid" or c_type == "int8_t" else "uint8",
                               "base64": base64.b64encode(raw).decode("ascii")}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("header", type=Path, help="llama.cpp's ggml/src/ggml-common.h")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--commit", help="the llama.cpp commit the header comes from, recorded in the file")
    parser.add_argument("--ggml-version", help="ggml's version (ggml/CMakeLists.txt), recorded in the file")
    args = parser.parse_args()
    tables = parse(args.header.read_text())
    source = "/".join(args.header.resolve().parts[-3:])                # ggml/src/ggml-common.h
    text = json.dumps(to_json(tables, source, args.commit, args.ggml_version), indent=1)
    args.out.write_text(text + "\n")
    print(f"wrote {args.out} ({len(text)} bytes): {', '.join(TABLES)}")


if __name__ == "__main__":
    main()
