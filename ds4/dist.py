"""Several processes (one per GPU, or CPU processes over gloo) running one model: expert parallelism.

Launch with torchrun (`torchrun --standalone --nproc-per-node N --no-python ds4 ...`, or `ds4 --gpus N`,
which re-launches itself that way). `init()` reads torchrun's RANK / WORLD_SIZE / LOCAL_RANK and joins the
default process group: NCCL when CUDA is present (device = LOCAL_RANK), else gloo. NCCL's NVLink multicast
(NVLS) is switched off before NCCL starts: on the lent multi-GPU hosts it can take every GPU of the host
out of service.

Parallel layout (expert parallel only):
  * routed experts: rank r holds and computes experts [r*E/N, (r+1)*E/N) (`expert_range`); every rank
    routes every token (the router is replicated), masks the experts it does not own, and the routed
    outputs are summed with one all_reduce per MoE layer (ds4.model.moe, ds4.model.cuda.experts). With
    replicated activations an all_reduce is exactly reduce-scatter + all-gather, so no all-to-all is needed.
  * everything else (embeddings, attention, compressors, indexer, shared expert, HC, head) is replicated.
Why no tensor parallelism yet: the routed experts are ~90% of the bytes (q4: ~140 of ~153 GB), so sharding
them alone lets q4 fit two 141 GB GPUs and halves the dominant decode read. The replicated rest is ~13 GB.
Sharding attention or the shared expert would add two collectives per layer (43 layers x 2 more latency-
bound all_reduces per decode token, ~10-20 us each on NVLink) to save reads of ~0.1 GB per token; the vocab
head (129k x 4096) is the cheapest first TP candidate and is left for later.

Execution model (leader / followers): rank 0 runs the product (CLI, server, bench) unchanged against
`Leader(model)`; every model call it makes (new_state, new_states, forward, decode_batch, decode_greedy, ...)
and every state call (reset, copy_from, clone, load_cpu, ...) is first broadcast as a small op record over a
gloo control group, then executed. Ranks > 0 run `follow(model)`: receive the same records and execute them
on their own model, so every rank runs the same sequence of forwards and meets at the same all_reduces.
States are created in the same order on every rank and referred to by id. Reads that change nothing
(state.to_cpu, state.nbytes, attributes) run on rank 0 only: states are replicated, so rank 0's copy is
the truth. Rank 0 sends "exit" when it closes (also at interpreter exit), and the followers return.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as tdist

from ds4.launch import launched

NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# The control group waits for rank 0's next call, which can be hours away on an idle server.
CONTROL_TIMEOUT = datetime.timedelta(days=365)

_ctrl = None  # gloo group for op records (CPU), set by init() when world > 1
_leader = None  # rank 0's Leader once wrapped
_suspended = False  # local_only(): this process computes as if alone


class DistError(RuntimeError):
    pass


def init(backend: str | None = None) -> bool:
    """Join the process group described by torchrun's environment (no-op for a single process).

    backend: "nccl" or "gloo"; None = nccl when CUDA is available, else gloo. Returns True when a group of
    more than one process is active.
    """
    global _ctrl
    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_world_size() > 1
    if not launched():
        return False
    for key, value in NVLS_OFF.items():
        os.environ[key] = value  # before NCCL reads its environment
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        if local >= torch.cuda.device_count():
            raise DistError(
                f"LOCAL_RANK {local} but only {torch.cuda.device_count()} CUDA devices are visible"
            )
        torch.cuda.set_device(local)
        tdist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        tdist.init_process_group(backend)
    _ctrl = tdist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    if rank() == 0:
        atexit.register(shutdown)
    return True


def active() -> bool:
    """True when a group of several processes is up and the model must shard (not in local_only())."""
    return not _suspended and tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1


@contextlib.contextmanager
def local_only():
    """Inside: models built and run here act as a single process (all experts, no all_reduce), e.g. a
    one-GPU reference on rank 0 while the other ranks wait for rank 0's next message."""
    global _suspended
    saved, _suspended = _suspended, True
    try:
        yield
    finally:
        _suspended = saved


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's obj, in rank order, on every rank (control group; [obj] for one process)."""
    if not active():  # one process, or inside local_only()
        return [obj]
    out: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, obj, group=_ctrl)
    return out


def world() -> int:
    return tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1


def rank() -> int:
    return tdist.get_rank() if tdist.is_available() and tdist.is_initialized() else 0


