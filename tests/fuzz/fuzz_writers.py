"""Fuzz campaign, part 3: faults of the writers (tests/fuzz/fuzz.py --faults runs it; alone: this file).

    python tests/fuzz/fuzz_writers.py [--kinds kill writers disk source user] [--writer-trials 6] [--seed 0]

Everything runs `run.py` as a user would, each command in its own process, on two small random models A and B (B
differs from A in one weight of layer 1), and then checks what is on disk:

  kill     `quantize --model A --out O` over an existing checkpoint O (fp8 and gptq), killed (os._exit: no clean-up
           at all) just before its n-th rename (os.replace, os.rename, the folder swap), for every n of a whole run.
           O must then be the complete old or the complete new checkpoint; the same command run again must exit 0,
           say whether it resumed or started over (when the kill left a partial folder), leave O byte-identical to
           an uninterrupted run, and leave no `.O.*` entry beside it
  writers  two runs into one O, of A and of B, the second started at a random instant of the first: one exits 0;
           the other, if they overlapped, exits 1 with one line naming the first's pid; O is the checkpoint of the
           run that exited 0 last, byte for byte. Then two `export`s into one new GGUF file (no --force): exactly one
           exits 0, the other is refused naming the first's pid or the file it wrote, which is the first's export
  disk     O on a real full disk: a tmpfs (mounted in a user and mount namespace, `unshare -rm`) sized from 5% to
           300% of the output (fp8), or a roomy one that another program fills at a random instant of the run
           (gptq). Either success, or one `error:` line naming O and the space needed (the partial folder kept when
           it says so, removed otherwise); then the space is freed and the same command run again: O byte-identical
           to an uninterrupted run (resumed when layers were kept)
  source   --out equal to the model, inside it, containing it (also with --force, also --format gguf and export):
           one `error:` line, the model's bytes unchanged
  user     O an engine checkpoint with the user's entries added (files, folders, hidden files, a stray shard, a
           link), or a folder of the user's: without --force one `error:` line naming them and every entry kept; and
           where O's lock goes (.O.lock), a link to a file of the user's or a file of the user's: refused in one
           `error:` line naming it, both left as they were

Counted: commands run; mixed or incomplete checkpoints accepted (a command that exits 0 leaving O anything but its
own complete checkpoint, or a kill leaving O neither the old nor the new one); user files lost (a model's or the
user's bytes changed or gone without --force); tracebacks (in any stderr); failures that are not one `error:` line.
"""
import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.loaders import save_dense  # noqa: E402
from engine.checkpoints.tokenizer import export_tokenizer  # noqa: E402
from engine.qwen3 import Qwen3, Qwen3Config  # noqa: E402

KINDS = ("kill", "writers", "disk", "source", "user")
CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_hidden_layers=3)
METHODS = {"fp8": ["--method", "fp8", "--option", "block=32"],
           "gptq": ["--method", "gptq", "--group-size", "32", "--calib-samples", "4", "--calib-len", "32"]}
