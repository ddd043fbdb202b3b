"""A pool of gloo ranks kept alive across calls: the launcher of the tests, `muon_check.verify` and
`muon_check.conformance` (measured facts: docs/testing.md).

Workers are started once per world size (forked, or spawned with their own hash seeds: RankPool); each sets
torch.set_num_threads(1) first, joins a gloo group through a file:// rendezvous in a fresh temporary directory
(runs never collide), then serves calls: a module-level function and picklable args, run on every rank. A call
that raises on any rank or outlives its timeout kills the pool (its next ranks start at once) and raises
RankFailure in the parent.

device="cuda": W ranks share the node's GPUs (rank r on cuda:r mod #GPUs; several ranks on one GPU), gloo
carrying CUDA tensors (docs/gpu.md: all_to_all_single, all_gather_into_tensor and
reduce_scatter_tensor work there; NCCL refuses two ranks on one GPU). Such workers are spawned, not forked:
CUDA cannot be used in a child forked from a parent that has used it. Results must come back as CPU tensors.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing import connection
from typing import Any, Callable, Iterator


class RankFailure(AssertionError):
    """A rank raised, died or hung; `messages` holds each failing rank's traceback, `hung` the ranks that never
    answered."""

    def __init__(self, messages: dict[int, str], hung: frozenset[int] = frozenset()) -> None:
        self.messages, self.hung = messages, hung
        super().__init__("\n".join(f"--- rank {r} ---\n{m}" for r, m in sorted(messages.items())))


def _serve(
    rank: int, world_size: int, init_file: str, conn: Any, device: str, process_group: bool = True
) -> None:
    # the rank's stderr goes to a file of the pool (stderr_path): gloo's C++ threads print there when a peer
    # dies (`terminate called ... gloo::EnforceNotMet`), which the parent reports with the rank that died
    # instead of interleaving it with the report
    log = os.open(stderr_path(init_file, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 2)
    os.close(log)
    # sys.stderr may be an object without a file descriptor in the parent (pytest's capsys): the rank's own
    # stderr is fd 2, which faulthandler needs
    sys.stderr = os.fdopen(2, "w", closefd=False)
    # a fatal signal (SIGSEGV, SIGABRT, ...) dumps every thread's Python stack to the file: the parent names the
    # signal and the torch.distributed call it hit (fatal_error)
    faulthandler.enable(file=sys.stderr)
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        torch.zeros(1, device="cuda")  # the rank's CUDA context, made before it counts as started
    if process_group:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
    if hasattr(
        signal, "SIGUSR1"
    ):  # the parent asks a hung rank where it is blocked (RankPool.blocked_at)
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    conn.send(READY)  # started: a call's timeout counts from here (RankPool.collect)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args = msg
        try:
            answer = ("ok", fn(*args))
        except BaseException:  # noqa: BLE001 - every failure goes back to the parent
            answer = ("error", traceback.format_exc())
        conn.send_bytes(_answer_bytes(answer))
    if dist.is_initialized():
        dist.destroy_process_group()


def _answer_bytes(answer: Any) -> bytes:
    """A rank's answer pickled for its pipe (the parent's Connection.recv reads it) with CPU tensors by value: each
    storage once, as raw bytes (views of one storage stay views of one storage in the parent), each tensor as its
    dtype, offset, size, stride, requires_grad and class (Tensor or Parameter). multiprocessing's pickler, as torch
    registers it, would move each storage into shared memory and pass its file descriptor over a socket of its
    own, a cost per storage that the many small tensors of a check's answers multiply (docs/conformance.md,
    "Ranks"). Everything else (CUDA tensors, tensors with attributes, conjugate or negative views, other layouts,
    non-leaf tensors that require grad) goes as that pickler sends it."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch

    plain = (torch.Tensor, torch.nn.Parameter)
    # data_ptr -> the first storage object seen for it (pickled once, then memoised by pickle)
    storages: dict[int, Any] = {}

    class ByValue(ForkingPickler):
        def reducer_override(self, obj: Any) -> Any:
            if (
                type(obj) in plain
                and obj.device.type == "cpu"
                and obj.layout == torch.strided
                and not (obj.is_conj() or obj.is_neg() or obj.__dict__)
                and (obj.is_leaf or not obj.requires_grad)
            ):
                untyped = obj.untyped_storage()
                untyped = storages.setdefault(untyped.data_ptr(), untyped)
                meta = (obj.dtype, obj.storage_offset(), tuple(obj.shape), obj.stride())
                return _tensor_of, (
                    untyped,
                    *meta,
                    obj.requires_grad,
                    type(obj) is not torch.Tensor,
                )
            if type(obj) is torch.UntypedStorage and obj.device.type == "cpu":
                raw = torch.empty(0, dtype=torch.uint8).set_(obj)
                return _storage_of, (raw.numpy().tobytes(),)
            return NotImplemented

    out = io.BytesIO()
    ByValue(out, pickle.HIGHEST_PROTOCOL).dump(answer)
    return out.getvalue()


