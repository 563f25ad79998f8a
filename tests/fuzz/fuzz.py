"""Fuzz campaign: mutated checkpoints of every method, corrupted streams of every coder, and a crash campaign.

    python tests/fuzz/fuzz.py [--checkpoint-cases 2000] [--stream-cases 20000] [--seed 0] [--timeout 20]
                              [--memory-gib 3] [--workers 2] [--crash-kills 0] [--faults] [--input-cases 0] [--case N]

What is mutated: tests/fuzz/fuzz_checkpoints.py (every method's checkpoint, dense, sharded and GGUF files) and
tests/fuzz/fuzz_streams.py (rANS, Rice and trellis streams). This file runs the cases and counts the outcomes.

Each case runs in a worker process (spawned once, reused, torch.set_num_threads(1), address space capped with
RLIMIT_AS); a worker that does not answer within the timeout is killed and replaced. A checkpoint case loads the
mutated copy and runs a forward pass; a stream case decodes the corrupted stream. Outcomes:
    ok-identical       the mutation did not change what loads (same logits / same decoded weights)
    ValueError         refused with a ValueError (exactly that type: a subclass such as JSONDecodeError is "other")
    other              any other exception (type and first line recorded), or a worker that died
    hang               no answer within the timeout
    memory             MemoryError, a failed allocation, or a worker killed by the kernel
    non-finite         loaded, but the logits are not finite and neither is some weight it computes with
    overflow           loaded, every weight finite, but the forward pass overflows float32 (a representable model:
                       e.g. a norm weight of 3.4e38 that a flipped exponent bit can give)
    silent-different   loaded without error, different logits; for a stream: a silent wrong decode
    fuzzer-error       the mutation itself could not be applied (a bug of the fuzzer)

Crash campaign (--crash-kills N): `run.py quantize --method fp8 --force` overwrites a checkpoint, alternately with
128- and 64-wide blocks (so that old and new differ), and is SIGKILLed N times at a uniformly random instant of its
run and N times at a uniformly random instant of its save; DIR must then load and hold the complete old or the
complete new checkpoint, and after the next complete save no `.DIR.*` entry may be left.

Writer faults (--faults): tests/fuzz/fuzz_writers.py, `run.py` killed at each rename of a conversion, two writers
into one folder, a full disk (a real tmpfs), --out equal to the source, the user's files inside a checkpoint;
counted: mixed or incomplete checkpoints accepted, user files lost, tracebacks (all must be 0).

What a user types (--input-cases N): tests/fuzz/fuzz_inputs.py, `run.py quantize --model` with hostile option
values, calibration files and tokenizers, `generate` with hostile prompt files, tokenizers and --kv-cache SPECs,
`eval --ctx`: each refused with one `error:` line before the model's weights are read, in bounded time and memory,
or accepted (a checkpoint written loads with finite weights; generate reports its cache).
"""

import argparse
import hashlib
import json
import multiprocessing
import os
import queue
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from fuzz_checkpoints import TARGETS, build, checkpoint_cases, forward, load, mutate_checkpoint, pristine
from fuzz_streams import STREAMS, corrupt_layer, corrupt_rans, pristine_streams, stream_cases
from fuzz_inputs import campaign as inputs_campaign, report as inputs_report
from fuzz_writers import faults_campaign
from engine.loaders import load_dense
from engine.formats.quantized_checkpoints import load_quantized
from engine.safetensors_io import snapshot_tensors, tensor_digest
from engine.layers import QuantLinear

ROOT = Path(__file__).resolve().parents[2]
OUTCOMES = ("ok-identical", "ValueError", "other", "hang", "memory", "non-finite", "overflow", "silent-different",
            "fuzzer-error")


def describe(case):
    keys = [k for k in ("target", "flavor", "category", "file", "name", "key", "path", "op", "seed") if k in case]
    return " ".join(f"{case[k]}" if k in ("target", "category", "op") else f"{k}={case[k]}" for k in keys)


# ---- workers --------------------------------------------------------------------------------------------------------

class FuzzerError(Exception):
    """A case that could not be built (a bug of this file, not of the engine)."""


def classify(error):
    if isinstance(error, FuzzerError):
        return "fuzzer-error"
    text = str(error)
    if isinstance(error, MemoryError) or (isinstance(error, OSError) and error.errno == 12) or (
            isinstance(error, RuntimeError) and "alloc" in text and "memory" in text):
        return "memory"
    return "ValueError" if type(error) is ValueError else "other"


def first_line(error):
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"


