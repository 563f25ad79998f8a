"""Writes that never lose data: an output that holds other files is refused, a save killed at any instant leaves the
complete old or the complete new checkpoint, the next save cleans up, modes follow the umask; one writer per
output (a stale lock taken over, anything else where the lock goes left alone), a single output file never replaces
one that appeared meanwhile, a full disk is one error and changes nothing; a new folder is renamed in only where
its path is still free."""
import contextlib
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from engine.formats.llama_cpp import gguf_writer
from engine.loaders import dense_tensors, load_dense, save_dense
from engine import safe_writes, safetensors_io
from engine.safe_writes import atomic_directory, check_output, is_engine_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def saved(tiny_model, tmp_path):
    save_dense(tiny_model, tmp_path / "ck")
    return tmp_path / "ck"


def test_a_folder_with_other_files_is_refused_and_kept(tiny_model, tmp_path):
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("keep me")
    (mine / "sub" / "a.txt").write_text("and me")
    with pytest.raises(ValueError, match=r"holds files that are not an engine checkpoint \(notes.txt, sub/\)"):
        save_dense(tiny_model, mine)
    assert (mine / "notes.txt").read_text() == "keep me" and (mine / "sub" / "a.txt").read_text() == "and me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]            # no temporary folder left either


def test_a_file_is_never_replaced(tiny_model, tmp_path):
    (tmp_path / "out").write_text("a file")
    for force in (False, True):
        with pytest.raises(ValueError, match="exists and is not a folder"):
            save_dense(tiny_model, tmp_path / "out", force=force)
    assert (tmp_path / "out").read_text() == "a file"


def test_an_engine_checkpoint_is_replaced_and_force_replaces_anything(tiny_model, saved, tmp_path):
    assert is_engine_checkpoint(saved)
    check_output(saved)                                   # an engine checkpoint may be replaced
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.txt").write_text("x")
    save_dense(tiny_model, other, force=True)
    assert is_engine_checkpoint(other) and not (other / "x.txt").exists()


def test_modes_follow_the_umask(saved):
    mask = os.umask(0)
    os.umask(mask)
    assert (saved.stat().st_mode & 0o777) == 0o777 & ~mask
    for f in saved.iterdir():
        assert (f.stat().st_mode & 0o777) == 0o666 & ~mask


def test_interrupted_save_leaves_no_checkpoint(tmp_path):
    target = tmp_path / "ck"
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_directory(target) as tmp:
            (tmp / "config.json").write_text("{}")
            raise RuntimeError("disk full")
    assert not target.exists() and list(tmp_path.iterdir()) == []


def test_interrupted_overwrite_keeps_the_old_checkpoint(saved):
    before = (saved / "model.safetensors").read_bytes()
    with pytest.raises(RuntimeError, match="killed"):
        with atomic_directory(saved) as tmp:
            (tmp / "model.safetensors").write_bytes(b"half")
            raise RuntimeError("killed")
    assert (saved / "model.safetensors").read_bytes() == before


# A child process overwrites the checkpoint and is killed (os._exit) at the n-th call of one of the steps of the
# swap; whatever n, the folder then holds the complete old or the complete new checkpoint, and the next save leaves
# nothing behind. "fallback" disables the atomic rename-exchange to test the journalled two-rename swap.
CHILD = textwrap.dedent("""
    import os, shutil, sys, torch
    from engine import safe_writes
    from engine.loaders import dense_tensors, load_dense, save_dense
    step, n, fallback, target = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
    if fallback:
        safe_writes._exchange = lambda a, b: False
    calls = [0]
    real = {"replace": os.replace, "rmtree": shutil.rmtree, "exchange": safe_writes._exchange}[step]
    def dying(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            os._exit(9)
        return real(*args, **kwargs)
    model = load_dense(target)
    with torch.no_grad():
        model.model.norm.weight.fill_(7.0)                       # the new checkpoint: recognizable
    if step == "replace":
        safe_writes.os.replace = dying
    elif step == "rmtree":
        safe_writes.shutil.rmtree = dying
    else:
        safe_writes._exchange = dying
    save_dense(model, target)
""")


