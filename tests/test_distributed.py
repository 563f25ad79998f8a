"""Beyond one process (engine/distributed.py): `torchrun --nproc-per-node 2 run.py quantize --model ...` writes the
same bytes as one process, for a data-free method (layers split over the ranks) and for the data-aware ones (GPTQ,
AWQ, BlockLDLQ, EntQuant with feedback: calibration split, statistics folded in a fixed slot order, each linear
quantized by one owner; a rank without a calibration batch only takes part); a rank killed mid-run (by hand or
under torchrun) ends the other with one error line, and the same command then resumes and finishes with the same
bytes; what a rank receives is loaded weights_only. A linear whose error feedback is the step's longest is cut into
shares of rows over the ranks (distributed.plan), and the joined shares are still the bytes of one process."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine import distributed
from engine.formats.numerics import obq
from engine.checkpoints.tokenizer import byte_tokenizer, write_tokenizer_files
from engine.formats import gptq
from engine.formats.numerics.affine import AffineQuantLinear
from engine.formats.numerics.input_stats import InputStats, slot_of
from engine.loaders import save_dense
from engine.qwen3 import Qwen3, Qwen3Config, Qwen3MoeConfig

ROOT = Path(__file__).resolve().parents[1]
CALIB = ("--calib-samples", "24", "--calib-len", "32")
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}          # what torchrun gives each rank


def dense_folder(tmp_path_factory, name, seed, **shape):
    """A random Qwen3 with the byte tokenizer, saved as a Hugging Face folder."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=16, **shape)
    folder = tmp_path_factory.mktemp("src") / name
    save_dense(Qwen3(cfg).eval(), folder, side_files=lambda f: write_tokenizer_files(byte_tokenizer(), f))
    return folder


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return dense_folder(tmp_path_factory, "dense", 0, hidden_size=64, intermediate_size=128, num_hidden_layers=6)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """o_proj and down_proj of 128 rows, alone in their steps: two blocks of obq.ROWS rows, cut over 2 ranks."""
    return dense_folder(tmp_path_factory, "wide", 1, hidden_size=128, intermediate_size=192, num_hidden_layers=2)


def quantize(*args, ranks=1, env=None):
    command = [sys.executable, str(ROOT / "run.py"), "quantize", *args]
    if ranks > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                   "--master-port", str(free_port()), str(ROOT / "run.py"), "quantize", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env or ONE_THREAD, timeout=600)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def files(folder):
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}