def expert_range(n_expert: int, r: int | None = None, n: int | None = None) -> tuple[int, int]:
    """[lo, hi) of the routed experts rank r (default: this rank) of n (default: world) holds."""
    if r is None and n is None and not active():
        return 0, n_expert
    r = rank() if r is None else r
    n = world() if n is None else n
    if n_expert % n:
        raise DistError(f"{n_expert} routed experts do not split evenly over {n} processes (use a divisor)")
    per = n_expert // n
    return r * per, (r + 1) * per


def all_reduce_(t: torch.Tensor) -> torch.Tensor:
    """Sum t over the ranks in place (no-op for one process); plain all_reduce on the current stream,
    so it can be captured in a CUDA graph."""
    if active():
        tdist.all_reduce(t)
    return t


# ---------------------------------------------------------------------------------------------
# Control channel
# ---------------------------------------------------------------------------------------------


def _send(obj: Any) -> None:
    tdist.broadcast_object_list([obj], src=0, group=_ctrl)


def _recv() -> Any:
    box = [None]
    tdist.broadcast_object_list(box, src=0, group=_ctrl)
    return box[0]


_exit_sent = False  # rank 0 sent "exit"
_exit_seen = False  # a follower received it


def shutdown() -> None:
    """The end of a distributed run, on every rank: rank 0 sends "exit" (once), a follower that has not
    received it yet waits for it (so rank 0 never sends to a closed peer); then leave the process group."""
    global _exit_sent
    if not (tdist.is_available() and tdist.is_initialized()):
        return
    if tdist.get_world_size() > 1:
        if rank() == 0 and not _exit_sent:
            _exit_sent = True
            _send(("exit",))
        elif rank() > 0:
            while not _exit_seen:
                _note_exit(_recv())
    if tdist.get_backend() == "nccl":
        # Measured on 2 x H200 (torch 2.11): destroy_process_group() hangs once an all_reduce was captured
        # in a CUDA graph. The process is ending anyway: leave the group to process exit.
        return
    tdist.destroy_process_group()


def _note_exit(op: Any) -> Any:
    global _exit_seen
    if op[0] == "exit":
        _exit_seen = True
    return op


def leader_message(obj: Any = None) -> Any:
    """A message from rank 0 to the followers outside the op stream (e.g. the model path the CLI resolved):
    rank 0 sends obj, the others return it. A follower that gets "exit" instead leaves the process."""
    if not active():
        return obj
    if rank() == 0:
        _send(("msg", obj))
        return obj
    got = _note_exit(_recv())
    if got[0] != "msg":  # rank 0 finished without loading anything (e.g. --inspect), or shut down
        _exit_follower()
    return got[1]


def on_leader(fn: Callable[[], Any]) -> Any:
    """fn() on rank 0 only; every rank returns its result (e.g. resolve or build a model path once, so the
    ranks do not race to build it). One process: fn()."""
    if not active():
        return fn()
    return leader_message(fn() if rank() == 0 else None)


def _exit_follower() -> NoReturn:
    shutdown()
    sys.exit(0)


# ---------------------------------------------------------------------------------------------
# Ops: the same `Executor.run` executes them on every rank
# ---------------------------------------------------------------------------------------------


class _Ref:
    """A state named by id inside an op record."""

    __slots__ = ("sid",)

    def __init__(self, sid: int) -> None:
        self.sid = sid

    def __reduce__(self):
        return (_Ref, (self.sid,))


def _is_state(obj: Any) -> bool:
    return hasattr(obj, "n_tokens") and hasattr(obj, "layers") and hasattr(obj, "ctx")