def weights_finite(model):
    """Every weight the loaded model computes with (dense tensors, each quantized layer's decoded weight) is finite."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    return all(torch.isfinite(t).all() for t in [*model.parameters(), *(m.dequantize() for m in layers)])


class Worker:
    """What a worker process keeps between cases: each target's reference logits, the dense model (GGUF files are
    written from it) and the pristine streams; all made before the first case, so that no case's time includes it."""

    def __init__(self, root):
        self.root = Path(root)
        self.scratch = Path(tempfile.mkdtemp(prefix="worker-", dir=self.root))
        self.references = {target: forward(load(target, pristine(self.root, target))) for target in TARGETS}
        self.dense = load_dense(pristine(self.root, "dense"))
        self.streams = {kind: pristine_streams(self.root, kind) for kind in STREAMS}

    def run(self, case):
        """(outcome, what was done) of one case, exceptions included."""
        try:
            return (self.checkpoint if case["kind"] == "checkpoint" else self.stream)(case)
        except Exception as e:                           # noqa: BLE001  (every failure is an outcome)
            return classify(e), first_line(e)

    def checkpoint(self, case):
        target = case["target"]
        folder, outside = self.scratch / "case", self.scratch / "outside"
        for old in (folder, outside):
            shutil.rmtree(old, ignore_errors=True)
        shutil.copytree(pristine(self.root, target, case["flavor"]), folder, symlinks=True)
        try:
            where = mutate_checkpoint(folder, case, outside, self.dense)
        except Exception as e:                          # noqa: BLE001
            raise FuzzerError(f"the mutation itself failed: {first_line(e)}") from e
        model = load(target, folder)
        if case["category"] == "tokenizer":
            return tokenizer_case(model, folder), where
        logits = forward(model)
        if not torch.isfinite(logits).all():
            return ("non-finite" if not weights_finite(model) else "overflow"), where
        return ("ok-identical" if torch.equal(logits, self.references[target]) else "silent-different"), where

    def stream(self, case):
        kind = case["target"]
        rng = random.Random(case["seed"])
        same, where = (corrupt_rans(self.streams[kind], case["op"], rng) if kind == "rans"
                       else corrupt_layer(kind, self.streams[kind], case["op"], rng))
        return ("ok-identical" if same else "silent-different"), where


def tokenizer_case(model, folder):
    """A folder whose tokenizer.json has an added token beyond the vocabulary: its tokenizer loads (ValueError
    expected) and a prompt holding that token runs through the model, as `run.py generate` would."""
    from engine.checkpoints.tokenizer import encode, load_tokenizer
    ids = encode(load_tokenizer(folder), "The <|fuzz|> is")[None]
    with torch.no_grad():
        logits = model(ids)
    return "ok-identical" if torch.isfinite(logits).all() else "overflow"


def worker_main(conn, root, memory_gib):
    torch.set_num_threads(1)
    limit = int(memory_gib * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    worker = Worker(root)
    conn.send("ready")
    while (case := conn.recv()) is not None:
        start = time.perf_counter()
        outcome, detail = worker.run(case)
        conn.send((outcome, detail, time.perf_counter() - start))


class Slot:
    """One spawned worker, replaced when it does not answer in time or dies."""

    def __init__(self, root, memory_gib):
        self.root, self.memory_gib = str(root), memory_gib
        self.start()

    def start(self):
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=worker_main, args=(child, self.root, self.memory_gib), daemon=True)
        self.process.start()
        child.close()
        if not self.conn.poll(300) or self.conn.recv() != "ready":
            raise RuntimeError("a fuzz worker did not start")

    def stop(self):
        self.process.kill()
        self.process.join()

    def run(self, case, timeout):
        start = time.perf_counter()
        self.conn.send(case)
        if self.conn.poll(timeout):
            try:
                return self.conn.recv()
            except (EOFError, OSError):
                self.process.join(10)
                code = self.process.exitcode
                outcome = "memory" if code == -signal.SIGKILL else "other"
                detail = f"worker died (exit code {code})"
        else:
            outcome, detail = "hang", f"no answer in {timeout} s"
        self.stop()
        self.start()
        return outcome, detail, time.perf_counter() - start


@dataclass
class Result:
    case: dict
    outcome: str
    detail: str
    seconds: float


