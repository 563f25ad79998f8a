"""Quantizing with several processes (torchrun, torch.distributed): the group, and the few exchanges the converter
needs, each exact and each naming the rank it lost when one dies.

    torchrun --nproc-per-node N [--nnodes K --rdzv-endpoint HOST:PORT] run.py quantize --model SRC --method M --out DIR

Data-free methods split the decoder layers: rank r quantizes layers r, r + N, r + 2N, ... and sends each one's
tensors to rank 0. Data-aware methods split the calibration: each rank runs its contiguous share of the batches
through every layer; each linear's input statistics (GPTQ's Hessian) are summed over the ranks, and each step's
linears are shared out by numerics/obq.py's `row_shares`: whole linears to ranks where that balances, and for error
feedback (GPTQ, on llama.cpp's grids too, BlockLDLQ, EntQuant's feedback) a linear too long for one rank cut into
shares of output rows (rows are independent given H: each rank runs the feedback on its rows with the factor made
from the same H bytes, numerics/obq.py's products in fixed blocks of rows keep the bytes). Every rank gets every
result, so every rank continues from the same quantized layer.

Byte-identical to one process. A float64 sum depends on its order, so the statistics are always summed the same way,
whatever the number of ranks: the batches are cut into SLOTS contiguous slots, each slot summed from zero in batch
order, and the slot sums folded left to right (one process: as it goes; ranks: each holds its slots' sums until the
running total of the slots before them arrives from the rank before, adds them and passes it on; the last rank
sends every rank the total, divided and in float32: half the bytes; only the upper triangle of the symmetric X^T X
moves, half again). Rank 0 is the only one that writes (so no shared file system is needed): the lock, the
progress record, every shard, the index and the provenance, in the same order as one process.

A rank that dies (or a group that cannot form within the timeout) ends every other rank with one error line naming
the rank lost; the progress record keeps every layer written, and the same command resumes. torchrun itself stops
every rank (SIGTERM) as soon as one has died: a rank stopped so ends with one error line too.

Trust: c10d and gloo do not authenticate, so whatever reaches the rendezvous port while the group forms can join as
a rank. What a rank receives is loaded weights_only (tensors, plain containers, paths and the engine's quantized
layers, rebuilt without running any code they name): a rank that sends anything else is refused, with one line.
"""
import datetime
import os
import signal
import sys

TIMEOUT = 1800             # seconds a rank waits for another before giving up (ENGINE_DIST_TIMEOUT overrides it)


def launched():
    """Whether this process is one of several (torchrun sets WORLD_SIZE)."""
    return _env_int("WORLD_SIZE", 1) > 1


class RankLost(RuntimeError):
    """An exchange with another rank failed (it died, the group timed out, or it sent what is refused)."""


class Follower(Exception):
    """This rank stops because rank 0 refused the conversion (rank 0 prints why)."""


class Group:
    """This process's place in a torch.distributed group: rank, world (the number of ranks)."""

    def __init__(self, rank, world, timeout):
        self.rank, self.world, self.timeout = rank, world, timeout
        self.bytes = 0                                  # bytes this rank sent and received
        self.ending = False                             # this rank is on its way out, its own line to print

    @classmethod
    def from_env(cls):
        """The group torchrun (or the environment variables WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT) describes,
        joined with the gloo backend; None for one process."""
        world = _env_int("WORLD_SIZE", 1)
        if world <= 1:
            return None
        rank, timeout = _env_int("RANK", 0), _env_int("ENGINE_DIST_TIMEOUT", TIMEOUT)
        if not 0 <= rank < world or timeout < 1:
            raise ValueError(f"RANK={rank} of WORLD_SIZE={world}, ENGINE_DIST_TIMEOUT={timeout}: a rank is 0 .. "
                             "WORLD_SIZE - 1 and the timeout at least 1 second")
        import torch.distributed as dist
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout))
        except Exception as e:                          # noqa: BLE001 (torch raises several kinds)
            raise RankLost(f"rank {rank}: the group of {world} ranks did not form within {timeout} s at "
                           f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} "
                           f"({str(e).splitlines()[0][:160]})") from None
        group = cls(rank, world, timeout)
        signal.signal(signal.SIGTERM, group._stopped)
        return group

    @property
    def first(self):
        return self.rank == 0

    def _stopped(self, signum, frame):
        """SIGTERM: torchrun ends every rank this way once one has died, often before this rank's next exchange
        would have noticed. The rank prints its one line and leaves at once, as the kill would have ended it (what is
        written is the progress record's, so the same command resumes; the lock goes with the process). Not an
        exception: raised inside torch's C code one can come out as another error. Ignored once this rank is ending
        anyway (its own error on the way, or the group closed)."""
        if self.ending:
            return
        self.ending = True
        sys.stderr.write(f"error: rank {self.rank}: stopped by SIGTERM, which torchrun sends every rank when one has "
                         "failed (its report names that rank); run the same command again to resume\n")
        sys.stderr.flush()
        os._exit(1)

    def _lost(self, peer, what, e):
        self.ending = True
        return RankLost(f"rank {self.rank}: lost rank {peer} while {what} (it died, or did not answer within "
                        f"{self.timeout} s): {str(e).splitlines()[0][:160]}; run the same command again to resume")

    def _received(self, data, peer, what):
        """uint8 [n] from rank `peer` -> the object it packed (_unpacked); RankLost naming the rank if refused."""
        try:
            return _unpacked(data)
        except ValueError as e:
            self.ending = True
            raise RankLost(f"rank {self.rank}: refused what rank {peer} sent while {what} ({e})") from None

    def broadcast(self, obj, src, what="exchanging results"):
        """obj from rank src to every rank (tensors, plain containers, paths, the engine's quantized layers);
        returns it on every rank."""
        import torch.distributed as dist
        try:
            data = _packed(obj) if self.rank == src else None
            size = _size(0 if data is None else data.numel())
            dist.broadcast(size, src=src)
            if data is None:
                data = _buffer(int(size))
            dist.broadcast(data, src=src)
        except RuntimeError as e:
            raise self._lost(src, what, e) from None
        self.bytes += int(size) * (self.world - 1 if self.rank == src else 1)
        return obj if self.rank == src else self._received(data, src, what)

    def send(self, obj, dst, what="sending results"):
        import torch.distributed as dist
        data = _packed(obj)
        try:
            dist.send(_size(data.numel()), dst=dst)
            dist.send(data, dst=dst)
        except RuntimeError as e:
            raise self._lost(dst, what, e) from None
        self.bytes += data.numel()

    def receive(self, src, what="receiving results"):
        import torch.distributed as dist
        try:
            size = _size(0)
            dist.recv(size, src=src)
            data = _buffer(int(size))
            dist.recv(data, src=src)
        except RuntimeError as e:
            raise self._lost(src, what, e) from None
        self.bytes += data.numel()
        return self._received(data, src, what)

    def fold(self, parts, add, finish=lambda total: total, what="summing calibration statistics"):
        """parts: this rank's slot sums, in slot order -> finish(the left fold of every rank's slot sums in rank
        order), on every rank (add(total, part) -> total; total starts as the first part; None if no rank has one).
        A reduction, not an all-gather: each rank sends one running total to the next, and the last rank sends
        every rank the finished total (InputStats: float32, half the float64 sums' bytes)."""
        total = None if self.rank == 0 else self.receive(self.rank - 1, what)
        for part in parts:
            total = part if total is None else add(total, part)
        if self.rank + 1 < self.world:
            self.send(total, self.rank + 1, what)
            return self.broadcast(None, self.world - 1, what)
        return self.broadcast(None if total is None else finish(total), self.world - 1, what)

    def close(self):
        """Leave the group: this rank's last step (a SIGTERM from now on is ignored)."""
        import torch.distributed as dist
        self.ending = True
        if dist.is_initialized():
            dist.destroy_process_group()