OLD = ["--method", "fp8", "--option", "block=64"]          # the checkpoint a run replaces
FRACTIONS = (0.05, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 2.0, 3.0)   # tmpfs size / output size
# Runs run.py, killed (os._exit) just before the FUZZ_KILL_AT-th rename; FUZZ_COUNT: write the renames done there.
KILLER = """import atexit, os, runpy, sys
from engine import safe_writes
n, calls = int(os.environ.get("FUZZ_KILL_AT", "0")), []
def dying(real):
    def rename(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            os._exit(9)
        return real(*args, **kwargs)
    return rename
os.replace, os.rename, safe_writes._exchange = dying(os.replace), dying(os.rename), dying(safe_writes._exchange)
if os.environ.get("FUZZ_COUNT"):
    atexit.register(lambda: open(os.environ["FUZZ_COUNT"], "w").write(str(len(calls))))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class Campaign:
    def __init__(self, scratch, seed=0, log=print):
        self.scratch, self.rng, self.log = Path(scratch), random.Random(seed), log
        self.counts = Counter()
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "ENGINE_CACHE": str(self.scratch / "cache")}
        (self.scratch / "killer.py").write_text(KILLER)
        torch.manual_seed(seed)
        model = Qwen3(Qwen3Config(**CONFIG)).eval()
        self.models = {"A": self.scratch / "models" / "A", "B": self.scratch / "models" / "B"}
        save_dense(model, self.models["A"], side_files=lambda folder: export_tokenizer(None, folder))
        with torch.no_grad():
            model.model.layers[1].mlp.up_proj.weight[0, 0] += 1
        save_dense(model, self.models["B"], side_files=lambda folder: export_tokenizer(None, folder))
        self.references = {}

    # ---- running and judging commands ------------------------------------------------------------------------

    def run(self, *args, kill_at=0, count=None, wait=True):
        env = {**self.env, "FUZZ_KILL_AT": str(kill_at), "FUZZ_COUNT": str(count or "")}
        process = subprocess.Popen([sys.executable, str(self.scratch / "killer.py"), str(ROOT / "run.py"), *args],
                                   env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        return self.finish(process) if wait else process

    def finish(self, process):
        stderr = process.communicate()[1]
        self.counts["commands run"] += 1
        if "Traceback" in stderr:
            self.counts["tracebacks"] += 1
            self.log(f"TRACEBACK: {stderr[-1500:]}")
        elif process.returncode == 1 and not one_error_line(stderr):
            self.counts["failures that are not one error: line"] += 1
            self.log(f"NOT ONE LINE: {stderr[-800:]}")
        return process.returncode, stderr

    def quantize(self, model, method, out, *extra, **kw):
        options = METHODS[method] if isinstance(method, str) else method
        return self.run("quantize", "--model", str(self.models[model]), *options, "--out", str(out), *extra, **kw)

    def reference(self, model, method):
        """The files of an uninterrupted conversion ({name: bytes})."""
        key = (model, method if isinstance(method, str) else " ".join(method))
        if key not in self.references:
            out = self.scratch / "references" / "-".join(key).replace(" ", "_")
            code, stderr = self.quantize(model, method, out)
            if code:
                raise RuntimeError(f"the reference conversion failed: {stderr[-2000:]}")
            self.references[key] = files(out)
        return self.references[key]

    def gguf(self, model):
        """The bytes of `export MODEL --gguf` (and, in gguf_seconds, how long one took)."""
        if ("gguf", model) not in self.references:
            out, start = self.scratch / "references" / f"{model}.gguf", time.monotonic()
            out.parent.mkdir(parents=True, exist_ok=True)
            code, stderr = self.run("export", str(self.models[model]), "--gguf", str(out))
            if code:
                raise RuntimeError(f"the reference export failed: {stderr[-2000:]}")
            self.gguf_seconds = time.monotonic() - start
            self.references[("gguf", model)] = out.read_bytes()
        return self.references[("gguf", model)]

    def judge(self, out, code, model, method, what):
        """A command that exited 0 must leave its own complete checkpoint in `out` and nothing beside it."""
        if code == 0 and files(out) != self.reference(model, method):
            self.counts["mixed or incomplete checkpoints accepted"] += 1
            self.log(f"MIXED: {what}: {out} is not the checkpoint of {model} {method}")
        left = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
        if code == 0 and left:
            self.counts["leftovers after a complete run"] += 1
            self.log(f"LEFTOVERS: {what}: {left}")

    # ---- the faults ------------------------------------------------------------------------------------------

    def kill(self):
        for method in METHODS:
            old, new = self.reference("A", OLD), self.reference("A", method)
            folder = self.scratch / "kill" / method
            out = folder / "O"
            restore(folder, out, old)
            steps_file = folder / "steps"
            code, stderr = self.quantize("A", method, out, count=steps_file)
            assert code == 0, stderr
            steps = int(steps_file.read_text())
            for n in range(1, steps + 1):
                restore(folder, out, old)
                code, _ = self.quantize("A", method, out, kill_at=n)
                self.counts[f"kill: runs killed before a rename ({method}: {steps} renames in a run)"] += code == 9
                after = files(out) if out.is_dir() else None
                if after not in (old, new):
                    if out.exists() or not (folder / f".{out.name}.swap.json").exists():
                        self.counts["mixed or incomplete checkpoints accepted"] += 1
                        self.log(f"MIXED: kill {method} at {n}: O is neither old nor new")
                    else:
                        self.counts["kill: swap finished by the next run (no renameat2)"] += 1
                self.counts["kill: O the complete old or new checkpoint"] += after in (old, new)
                partial = (folder / ".O.partial").exists()
                code, stderr = self.quantize("A", method, out)
                said = ("resuming" in stderr) + ("started over" in stderr)
                how = "resuming" if "resuming" in stderr else "started over" if said else "started afresh"
                self.counts[f"kill: the next run {how}"] += 1
                if partial and said != 1:
                    self.counts["kill: resumed runs that did not say which"] += 1
                    self.log(f"UNSAID: kill {method} at {n}: {stderr[-500:]}")
                self.judge(out, code, "A", method, f"kill {method} at {n}, then again")
                self.counts["kill: next run completed"] += code == 0

    def writers(self, trials):
        method = "fp8"
        start = time.monotonic()
        self.reference("A", method), self.reference("B", method)
        duration = (time.monotonic() - start) / 2                     # one whole run, imports included
        self.gguf("A"), self.gguf("B")
        for t in range(trials):
            out = self.scratch / "writers" / f"t{t}" / "O"
            out.parent.mkdir(parents=True)
            first = self.quantize("A", method, out, wait=False)
            time.sleep(self.rng.uniform(0, duration))
            second = self.quantize("B", method, out, wait=False)
            (code_a, err_a), (code_b, err_b) = self.finish(first), self.finish(second)
            if code_a == code_b == 0:                                # one after the other
                self.counts["writers: one after the other, both exit 0"] += 1
                if files(out) not in (self.reference("A", method), self.reference("B", method)):
                    self.counts["mixed or incomplete checkpoints accepted"] += 1
                    self.log(f"MIXED: writers trial {t}: O is neither A's nor B's checkpoint")
                continue
            winner = {0: None, 1: ("A", first, err_b), 2: ("B", second, err_a)}[(code_a == 0) + 2 * (code_b == 0)]
            if winner is None:
                self.counts["writers: neither finished"] += 1
                self.log(f"NEITHER: {err_a[-300:]} {err_b[-300:]}")
                continue
            model, process, loser = winner
            named = f"being written by another run (pid {process.pid}" in loser
            self.counts["writers: the second refused at once, naming the first's pid"] += named
            self.counts["writers: refused without naming the writer"] += not named
            self.judge(out, 0, model, method, f"writers trial {t}")
        for t in range(trials):                                      # one GGUF file: no --force, so one winner
            out = self.scratch / "writers" / f"g{t}" / "O.gguf"
            out.parent.mkdir(parents=True)
            first = self.run("export", str(self.models["A"]), "--gguf", str(out), wait=False)
            time.sleep(self.rng.uniform(0, self.gguf_seconds / (10 if t % 2 else 1)))   # odd t: both past the check
            second = self.run("export", str(self.models["B"]), "--gguf", str(out), wait=False)
            (code_a, err_a), (code_b, err_b) = self.finish(first), self.finish(second)
            if (code_a == 0) == (code_b == 0):                      # both wrote it (one replacing the other)
                self.counts["writers: neither finished" if code_a else "mixed or incomplete checkpoints accepted"] += 1
                self.log(f"GGUF WRITERS trial {t}: exits {code_a} and {code_b}: {err_a[-300:]} {err_b[-300:]}")
                continue
            model, process, loser = ("A", first, err_b) if code_a == 0 else ("B", second, err_a)
            how = "naming the first's pid" if f"being written by another run (pid {process.pid}" in loser else \
                "the file exists" if f"output {out} exists" in loser else None
            self.counts[f"writers (GGUF): the other refused, {how}" if how else "writers: refused without naming the "
                        "writer"] += 1
            left = [p.name for p in out.parent.iterdir() if p.name != out.name]
            if out.read_bytes() != self.gguf(model) or left:
                self.counts["mixed or incomplete checkpoints accepted"] += 1
                self.log(f"GGUF WRITERS trial {t}: not {model}'s export, or left {left}")

    def disk(self, fill_trials=6):
        if shutil.which("unshare") is None:
            self.counts["disk: skipped (no unshare)"] += 1
            return
        size = sum(len(b) for b in self.reference("A", "fp8").values())
        cases = [{"method": "fp8", "fraction": f} for f in FRACTIONS]
        cases += [{"method": "gptq", "fill_at": self.rng.random()} for _ in range(fill_trials)]
        driver = [sys.executable, __file__, "--disk-driver", str(self.scratch), json.dumps({"size": size,
                                                                                          "cases": cases})]
        result = subprocess.run(["unshare", "-rm", *driver], env=self.env, capture_output=True, text=True)
        if result.returncode:
            self.counts["disk: skipped (no tmpfs in a user namespace)"] += 1
            self.log(f"disk driver failed: {result.stderr[-800:]}")
            return
        for line in result.stdout.splitlines():
            case = json.loads(line)
            self.counts["commands run"] += 2
            for err in (case["first_stderr"], case["again_stderr"]):
                self.counts["tracebacks"] += "Traceback" in err
            how = "tmpfs of a fraction of the output" if "fraction" in case else "tmpfs filled by another program"
            ran_out = "no space left on the device" in case["first_stderr"]
            outcome = "completed" if case["first"] == 0 else \
                f"{'disk filled up' if ran_out else 'refused by the free-space check'}, " \
                f"{'finished layers kept' if case['kept'] else 'nothing kept'}"
            self.counts[f"disk ({how}): {outcome}"] += 1
            if case["first"] and not one_error_line(case["first_stderr"], "MB more is needed"):
                self.counts["failures that are not one error: line"] += 1
                self.log(f"DISK NOT ONE LINE: {case['first_stderr'][-800:]}")
            if case["first"] and (("is kept" in case["first_stderr"]) != case["kept"]):
                self.counts["disk: partial folder not as the error said"] += 1
                self.log(f"DISK PARTIAL: {case}")
            reference = {k: v.hex() for k, v in self.reference("A", case["method"]).items()}
            if case["again"] != 0 or case["files"] != reference:
                self.counts["mixed or incomplete checkpoints accepted" if case["again"] == 0 else
                            "disk: the run after freeing space failed"] += 1
                self.log(f"DISK: {case}: {case['again_stderr'][-500:]}")
            if case["kept"] and "resuming" not in case["again_stderr"]:
                self.counts["disk: kept layers not resumed"] += 1

    def source(self):
        a = self.models["A"]
        gguf = self.scratch / "source" / "A.gguf"
        gguf.parent.mkdir(parents=True)
        assert self.run("export", str(a), "--gguf", str(gguf))[0] == 0
        before = {a: files(a), gguf: gguf.read_bytes()}
        cases = [("quantize", "--model", str(a), "--method", "fp8", "--out", str(out), *force)
                 for out in (a, a / "sub", a.parent) for force in ((), ("--force",))]
        cases += [("quantize", "--model", str(gguf), "--method", "compressed-tensors", "--format", "gguf", "--out",
                   str(gguf), "--force"), ("export", str(a), "--gguf", str(a / "x.gguf")),
                  ("export", str(gguf), "--gguf", str(gguf), "--force")]
        for case in cases:
            code, stderr = self.run(*case)
            refused = code == 1 and "the model it is made from" in stderr
            self.counts["source: refused with one error: line"] += refused
            if not refused:
                self.log(f"SOURCE NOT REFUSED: {case}: {stderr[-300:]}")
                self.counts["source: not refused"] += 1
            if files(a) != before[a] or gguf.read_bytes() != before[gguf]:
                self.counts["user files lost"] += 1
                self.log(f"SOURCE CHANGED by {case}")
                restore(a.parent, a, before[a])

    def user(self, trials=8):
        entries = ["notes.txt", ".hidden", "mydata/", "mydata/run1.json", "model-00009-of-00009.safetensors",
                   "results.csv", "link", "README.md", "sub/deeper/x.bin"]
        for t in range(trials):
            out = self.scratch / "user" / f"t{t}" / "O"
            if t % 4 == 3:
                out.mkdir(parents=True)                              # a folder of the user's, no checkpoint
            else:
                restore(out.parent, out, self.reference("A", OLD))
            added = self.rng.sample(entries, self.rng.randint(1, 4))
            for name in added:
                path = out / name.rstrip("/")
                path.parent.mkdir(parents=True, exist_ok=True)
                if name.endswith("/"):
                    path.mkdir(exist_ok=True)
                elif name == "link":
                    path.symlink_to("/etc/hostname")
                else:
                    path.write_bytes(os.urandom(64))
            before = files(out, links=True)
            code, stderr = self.quantize("A", "fp8", out)
            refused = code == 1 and ("holds files that are not an engine checkpoint" in stderr
                                     or "also holds other files" in stderr)
            self.counts["user: refused naming the user's entries"] += refused
            if not refused:
                self.log(f"USER NOT REFUSED: {added}: {stderr[-300:]}")
                self.counts["user: not refused"] += 1
            if files(out, links=True) != before:
                self.counts["user files lost"] += 1
                self.log(f"USER FILES LOST: {added}")
        for kind, command in (("link", "quantize"), ("file", "export")):      # where the output's lock goes
            out = self.scratch / "user" / f"lock-{kind}" / ("O" if command == "quantize" else "O.gguf")
            lock, victim = out.parent / f".{out.name}.lock", out.parent / "victim"
            out.parent.mkdir(parents=True)
            victim.write_bytes(os.urandom(64))
            lock.symlink_to(victim) if kind == "link" else lock.write_bytes(b"the user's notes")
            theirs = lambda: {k: v for k, v in files(out.parent, links=True).items() if not k.startswith(out.name)}
            before = theirs()
            code, stderr = self.quantize("A", "fp8", out) if command == "quantize" else \
                self.run("export", str(self.models["A"]), "--gguf", str(out))
            refused = code == 1 and one_error_line(stderr, f"{lock} is ")
            self.counts["user: a lock file not the engine's refused"] += refused
            if not refused:
                self.counts["user: lock file not refused"] += 1
                self.log(f"LOCK NOT REFUSED: {kind}: {stderr[-300:]}")
            if theirs() != before:
                self.counts["user files lost"] += 1
                self.log(f"USER FILES LOST: a lock {kind}")


def one_error_line(stderr, saying=""):
    """A failure told as one `error:` line, the last (progress lines may come before it)."""
    lines = stderr.strip().splitlines()
    return [line for line in lines if line.startswith("error: ")] == lines[-1:] and saying in lines[-1]


def files(folder, links=False):
    """{relative path: bytes} of every file below `folder` (links: their target's text)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_symlink() and links:
            out[str(p.relative_to(folder))] = os.readlink(p).encode()
        elif p.is_file() and not p.is_symlink():
            out[str(p.relative_to(folder))] = p.read_bytes()
    return out


def restore(parent, out, content):
    """Make `parent` hold only the folder `out` with `content` {name: bytes}."""
    shutil.rmtree(parent, ignore_errors=True)
    out.mkdir(parents=True)
    for name, data in content.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)