def run_cases(root, cases, timeout=20.0, memory_gib=3.0, workers=2, progress=None):
    """Every case through `workers` worker processes -> [Result] in the cases' order."""
    todo = queue.Queue()
    for i in range(len(cases)):
        todo.put(i)
    results, errors = [None] * len(cases), []

    def serve():
        try:
            slot = Slot(root, memory_gib)
        except Exception as e:                          # noqa: BLE001
            errors.append(e)
            return
        try:
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                results[i] = Result(cases[i], *slot.run(cases[i], timeout))
                if progress:
                    progress(results[i])
        finally:
            slot.stop()

    threads = [threading.Thread(target=serve) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors and any(r is None for r in results):
        raise errors[0]
    return results


def campaign(root, checkpoint_n, stream_n, seed=0, timeout=20.0, memory_gib=3.0, workers=2, progress=None):
    """Build the pristine checkpoints under root, then run checkpoint_n + stream_n cases -> [Result]."""
    build(root, seed)
    cases = checkpoint_cases(root, checkpoint_n, seed) + stream_cases(stream_n, seed)
    return run_cases(root, cases, timeout, memory_gib, workers, progress)


# ---- reporting ------------------------------------------------------------------------------------------------------

def counts(results):
    """{(kind, target): Counter(outcome)}."""
    out = defaultdict(Counter)
    for r in results:
        out[r.case["kind"], r.case["target"]][r.outcome] += 1
    return out


def report(results, slowest=10):
    lines = []
    table = counts(results)
    for kind, targets in (("checkpoint", TARGETS), ("stream", STREAMS)):
        rows = [(t, table[kind, t]) for t in targets if (kind, t) in table]
        if not rows:
            continue
        head = f"{kind + ' target':18}" + "".join(f"{o:>{len(o) + 2}}" for o in OUTCOMES) + f"{'total':>8}"
        lines += ["", head, "-" * len(head)]
        total = Counter()
        for target, c in rows + [("total", None)]:
            c = total if c is None else c
            if target != "total":
                total.update(c)
            lines.append(f"{target:18}" + "".join(f"{c[o]:>{len(o) + 2}}" for o in OUTCOMES) + f"{sum(c.values()):>8}")
    bad = [r for r in results if r.outcome in ("other", "hang", "memory", "non-finite", "overflow", "fuzzer-error")
           or (r.outcome == "silent-different" and r.case["kind"] == "stream")]
    if bad:
        lines += ["", "failures:"] + [f"  {r.outcome:16} {describe(r.case)}: {r.detail}" for r in bad]
    for outcome in ("silent-different", "ok-identical"):
        grouped = Counter(" ".join(str(r.case[k]) for k in ("target", "flavor", "category", "path", "name", "key", "op")
                                   if k in r.case) for r in results if r.outcome == outcome)
        if grouped:
            lines += ["", f"{outcome} (target, flavor, category, path / tensor / key, op: count):"]
            lines += [f"  {k}: {n}" for k, n in sorted(grouped.items())]
    lines += ["", f"slowest {slowest} cases:"]
    lines += [f"  {r.seconds:7.2f} s  {r.outcome:16} {describe(r.case)}"
              for r in sorted(results, key=lambda r: -r.seconds)[:slowest]]
    return "\n".join(lines)


# ---- the crash campaign -------------------------------------------------------------------------------------------

def checkpoint_digest(directory):
    """SHA-256 of config.json and of every tensor (each verified against its recorded digest on the way)."""
    h = hashlib.sha256((Path(directory) / "config.json").read_bytes())
    for name, t in sorted(snapshot_tensors(directory)):
        h.update(f"{name}:{tensor_digest(t)}".encode())
    return h.hexdigest()


def leftovers(directory):
    return sorted(p.name for p in directory.parent.iterdir() if p.name.startswith(f".{directory.name}."))


def crash_campaign(kills, seed=0, scratch=None, steps=20, log=print):
    """`run.py quantize --force` overwrites of a checkpoint, SIGKILLed: `kills` times at a uniformly random instant
    of the run, then as many times at a uniformly random instant of its save (while its temporary folder exists: from
    the first file written to the swap and the removal of the old copy, as long as complete runs took). After each kill DIR must load and hold the complete
    old or new checkpoint; the next complete save must leave DIR holding what it wrote and no `.DIR.*` entry.
    Returns the counts."""
    rng = random.Random(seed)
    scratch = Path(scratch or tempfile.mkdtemp(prefix="fuzz-crash-"))
    env = {**os.environ, "ENGINE_CACHE": str(scratch / "cache")}
    out = scratch / "out" / "ck"
    variants = ([], ["--option", "block=64"])             # two different checkpoints of the same model

    def run(v, kill_at=None, kill_after_save=None):
        """-> (exit code, seconds until the save's temporary folder appeared or None, until it was gone, until the
        process ended); killed at kill_at, or kill_after_save seconds after the temporary folder appeared."""
        with open(scratch / "stderr", "w") as err:
            process = subprocess.Popen([sys.executable, str(ROOT / "run.py"), "quantize", "--method", "fp8", "--out",
                                        str(out), "--force", "--steps", str(steps), *variants[v]], env=env,
                                       stdout=subprocess.DEVNULL, stderr=err)
            start, saving, saved = time.monotonic(), None, None
            while process.poll() is None:
                now = time.monotonic() - start
                temporary = any(n.startswith(f".{out.name}.new-{process.pid}.") for n in leftovers(out))
                if saving is None and temporary:
                    saving = now
                if saving is not None and saved is None and not temporary:
                    saved = now
                if saving is not None and kill_after_save is not None:
                    kill_at = saving + kill_after_save
                if kill_at is not None and now >= kill_at:
                    process.kill()
                    process.wait()
                time.sleep(0.002)
        if kill_at is None and kill_after_save is None and process.returncode:
            raise RuntimeError(f"run.py quantize failed: {(scratch / 'stderr').read_text()[-2000:]}")
        return process.returncode, saving, saved, time.monotonic() - start

    out.parent.mkdir(parents=True)
    run(0)                                                 # trains and caches the model
    digests, runs = {}, []
    for v in (1, 0):
        runs.append(run(v))
        digests[v] = checkpoint_digest(out)
    duration = min(r[3] for r in runs)
    save = min(r[2] - r[1] for r in runs)
    current, summary = 0, Counter()
    for k in range(2 * kills):
        new, window = 1 - current, "run" if k < kills else "save"
        kill_at = rng.uniform(0, duration if window == "run" else save)
        code, started, _, _ = run(new, **{"kill_at" if window == "run" else "kill_after_save": kill_at})
        left = leftovers(out)
        try:
            load_quantized(out)
            digest = checkpoint_digest(out)
            state = "old" if digest == digests[current] else "new" if digest == digests[new] else "another"
        except ValueError as e:
            state = f"broken ({e})"
        when = "finished before the kill" if code == 0 else "during the save" if started is not None else \
            "before the save"
        summary[f"{window}: {when}: {state.split(' ')[0]}"] += 1
        summary[f"{window}: leftovers after the kill"] += bool(left)
        current = new if state == "new" else current
        run(1 - current)
        current = 1 - current
        after = leftovers(out)
        summary[f"{window}: leftovers after the next save"] += bool(after)
        summary[f"{window}: wrong checkpoint after the next save"] += checkpoint_digest(out) != digests[current]
        log(f"kill {k + 1}/{2 * kills} ({window}) at {kill_at:.3f} s of {duration if window == 'run' else save:.3f} s,"
            f" {when}: DIR holds the "
            f"{state} checkpoint{f', leftovers {left}' if left else ''}; after the next save: leftovers {after}")
    shutil.rmtree(scratch, ignore_errors=True)
    return dict(sorted(summary.items()), kills=2 * kills, run_seconds=round(duration, 2), save_seconds=round(save, 3))


# ---- command line ---------------------------------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint-cases", type=int, default=2000)
    parser.add_argument("--stream-cases", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds per case before it counts as a hang")
    parser.add_argument("--memory-gib", type=float, default=3.0, help="address space of a worker (RLIMIT_AS)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--crash-kills", type=int, default=0, help="also kill this many run.py quantize overwrites")
    parser.add_argument("--faults", action="store_true", help="also run the writer faults (fuzz_writers.py)")
    parser.add_argument("--input-cases", type=int, default=0, help="also run this many fuzz_inputs.py commands")
    parser.add_argument("--case", type=int, help="run only case N (checkpoint cases first), here, with a traceback")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="fuzz-"))
    try:
        start = time.monotonic()
        if args.case is not None:
            build(root, args.seed)
            cases = checkpoint_cases(root, args.checkpoint_cases, args.seed) + stream_cases(args.stream_cases,
                                                                                              args.seed)
            case = cases[args.case]
            print(describe(case))
            worker = Worker(root)
            print((worker.checkpoint if case["kind"] == "checkpoint" else worker.stream)(case))
            return
        done = Counter()

        def progress(result):
            done[result.outcome] += 1
            if sum(done.values()) % 500 == 0:
                print(f"{sum(done.values())} cases, {time.monotonic() - start:.0f} s: {dict(done)}", file=sys.stderr,
                      flush=True)

        if args.checkpoint_cases or args.stream_cases:
            results = campaign(root, args.checkpoint_cases, args.stream_cases, args.seed, args.timeout,
                               args.memory_gib, args.workers, progress)
            print(report(results))
            print(f"\n{len(results)} cases in {time.monotonic() - start:.0f} s")
        if args.crash_kills:
            print("\ncrash campaign:", json.dumps(crash_campaign(args.crash_kills, args.seed,
                                                                 log=lambda m: print(m, file=sys.stderr))))
        if args.faults:
            counts = faults_campaign(seed=args.seed, log=lambda m: print(m, file=sys.stderr))
            print("\nwriter faults:", json.dumps(counts, indent=1))
        if args.input_cases:
            results = inputs_campaign(root / "inputs", args.input_cases, seed=args.seed, workers=args.workers)
            print("\nwhat a user types:\n" + inputs_report(results))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