def _env_int(key, default):
    text = os.environ.get(key, str(default))
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{key}={text!r} is not a whole number") from None


def _size(n):
    import torch
    return torch.tensor([n], dtype=torch.int64)


def _buffer(n):
    import torch
    return torch.empty(n, dtype=torch.uint8)


def _packed(obj):
    """What a rank sends (tensors of every dtype, plain containers, paths, quantized layers) -> uint8 [n]."""
    import io

    import torch
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _unpacked(data):
    """uint8 [n] -> the object _packed packed, loaded weights_only: tensors, plain containers, paths and the engine's
    quantized layers (what ranks exchange) come back; anything else is a ValueError naming what it holds."""
    import io

    import torch
    allowed = _exchanged_classes()
    buffer = io.BytesIO(data.numpy().tobytes())
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(buffer, weights_only=True)
    except Exception as e:                              # noqa: BLE001 (an unpickling error, a malformed archive ...)
        names = {f"{c.__module__}.{c.__qualname__}" for c in allowed}
        buffer.seek(0)
        try:
            refused = ", ".join(sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(buffer)) - names))
        except Exception:                               # noqa: BLE001 (not even a readable archive)
            refused = ""
        raise ValueError(f"{refused or str(e).splitlines()[0][:160]}: a rank accepts only tensors, plain containers, "
                         "paths and the engine's quantized layers") from None


def _exchanged_classes():
    """The classes beyond tensors and plain containers that ranks send: a path (the output folder) and every
    quantized layer class (GPTQ's, AWQ's, ... linears, sent by their owner rank). Rebuilding one of them sets its
    attributes, which may only be such objects in turn: no code runs."""
    from pathlib import Path

    from .layers import QuantLinear
    classes, todo = [type(Path())], [QuantLinear]
    while todo:
        classes.append(todo.pop())
        todo.extend(classes[-1].__subclasses__())
    return classes


def share(batches, rank, world):
    """range of the batch indices rank `rank` of `world` calibrates with: the batches of its slots."""
    from .formats.numerics.input_stats import SLOTS, slot_of    # (torch: run.py imports this file before parsing)
    first_slot, end_slot = rank * SLOTS // world, (rank + 1) * SLOTS // world
    mine = [b for b in range(batches) if first_slot <= slot_of(b, batches) < end_slot]
    return range(mine[0], mine[-1] + 1) if mine else range(0)


def check_world(world, data_aware):
    """ValueError unless a conversion can use `world` ranks."""
    from .formats.numerics.input_stats import SLOTS
    if data_aware and world > SLOTS:
        raise ValueError(f"{world} ranks: a data-aware method splits its calibration into {SLOTS} slots, so it uses "
                         f"at most {SLOTS} ranks")


def on_first(group, fn, what):
    """fn() run by rank 0 alone (or by the one process) and its result sent to every rank. A ValueError there stops
    every rank: rank 0 raises it, the others raise Follower."""
    if group is None:
        return fn()
    result, refusal = None, None
    if group.first:
        try:
            result = fn()
        except ValueError as e:
            refusal = e
    result, said = group.broadcast((result, None if refusal is None else str(refusal)), 0, what)
    if refusal is not None:
        raise refusal
    if said is not None:
        raise Follower(said)
    return result