def _storage_of(raw: bytes) -> Any:
    """The CPU storage whose bytes are `raw` (_answer_bytes)."""
    import torch

    return (
        torch.UntypedStorage.from_buffer(raw, dtype=torch.uint8) if raw else torch.UntypedStorage(0)
    )


def _tensor_of(
    storage: Any,
    dtype: Any,
    offset: int,
    size: tuple,
    stride: tuple,
    requires_grad: bool,
    parameter: bool,
) -> Any:
    """The tensor _answer_bytes sent: a view of `storage`, a Parameter where `parameter`."""
    import torch

    t = torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)
    return torch.nn.Parameter(t, requires_grad) if parameter else t.requires_grad_(requires_grad)


def stderr_path(init_file: str, rank: int) -> str:
    """Where rank `rank` of the pool whose rendezvous file is init_file writes its stderr."""
    return os.path.join(os.path.dirname(init_file), f"rank{rank}.stderr")


def _tail(path: str, limit: int | None = 600) -> str:
    """The last `limit` characters of a file (all of it for None), stripped; "" where it cannot be read."""
    try:
        with open(path, errors="replace") as f:
            return f.read()[-limit if limit else 0 :].strip()
    except OSError:
        return ""


_FATAL = re.compile(r"^Fatal Python error: (?P<what>[^\n]+)$", re.M)


def fatal_error(text: str) -> tuple[str | None, str]:
    """A rank's stderr split at faulthandler's dump of a fatal signal (enabled in every rank): (what killed it: the
    signal and, where the dump has a torch.distributed frame, the call it hit, e.g. "Segmentation fault in
    torch.distributed full_tensor (_api.py) at ..., called from FILE:LINE in FUNC"; None without a dump), and the
    text before the dump (what the rank printed itself, e.g. a C++ exception before an abort)."""
    found = list(_FATAL.finditer(text))
    if not found:
        return None, text
    what, where = found[-1]["what"].strip(), blocked_frame(text[found[-1].end() :])
    killed = what + (" in" + where.removeprefix("blocked in") if where else "")
    return killed, text[: found[0].start()]


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


_WRAPPERS = frozenset(
    {"wrapper", "inner", "_fn", "decorate_context"}
)  # decorators around collectives


def blocked_frame(dump: str) -> str | None:
    """From a faulthandler dump (most recent call first): the torch.distributed call the rank's own code made
    and is blocked in (the outermost torch.distributed frame below the first frame outside torch), the innermost
    torch.distributed frame, and the calling frame; None without a torch.distributed frame."""
    frames = [m.groupdict() for m in map(_FRAME.match, dump.splitlines()) if m]
    paths = [f["file"].replace(os.sep, "/") for f in frames]
    dist_frames = [i for i, p in enumerate(paths) if "/torch/distributed/" in p]
    if not dist_frames:
        return None
    j = dist_frames[0]
    while j + 1 < len(frames) and "/torch/" in paths[j + 1]:
        j += 1
    named = [i for i in dist_frames if i <= j and frames[i]["func"] not in _WRAPPERS]
    entered = frames[max(named)] if named else frames[dist_frames[0]]
    innermost = frames[dist_frames[0]]
    where = f"blocked in torch.distributed {entered['func']} ({os.path.basename(entered['file'])})"
    if innermost is not entered:
        where += f" at {innermost['func']}"
    if j + 1 < len(frames):
        caller = frames[j + 1]
        where += (
            f", called from {os.path.basename(caller['file'])}:{caller['line']} in {caller['func']}"
        )
    return where


DEVICES = ("cpu", "cuda")


