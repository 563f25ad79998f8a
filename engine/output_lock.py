"""One writer per output. `output_lock(OUT)` holds an OS lock (flock) on the sibling file .OUT.lock, which records the
holder's pid; a second writer is refused at once, naming that pid. The kernel drops the lock when its process dies,
so the lock file a killed run leaves behind is recognized as stale and taken over. A lock file the engine made is a
regular file with one link that holds a pid and a newline, or nothing (a run killed before it wrote its pid); it is
opened without following links, and anything else there (a link, a FIFO, a file of the user's) is refused, never
written, truncated or removed: the user removes it.
"""
import contextlib
import errno
import fcntl
import os
import re
import stat
import sys
from pathlib import Path

from .safetensors_io import current_umask

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
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _no_space(lock, path) from None
        raise


def _no_space(lock, path):
    return ValueError(f"no space left on the device for {lock}, output {path}'s lock; nothing was written")


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


def locked_by_another(path):
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
    return bool(pid) and int(pid) != os.getpid() and alive(int(pid))


def _acquire(lock, path):
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        above = next((p for p in lock.parents if p.exists() or p.is_symlink()), lock.parent)
        raise ValueError(f"output {path}: {above} is a file, not a folder; choose another path") from None
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
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _no_space(lock, path) from None
        raise
    return fd


def alive(pid):
    """Whether process `pid` lives (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
