"""Writing a checkpoint folder so that a kill at any instant leaves the complete old or the complete new one, and
nothing of the user's is ever replaced.

`atomic_directory(DIR)` builds a checkpoint in a sibling temporary folder; once every file and the folder are
fsynced it moves the folder into place. Where nothing was, that is one rename that refuses whatever another program
put at DIR meanwhile (renameat2's RENAME_NOREPLACE), and nothing more is needed: no lock, nothing to recover. Over an
old checkpoint, it is one atomic rename-exchange (Linux renameat2), and the old one is then removed; where the
exchange is unavailable, two renames and a journal are used, and `recover_interrupted_swap` (run before every load
and save) finishes or undoes a swap that was cut short. Leftovers of killed runs are removed by the
next save to the same place. A long conversion builds in `resumable_directory(DIR)` instead, which a re-run finds
again, and commits it with `commit_directory`. A single output file: `output_file` (below).

What may be replaced (`check_output`): a missing or empty folder, or an engine checkpoint that holds nothing but the
files the engine writes (config.json, the safetensors files and their index, the tokenizer files); a folder holding
anything else is refused, naming those files, unless force=True. A file is never replaced by a folder, nor an output
written below a file. `check_apart` refuses an output equal to, inside or containing the model it is made from.

One writer per output: engine/output_lock.py.

Single files (a GGUF file): `output_file(FILE)` writes under the same lock, by the same rule as folders: FILE absent,
or replaced with force=True; the temporary file is renamed into place only if nothing is at FILE at that instant
(renameat2's RENAME_NOREPLACE, or a hard link), so a writer that is not the engine is not overwritten either.

A full disk: `check_free_space` compares an estimate with what shutil.disk_usage reports before anything is
written, and an ENOSPC met anyway becomes one ValueError naming the path and the space needed (`space_error`).
"""
import contextlib
import ctypes
import errno
import glob
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from .output_lock import alive, locked_by_another, output_lock
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
    if directory.exists() or directory.is_symlink():
        _check_replaceable(directory, force, override)


def _check_replaceable(directory, force, override):
    if directory.is_symlink() or not directory.is_dir():
        raise ValueError(f"output {directory} exists and is not a folder; choose another path")
    if force or not any(directory.iterdir()):
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
    """Rename `tmp` (a file or a folder) to `path` only if nothing is at `path` at that instant, in one step
    (RENAME_NOREPLACE; where the system lacks it, a file is hard-linked, which fails the same way, then its temporary
    name removed, and a folder renamed, which fails on anything but an empty folder); FileExistsError otherwise."""
    err = _renameat2(tmp, path, RENAME_NOREPLACE)
    if err in (errno.ENOSYS, errno.EINVAL):
        if Path(tmp).is_dir():
            try:
                os.rename(tmp, path)
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path)) from None
                raise
        else:
            os.link(tmp, path)
            os.unlink(tmp)
    elif err:
        raise OSError(err, os.strerror(err), str(path))      # EEXIST: a FileExistsError


def _journal(directory):
    return directory.parent / f".{directory.name}.swap.json"


def recover_interrupted_swap(directory):
    """Finish a fallback swap that a kill cut short (the journal names the complete new folder and the old one), and
    remove leftovers of killed saves to `directory`: temporary folders whose process is gone. Nothing is done while
    another process holds the output's lock (its swap is not cut short: it is under way)."""
    directory = Path(directory)
    if locked_by_another(directory):
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
    for leftover in directory.parent.glob(f".{glob.escape(directory.name)}.*.tmp"):
        owner = re.match(rf"\.{re.escape(directory.name)}\.(?:new|old)-(\d+)\.", leftover.name)
        if owner and leftover.is_dir() and not alive(int(owner.group(1))):
            shutil.rmtree(leftover, ignore_errors=True)


def _fsync_tree(folder):
    for f in folder.rglob("*"):
        if f.is_file():
            _fsync(f)
    _fsync(folder)


def _commit_new(tmp, directory):
    """Move the finished folder `tmp` to `directory`, where nothing was, fsynced first: one rename that refuses
    (ValueError, keeping it) anything another program put there while the checkpoint was written."""
    _fsync_tree(tmp)
    try:
        _rename_new(tmp, directory)
    except FileExistsError:
        raise ValueError(f"output {directory} was created by another program while it was written, and kept; choose "
                         "another path") from None
    _fsync(directory.parent)


def commit_directory(tmp, directory):
    """Move the finished folder `tmp` (a sibling of `directory`) into place: every file and the folder fsynced, then
    one atomic rename (no old checkpoint: _commit_new), one atomic rename-exchange (the old one is then removed), or,
    where the system has no exchange, two renames with a journal that recover_interrupted_swap finishes after a
    kill."""
    tmp, directory = Path(tmp), Path(directory)
    if not (directory.exists() or directory.is_symlink()):
        return _commit_new(tmp, directory)
    _fsync_tree(tmp)
    if _exchange(tmp, directory):
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


def _untouched(directory):
    """Nothing at `directory`, nor beside it of another write to it: no lock (a writer at work), no swap journal, no
    temporary folder (a write cut short). A save there needs neither the lock nor a recovery: its one rename
    (_commit_new) refuses whatever appears there meanwhile."""
    return not (directory.exists() or directory.is_symlink() or
                any(directory.parent.glob(f".{glob.escape(directory.name)}.*")))


@contextlib.contextmanager
def atomic_directory(directory, force=False, needed=None):
    """Write a checkpoint folder atomically: yields a temporary sibling folder to fill; on success it replaces
    `directory` (see the module docstring: crash-safe at every instant); on any error it is deleted and `directory`
    is untouched. Refuses (ValueError, before anything is written) a `directory` that holds other files, that
    another process is writing, or, given the bytes `needed`, on a device without that much space. A new folder
    (_untouched) takes the short way: written and renamed into place, with no lock to take and nothing to recover."""
    directory = Path(directory)
    if _untouched(directory):
        check_parents(directory)
        with _staging(directory, needed, _commit_new) as tmp:
            yield tmp
        return
    with output_lock(directory):
        recover_interrupted_swap(directory)
        check_output(directory, force)
        with _staging(directory, needed, commit_directory) as tmp:
            yield tmp


@contextlib.contextmanager
def _staging(directory, needed, commit):
    """The temporary sibling folder a checkpoint is written in, moved into place by commit(tmp, directory), removed
    on any error (a full disk: space_error)."""
    if needed is not None:
        check_free_space(directory, needed)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.new-{os.getpid()}.", suffix=".tmp", dir=directory.parent))
    try:
        os.chmod(tmp, 0o777 & ~current_umask())
        yield tmp
        commit(tmp, directory)
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