def device_unavailable(device: str) -> str | None:
    """Why ranks cannot run on `device` here, as the end of a one-line error that names it and the valid ones
    ("{device!r} is not ..."); None when they can. Every entry point that takes a device (RankPool.start, verify,
    conformance) asks before it starts a rank."""
    import torch

    if device not in DEVICES:
        return f"{device!r} is not one of {DEVICES}"
    if device == "cuda" and not torch.cuda.is_available():
        why = "built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        return f"'cuda' is not available here (torch {torch.__version__}, {why}); valid here: 'cpu'"
    return None


# s the other ranks get after a rank's error before they count as blocked with it
ERROR_GRACE_S = 3.0
# what a rank sends once it has started (torch imported, its CUDA context made, the process group joined); a
# call's timeout counts from the moment every rank has sent it, and the start has its own limit: a spawned rank's
# start (torch's import, a CUDA context) takes seconds on a loaded node, longer than a tiny case's timeout
READY = ("ready", None)
START_TIMEOUT_S = 300.0
GRACE_IDLE_S = (
    0.5  # s without CPU after a peer's error: the others are blocked, not about to raise their own
)


class _Progress:
    """Whether processes still work: stalled(pids, window) is True once they and their descendants together used
    less than 1% of a core each (utime + stime from /proc/<pid>/stat, in clock ticks of 10 ms) over the last
    `window` seconds, and none of them waited for the CPU or the disk (state R, or D) at any sample of it. A
    rank blocked in a gloo collective uses none; one blocked in a store-based barrier polls (a tick every 2 s, measured on
    Linux with torch 2.13.0); a working rank uses tens of ticks a second even on 2 loaded cores. Never True
    without idle_s (the pool's) or without /proc."""

    def __init__(self, idle_s: float | None) -> None:
        self.idle_s, self.samples, self.pids, self.stalled_at, self.window = (
            idle_s,
            [],
            [],
            None,
            None,
        )

    def stalled(self, pids: list[int], window: float | None) -> bool:
        if self.idle_s is None or window is None or not os.path.isdir("/proc"):
            return False
        now = time.monotonic()
        if pids != self.pids:  # a rank answered: its ticks leave the sum
            self.pids, self.samples = list(pids), []
        ticks, waiting = _activity(pids)
        if waiting:  # waiting for the CPU or the disk is not blocked: the window starts again
            self.samples = []
        self.samples.append((now, ticks))
        old = [ticks for t, ticks in self.samples if t <= now - window]
        if old and self.samples[-1][1] - old[-1] < len(pids) * window:
            self.stalled_at, self.window = now, window
        return self.stalled_at is not None


def _activity(pids: list[int]) -> tuple[int, bool]:
    """(utime + stime in clock ticks, whether one of them waits for the CPU or the disk) of the processes and
    all their descendants (found by their parent pids). A rank blocked in a collective sleeps (state S); one
    that a loaded machine has not scheduled (state R) or a thread in state D (an import, or a checkpoint's
    fsync, on a busy disk) uses no CPU for seconds without being blocked on a peer (ranks were reported hung
    inside imports and inside deepspeed.initialize at load averages of 24 to 36 on 2 cores, each bitwise when
    rerun)."""
    table = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat_fields(f"/proc/{entry}/stat")
        if fields:  # after "pid (comm)": state, ppid, ..., utime (11), stime (12)
            table[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]), fields[0])
    total, waiting, frontier, seen = 0, False, list(pids), set()
    while frontier:
        pid = frontier.pop()
        if pid in seen or pid not in table:
            continue
        seen.add(pid)
        total += table[pid][1]
        # the process's own state is its main thread's: R there (not S, blocked) or D in any thread
        waiting = waiting or table[pid][2] == "R" or _waits_on_disk(pid)
        frontier += [child for child, (parent, _, _) in table.items() if parent == pid]
    return total, waiting