class Executor:
    """The registry of live states (id -> local state) and the op interpreter."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.states: dict[int, Any] = {}
        self.next_id = 0

    def resolve(self, obj: Any) -> Any:
        if isinstance(obj, _Ref):
            return self.states[obj.sid]
        if isinstance(obj, list):
            return [self.resolve(o) for o in obj]
        if isinstance(obj, tuple):
            return tuple(self.resolve(o) for o in obj)
        if isinstance(obj, dict):
            return {k: self.resolve(v) for k, v in obj.items()}
        return obj

    def register(self, obj: Any) -> Any:
        """New states in a result get the next ids (same order on every rank); returns obj with _Refs."""
        if _is_state(obj):
            sid, self.next_id = self.next_id, self.next_id + 1
            self.states[sid] = obj
            return _Ref(sid)
        if isinstance(obj, list) and any(_is_state(o) for o in obj):
            return [self.register(o) for o in obj]
        if isinstance(obj, tuple) and any(_is_state(o) for o in obj):
            return tuple(self.register(o) for o in obj)
        return obj

    def run(self, op: tuple) -> Any:
        kind, frees, inference, grad = op[0], op[1], op[2], op[3]
        for sid in frees:
            self.states.pop(sid, None)
        ctx = torch.inference_mode() if inference else torch.set_grad_enabled(grad)
        with ctx:
            return self._dispatch(kind, *op[4:])

    def _dispatch(self, kind: str, *a: Any) -> Any:
        if kind == "call":  # model method
            name, args, kwargs = a
            return self.register(getattr(self.model, name)(*self.resolve(args), **self.resolve(kwargs)))
        if kind == "set":  # model attribute
            setattr(self.model, a[0], self.resolve(a[1]))
            return None
        sid = a[0]
        st = self.states[sid]
        if kind == "scall":  # state method
            name, args, kwargs = a[1:]
            return self.register(getattr(st, name)(*self.resolve(args), **self.resolve(kwargs)))
        if kind == "sset":
            setattr(st, a[1], self.resolve(a[2]))
            return None
        if kind == "reset":  # device states reset in place; CPU states are replaced by a fresh one
            if hasattr(st, "reset"):
                st.reset()
            else:
                self.states[sid] = self.model.new_state(st.ctx)
            return None
        if kind == "copy_from":
            src = self.states[a[1]]
            if hasattr(st, "copy_from"):
                st.copy_from(src)
            else:
                self.states[sid] = src.clone()
            return None
        if kind == "load_cpu":
            if hasattr(st, "load_cpu"):
                st.load_cpu(a[1])
            else:
                self.states[sid] = a[1].clone()
            return None
        raise DistError(f"unknown op {kind!r}")


# ---------------------------------------------------------------------------------------------
# Rank 0: the wrapper the product talks to
# ---------------------------------------------------------------------------------------------

_LOCAL_STATE_READS = {"nbytes", "to_cpu", "tensors"}  # run on rank 0 only: they change nothing


def _cpu_args(obj: Any) -> Any:
    """Tensors travel as CPU tensors (a pickled CUDA tensor would land on the receiver's device 0)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, list):
        return [_cpu_args(o) for o in obj]
    if isinstance(obj, tuple):
        return tuple(_cpu_args(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _cpu_args(v) for k, v in obj.items()}
    return obj


class Leader:
    """Rank 0's view of the model: calls are broadcast to the followers, then run here."""

    def __init__(self, model: Any) -> None:
        object.__setattr__(self, "_ex", Executor(model))
        object.__setattr__(self, "_frees", [])
        object.__setattr__(self, "_ended", False)
        # One op at a time, broadcast and local run together: the followers replay ops in broadcast order,
        # so two threads (a server's model thread and a job thread) must not interleave them.
        object.__setattr__(self, "_lock", threading.RLock())

    @property
    def inner(self) -> Any:
        return self._ex.model

    def _op(self, kind: str, *args: Any) -> Any:
        with self._lock:
            return self._op_locked(kind, *args)

    def _op_locked(self, kind: str, *args: Any) -> Any:
        frees = []
        while self._frees:  # pop one by one: a finalizer may append while we drain
            frees.append(self._frees.pop())
        op = (kind, frees, torch.is_inference_mode_enabled(), torch.is_grad_enabled(), *args)
        if _exit_sent or self._ended:
            raise DistError("the followers no longer run this model (ended or shut down)")
        _send(op)
        return self._wrap(self._ex.run(op))

    def _wrap(self, obj: Any) -> Any:
        if isinstance(obj, _Ref):
            return self._ref(obj.sid)
        if isinstance(obj, list):
            return [self._wrap(o) for o in obj]
        if isinstance(obj, tuple):
            return tuple(self._wrap(o) for o in obj)
        return obj

    def _ref(self, sid: int) -> StateRef:
        ref = StateRef(self, sid)
        weakref.finalize(ref, self._frees.append, sid)
        return ref

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._ex.model, name)
        if name.startswith("_") or not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._op("call", name, _encode(args), _encode(kwargs))

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        self._op("set", name, _encode(value))

    def end(self) -> None:
        """Stop mirroring: the followers' follow() returns (the process group stays up)."""
        if not self._ended and not _exit_sent:
            _send(("end",))
        object.__setattr__(self, "_ended", True)

    def close(self) -> None:
        """The end of the run: followers exit, the process group is left."""
        shutdown()


def _encode(obj: Any) -> Any:
    """Op-record form of call arguments: StateRefs -> _Ref ids, tensors -> CPU."""
    if isinstance(obj, StateRef):
        return _Ref(obj._sid)
    if isinstance(obj, list):
        return [_encode(o) for o in obj]
    if isinstance(obj, tuple):
        return tuple(_encode(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _encode(v) for k, v in obj.items()}
    return _cpu_args(obj)


class StateRef:
    """A state living on every rank; reads go to rank 0's copy, mutations are broadcast."""

    def __init__(self, leader: Leader, sid: int) -> None:
        object.__setattr__(self, "_leader", leader)
        object.__setattr__(self, "_sid", sid)

    @property
    def local(self) -> Any:
        return self._leader._ex.states[self._sid]

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.local, name)
        if name.startswith("_") or not callable(value) or name in _LOCAL_STATE_READS:
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._leader._op("scall", self._sid, name, _encode(args), _encode(kwargs))

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        self._leader._op("sset", self._sid, name, _encode(value))

    # In-place forms every state gets (CPU KVStates lack them; the op replaces the local object instead).
    def reset(self) -> None:
        self._leader._op("reset", self._sid)

    def copy_from(self, other: StateRef) -> None:
        self._leader._op("copy_from", self._sid, other._sid)

    def load_cpu(self, cpu: Any) -> None:
        self._leader._op("load_cpu", self._sid, cpu)

    def to_cpu(self) -> Any:
        local = self.local
        return local.to_cpu() if hasattr(local, "to_cpu") else local.clone()


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def follow(model: Any) -> str:
    """Ranks > 0: execute rank 0's op records on `model` until its Leader ends ("end") or rank 0 shuts
    down ("exit"); returns which."""
    ex = Executor(model)
    while True:
        op = _note_exit(_recv())
        if op[0] in ("end", "exit"):
            return op[0]
        if op[0] == "msg":
            continue
        try:
            ex.run(op)
        except Exception as e:  # noqa: BLE001 - rank 0 normally raised the same error from the same op
            # and reports it; said here too, since an error on this rank alone desynchronises the collectives
            msg = f"ds4 rank {rank()}: op {op[0]!r} failed here: {type(e).__name__}: {e}"
            print(msg[:2000], file=sys.stderr)


def ignore_interrupts() -> None:
    """Followers leave Ctrl+C to rank 0 (the terminal signals every process of the job): rank 0 cancels or
    exits, and its shutdown then sends "exit"."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def wrap_or_follow(model: Any) -> Any:
    """Call right after loading the model. One process: the model itself. Rank 0: a Leader that mirrors
    every call to the followers. Ranks > 0: run the follower loop, then exit the process (status 0)."""
    global _leader
    if not active():
        return model
    if rank() == 0:
        _leader = Leader(model)
        return _leader
    ignore_interrupts()
    follow(model)
    _exit_follower()  # after an "end", waits for rank 0's "exit"


def torchrun_command(n: int, argv: list[str], module: str = "ds4") -> list[str]:
    """The command that runs `python -m module argv` as n processes under torch.distributed.run."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
            "-m", module, *argv]  # fmt: skip


def relaunch(n: int, argv: list[str], module: str = "ds4") -> NoReturn:
    """exec `python -m module argv` under torchrun with n processes, NVLink multicast off (no return)."""
    env = dict(os.environ, **NVLS_OFF)
    cmd = torchrun_command(n, argv, module)
    os.execve(cmd[0], cmd, env)


def without_flag(argv: list[str], flag: str = "--gpus") -> list[str]:
    """argv without `flag N` / `flag=N` (the relaunched processes must not relaunch again)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def start(gpus: int | None, argv: list[str], module: str, backend: str | None = None) -> None:
    """An entry point's first distributed step. Outside torchrun with gpus > 1: re-exec under torchrun
    (`python -m module argv` minus --gpus). Inside torchrun: init(backend) (gloo for a CPU backend)."""
    if launched():
        init("gloo" if backend == "cpu" else None)
    elif gpus and gpus > 1:
        relaunch(gpus, without_flag(argv), module)
