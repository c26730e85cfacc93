"""A group of real gloo worker processes, started once, that runs many cases.

Starting processes and importing torch costs seconds per rank on a small machine,
so a :class:`WorkerGroup` keeps its processes and default process group alive and
runs one function after another on every rank::

    with WorkerGroup(4) as group:
        results = group.run(my_case, steps=5)   # my_case(**kwargs) on ranks 0..3

A case is a module-level function (it is pickled by reference). Each rank's return
value comes back in rank order; ``modelparallel.reset()`` runs after every case. If
a rank raises, :class:`WorkerError` carries its traceback; ranks that do not answer
in time are killed and the group restarts on the next ``run``, as it does when the
ranks that raised leave the default group unusable, or when the cases have left too
many gloo groups alive (each costs every process a thread that wakes every 10 ms).
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import time
import traceback
from collections.abc import Callable
from multiprocessing import forkserver
from typing import Any


class WorkerError(RuntimeError):
    """A case failed (or timed out) on at least one rank."""


def _worker_main(rank: int, world_size: int, store_port: int, conn, env: dict[str, str],
                 collective_timeout_s: float) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(store_port))
    import torch
    import torch.distributed as dist

    import modelparallel

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=collective_timeout_s))
    conn.send_bytes(pickle.dumps(("ready", None, 0)))
    while True:
        fn, kwargs = pickle.loads(conn.recv_bytes())
        if fn is None:
            break
        try:
            reply = ("ok", fn(**kwargs))
        except BaseException as e:
            reply = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        finally:
            modelparallel.reset()
        try:
            payload = pickle.dumps((*reply, gloo_loops()))
        except Exception as e:
            payload = pickle.dumps(("error", f"result of {fn.__name__} is not picklable: {e}",
                                    gloo_loops()))
        conn.send_bytes(payload)
    dist.destroy_process_group()


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def gloo_loops() -> int:
    """How many gloo transport threads this process runs (Linux; 0 elsewhere).

    Every gloo process group has its own event-loop thread that wakes every 10 ms, even
    idle, and cases create groups (meshes of new layouts) that live as long as the
    process: hundreds of them make every process of the machine crawl.
    """
    count = 0
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().strip() == "gloo_tcp_loop"
    return count


def _process_context() -> Any:
    """How worker processes start: forked from a server that has imported torch and this
    package once (``forkserver``), so a group of 8 starts in about a second instead of
    every rank importing them again (about 10 s on 2 cores); nothing in the server has
    started a process group or CUDA, and it imports torch with one OpenMP thread, as the
    workers run. ``spawn`` where forking is not available."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # missing ones are skipped; the package imports its API lazily (at the first use of
    # a name), so its heavy modules are named
    ctx.set_forkserver_preload([
        "modelparallel", "modelparallel.smp.state", "modelparallel.smp.appliers",
        "modelparallel.smp.v1.distributed_model", "modelparallel.smp.checkpoints",
        "modelparallel.models", "transformers"])
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # read by the server's imports (OpenMP, BLAS)
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    return ctx


class WorkerGroup:
    """``world_size`` gloo processes on this machine that run cases on demand."""

    def __init__(self, world_size: int, *, case_timeout_s: float = 300,
                 collective_timeout_s: float = 60, env: dict[str, str] | None = None,
                 max_gloo_groups: int = 24):
        self.world_size = world_size
        # past this many live gloo groups in a worker, the group restarts before the next
        # case (see gloo_loops)
        self.max_gloo_groups = max_gloo_groups
        self.case_timeout_s = case_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.env = env or {}
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._store: Any = None  # a TCPStore while the workers run

    def __enter__(self) -> WorkerGroup:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        import torch.distributed as dist

        if self.alive:
            return
        self.close()
        self._store = dist.TCPStore("127.0.0.1", 0, self.world_size + 1, is_master=True,
                                    wait_for_workers=False)
        ctx = _process_context()
        env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **self.env}
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, daemon=True,
                            args=(rank, self.world_size, self._store.port, child, env,
                                  self.collective_timeout_s))
            p.start()
            self._procs.append(p)
            self._conns.append(parent)
        self._collect("start-up", timeout_s=180)

    def run(self, fn: Callable[..., Any], **kwargs: Any) -> list[Any]:
        """Run ``fn(**kwargs)`` on every rank; return the results in rank order."""
        self.start()
        message = pickle.dumps((fn, kwargs))
        for conn in self._conns:
            conn.send_bytes(message)
        return self._collect(fn.__name__, timeout_s=self.case_timeout_s)

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        errors: dict[int, str] = {}
        loops = 0
        start = time.monotonic()
        deadline = start + timeout_s
        while pending:
            now = time.monotonic()
            if now > deadline:
                break
            for rank in list(pending):
                conn, proc = self._conns[rank], self._procs[rank]
                if conn.poll(0.05):
                    status, value, rank_loops = pickle.loads(conn.recv_bytes())
                    loops = max(loops, rank_loops)
                    pending.discard(rank)
                    if status == "error":
                        errors[rank] = value
                        # the others may wait in a collective for the failed rank
                        deadline = min(deadline, time.monotonic() + 10)
                    else:
                        results[rank] = value
                elif not proc.is_alive():
                    pending.discard(rank)
                    errors[rank] = f"process died with exit code {proc.exitcode}"
        # a half-finished group cannot run the next case; one where every rank answered
        # (all raised the same refusal, say) can, if its default group still works
        if pending or (errors and not self._healthy()) or loops > self.max_gloo_groups:
            self.close()
        if pending or errors:
            lines = [f"{what} failed on {self.world_size} ranks:"]
            lines += [f"--- rank {r} ---\n{msg}" for r, msg in sorted(errors.items())]
            if pending:
                waited = time.monotonic() - start
                why = " (10 s after the first error)" if errors else ""
                lines.append(f"no answer within {waited:.0f}s{why} from rank(s) "
                             f"{sorted(pending)}")
            raise WorkerError("\n".join(lines))
        return results

    def _healthy(self, timeout_s: float = 10) -> bool:
        """Whether every rank still answers and passes a barrier of the default group."""
        try:
            message = pickle.dumps((_barrier, {}))
            for conn in self._conns:
                conn.send_bytes(message)
            deadline = time.monotonic() + timeout_s
            for conn in self._conns:
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    return False
                if pickle.loads(conn.recv_bytes())[0] != "ok":
                    return False
        except (OSError, EOFError):
            return False
        return True

    def close(self, grace_s: float = 5) -> None:
        """Ask the workers to exit; kill those still running after ``grace_s``."""
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send_bytes(pickle.dumps((None, None)))
        deadline = time.monotonic() + grace_s
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join()
        self._procs, self._conns, self._store = [], [], None