def disk_driver(scratch, spec):
    """Inside `unshare -rm`: each case's conversion with O on its own tmpfs: `fraction` of the output's size, or a
    roomy one that another program fills (one file taking all but 16 KiB) at `fill_at` of the run's duration; then
    the tmpfs grown (or the filler removed) and the same command again. One JSON line per case."""
    scratch, env, duration = Path(scratch), {**os.environ}, None
    for k, case in enumerate(spec["cases"]):
        mount = scratch / "disk" / f"case{k}"
        mount.mkdir(parents=True)
        roomy = 4 * spec["size"] + (4 << 20)
        limit = max(4096, int(spec["size"] * case["fraction"]) // 4096 * 4096) if "fraction" in case else roomy
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={limit}", "tmpfs", str(mount)], check=True)
        out = mount / "O"
        command = [sys.executable, str(ROOT / "run.py"), "quantize", "--model", str(scratch / "models" / "A"),
                   *METHODS[case["method"]], "--out", str(out)]
        if "fill_at" in case and duration is None:                  # one whole run, to time the fill
            start = time.monotonic()
            subprocess.run(command + ["--force"], env=env, capture_output=True, check=True)
            duration = time.monotonic() - start
            shutil.rmtree(out)
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        filler = mount / "filler"
        if "fill_at" in case:
            time.sleep(case["fill_at"] * duration)
            with open(filler, "wb") as f, contextlib.suppress(OSError):
                f.write(bytes(max(0, shutil.disk_usage(mount).free - (16 << 10))))
        first_stderr = process.communicate()[1]
        kept = (mount / ".O.partial").exists()
        filler.unlink(missing_ok=True)
        subprocess.run(["mount", "-o", f"remount,size={roomy}", str(mount)], check=True)
        again = subprocess.run(command, env=env, capture_output=True, text=True)
        print(json.dumps({**case, "first": process.returncode, "first_stderr": first_stderr, "kept": kept,
                          "again": again.returncode, "again_stderr": again.stderr,
                          "files": {k: v.hex() for k, v in (files(out) or {}).items()}}), flush=True)
        subprocess.run(["umount", str(mount)], check=True)


def faults_campaign(kinds=KINDS, seed=0, writer_trials=6, user_trials=8, scratch=None, log=print):
    """Run the fault kinds; returns the counts (every kind's tallies and the totals that must be 0)."""
    scratch = Path(scratch or tempfile.mkdtemp(prefix="fuzz-writers-"))
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        campaign = Campaign(scratch, seed, log)
        for totals in ("mixed or incomplete checkpoints accepted", "user files lost", "tracebacks",
                       "failures that are not one error: line"):
            campaign.counts[totals] += 0
        for kind in kinds:
            start = time.monotonic()
            {"kill": campaign.kill, "writers": lambda: campaign.writers(writer_trials), "disk": campaign.disk,
             "source": campaign.source, "user": lambda: campaign.user(user_trials)}[kind]()
            log(f"{kind}: {time.monotonic() - start:.0f} s")
        return dict(sorted(campaign.counts.items()))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS)
    parser.add_argument("--writer-trials", type=int, default=6)
    parser.add_argument("--user-trials", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--disk-driver", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.disk_driver:
        return disk_driver(args.disk_driver[0], json.loads(args.disk_driver[1]))
    counts = faults_campaign(args.kinds, args.seed, args.writer_trials, args.user_trials,
                             log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(counts, indent=1))


if __name__ == "__main__":
    main()