def two_ranks_write_what_one_process_writes(tmp_path, common):
    """`run.py quantize *common` by one process and by torchrun with 2 ranks: both succeed, with the same bytes."""
    one = quantize(*common, "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    two = quantize(*common, "--out", str(tmp_path / "two"), ranks=2)
    assert two.returncode == 0, two.stderr
    assert "with 2 ranks" in two.stderr
    assert files(tmp_path / "two") == files(tmp_path / "one")


def rank_pid(launcher, rank):
    """The pid of rank `rank` among the processes torchrun (pid `launcher`) started (Linux /proc), None if none."""
    for task in Path(f"/proc/{launcher}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                if f"RANK={rank}".encode() in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
                    return int(child)
            except OSError:                         # it ended meanwhile
                pass
    return None


class Planted:
    """What a stranger that joined the group as a rank could send: unpickling it runs os.remove."""

    def __init__(self, victim):
        self.victim = victim

    def __reduce__(self):
        return os.remove, (str(self.victim),)


def test_slot_sums_split_over_ranks_fold_to_the_one_process_sums():
    """The fold Group.fold makes, done by hand: two 'ranks' holding slots 0-3 and 4-7 reach the one-process
    float64 sums bit for bit; a plain sum of the two halves (what a naive all-reduce does) does not."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(40, 24, generator=g) * 10 ** (4 * torch.randn(1, generator=g)) for _ in range(16)]
    one = InputStats(24)
    for b, x in enumerate(batches):
        one.add(x, slot_of(b, len(batches)))
    halves = []
    for rank in range(2):
        part = InputStats(24, keep_slots=True)
        for b in distributed.share(len(batches), rank, 2):
            part.add(batches[b], slot_of(b, len(batches)))
        halves.append(part)
    assert [len(h.parts) for h in halves] == [4, 4]                 # each rank keeps its 4 slots apart
    assert halves[0].parts[0][1].shape == (24 * 25 // 2,)           # X^T X's upper triangle: what a rank sends
    folded = halves[0].parts + halves[1].parts
    merged = InputStats(24)
    merged.parts = [[p[0], p[1].clone(), p[2].clone(), p[3]] for p in folded]        # folded in place
    assert torch.equal(merged.hessian, one.hessian) and torch.equal(merged.mean_abs, one.mean_abs)
    assert torch.equal(merged.gram, merged.gram.T) and merged.gram.dtype == torch.float32
    naive = halves[0]._total()[1] + halves[1]._total()[1]
    assert not torch.equal(naive, one._total()[1])                 # the order matters: the fold is needed


def test_the_plan_cuts_rows_only_where_that_shortens_the_step():
    """q/k/v and gate/up stay whole on 2 ranks (cutting q or gate would not shorten the longest rank), gate/up are
    cut on 8; a linear alone in its step is cut into shares of whole blocks, one too small to cut stays whole."""
    qkv = {"q": (2048, 1024), "k": (1024, 1024), "v": (1024, 1024)}
    assert obq.row_shares(qkv, 2, 64) == {"q": [(0, 0, 2048)], "k": [(1, 0, 1024)], "v": [(1, 0, 1024)]}
    assert obq.row_shares({"g": (3072, 1024), "u": (3072, 1024)}, 2, 64) == {"g": [(0, 0, 3072)],
                                                                                "u": [(1, 0, 3072)]}
    cut = obq.row_shares({"g": (3072, 1024), "u": (3072, 1024)}, 8, 64)
    assert cut["g"] == cut["u"] == [(r, 384 * r, 384 * (r + 1)) for r in range(8)]
    assert obq.row_shares({"down": (1024, 3072)}, 3, 64) == {"down": [(0, 0, 320), (1, 320, 640), (2, 640, 1024)]}
    assert obq.row_shares({"o": (130, 64)}, 4, 64) == {"o": [(1, 0, 64), (2, 64, 128), (3, 128, 130)]}
    assert obq.row_shares({"o": (64, 64)}, 2, 64) == {"o": [(0, 0, 64)]}


def test_shares_of_rows_join_into_the_whole_layer():
    w, bias = torch.randn(130, 64), torch.randn(130)
    g_idx = torch.arange(64).flip(0) // 16                        # a column permutation: the same in each share
    make = lambda a, b: gptq.to_runtime(*gptq.gptq_quantize(w[a:b], torch.eye(64), 4, 16)[:3], g_idx, 16,
                                        bias=bias[a:b])                                           # noqa: E731
    whole, joined = make(0, 130), AffineQuantLinear.joined([make(0, 64), make(64, 130)])
    assert joined.out_features == 130 and all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(),
                                                                                joined.state_dict().values()))
    other = gptq.to_runtime(*gptq.gptq_quantize(w[64:], torch.eye(64), 4, 16)[:3], torch.arange(64) // 16, 16)
    with pytest.raises(ValueError, match="AffineQuantLinear.perm differs between shares of rows, but is not per row"):
        AffineQuantLinear.joined([make(0, 64), other])


def test_shares_are_contiguous_and_cover_every_batch():
    for batches in (1, 3, 8, 13, 40):
        for world in (1, 2, 3, 4, 8):
            shares = [distributed.share(batches, r, world) for r in range(world)]
            covered = [b for s in shares for b in s]
            assert covered == list(range(batches)), (batches, world)
    with pytest.raises(ValueError, match="at most 8 ranks"):
        distributed.check_world(9, data_aware=True)
    distributed.check_world(9, data_aware=False)


@pytest.mark.slow
@pytest.mark.parametrize("method, options", [("fp8", ("--option", "block=32")),
                                             ("gptq", ("--group-size", "32")),
                                             ("awq", ("--group-size", "32")),
                                             ("trellis", ("--option", "ldlq=true", "--option", "L=6",
                                                          "--option", "group=64")),
                                             ("entquant", ("--bpw", "3.0", "--option", "feedback=calibration"))])
def test_two_ranks_write_the_bytes_of_one_process(tmp_path, source, method, options):
    common = ("--model", str(source), "--method", method, *options, *CALIB)
    two_ranks_write_what_one_process_writes(tmp_path, common)


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    """A Qwen3-MoE (8 experts, top 2, one dense layer) with the byte tokenizer: the ranks' calibration shares route
    different tokens to each expert, and an expert some rank never sees."""
    torch.manual_seed(2)
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=(1,))
    folder = tmp_path_factory.mktemp("src") / "sparse"
    save_dense(Qwen3(cfg).eval(), folder, side_files=lambda f: write_tokenizer_files(byte_tokenizer(), f))
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_two_ranks_write_the_bytes_of_one_process_for_a_sparse_model(tmp_path, sparse, method):
    """Each expert's statistics fold over the ranks like any linear's, its token count included (the config
    records it): the same experts starved (here those under 100 of the 768 tokens' 2 picks), the same bytes."""
    common = ("--model", str(sparse), "--method", method, "--group-size", "32", "--option", "expert_min_tokens=100",
              *CALIB)
    two_ranks_write_what_one_process_writes(tmp_path, common)
    config = json.loads((tmp_path / "two" / "config.json").read_text())["quantization_config"]
    assert any(config["experts_rounded"]) and sum(map(sum, filter(None, config["expert_tokens"]))) > 0


@pytest.mark.slow
@pytest.mark.parametrize("options, out", [(("--group-size", "32"), "q"),
                                          (("--target", "llama.cpp", "--option", "ggml_type=Q4_0"), "q.gguf")])
def test_linears_cut_over_two_ranks_write_the_bytes_of_one_process(tmp_path, wide, options, out):
    """o_proj and down_proj are cut into two shares of 64 rows (the plan above): plain GPTQ and GPTQ on GGML
    blocks."""
    common = ("--model", str(wide), "--method", "gptq", *options, *CALIB)
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = quantize(*common, "--out", str(tmp_path / "one" / out))
    assert one.returncode == 0, one.stderr
    two = quantize(*common, "--out", str(tmp_path / "two" / out), ranks=2)
    assert two.returncode == 0, two.stderr
    written = lambda run: files(run / out) if (run / out).is_dir() else (run / out).read_bytes()   # noqa: E731
    assert written(tmp_path / "two") == written(tmp_path / "one")


@pytest.mark.slow
def test_a_rank_without_a_calibration_batch_only_takes_part(tmp_path, source):
    """8 samples are one batch of 8: rank 1's share is empty; it adds nothing and still joins every exchange."""
    common = ("--model", str(source), "--method", "gptq", "--group-size", "32", "--calib-samples", "8",
              "--calib-len", "32")
    one = quantize(*common, "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    two = quantize(*common, "--out", str(tmp_path / "two"), ranks=2)
    assert two.returncode == 0, two.stderr
    assert files(tmp_path / "two") == files(tmp_path / "one")


def test_a_rank_loads_what_it_receives_weights_only(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("kept")
    planted = distributed._packed({"layer": Planted(victim)})
    remove = f"{os.remove.__module__}\\.remove"                        # posix.remove on Linux
    with pytest.raises(ValueError, match=rf"^{remove}: a rank accepts only tensors, plain containers, paths and "
                       r"the engine's quantized layers$"):
        distributed._unpacked(planted)
    assert victim.read_text() == "kept"
    with pytest.raises(distributed.RankLost, match=rf"^rank 0: refused what rank 1 sent while sharing x \({remove}"):
        distributed.Group(0, 2, 60)._received(planted, 1, "sharing x")
    # what ranks do exchange still comes through: a quantized layer, a path, plain containers of tensors
    layer = AffineQuantLinear.from_weight(torch.randn(8, 32), group_size=16)
    back, path, parts = distributed._unpacked(distributed._packed((layer, tmp_path, [3, torch.ones(2), None])))
    assert type(back) is AffineQuantLinear and torch.equal(back.dequantize(), layer.dequantize())
    assert path == tmp_path and parts[0] == 3 and torch.equal(parts[1], torch.ones(2))


@pytest.mark.slow
def test_a_killed_rank_ends_the_other_with_one_line_and_the_rerun_finishes_the_same(tmp_path, source):
    common = ("--model", str(source), "--method", "gptq", "--group-size", "32", *CALIB)
    one = quantize(*common, "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    port, out = free_port(), tmp_path / "two"
    # the ranks started by hand (as torchrun would: WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT), so that one can be
    # killed and the other's own stderr read; the kill lands while layers 2-5 (about 0.1 s each) are to go
    env = {**ONE_THREAD, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "ENGINE_DIST_TIMEOUT": "60"}
    command = [sys.executable, str(ROOT / "run.py"), "quantize", *common, "--out", str(out)]
    ranks = [subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    progress = tmp_path / ".two.partial" / "progress.json"
    deadline = time.time() + 300
    while time.time() < deadline and not (progress.exists() and '"done": 1' in progress.read_text()):
        assert ranks[0].poll() is None, ranks[0].communicate()
        time.sleep(0.01)
    os.kill(ranks[1].pid, signal.SIGKILL)
    _, err = ranks[0].communicate(timeout=120)
    ranks[1].wait()
    lines = err.strip().splitlines()
    assert ranks[0].returncode == 1 and lines[-1].startswith("error: rank 0: lost rank 1 while"), err
    assert "run the same command again to resume" in lines[-1]
    assert not out.exists()
    again = quantize(*common, "--out", str(out), ranks=2)
    assert again.returncode == 0, again.stderr
    assert "resuming" in again.stderr
    assert files(out) == files(tmp_path / "one")


@pytest.mark.slow
def test_under_torchrun_a_killed_rank_ends_the_other_with_one_line(tmp_path, source):
    """torchrun stops the other ranks (SIGTERM) as soon as one dies, mostly before their next exchange notices:
    rank 0 still ends with the engine's one line, and the same command resumes."""
    common = ("--model", str(source), "--method", "gptq", "--group-size", "32", *CALIB)
    one = quantize(*common, "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    out, progress = tmp_path / "two", tmp_path / ".two.partial" / "progress.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), str(ROOT / "run.py"), "quantize", *common, "--out", str(out)]
    launcher = subprocess.Popen(command, cwd=ROOT, env=ONE_THREAD, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not (progress.exists() and '"done": 1' in progress.read_text()):
        assert launcher.poll() is None, launcher.communicate()
        time.sleep(0.01)
    os.kill(rank_pid(launcher.pid, 1), signal.SIGKILL)
    _, err = launcher.communicate(timeout=120)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert launcher.returncode != 0 and len(errors) == 1 and errors[0].startswith("error: rank 0: "), err
    assert errors[0].endswith("run the same command again to resume"), errors
    again = quantize(*common, "--out", str(out), ranks=2)
    assert again.returncode == 0, again.stderr
    assert "resuming" in again.stderr
    assert files(out) == files(tmp_path / "one")


@pytest.mark.slow
def test_a_group_that_cannot_form_is_one_error_line_after_the_timeout(tmp_path, source):
    env = {**ONE_THREAD, "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "ENGINE_DIST_TIMEOUT": "3"}
    alone = quantize("--model", str(source), "--method", "fp8", "--out", str(tmp_path / "q"), env=env)
    lines = alone.stderr.strip().splitlines()
    assert alone.returncode == 1 and len(lines) == 1, alone.stderr
    assert lines[0].startswith("error: rank 0: the group of 2 ranks did not form within 3 s at 127.0.0.1:"), lines
    assert not (tmp_path / "q").exists()


def test_what_runs_in_one_process_only_is_refused_before_the_group_forms(tmp_path, source):
    env = {**ONE_THREAD, "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    mix = quantize("--model", str(source), "--method", "gptq", "--target", "llama.cpp", "--bpw", "5.0",
                   "--out", str(tmp_path / "q.gguf"), env=env)
    assert mix.returncode == 1 and mix.stderr.strip() == ("error: --bpw 5.0: GPTQ's mix is planned by one process; "
                                                          "run it without torchrun"), mix.stderr
    tiny = quantize("--method", "fp8", "--out", str(tmp_path / "t"), env=env)
    assert tiny.returncode == 1 and tiny.stderr.strip().startswith("error: torchrun: several processes quantize a "
                                                                   "model from disk"), tiny.stderr
    assert not (tmp_path / "q.gguf").exists() and not (tmp_path / "t").exists()


def test_a_malformed_launch_environment_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match=r"RANK=2 of WORLD_SIZE=2, ENGINE_DIST_TIMEOUT=1800: a rank is 0 \.\. "):
        distributed.Group.from_env()
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ValueError, match="RANK='one' is not a whole number"):
        distributed.Group.from_env()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert distributed.Group.from_env() is None and not distributed.launched()
