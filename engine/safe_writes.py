"""Writing a checkpoint folder so that a kill at any instant leaves the complete old or the complete new one, and
nothing of the user's is ever replaced.

`atomic_directory(DIR)` builds a checkpoint in a sibling temporary folder; once every file and the folder are
fsynced it swaps the folder into place with one atomic rename-exchange (Linux renameat2), and the old one is then
removed. Where the exchange is unavailable, two renames and a journal are used, and `recover_interrupted_swap` (run
before every load and save) finishes or undoes a swap that was cut short. Leftovers of killed runs are removed by the
next save to the same place. A long conversion builds in `resumable_directory(DIR)` instead, which a re-run finds
again, and commits it with `commit_directory`. A single output file: `output_file` (below).

What may be replaced (`check_output`): a missing or empty folder, or an engine checkpoint that holds nothing but the
files the engine writes (config.json, the safetensors files and their index, the tokenizer files); a folder holding
anything else is refused, naming those files, unless force=True. A file is never replaced by a folder, nor an output
written below a file. `check_apart` refuses an output equal to, inside or containing the model it is made from.

One writer per output: `output_lock(OUT)` holds an OS lock (flock) on the sibling file .OUT.lock, which records the
holder's pid; a second writer is refused at once, naming that pid. The kernel drops the lock when its process dies,
so the lock file a killed run leaves behind is recognized as stale and taken over. A lock file the engine made is a
regular file with one link that holds a pid and a newline, or nothing (a run killed before it wrote its pid); it is
opened without following links, and anything else there (a link, a FIFO, a file of the user's) is refused, never
written, truncated or removed: the user removes it.

Single files (a GGUF file): `output_file(FILE)` writes under the same lock, by the same rule as folders: FILE absent,
or replaced with force=True; the temporary file is renamed into place only if nothing is at FILE at that instant
(renameat2's RENAME_NOREPLACE, or a hard link), so a writer that is not the engine is not overwritten either.

A full disk: `check_free_space` compares an estimate with what shutil.disk_usage reports before anything is
written, and an ENOSPC met anyway becomes one ValueError naming the path and the space needed (`space_error`).
"""
import contextlib
import ctypes
import errno
import fcntl
import json
import os
import re
import shutil
import stat
import sys
import tempfile
from pathlib import Path

from .safetensors_io import INDEX, SINGLE, WRITER, atomic_file, checkpoint_files, current_umask, read_header

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


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


def other_files(directory):
    """The entries of an engine checkpoint folder that the engine does not write there (sorted, folders with a
    trailing /): anything but config.json, the safetensors files its index lists (or model.safetensors) and the
    index, and the tokenizer files."""
    directory = Path(directory)
    ours = {"config.json", INDEX, SINGLE, *TOKENIZER_FILES, *(f.name for f in checkpoint_files(directory))}
    return sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir()
                  if p.name not in ours or p.is_dir() or p.is_symlink())


def _listing(names):
    return f"{', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"


def check_parents(path):
    """ValueError if a folder above output `path` is a file (nothing can be written below it)."""
    for parent in path.parents:
        if parent.is_symlink() or parent.exists():
            if not parent.is_dir():
                raise ValueError(f"output {path}: {parent} is a file, not a folder; choose another path")
            return


def check_output(directory, force=False, override="force=True"):
    """ValueError unless `directory` may be written: absent, an empty folder, or an engine checkpoint holding only
    the engine's files (which a new save replaces). force=True allows replacing any folder; a file is never
    replaced, and nothing is written below a file. override: how the refusal names that permission to its reader
    (the CLI's "--force")."""
    directory = Path(directory)
    check_parents(directory)
    if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
        raise ValueError(f"output {directory} exists and is not a folder; choose another path")
    if not directory.exists() or force or not any(directory.iterdir()):
        return
    if is_engine_checkpoint(directory):
        extra = other_files(directory)
        if not extra:
            return
        raise ValueError(f"output {directory} is an engine checkpoint that also holds other files ({_listing(extra)})"
                         f"; replacing it would delete them: move them, choose another folder or pass {override}")
    held = sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir())
    raise ValueError(f"output {directory} holds files that are not an engine checkpoint ({_listing(held)}); choose "
                     f"another folder or pass {override} to replace it")


def check_apart(source, output):
    """ValueError if `output` is the model `source` (a folder or a file), lies inside it or contains it: writing it
    would replace or change the model while it is read, and --force cannot make that safe."""
    src, out = Path(source).resolve(), Path(output).resolve()
    if src == out:
        raise ValueError(f"output {output} is the model it is made from ({source}); choose another path")
    if src in out.parents:
        raise ValueError(f"output {output} lies inside the model it is made from ({source}); choose another path")
    if out in src.parents:
        raise ValueError(f"output {output} contains the model it is made from ({source}): replacing it would delete "
                         "that model; choose another path")


