"""Run a user's script as one worker, recording an uncaught error for the launcher.

``python -m modelparallel.launch.worker script.py [args...]`` runs the script as
``__main__`` (like ``python script.py``). An uncaught exception is printed once,
without the wrapper's own frames, and written to the file torchrun's agent reads
(``TORCHELASTIC_ERROR_FILE``), so ``modelparallel run`` can name the failing rank and
show its traceback without the script using ``@record``.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import runpy
import sys
import threading
import time
import traceback

import modelparallel_compat
from modelparallel.doctor import configured_timeout, start_from_environment
from modelparallel.doctor.frames import is_user_file
from modelparallel.launch import warnings_once
from modelparallel.launch.lifeline import die_with_parent

# What a collective that waited too long raises: gloo's RuntimeError ("Timed out waiting
# 5000ms for recv operation to complete") and nccl's watchdog ("Watchdog caught
# collective operation timeout: WorkNCCL(...) ran for 600042 milliseconds").
COLLECTIVE_TIMEOUT = re.compile(r"timed out waiting \d+ ?ms for \w+ operation|"
                                r"collective operation timeout", re.IGNORECASE)


# What torch's clip_grad_norm_ raises over gradients it cannot add up: DTensors on several
# meshes (stacking their norms), or DTensors with plain tensors.
TORCH_CLIP_MIXED = re.compile(r"must have the same mesh|got mixed torch\.Tensor and DTensor")
TORCH_CLIP_FUNCTIONS = {"clip_grad_norm_", "get_total_norm", "_get_total_norm"}


def torch_clip_hint(error: BaseException) -> str | None:
    """The one line for torch's ``clip_grad_norm_`` failing on a model whose gradients it
    cannot add up (tensor parallelism without one mesh for all parameters), or None.
    ``mp.init`` routes the function to ``mp.clip_grad_norm_`` (smp/torch_clip_hook.py), so
    this is torch's own, bound before ``mp.init``."""
    frames = traceback.extract_tb(error.__traceback__)
    if not TORCH_CLIP_MIXED.search(str(error)) or not any(
            f.name in TORCH_CLIP_FUNCTIONS and "clip_grad" in f.filename for f in frames):
        return None
    return ("torch.nn.utils.clip_grad_norm_ cannot add up this model's gradient norms (its "
            "parameters are DTensors on several meshes, or DTensors and plain tensors): call "
            "mp.clip_grad_norm_(model, max_norm) (SMP v2: torch.sagemaker.grad_norm."
            "clip_grad_norm_), which returns the global norm of any layout; "
            "torch.nn.utils.clip_grad_norm_ looked up after mp.init() calls it itself "
            "(this one was bound before)")


def _user_frames(error: BaseException, script: str):
    """The traceback from the first frame of the user's script on."""
    tb = error.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != script:
        tb = tb.tb_next
    return tb or error.__traceback__


def is_collective_timeout(error: BaseException | None) -> bool:
    """Whether ``error`` (or an error it was raised from) is a collective's timeout."""
    # torch's backend error type, if the script imported torch.distributed; () matches none
    backend_error = getattr(sys.modules.get("torch.distributed"), "DistBackendError", ())
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        if COLLECTIVE_TIMEOUT.search(text) or (
                isinstance(error, backend_error) and re.search(r"time[ds]? ?out", text, re.I)):
            return True
        error = error.__cause__ or error.__context__
    return False


def timeout_hint() -> str:
    """What to do about a collective timeout, with the configured timeout if known."""
    setting = "collective_timeout"
    configured = configured_timeout()
    if configured is not None:
        setting += f"={configured:g}s"
    return (f"hint: a collective waited longer than {setting}: another rank failed, was "
            f"killed, or did not call the same collective; the launcher names the rank "
            f"that failed first; raise collective_timeout in the config if the work "
            f"between collectives is just slow")


def write_error_file(message: str, formatted: str, user_site: str | None = None,
                     diagnosis: str | None = None) -> None:
    """What the launcher's summary reads: the error line, the traceback, the innermost
    line of the user's code and the doctor's diagnosis."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    info = {"py_callstack": formatted, "timestamp": str(int(time.time()))}
    if user_site:
        info["user_site"] = user_site
    if diagnosis:
        info["diagnosis"] = diagnosis
    with open(path, "w") as f:
        json.dump({"message": {"message": message, "extraInfo": info}}, f)


def innermost_user_line(error: BaseException) -> str | None:
    """``file:line: source`` of the innermost frame of the user's own code."""
    found = None
    for frame in traceback.extract_tb(error.__traceback__):
        if is_user_file(frame.filename):
            found = f"{frame.filename}:{frame.lineno}" + (f": {frame.line}" if frame.line else "")
    return found


