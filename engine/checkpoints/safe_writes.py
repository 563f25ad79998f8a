"""Writing a checkpoint folder so that a kill at any instant leaves the complete old or the complete new one.

`atomic_directory(DIR)` builds a checkpoint in a sibling temporary folder; once every file and the folder are
fsynced it swaps the folder into place with one atomic rename-exchange (Linux renameat2), and the old one is then
removed. Where the exchange is unavailable, two renames and a journal are used, and `recover_interrupted_swap` (run
before every load and save) finishes or undoes a swap that was cut short. DIR is only replaced when it is empty or an
engine checkpoint (force=True overrides): a user's other files are never deleted. Leftovers of killed runs are
removed by the next save to the same place. A long conversion builds in `resumable_directory(DIR)` instead, which a
re-run finds again, and commits it with `commit_directory`. Single files: safetensors_io.atomic_file.
"""
import contextlib
import ctypes
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from .safetensors_io import WRITER, checkpoint_files, current_umask, read_header


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_engine_checkpoint(directory):
    """A folder the engine wrote: config.json and safetensors files whose metadata names the engine as writer."""
    directory = Path(directory)
    try:
        files = checkpoint_files(directory)
        return (directory / "config.json").is_file() and all(
            read_header(f)[1].get("engine.writer") == WRITER for f in files)
    except ValueError:
        return False


def check_output(directory, force=False, override="force=True"):
    """ValueError unless `directory` may be written: absent, an empty folder, or an engine checkpoint (which a new
    save replaces). force=True allows replacing any folder; a file is never replaced. override: how the refusal
    names that permission to its reader (the CLI's "--force")."""
    directory = Path(directory)
    if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
        raise ValueError(f"output {directory} exists and is not a folder; choose another path")
    if not directory.exists() or force or not any(directory.iterdir()) or is_engine_checkpoint(directory):
        return
    held = sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir())
    raise ValueError(f"output {directory} holds files that are not an engine checkpoint ({', '.join(held[:5])}"
                     f"{' ...' if len(held) > 5 else ''}); choose another folder or pass {override} to replace it")


_libc = ctypes.CDLL(None, use_errno=True)
RENAME_EXCHANGE = 2


def _exchange(a, b):
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where the system cannot."""
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        return False
    if fn(-100, os.fsencode(a), -100, os.fsencode(b), RENAME_EXCHANGE) == 0:        # -100: AT_FDCWD
        return True
    return False


def _journal(directory):
    return directory.parent / f".{directory.name}.swap.json"


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover_interrupted_swap(directory):
    """Finish a fallback swap that a kill cut short (the journal names the complete new folder and the old one), and
    remove leftovers of killed saves to `directory`: temporary folders whose process is gone."""
    directory = Path(directory)
    journal = _journal(directory)
    if journal.exists():
        try:
            names = json.loads(journal.read_text())
            new, old = directory.parent / names["new"], directory.parent / names["old"]
        except (ValueError, KeyError, TypeError):
            names = None                        # cut short while it was written, so before the first rename
        if names is not None and not directory.exists():
            os.replace(new if new.exists() else old, directory)
        journal.unlink()
    for leftover in directory.parent.glob(f".{directory.name}.*.tmp"):
        owner = re.match(rf"\.{re.escape(directory.name)}\.(?:new|old)-(\d+)\.", leftover.name)
        if owner and leftover.is_dir() and not _alive(int(owner.group(1))):
            shutil.rmtree(leftover, ignore_errors=True)


def commit_directory(tmp, directory):
    """Move the finished folder `tmp` (a sibling of `directory`) into place: every file and the folder fsynced, then
    one atomic rename (no old checkpoint), one atomic rename-exchange (the old one is then removed), or, where the
    system has no exchange, two renames with a journal that recover_interrupted_swap finishes after a kill."""
    tmp, directory = Path(tmp), Path(directory)
    for f in tmp.rglob("*"):
        if f.is_file():
            _fsync(f)
    _fsync(tmp)
    if not directory.exists():
        os.replace(tmp, directory)
    elif _exchange(tmp, directory):
        shutil.rmtree(tmp, ignore_errors=True)          # tmp now holds the old checkpoint
    else:
        old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old-{os.getpid()}.", suffix=".tmp",
                                    dir=directory.parent))
        old.rmdir()
        _journal(directory).write_text(json.dumps({"new": tmp.name, "old": old.name}))
        os.replace(directory, old)
        os.replace(tmp, directory)
        _journal(directory).unlink()
        shutil.rmtree(old, ignore_errors=True)
    _fsync(directory.parent)


@contextlib.contextmanager
def atomic_directory(directory, force=False):
    """Write a checkpoint folder atomically: yields a temporary sibling folder to fill; on success it replaces
    `directory` (see the module docstring: crash-safe at every instant); on any error it is deleted and `directory`
    is untouched. Refuses (ValueError, before anything is written) a `directory` that holds other files."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    recover_interrupted_swap(directory)
    check_output(directory, force)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.new-{os.getpid()}.", suffix=".tmp", dir=directory.parent))
    try:
        os.chmod(tmp, 0o777 & ~current_umask())
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit_directory(tmp, directory)


def resumable_directory(directory):
    """The folder a long conversion to `directory` builds in, under a name that a re-run finds again (so it can
    resume), created with the umask's mode: DIR's sibling .DIR.partial."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    partial = directory.parent / f".{directory.name}.partial"
    partial.mkdir(exist_ok=True)
    return partial