# ---- one writer per output --------------------------------------------------------------------------------------

_HELD = {}                                       # lock file -> [descriptor, depth]: a process re-enters its own lock
LOCK_TEXT = re.compile(rb"(\d{1,7}\n)?")          # a pid (Linux's stay below 2**22) and a newline, or nothing yet


def _lock_file(path):
    path = Path(path).absolute()
    return path.parent / f".{path.name}.lock"


@contextlib.contextmanager
def output_lock(path):
    """Hold the one-writer lock of output `path` (a folder or a file) while the block runs; ValueError at once,
    naming the holder's pid, if another process holds it, or naming the lock file if something not the engine's is
    there. Re-entrant within a process."""
    lock = _lock_file(path)
    key = str(lock)
    if key in _HELD:
        _HELD[key][1] += 1
    else:
        _HELD[key] = [_acquire(lock, path), 1]
    try:
        yield
    finally:
        _HELD[key][1] -= 1
        if not _HELD[key][1]:
            _release(lock, _HELD.pop(key)[0])


def _release(lock, fd):
    try:
        if _same_file(lock, fd):                # not what someone put in its place meanwhile
            os.unlink(lock)                     # before the lock is released: the next writer creates a new file
    finally:
        os.close(fd)


def _open_lock(lock, path, flags=os.O_RDWR | os.O_CREAT):
    """A descriptor of the lock file of output `path`, never through a link (O_NOFOLLOW) and never blocking on a
    FIFO; created (by default) if it is missing."""
    try:
        return os.open(lock, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666 & ~current_umask())
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"{lock} is a symbolic link, and output {path}'s lock goes there (the engine never "
                             "writes through a link): it was left as it is; remove it, or choose another output") \
                from None
        if is_disk_full(e):
            raise space_error(path, None) from None
        raise