def out_of_memory_report(error: BaseException) -> str | None:
    """For a CUDA out-of-memory error: this rank, its device and what torch held there."""
    torch = sys.modules.get("torch")
    oom = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    if torch is None or oom is None or not isinstance(error, oom):
        return None
    rank = os.environ.get("RANK", "0")
    device = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    asked = re.search(r"Tried to allocate ([\d.]+ \w+)", str(error))
    gib = 2 ** 30
    return (f"rank {rank} ran out of GPU memory on cuda:{device}"
            f"{f' asking for {asked.group(1)}' if asked else ''}: torch held "
            f"{torch.cuda.memory_allocated(device) / gib:.2f} GiB in tensors, "
            f"{torch.cuda.memory_reserved(device) / gib:.2f} GiB reserved; "
            f"{free / gib:.2f} of {total / gib:.2f} GiB free on the device")


def end_with_verdict(diagnosis: str) -> None:
    """The doctor found a fault (watchdog thread): record it and end this rank; the
    launcher stops the others and prints the diagnosis."""
    write_error_file("DoctorVerdict: " + diagnosis.splitlines()[0], "", None, diagnosis)
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):  # no launcher summary to print it
        sys.stderr.write(diagnosis + "\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


def check_instance_order() -> None:
    """In a training job, the instance the job calls node N must be torchrun's node N
    (the rendezvous numbers nodes by address), or host names, model artifacts and
    shards would belong to the wrong ranks."""
    index, group = os.environ.get("MP_INSTANCE_INDEX"), os.environ.get("GROUP_RANK")
    if index is not None and group is not None and index != group:
        raise RuntimeError(
            f"instance {os.environ.get('MP_CURRENT_HOST')} is node {index} of the job but "
            f"torchrun's rendezvous numbered it node {group}: the instances' addresses do "
            f"not sort in instance order; the job's backend must give them such addresses")


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m modelparallel.launch.worker script.py [args...]")
    die_with_parent()  # a worker whose launcher was killed ends too
    warnings_once.fold_from_environment()  # before the script imports anything that warns
    script = os.path.abspath(sys.argv[1])
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(script))
    doctor = None
    try:
        check_instance_order()
        # MODELPARALLEL_COMPAT (modelparallel run --compat): also without the .pth file
        modelparallel_compat.install_from_environment()
        doctor = start_from_environment(end_with_verdict)
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if done.code not in (None, 0):
            _exit(record_exit(done))
    except BaseException as error:
        timed_out = is_collective_timeout(error)
        diagnosis, user_line = None, innermost_user_line(error)
        if doctor is not None and (timed_out or _distributed_error(error)):
            diagnosis = doctor.explain(timed_out, user_line and user_line.split(": ", 1)[0])
        diagnosis = diagnosis or out_of_memory_report(error)
        if timed_out:  # after the error line, or the diagnosis's last line
            if diagnosis is None:
                error.add_note(timeout_hint())
            else:
                diagnosis += "\n" + timeout_hint()
        hint = torch_clip_hint(error)
        if hint is not None:
            error.add_note(hint)
        formatted = "".join(traceback.format_exception(
            type(error), error, _user_frames(error, script)))
        # the launcher prints it once for all ranks (its summary); the worker's log keeps
        # the whole traceback
        write_error_file(f"{type(error).__name__}: {hint or error}", formatted, user_line,
                         diagnosis)
        if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
            sys.stderr.write(formatted)
        _exit(1)
    if doctor is not None:
        doctor.finish()
    _exit(0)


def record_exit(done: SystemExit) -> int:
    """Record a ``sys.exit(CODE)`` that ended the script (its code, and where in the
    user's code it was called) for the launcher's summary; the exit code to end with."""
    code = done.code if isinstance(done.code, int) else 1
    if not isinstance(done.code, int):  # sys.exit("message") prints the message
        sys.stderr.write(f"{done.code}\n")
    text = f"exited with code {code}" + ("" if isinstance(done.code, int) else f": {done.code}")
    write_error_file(f"SystemExit: the script {text}", "", innermost_user_line(done))
    return code


def _distributed_error(error: BaseException) -> bool:
    """An error a backend raised (a peer went away, sizes did not match, ...)."""
    backend_error = getattr(sys.modules.get("torch.distributed"), "DistBackendError", ())
    return isinstance(error, backend_error) or "gloo" in str(error).lower() or \
        "nccl" in str(error).lower()


def _exit(code: int) -> None:
    """End the worker without running C++ destructors: at interpreter exit, gloo's
    threads of a process group still open are sometimes destroyed while joinable
    ("terminate called without an active exception", SIGABRT), so a run that succeeded
    would fail; and after a failure, destroying a group whose peer is stalled waits for
    that peer. The script's atexit handlers run first (after a failure for at most 10
    seconds: one may itself wait on a peer), and the output is flushed."""
    if code == 0:
        atexit._run_exitfuncs()
    else:
        handlers = threading.Thread(target=atexit._run_exitfuncs, daemon=True)
        handlers.start()
        handlers.join(10.0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
