"""benchmarks/frontier.py's report: the table of every row, per rate the engine's best KL over the best peer's on
each held-out text (their range and geometric mean), each text's frontier, and the plot. Rows are the JSON dicts
frontier.measure makes: {"tool", "row", "bits", "texts": {text: compare_models' statistics}, ...} or an "error"."""
import math

RATES = (2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.5, 8.0)


def kl(r, text):
    return r["texts"][text]["kl_nats"]


def scored(results, text):
    """The rows that ran and have a score on `text` (a row cached before a text was added may lack it)."""
    return [r for r in results if "error" not in r and text in r.get("texts", {})]


def table(info, results, texts):
    """Markdown: one line per row sorted by bits, then the rows that could not run and why."""
    ok = sorted((r for r in results if "error" not in r), key=lambda r: (r["bits"], r["texts"].get(texts[0], {})
                                                                        .get("kl_nats", 0)))
    head = ["tool", "row", "bits", "file MiB"] + [f"KL {t}" for t in texts] + [
        f"KL p99 {texts[0]}", f"same top % {texts[0]}", "bits counted from"]
    lines = [f"**{info['reference']}**: {info['model']}", "", "| " + " | ".join(head) + " |",
             "|---|---|" + "---:|" * (len(head) - 3) + "---|"]
    for r in ok:
        s = r["texts"]
        first = s.get(texts[0])
        lines.append("| " + " | ".join([r["tool"], r["row"], f"{r['bits']:.3f}", mib(r)] + [
            f"{s[t]['kl_nats']:.3g} ± {s[t]['kl_stderr']:.2g}" if t in s else "-" for t in texts] + [
            f"{first['kl_p99']:.3g}" if first else "-", f"{first['same_top_pct']:.1f}" if first else "-",
            r["bits_counted"]]) + " |")
    for r in (r for r in results if "error" in r):
        lines.append(f"| {r['tool']} | {r['row']} | - | cannot run: {r['error'].replace('|', '/')} |" +
                     " |" * (len(head) - 4))
    return "\n".join(lines)


def mib(r):
    return f"{r['file_bytes'] / 2 ** 20:.1f}" if "file_bytes" in r else "-"


def point(r, text):
    """(bits, KL) of a row, and its whole file's MiB where measured."""
    return f"({r['bits']:.2f}, {kl(r, text):.3g}" + (f", {mib(r)} MiB)" if "file_bytes" in r else ")")


def nearest_rate(bits):
    """The rate of RATES a row's bits belong to: the nearest, 0.05 bit of metadata forgiven (a 4-bit g128 row with
    its 4.25 or 4.27 bits is a ~4-bit row, Q4_K_S's 4.54 a ~4.5-bit one)."""
    return min(RATES, key=lambda rate: abs(rate - (bits - 0.05)))


def frontier(results, text):
    """Per target rate, on one text: the best peer row among those nearest that rate, and the engine's best row at
    or below the peer row's bits -> [(rate, peer result, engine result or None)]."""
    ok = scored(results, text)
    engine = [r for r in ok if r["tool"] == "engine"]
    out = []
    for rate in RATES:
        near = [r for r in ok if r["tool"] != "engine" and nearest_rate(r["bits"]) == rate]
        if not near:
            continue
        peer = min(near, key=lambda r: kl(r, text))
        below = [r for r in engine if r["bits"] <= peer["bits"] + 1e-9]
        out.append((rate, peer, min(below, key=lambda r: kl(r, text)) if below else None))
    return out


def ratios(results, texts):
    """{rate: {text: engine's best KL / the best peer's, on that text's own frontier}} (None: no engine row)."""
    out = {}
    for text in texts:
        for rate, peer, ours in frontier(results, text):
            out.setdefault(rate, {})[text] = kl(ours, text) / kl(peer, text) if ours and kl(peer, text) > 0 else None
    return out


def spread_table(results, texts):
    """Markdown: per rate, the ratio on each text, their range and geometric mean; "every text" says whether the
    engine's best is below the best peer's on all of them."""
    lines = ["| rate | " + " | ".join(f"engine / peer, {t}" for t in texts) + " | range | geometric mean | "
             "below on every text |", "|---:|" + "---:|" * (len(texts) + 2) + "---|"]
    for rate, by_text in sorted(ratios(results, texts).items()):
        cells = [by_text.get(t) for t in texts]
        known = [c for c in cells if c is not None]
        gm = math.exp(sum(math.log(c) for c in known) / len(known)) if known else None
        every = "yes" if len(known) == len(texts) and max(known) < 1 else "no"
        lines.append(f"| ~{rate} | " + " | ".join("-" if c is None else f"{c:.2f}x" for c in cells) + " | " +
                     (f"{min(known):.2f}-{max(known):.2f}x | {gm:.2f}x" if known else "- | -") + f" | {every} |")
    return "\n".join(lines)