def _lock_pid(fd):
    """The pid an open lock file records ("" for none yet), or None if it is not a lock file the engine made."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        return None
    text = os.pread(fd, 9, 0)                   # a byte more than a lock file holds: a longer file does not match
    return text.decode().strip() if LOCK_TEXT.fullmatch(text) else None


def _same_file(lock, fd):
    """Whether the name `lock` still leads to the open file fd (its holder may have removed it, or another put a
    new one there)."""
    try:
        info, held = os.lstat(lock), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (info.st_dev, info.st_ino) == (held.st_dev, held.st_ino)


def _locked_by_another(path):
    """Whether another live process holds the lock of output `path` (read from the pid in its lock file, which is
    removed when a holder releases it: probing the lock itself could make a starting writer fail)."""
    try:
        fd = _open_lock(_lock_file(path), path, os.O_RDONLY)
    except (OSError, ValueError):
        return False
    try:
        pid = _lock_pid(fd)
    finally:
        os.close(fd)
    return bool(pid) and int(pid) != os.getpid() and _alive(int(pid))


def _acquire(lock, path):
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        check_parents(Path(path))
        raise
    while True:
        fd = _open_lock(lock, path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _lock_pid(fd) or "?"
            os.close(fd)
            raise ValueError(f"output {path} is being written by another run (pid {owner}, lock {lock.name}); wait "
                             "for it to finish or choose another output") from None
        if _same_file(lock, fd):                # else its holder removed it as we opened it: lock the new one
            break
        os.close(fd)
    stale = _lock_pid(fd)                       # read under the lock: no engine writes it meanwhile
    if stale is None:
        os.close(fd)
        raise ValueError(f"{lock} is not a lock file the engine made (those hold nothing but a pid), and output "
                         f"{path}'s lock goes there: it was left as it is; remove it, or choose another output")
    if stale:
        print(f"{path}: took over the lock of pid {stale}, a run that ended without releasing it", file=sys.stderr)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as e:
        _release(lock, fd)
        if is_disk_full(e):
            raise space_error(path, None) from None
        raise
    return fd


# ---- disk space -------------------------------------------------------------------------------------------------

def _mb(n):
    return f"{n / 1e6:.1f} MB"


def _free(path):
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def check_free_space(path, needed, kept=None):
    """ValueError (space_error) unless the device that will hold `path` has `needed` more bytes free (plus 1% and
    64 KiB for the index and config.json)."""
    if _free(path) < needed * 1.01 + (64 << 10):
        raise space_error(path, needed, kept)


def is_disk_full(error):
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


def space_error(path, needed, kept=None, ran_out=False):
    """The ValueError for `path` lacking space (ran_out: the disk filled up while it was written): the space still
    needed (None: not known, say for the lock file), and what is left of the work (kept: (folder name, bytes) kept
    for a resume)."""
    if kept:
        left = f"the finished part ({_mb(kept[1])} in {kept[0]}) is kept: free space and run the same command again"
    else:
        left = "the unfinished copy was removed and nothing was replaced" if ran_out else "nothing was written"
    what = "no space left on the device while writing" if ran_out else "not enough space for"
    need = "" if needed is None else f"about {_mb(needed)} more is needed, "
    return ValueError(f"{what} {path}: {need}{_mb(_free(path))} is free; {left}")


def folder_size(folder):
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


_libc = ctypes.CDLL(None, use_errno=True)
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2


def _renameat2(a, b, flags):
    """Linux renameat2(a, b, flags): 0, or the errno of its failure (ENOSYS where the C library lacks it, EINVAL
    where the file system does)."""
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        return errno.ENOSYS
    return 0 if fn(-100, os.fsencode(a), -100, os.fsencode(b), flags) == 0 else ctypes.get_errno()   # AT_FDCWD


def _exchange(a, b):
    """Atomically swap two paths (RENAME_EXCHANGE); False where the system cannot."""
    return _renameat2(a, b, RENAME_EXCHANGE) == 0


def _rename_new(tmp, path):
    """Rename the file `tmp` to `path` only if nothing is at `path` at that instant, in one step (RENAME_NOREPLACE;
    where the system lacks it, a hard link, which fails the same way, then the temporary name removed);
    FileExistsError otherwise."""
    err = _renameat2(tmp, path, RENAME_NOREPLACE)
    if err in (errno.ENOSYS, errno.EINVAL):
        os.link(tmp, path)
        os.unlink(tmp)
    elif err:
        raise OSError(err, os.strerror(err), str(path))


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
    remove leftovers of killed saves to `directory`: temporary folders whose process is gone. Nothing is done while
    another process holds the output's lock (its swap is not cut short: it is under way)."""
    directory = Path(directory)
    if _locked_by_another(directory):
        return
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
def atomic_directory(directory, force=False, needed=None):
    """Write a checkpoint folder atomically: yields a temporary sibling folder to fill; on success it replaces
    `directory` (see the module docstring: crash-safe at every instant); on any error it is deleted and `directory`
    is untouched. Refuses (ValueError, before anything is written) a `directory` that holds other files, that
    another process is writing, or, given the bytes `needed`, on a device without that much space."""
    directory = Path(directory)
    with output_lock(directory):
        recover_interrupted_swap(directory)
        check_output(directory, force)
        if needed is not None:
            check_free_space(directory, needed)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.new-{os.getpid()}.", suffix=".tmp",
                                    dir=directory.parent))
        try:
            os.chmod(tmp, 0o777 & ~current_umask())
            yield tmp
            commit_directory(tmp, directory)
        except BaseException as e:
            written = folder_size(tmp) if is_disk_full(e) else 0
            shutil.rmtree(tmp, ignore_errors=True)
            if is_disk_full(e):
                raise space_error(directory, needed or written, ran_out=True) from None
            raise


def check_output_file(path, force=False, override="force=True"):
    """ValueError unless the file `path` may be written: absent, or replaced with force. A folder is never replaced
    by a file, and nothing is written below a file."""
    path = Path(path)
    check_parents(path)
    if path.is_dir():
        raise ValueError(f"output {path} is a folder, not a file; choose another path")
    if (path.exists() or path.is_symlink()) and not force:
        raise ValueError(f"output {path} exists; choose another path or pass {override}")


@contextlib.contextmanager
def output_file(path, needed, force=False, override="force=True"):
    """`with output_file(path, needed) as f:` write one output file (a GGUF file), binary f open for writing, by the
    rules of atomic_directory: refused (ValueError, before anything is written) while another process writes it,
    where check_output_file refuses or without the bytes `needed` free; written to a temporary sibling, fsynced and
    renamed into place only if nothing is at `path` at that instant (force: replacing it), so two writers never
    both succeed; on any error the temporary file is removed and `path` untouched (a full disk: space_error)."""
    path = Path(path)
    with output_lock(path):
        check_output_file(path, force, override)
        check_free_space(path, needed)
        try:
            with atomic_file(path, commit=None if force else _rename_new) as f:
                yield f
        except FileExistsError:
            raise ValueError(f"output {path} was created by another program while it was written, and kept; choose "
                             f"another path or pass {override}") from None
        except OSError as e:
            if is_disk_full(e):
                raise space_error(path, needed, ran_out=True) from None
            raise


def resumable_directory(directory):
    """The folder a long conversion to `directory` builds in, under a name that a re-run finds again (so it can
    resume), created with the umask's mode: DIR's sibling .DIR.partial."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    partial = directory.parent / f".{directory.name}.partial"
    partial.mkdir(exist_ok=True)
    return partial