# (swap, step killed just before its n-th call, what the folder must then hold). The exchange swap: killed before
# the exchange -> old; after it, before the old copy is removed -> new. The two-rename fallback (os.replace calls 1
# and 2 write config.json and the weights into the temporary folder, 3 moves the old checkpoint aside, 4 moves the
# new one in): killed before 4 -> the folder is missing until the next load finishes the swap from the journal.
KILLS = [(False, "exchange", 1, "old"), (False, "rmtree", 1, "new"), (True, "replace", 2, "old"),
         (True, "replace", 3, "old"), (True, "replace", 4, "new"), (True, "rmtree", 1, "new")]


@pytest.mark.slow
@pytest.mark.parametrize("fallback, step, n, expected", KILLS)
def test_a_save_killed_at_any_step_of_the_swap_leaves_old_or_new(tiny_model, saved, fallback, step, n, expected):
    old_norm = tiny_model.model.norm.weight.detach().clone()
    child = subprocess.run([sys.executable, "-c", CHILD, step, str(n), str(int(fallback)), str(saved)], cwd=ROOT,
                           capture_output=True, text=True)
    assert child.returncode == 9, child.stderr                          # it was killed where we asked
    norm = load_dense(saved).model.norm.weight                          # complete (this would raise otherwise)
    assert torch.equal(norm, torch.full_like(norm, 7.0) if expected == "new" else old_norm)
    save_dense(tiny_model, saved)                                       # cleans every leftover of the killed run
    assert sorted(p.name for p in saved.parent.iterdir()) == ["ck"]


def test_a_journal_cut_short_while_it_was_written_is_dropped(tiny_model, saved):
    """The fallback swap writes its journal before the first rename: a partial journal means nothing moved yet."""
    (saved.parent / ".ck.swap.json").write_text('{"new": ".ck.new-12')
    assert torch.equal(load_dense(saved).model.norm.weight, tiny_model.model.norm.weight)
    assert sorted(p.name for p in saved.parent.iterdir()) == ["ck"]


def test_leftovers_of_a_live_save_are_not_touched(saved):
    live = saved.parent / f".ck.new-{os.getpid()}.abc.tmp"
    live.mkdir()
    (live / "config.json").write_text(json.dumps({}))
    save_dense(load_dense(saved), saved)
    assert live.exists()                                                # its process (us) is alive


# ---- nothing of the user's replaced, one writer, a full disk ----------------------------------------------------

def test_an_engine_checkpoint_holding_the_users_files_is_refused_and_kept(tiny_model, saved):
    (saved / "notes.txt").write_text("keep me")
    (saved / "mydata").mkdir()
    (saved / "mydata" / "a.bin").write_bytes(b"and me")
    with pytest.raises(ValueError, match=r"engine checkpoint that also holds other files \(mydata/, notes.txt\)"):
        save_dense(tiny_model, saved)
    assert (saved / "notes.txt").read_text() == "keep me" and (saved / "mydata" / "a.bin").read_bytes() == b"and me"
    save_dense(tiny_model, saved, force=True)                           # the user's explicit choice
    assert not (saved / "notes.txt").exists() and load_dense(saved) is not None


def test_nothing_is_written_below_a_file(tiny_model, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"output .*file/sub: .*file is a file, not a folder"):
        save_dense(tiny_model, tmp_path / "file" / "sub")
    assert (tmp_path / "file").read_text() == "x"


HOLDER = textwrap.dedent("""
    import sys, time
    from engine.output_lock import output_lock
    with output_lock(sys.argv[1]):
        print("locked", flush=True)
        time.sleep(60)
""")