def _stat_fields(path: str) -> list[str] | None:
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _waits_on_disk(pid: int) -> bool:
    """Whether a thread of pid is in state D (its threads' states are in /proc/PID/task/TID/stat)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    return any((_stat_fields(f"/proc/{pid}/task/{tid}/stat") or ["?"])[0] == "D" for tid in tids)


@contextlib.contextmanager
def _hash_seed(seed: int | None) -> Iterator[None]:
    """PYTHONHASHSEED set to `seed` while a process is spawned (read by the new interpreter at its start)."""
    saved = os.environ.get("PYTHONHASHSEED")
    if seed is not None:
        os.environ["PYTHONHASHSEED"] = str(seed)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = saved


def _zygote(conn: Any) -> None:
    """Forks ranks on request: (rank, world_size, init_file, device, process_group, address, authkey) -> a child
    that connects to `address`, sends (rank, pid) and serves (_serve); answers nothing. Its children are reaped
    by the kernel (SIGCHLD ignored): the pool kills them by pid."""
    import torch  # noqa: F401 - imported once here, inherited by every fork
    import torch.distributed  # noqa: F401

    # every rank of the check builds DTensors: imported here, a rank's start (and its restart after a crash or a
    # hang) costs a fork, not this import (docs/conformance.md, "Ranks")
    import torch.distributed.tensor  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        rank, world_size, init_file, device, process_group, address, authkey = msg
        if os.fork() == 0:
            code = 0
            try:
                conn.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                link = connection.Client(address, family="AF_UNIX", authkey=authkey)
                link.send((rank, os.getpid()))
                _serve(rank, world_size, init_file, link, device, process_group)
            except BaseException:  # noqa: BLE001 - a forked child never returns into the zygote's loop
                code = 1
            finally:
                os._exit(code)


# this process's zygotes by the PYTHONHASHSEED they were spawned with: (the pid that spawned it, _spawn_context() at
# its spawn, the process, its pipe end). A zygote only forks, from the state it reached after its imports, so every
# pool's rank of a seed starts alike from it; sharing them makes a pool's start after the first a fork per rank, not
# a spawn and torch's import per rank. One per seed: a zygote whose context this process has since left is ended
# and spawned again. They end with this process (daemons; each also ends when its pipe closes).
_ZYGOTES: dict[int, tuple[int, tuple, Any, Any]] = {}


# variables that say where the calling process is, not what its ranks run: pytest sets PYTEST_CURRENT_TEST anew for
# every test and phase, so keying on it would spawn a suite's zygotes again in every test
_POSITION_ONLY = frozenset({"PYTEST_CURRENT_TEST"})


def _spawn_context() -> tuple:
    """What a spawned process takes from this one when it starts, and its forks keep: the working directory, the
    module search path (a candidate's module is imported by name on the ranks) and the environment, less the
    variables that only say where this process is (_POSITION_ONLY)."""
    env = sorted((k, v) for k, v in os.environ.items() if k not in _POSITION_ONLY)
    return (os.getcwd(), tuple(sys.path), tuple(env))


def _zygote_for(seed: int) -> tuple[Any, Any]:
    """(process, pipe end) of this process's zygote of PYTHONHASHSEED `seed`: the one alive, spawned by this process
    (a fork of it inherits the table, not the zygotes) in the context this process is in now (_spawn_context); else
    a new one, the old one ended."""
    context = _spawn_context()
    known = _ZYGOTES.pop(seed, None)
    if known is not None and known[0] == os.getpid():
        _, spawned_in, proc, conn = known
        if spawned_in == context and proc.is_alive():
            _ZYGOTES[seed] = known
            return proc, conn
        _end(proc, conn)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_zygote, args=(child,), daemon=True)
    with _hash_seed(seed):
        proc.start()
    _ZYGOTES[seed] = (os.getpid(), context, proc, parent)
    return proc, parent


def _end(proc: Any, conn: Any) -> None:
    """A zygote or a rank asked to end (its loop returns on None), killed if it has not within 5 s."""
    try:
        conn.send(None)
    except OSError:
        pass
    proc.join(timeout=5)
    if proc.is_alive():
        proc.kill()


class _Forked:
    """A rank forked by a zygote, known by its pid (not this process's child: no waitpid)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def is_alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def join(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)


class RankPool:
    """world_size gloo ranks on `device` ("cpu", or "cuda": the node's GPUs shared, module docstring), started
    with `start_method` (default: fork on CPU, spawn with CUDA or a hash seed). hash_seed: rank r runs with
    PYTHONHASHSEED = hash_seed + r (its own string-hashing seed, as separate training processes have; ranks forked
    from the parent would share the parent's), forked on the CPU from that seed's zygote (_zygote_for).
    process_group=False: the ranks join no group (a single-device candidate that calls torch.distributed fails
    there instead of running as a group of one). A rank that does not answer is asked where it is blocked
    (blocked_at: faulthandler's stack on SIGUSR1) before the pool is torn down. idle_s: a call counts as hung
    before its timeout once the ranks that have not answered, with their child processes, used no CPU time for idle_s seconds (CPU
    ranks, Linux /proc: they are blocked, in a collective that a peer never joins; not for CUDA, where a rank may
    wait for its GPU)."""

    def __init__(
        self,
        world_size: int,
        device: str = "cpu",
        start_method: str | None = None,
        idle_s: float | None = None,
        hash_seed: int | None = None,
        process_group: bool = True,
    ) -> None:
        if device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
        if idle_s is not None and device != "cpu":
            raise ValueError(
                f"idle_s needs CPU ranks (a CUDA rank waiting for its GPU uses no CPU), got {device!r}"
            )
        if hash_seed is not None and start_method not in (None, "spawn"):
            raise ValueError(f"hash_seed needs spawned ranks, got start_method={start_method!r}")
        self.world_size, self.device, self.idle_s = world_size, device, idle_s
        self.hash_seed, self.process_group = hash_seed, process_group
        spawned = device == "cuda" or hash_seed is not None
        self.start_method = start_method or ("spawn" if spawned else "fork")
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.started: set[int] = set()  # ranks of the running pool that sent READY
        self.zygotes: list[tuple[Any, Any]] = []

    def start(self) -> None:
        unavailable = device_unavailable(self.device)
        if unavailable:
            raise RuntimeError(f"RankPool device {unavailable}")
        self.started = set()
        self.tmpdir = tempfile.mkdtemp(prefix=f"muon_dist_w{self.world_size}_")
        init_file = self.init_file = os.path.join(self.tmpdir, "rendezvous")
        if self.hash_seed is not None and self.device == "cpu":
            self._start_from_zygotes(init_file)
            return
        ctx = mp.get_context(self.start_method)
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_serve,
                args=(rank, self.world_size, init_file, child, self.device, self.process_group),
                daemon=True,
            )
            with _hash_seed(None if self.hash_seed is None else self.hash_seed + rank):
                proc.start()
            self.procs.append(proc)
            self.conns.append(parent)

    def _start_from_zygotes(self, init_file: str) -> None:
        """Rank r forked by the zygote of hash seed hash_seed + r (_zygote_for: a process spawned once per seed in
        this process with that PYTHONHASHSEED and torch imported, shared by every pool that asks for the seed), which
        forks a fresh rank on request (its hash seed, not the parent's; a start after the first, and a restart after
        a failure, cost a fork, not a spawn). The rank connects back to the pool's listener and says which it is."""
        if not self.zygotes:
            self.authkey = os.urandom(16)
            self.listener = connection.Listener(
                os.path.join(tempfile.mkdtemp(prefix="muon_dist_zygotes_"), "sock"),
                family="AF_UNIX",
                authkey=self.authkey,
            )
        self.zygotes = [_zygote_for(self.hash_seed + rank) for rank in range(self.world_size)]
        address = self.listener.address
        for rank, (_, zconn) in enumerate(self.zygotes):
            zconn.send(
                (
                    rank,
                    self.world_size,
                    init_file,
                    self.device,
                    self.process_group,
                    address,
                    self.authkey,
                )
            )
        by_rank: dict[int, Any] = {}
        pids: dict[int, int] = {}
        for _ in range(self.world_size):
            conn = self.listener.accept()
            rank, pid = conn.recv()
            by_rank[rank], pids[rank] = conn, pid
        self.conns = [by_rank[r] for r in range(self.world_size)]
        self.procs = [_Forked(pids[r]) for r in range(self.world_size)]

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> list[Any]:
        """fn(*args) on every rank; the per-rank results, or RankFailure (and a killed pool)."""
        self.submit(fn, *args)
        return self.collect(timeout)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if not self.procs:
            self.start()
        for conn in self.conns:
            conn.send((fn, args))

    def collect(self, timeout: float = 60.0) -> list[Any]:
        """Every rank's answer, waiting on all ranks at once: the first error leaves the others a short grace (they
        may be stuck in a collective with the failed rank), so a crash is reported in seconds whichever rank it is.
        With idle_s, ranks that stopped using CPU are reported hung after idle_s, and after an error the grace ends
        once the others have used no CPU for GRACE_IDLE_S (blocked: their own errors will not come). `timeout`
        counts from the moment every rank has started (READY); a pool still starting has START_TIMEOUT_S for that."""
        results: dict[int, Any] = {}
        errors: dict[int, Any] = {}
        starting = len(self.started) < self.world_size
        deadline = time.monotonic() + (START_TIMEOUT_S if starting else timeout)
        waiting = dict(enumerate(self.conns))
        busy = _Progress(self.idle_s)
        while waiting and time.monotonic() < deadline:
            window = GRACE_IDLE_S if errors else self.idle_s
            if busy.stalled([self.procs[r].pid for r in waiting], window):
                break
            slice_s = (
                deadline - time.monotonic()
                if self.idle_s is None
                else min(0.1, deadline - time.monotonic())
            )
            for conn in connection.wait(list(waiting.values()), max(0.0, slice_s)):
                rank = next(r for r, c in waiting.items() if c is conn)
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    status, value = "error", "the rank died (its pipe closed)"
                    value += "" if rank in self.started else " before it started"
                    fatal, printed = fatal_error(_tail(stderr_path(self.init_file, rank), None))
                    printed = printed[-600:].strip()
                    value += f"; killed: {fatal}" if fatal else ""
                    value += f"; its stderr: {printed}" if printed else ""
                if (status, value) == READY:  # its answer comes next on the same pipe
                    self.started.add(rank)
                    if starting and len(self.started) == self.world_size and not errors:
                        starting, deadline = False, time.monotonic() + timeout
                    continue
                del waiting[rank]
                (results if status == "ok" else errors)[rank] = value
                if errors:
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        if busy.stalled_at is not None:
            why = f"no answer: no CPU used for {busy.window} s (blocked)"
        elif errors:  # the grace after another rank's error ran out, not `timeout`
            first = min(errors)
            why = f"no answer within {ERROR_GRACE_S:g} s of rank {first}'s error (blocked with it)"
        elif starting:
            why = f"not started within {START_TIMEOUT_S:g} s (torch's import, the CUDA context, the rendezvous)"
        else:
            why = f"no answer: none within {timeout} s (hung or dead)"
        for rank in sorted(waiting):
            where = self.blocked_at(rank) if self.procs[rank].is_alive() else None
            errors[rank] = f"{why}; {where}" if where else why
        if errors:
            self.kill(restart=True)
            raise RankFailure(errors, frozenset(waiting))
        return [results[r] for r in range(self.world_size)]

    def blocked_at(self, rank: int, wait_s: float = 0.5) -> str | None:
        """Where a live rank that does not answer is blocked, from the Python stack that faulthandler dumps on
        SIGUSR1 (registered by _serve): 'blocked in torch.distributed NAME, called from FILE:LINE in FUNC'
        (NAME: the outermost torch.distributed frame, the collective the caller entered); None where no stack
        came (no SIGUSR1, or a rank stuck where Python cannot run its handler)."""
        if not hasattr(signal, "SIGUSR1"):
            return None
        path = stderr_path(self.init_file, rank)
        try:
            before = os.path.getsize(path)
            os.kill(self.procs[rank].pid, signal.SIGUSR1)
        except OSError:
            return None
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            time.sleep(0.05)
            try:
                with open(path, errors="replace") as f:
                    f.seek(before)
                    dump = f.read()
            except OSError:
                return None
            found = blocked_frame(dump)
            if found:
                return found
        return None

    def kill(self, restart: bool = False) -> None:
        """SIGKILL every rank before waiting for any: a rank that outlives a killed peer sees gloo's connection
        drop in a background thread and dies printing `terminate called ... gloo::EnforceNotMet`. restart: start
        the next pool's ranks at once (after a failure), so that a spawned rank's start (importing torch: about
        2 s for 4 ranks on 2 cores) overlaps the caller's work instead of delaying its next call."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=5)
        if self.procs:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
        self.procs, self.conns, self.started = [], [], set()
        if restart:
            self.start()

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            _end(proc, conn)
        self.kill()
        if self.zygotes:  # the zygotes stay for the next pool of their seeds (_zygote_for)
            folder = os.path.dirname(self.listener.address)
            self.listener.close()
            shutil.rmtree(folder, ignore_errors=True)
        self.zygotes = []