def frontier_table(results, text):
    lines = ["| rate | best peer row (bits, KL, file) | engine's best at or below its bits (bits, KL, file) | "
             "engine / peer |", "|---:|---|---|---:|"]
    for rate, peer, ours in frontier(results, text):
        mine = f"{ours['row']} {point(ours, text)}" if ours else "none"
        ratio = f"{kl(ours, text) / kl(peer, text):.2f}x" if ours and kl(peer, text) > 0 else "-"
        lines.append(f"| ~{rate} | {peer['tool']} {peer['row']} {point(peer, text)} | {mine} | {ratio} |")
    return "\n".join(lines)


def pareto(rows, text):
    """The rows no other row beats with fewer or as many bits, by bits."""
    front = []
    for r in sorted(rows, key=lambda r: (r["bits"], kl(r, text))):
        if not front or kl(r, text) < kl(front[-1], text):
            front.append(r)
    return front


def reference_report(info, results, texts):
    """The table, the reference's notes (its KL to the original, llama.cpp's cross-check), the ratios on every text
    and each text's frontier."""
    parts = [table(info, results, texts)]
    if "perturbation_kl" in info:
        parts.append("KL of this reference to the original SmolLM2: " + ", ".join(
            f"{t} {v:.2e}" for t, v in info["perturbation_kl"].items()))
    if info.get("cross_check"):
        c = info["cross_check"]
        parts.append(f"llama.cpp's own run of its {c['file']} file against this scorer's forward of the same weights: "
                     f"KL {c['kl_engine_vs_llama.cpp']:.2e} over {c['positions']} positions (its 8-bit activations)")
    parts += [f"engine / best peer per rate, on each held-out text ({info['reference']}):",
              spread_table(results, texts)]
    for text in texts:
        parts += [f"frontier on {text} ({info['reference']}):", frontier_table(results, text)]
    return "\n\n".join(parts)


MARKERS = {"engine": "o", "llama.cpp": "^", "HQQ": "s", "bitsandbytes": "D", "GPTQModel": "v",
           "llm-compressor": "P", "AutoRound": "X"}


def plot(reports, texts, path):
    """A panel per reference: KL (log) against bits on the first text, every tool's points (engine filled, peers
    open); and a last panel: engine / best peer per rate, a line per reference and text."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    text = texts[0]
    fig, axes = plt.subplots(1, len(reports) + 1, figsize=(9 * len(reports) + 7, 7), squeeze=False)
    for ax, (info, results) in zip(axes[0], reports):
        ok = [r for r in scored(results, text) if kl(r, text) > 0]
        for tool, marker in MARKERS.items():
            pts = [r for r in ok if r["tool"] == tool]
            if not pts:
                continue
            ax.scatter([r["bits"] for r in pts], [kl(r, text) for r in pts], marker=marker, s=55, label=tool,
                       facecolors=None if tool == "engine" else "none", edgecolors=f"C{list(MARKERS).index(tool)}",
                       color=f"C{list(MARKERS).index(tool)}")
            for r in pts:
                ax.annotate(r["row"].split(" (")[0], (r["bits"], kl(r, text)), fontsize=5, alpha=0.8,
                            xytext=(3, 2), textcoords="offset points")
        for name, pts, style in (("engine's frontier", [r for r in ok if r["tool"] == "engine"], "C0-"),
                                 ("peers' frontier", [r for r in ok if r["tool"] != "engine"], "k--")):
            front = pareto(pts, text)
            if front:
                ax.step([r["bits"] for r in front], [kl(r, text) for r in front], style, where="post", lw=1,
                        alpha=0.6, label=name)
        ax.set(yscale="log", xlabel="bits per weight of the decoder linears (every scale and offset counted)",
               ylabel=f"KL(reference || row), nats per token, held-out {text}", title=info["reference"])
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:          # a --rows run may have no point to show
            ax.legend()
    ax = axes[0][-1]
    for (info, results), style in zip(reports, ("-o", "--s", ":^")):
        by_rate = ratios(results, texts)
        for i, t in enumerate(texts):
            pts = [(rate, v[t]) for rate, v in sorted(by_rate.items()) if v.get(t)]
            if pts:
                ax.plot(*zip(*pts), style, color=f"C{i}", label=f"{info['reference']}, {t}")
    ax.axhline(1, color="k", lw=0.8)
    ax.set(yscale="log", xlabel="rate (bits per weight)", ylabel="engine's best KL / best peer's KL",
           title="the engine against the best peer, per held-out text")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