@contextlib.contextmanager
def lock_held_by_another_run(path):
    """Another process holding output `path`'s lock while the block runs; yields its pid."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_a_second_writer_is_refused_at_once_naming_the_first(tiny_model, saved):
    before = (saved / "model.safetensors").read_bytes()
    with lock_held_by_another_run(saved) as pid:
        with pytest.raises(ValueError, match=rf"{saved} is being written by another run \(pid {pid}"):
            save_dense(tiny_model, saved)
    assert (saved / "model.safetensors").read_bytes() == before
    save_dense(tiny_model, saved)                       # its lock died with it: taken over, then released
    assert sorted(p.name for p in saved.parent.iterdir()) == ["ck"]


def test_a_stale_lock_of_a_killed_run_is_taken_over_and_said(tiny_model, saved, capfd):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (saved.parent / ".ck.lock").write_text(dead.stdout)                 # as a run killed holding it leaves it
    save_dense(tiny_model, saved)
    assert f"took over the lock of pid {dead.stdout.strip()}" in capfd.readouterr().err
    assert sorted(p.name for p in saved.parent.iterdir()) == ["ck"]


@pytest.mark.parametrize("kind", ["link", "file", "hard link"])
def test_what_is_not_the_engines_lock_file_is_refused_and_left_as_it_is(tiny_model, saved, kind):
    """A lock file is opened without following links and written only if it holds nothing but a pid: `ln -s victim
    .ck.lock` once made `victim` hold the writer's pid, and a file of the user's there was overwritten, then
    deleted."""
    lock, victim = saved.parent / ".ck.lock", saved.parent / "victim"
    victim.write_text("4242\n" if kind == "hard link" else "the user's text")      # a pid's text: a link still
    if kind == "link":
        lock.symlink_to(victim)
    elif kind == "file":
        lock.write_text("the user's notes")
    else:
        os.link(victim, lock)
    before = (saved / "model.safetensors").read_bytes()
    said = "is a symbolic link" if kind == "link" else "is not a lock file the engine made"
    with pytest.raises(ValueError, match=rf"{re.escape(str(lock))} {said}.* left as it is; remove it"):
        save_dense(tiny_model, saved)
    assert victim.read_text() == ("4242\n" if kind == "hard link" else "the user's text")
    assert lock.is_symlink() if kind == "link" else lock.read_text() == ("the user's notes" if kind == "file" else
                                                                         "4242\n")
    assert (saved / "model.safetensors").read_bytes() == before


def test_a_fifo_where_the_lock_goes_blocks_neither_a_load_nor_a_save(tiny_model, saved):
    """A load reads the lock's pid (is a swap under way?): opening a FIFO to read it waited for a writer forever."""
    os.mkfifo(saved.parent / ".ck.lock")

    class Hung(Exception):                                 # not an OSError, which a reader might take in its stride
        pass

    def hung(signum, frame):
        raise Hung("blocked on the FIFO")
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    try:
        assert torch.equal(load_dense(saved).model.norm.weight, tiny_model.model.norm.weight)
        with pytest.raises(ValueError, match="is not a lock file the engine made"):
            save_dense(tiny_model, saved)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_save_that_cannot_fit_is_refused_before_writing(tiny_model, saved, monkeypatch):
    before = (saved / "model.safetensors").read_bytes()
    monkeypatch.setattr(safe_writes.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 4096))
    size = f"{sum(t.numel() * t.element_size() for t in dense_tensors(tiny_model).values()) / 1e6:.1f} MB"
    with pytest.raises(ValueError, match=rf"not enough space for {saved}: about {size} more is needed, 0.0 MB is "
                                         "free; nothing was written"):
        save_dense(tiny_model, saved)
    assert (saved / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in saved.parent.iterdir()) == ["ck"]


@pytest.mark.parametrize("where", ["write-back", "safetensors"])
def test_a_disk_that_fills_up_during_a_save_is_one_error_and_nothing_changes(tiny_model, saved, monkeypatch, where):
    before = (saved / "model.safetensors").read_bytes()

    def full(*args, **kwargs):
        if where == "write-back":                          # as a write-back to a full device reports it
            raise OSError(errno.ENOSPC, "No space left on device")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(*(os, "fsync") if where == "write-back" else (safetensors_io, "library_save_file"), full)
    size = f"{sum(t.numel() * t.element_size() for t in dense_tensors(tiny_model).values()) / 1e6:.1f} MB"
    with pytest.raises(ValueError, match=rf"no space left on the device while writing {saved}: about {size} more is "
                                         "needed, .* the unfinished copy was removed and nothing was replaced"):
        save_dense(tiny_model, saved)
    monkeypatch.undo()
    assert (saved / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in saved.parent.iterdir()) == ["ck"]


