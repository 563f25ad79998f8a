"""What long commands say on stderr: a line, a progress bar, an elapsed time. Imports nothing heavy (run.py's
argument errors and `--help` never wait for torch)."""
import sys


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def bar(iterable=None, **kwargs):
    """A tqdm progress bar on stderr (on a terminal; silent when stderr is a file)."""
    from tqdm import tqdm
    return tqdm(iterable, disable=None, dynamic_ncols=True, **kwargs)


def clock(seconds):
    """Seconds as m:ss, or h:mm:ss from an hour up."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"