@pytest.mark.parametrize("rename", ["renameat2", "hard link"])
def test_a_file_another_program_writes_meanwhile_is_never_replaced(tiny_model, tmp_path, monkeypatch, rename):
    """A single output file (GGUF) is renamed into place only if its path is still free at that instant: two runs
    that both found it absent once both said `wrote`, the later one replacing the other's file."""
    path, real = tmp_path / "m.gguf", os.fsync
    if rename == "hard link":                              # a system or file system without RENAME_NOREPLACE
        monkeypatch.setattr(safe_writes, "_renameat2", lambda a, b, flags: errno.ENOSYS)

    def theirs(fd):                                        # after the check, before the rename
        if not path.exists():
            path.write_bytes(b"theirs")
        real(fd)
    monkeypatch.setattr(os, "fsync", theirs)
    with pytest.raises(ValueError, match=rf"output {re.escape(str(path))} was created by another program while it "
                                         "was written, and kept; choose another path or pass force=True"):
        gguf_writer.write_gguf(tiny_model, path)
    assert path.read_bytes() == b"theirs" and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
    gguf_writer.write_gguf(tiny_model, path, force=True)   # the user's explicit choice
    assert path.read_bytes()[:4] == b"GGUF" and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_a_second_writer_of_a_file_is_refused_at_once(tiny_model, tmp_path):
    path = tmp_path / "m.gguf"
    with lock_held_by_another_run(path) as pid:
        with pytest.raises(ValueError, match=rf"{path} is being written by another run \(pid {pid}"):
            gguf_writer.write_gguf(tiny_model, path)
    assert not path.exists()


# ---- a new folder: one rename, no lock ---------------------------------------------------------------------------

@pytest.mark.parametrize("rename", ["renameat2", "plain rename"])
def test_a_folder_another_program_creates_while_a_new_checkpoint_is_written_is_kept(tiny_model, tmp_path,
                                                                                     monkeypatch, rename):
    """Where nothing was, the checkpoint is renamed in only if its path is still free: a folder another program put
    there while it was written was once taken for an old checkpoint, swapped out and deleted."""
    target, real = tmp_path / "ck", os.fsync
    if rename == "plain rename":                           # a system or file system without RENAME_NOREPLACE
        monkeypatch.setattr(safe_writes, "_renameat2", lambda a, b, flags: errno.ENOSYS)

    def theirs(fd):                                        # after the checks, before the rename
        if not target.exists():
            target.mkdir()
            (target / "notes.txt").write_text("theirs")
        real(fd)
    monkeypatch.setattr(os, "fsync", theirs)
    with pytest.raises(ValueError, match=rf"output {re.escape(str(target))} was created by another program while "
                                         "it was written, and kept"):
        save_dense(tiny_model, target)
    assert (target / "notes.txt").read_text() == "theirs" and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_a_new_folder_another_run_holds_the_lock_of_is_refused_at_once(tiny_model, tmp_path):
    """The short way (no lock) is only for a folder with nothing beside it: a run holding its lock is waited for."""
    target = tmp_path / "new"
    with lock_held_by_another_run(target) as pid:
        with pytest.raises(ValueError, match=rf"{target} is being written by another run \(pid {pid}"):
            save_dense(tiny_model, target)
    assert not target.exists()


@pytest.mark.parametrize("name", ["ck", "ck[1]"])                       # a name glob would read as a pattern
def test_leftovers_of_a_killed_save_to_a_new_folder_are_removed_by_the_next(tiny_model, tmp_path, name):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / f".{name}.new-{dead.stdout.strip()}.abc.tmp").mkdir()
    save_dense(tiny_model, tmp_path / name)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name] and load_dense(tmp_path / name) is not None
