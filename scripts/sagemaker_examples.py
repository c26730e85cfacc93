"""Run public SageMaker example scripts (SMP v1, SMP v2, SMDDP) on modelparallel.

    python scripts/sagemaker_examples.py [--mirror OWNER/NAME=GIT_DIR ...] [--scratch DIR]
                                        [--only NAME ...] [--variant import-line|zero-lines]
                                        [--timeout S] [--list] [--compare-one-process]

Each example is extracted at its pinned commit from a git directory given with --mirror
(e.g. one made by `git clone --mirror`), or else cloned from GitHub into the scratch directory
(default /tmp/smp-examples). Nothing of their code is kept in this repository. The runner then
applies the edits the porting rules allow -- device (CUDA -> CPU), downloads -> synthetic data
of the same shape, NVIDIA-only imports removed, model size (command-line arguments only),
world-size assumptions, plain bugs of the script, and two more kinds, named as such: `dep`
(a package that is not installed here) and `env` (a SageMaker container path or S3 upload) --
each an exact search/replace listed in examples_catalog.py with the reason, and each written
into the edited file as a `# EDIT(kind)` comment. Two variants:

- import-line: SMP module paths rewritten to modelparallel's (`smdistributed.modelparallel.torch`
  -> `modelparallel`, `torch.sagemaker` -> `modelparallel`, the SMDDP modules ->
  `modelparallel.dataparallel`), launched with `modelparallel run`;
- zero-lines: imports untouched, launched with `modelparallel run --compat sagemaker`.

Missing pure-Python dependencies of the scripts (psutil, h5py, accelerate) are installed from
PyPI into <scratch>/_deps (put on PYTHONPATH), unless --no-install. A results table (script,
commit, edits, variant, result) is printed at the end; each run's output is in
<scratch>/<example>-<variant>.log.

With --compare-one-process, an example that names a one-process run (the SMP v2
context-parallel ones) is run again on one process, same files, edits and arguments, and
the figures it names (the batch-0 loss and gradient norm) must agree within its rtol.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from examples_catalog import EXAMPLES, Edit, Example
from examples_catalog_smp2 import SMP2_EXAMPLES
from smp_name_scan import FileScan
from smp_public_names import classify

# The import-line port (README, issue 16): SageMaker module path -> modelparallel's. Longest first.
IMPORT_LINE = [
    ("smdistributed.dataparallel.torch.parallel.distributed", "modelparallel.dataparallel"),
    ("smdistributed.dataparallel.torch.torch_smddp", "modelparallel.dataparallel"),
    ("smdistributed.dataparallel.torch.distributed", "modelparallel.dataparallel"),
    ("smdistributed.modelparallel.torch", "modelparallel"),
    ("smdistributed.modelparallel", "modelparallel"),
    ("torch.sagemaker", "modelparallel"),
]
VARIANTS = ("import-line", "zero-lines")
REPO_ROOT = Path(__file__).resolve().parents[1]


def git_dir_for(repo: str, mirrors: dict[str, Path], scratch: Path) -> Path:
    """The mirror given for ``repo``, or a clone of it from GitHub in the scratch directory."""
    if repo in mirrors:
        return mirrors[repo]
    target = scratch / "_git" / repo.replace("/", "+")
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "clone", "--mirror", "--filter=blob:none",
                        f"https://github.com/{repo}.git", str(target)], check=True)
    return target


def extract(ex: Example, git_dir: Path, dest: Path) -> None:
    """Write the example's files at its pinned commit into ``dest``."""
    if dest.exists():
        shutil.rmtree(dest)
    for rel, src in ex.files.items():
        blob = subprocess.run(["git", "--git-dir", str(git_dir), "show", f"{ex.commit}:{src}"],
                              capture_output=True, check=True).stdout
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(blob)


def apply_edit(dest: Path, edit: Edit) -> None:
    """One exact search/replace; each edited line carries an `# EDIT(kind): why` comment
    (at its end, or on a line of its own before a block of lines or in place of deleted lines)."""
    path = dest / edit.file
    text = path.read_text()
    found = text.count(edit.old)
    if found != edit.count:
        raise SystemExit(f"{edit.file}: expected {edit.count} x {edit.old!r}, found {found} "
                         f"(the pinned source changed?)")
    note = f"# EDIT({edit.kind}): {edit.why}"
    indent = re.match(r"[ \t]*", edit.old).group(0)  # type: ignore[union-attr]
    if not edit.new.strip():  # whole lines deleted: the note stays in their place
        path.write_text(text.replace(edit.old, f"{indent}{note}\n"))
        return
    if "\n" in edit.new.rstrip("\n"):  # a block of whole lines: the note before it
        path.write_text(text.replace(edit.old, f"{indent}{note}\n{edit.new}"))
        return
    out, pos = [], 0
    while (at := text.find(edit.old, pos)) >= 0:
        end = at + len(edit.old)
        eol = text.find("\n", end - 1 if edit.old.endswith("\n") else end)
        eol = len(text) if eol < 0 else eol
        new = edit.new.rstrip("\n")
        out.append(text[pos:at] + new + text[end:eol] if not edit.old.endswith("\n")
                   else text[pos:at] + new)
        out.append(f"  {note}")
        pos = eol
    out.append(text[pos:])
    path.write_text("".join(out))


def rewrite_imports(dest: Path) -> int:
    """The import-line port: every SMP module path in the example's files. Returns the count."""
    pattern = re.compile(r"\b(" + "|".join(re.escape(o) for o, _ in IMPORT_LINE) + r")\b")
    table = dict(IMPORT_LINE)
    count = 0
    for path in sorted(dest.rglob("*.py")):
        text = path.read_text()
        new, n = pattern.subn(lambda m: table[m.group(1)], text)
        if n:
            path.write_text(new)
            count += n
    return count


def ensure_deps(packages: set[str], deps: Path, install: bool) -> None:
    """Install into ``deps`` the example dependencies this interpreter cannot import."""
    missing = [p for p in sorted(packages)
               if subprocess.run([sys.executable, "-c", f"import {p}"], env=_env(deps, {}),
                                 capture_output=True).returncode != 0]
    if missing and install:
        print(f"installing into {deps}: {' '.join(missing)}")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(deps), *missing], check=True)


def _env(deps: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(deps), env.get("PYTHONPATH", "")) if p)
    env.pop("MODELPARALLEL_COMPAT", None)
    return env


def failure(log: str) -> str:
    """The launcher summary's error line (or the last traceback line) of a failed run."""
    found = re.findall(r"^\s*error: (.+)$", log, re.M)
    if found:
        return found[-1].strip()
    lines = [ln for ln in log.splitlines() if re.match(r"(\[rank\d+\]: )?\w+(Error|Exception)", ln)]
    return lines[-1].strip() if lines else (log.strip().splitlines() or ["no output"])[-1]


def _launch(cmd: list[str], workdir: Path, env: dict[str, str], timeout: int) -> tuple[str, int]:
    try:
        done = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True,
                              timeout=timeout)
        return done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        out = [x.decode() if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr)]
        return "".join(out), -1


def run_example(ex: Example, variant: str, git_dir: Path, scratch: Path, deps: Path,
                timeout: int, one_process: bool = False) -> tuple[str, str, str]:
    """(result, edits, output) of one example in one variant; with ``one_process``, of its
    one-process run (``ex.one_process``), which passes when its figures are printed."""
    dest = scratch / f"{ex.name}-{variant}{'-one-process' if one_process else ''}"
    extract(ex, git_dir, dest)
    for edit in ex.edits:
        apply_edit(dest, edit)
    n_imports = rewrite_imports(dest) if variant == "import-line" else 0
    workdir = dest / ex.workdir
    single = ex.one_process if one_process else None
    env = _env(deps, {k: v.replace("{dest}", str(dest))
                      for k, v in (single.env if single else ex.env).items()})
    if ex.setup is not None:
        ex.setup(dest)
    cmd = [sys.executable, "-m", "modelparallel", "run", "--nproc-per-node",
           str(1 if single else ex.nproc)]
    if variant == "zero-lines":
        cmd += ["--compat", "sagemaker"]
    cmd += [ex.entry, *(a.replace("{dest}", str(dest)) for a in ex.args)]
    log_path = scratch / f"{dest.name}.log"
    start = time.time()
    log, rc = _launch(cmd, workdir, env, timeout)
    then = None if single else ex.then
    if rc == 0 and then:  # the second run (a resume) in the same folder
        more, rc = _launch([*cmd, *(a.replace("{dest}", str(dest)) for a in then)], workdir,
                           env, timeout)
        log += "\n=== second run: " + " ".join(then) + "\n" + more
    log_path.write_text(f"$ cd {workdir} && {' '.join(cmd)}\n{log}")
    took = f"{time.time() - start:.0f}s"
    success = single.figures if single else ex.success
    ok = rc == 0 and (success is None or len(re.findall(success, log)) >= (2 if then else 1))
    if rc == -1:
        result = f"FAIL (timeout after {timeout}s)"
    elif ok:
        result = f"pass ({took})"
    else:
        result = f"FAIL: {failure(log)[:300]}"
    imports = f" + {n_imports} import-line" if variant == "import-line" else ""
    return result, f"{len(ex.edits)}{imports}", log


def figures(pattern: str, log: str) -> dict[str, float]:
    """The named groups of the first match of ``pattern`` in ``log``, as numbers."""
    found = re.search(pattern, log)
    return {k: float(v) for k, v in found.groupdict().items()} if found else {}


def compare_with_one_process(ex: Example, variant: str, log: str, run_one) -> str:
    """Run ``ex`` on one process (``run_one(one_process=True)``) and compare the figures
    its ``one_process.figures`` names: 'equal ...' or 'FAIL: ...'."""
    assert ex.one_process is not None
    result, _, single_log = run_one(one_process=True)
    if not result.startswith("pass"):
        return f"FAIL: the one-process run: {result}"
    many, one = figures(ex.one_process.figures, log), figures(ex.one_process.figures, single_log)
    if not many or set(many) != set(one):
        return f"FAIL: figures {sorted(many)} vs one process's {sorted(one)}"
    rows, worst = [], 0.0
    for name in many:
        rel = abs(many[name] - one[name]) / max(abs(one[name]), 1e-30)
        worst = max(worst, rel)
        rows.append(f"{name} {many[name]:.9g} vs {one[name]:.9g} (rel {rel:.1e})")
    verdict = "equal" if worst <= ex.one_process.rtol else "FAIL: differ"
    return f"{verdict} to one process [{variant}]: {', '.join(rows)}"


# Looks SMP names up as `modelparallel run --compat sagemaker` resolves them, without running
# anything: the longest importable module, then attributes (statically on objects, so
# tsm.state.X needs no init()), and for a keyword argument that the callable declares it.
LOOKUP = r"""
import importlib, inspect, json, sys, typing
def lookup(name, kwarg, instance):
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:end]))
            break
        except ImportError as e:
            error = e
    else:
        raise error
    for i, attr in enumerate(parts[end:]):
        if instance and i == len(parts) - end - 1 and not isinstance(obj, type):
            return  # a factory (SMDDP's DDP returns torch's): the instance is not ours to check
        obj = getattr(obj, attr) if inspect.ismodule(obj) else inspect.getattr_static(obj, attr)
        if isinstance(obj, property):  # follow its return type, if it states one
            hint = typing.get_type_hints(obj.fget).get("return")
            if not isinstance(hint, type):
                return
            obj = hint
    if kwarg:
        params = inspect.signature(obj).parameters
        if kwarg not in params and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            raise TypeError(f"takes no argument {kwarg!r}")
out = {}
for name, kwarg, instance in json.load(sys.stdin):
    try:
        lookup(name, kwarg, instance)
    except Exception as e:
        out[name + (f"({kwarg}=)" if kwarg else "")] = f"{type(e).__name__}: {e}"[:160]
print(json.dumps(out))
"""


def missing_names(dest: Path) -> dict[str, str]:
    """The SMP names the example's files use that do not resolve on modelparallel (all of
    them, where a run stops at the first), name -> error."""
    scans = []
    for path in sorted(dest.rglob("*.py")):
        scan = FileScan(ast.parse(path.read_text()))
        scan.scan()
        scans.append((f"0|example@0:{path.relative_to(dest)}", scan))
    wanted = sorted({(e["name"], e.get("kwarg", ""), bool(e.get("instance")))
                     for e in classify(scans) if e["kind"] != "backend"})
    env = {**os.environ, "MODELPARALLEL_COMPAT": "sagemaker"}
    done = subprocess.run([sys.executable, "-c", LOOKUP], input=json.dumps(wanted), env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return {"(lookup failed)": done.stderr.strip().splitlines()[-1]}
    return dict(json.loads(done.stdout.splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mirror", action="append", default=[], metavar="OWNER/NAME=GIT_DIR")
    ap.add_argument("--scratch", default="/tmp/smp-examples", type=Path)
    ap.add_argument("--only", nargs="*", help="example names (default: all; see --list)")
    ap.add_argument("--variant", choices=VARIANTS, action="append")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per run")
    ap.add_argument("--no-install", action="store_true", help="install no missing dependency")
    ap.add_argument("--list", action="store_true", help="list the examples and their edits")
    ap.add_argument("--compare-one-process", action="store_true",
                    help="also run the examples that name a one-process run so on one "
                         "process, and compare the figures they name")
    ap.add_argument("--names", action="store_true",
                    help="only list, per example, the SMP names it uses that do not resolve")
    args = ap.parse_args()
    chosen = [e for e in [*EXAMPLES, *SMP2_EXAMPLES] if not args.only or e.name in args.only]
    if args.list:
        for ex in chosen:
            print(f"{ex.name}: {ex.repo}@{ex.commit[:9]} {ex.entry} ({ex.nproc} ranks)")
            print(f"  {ex.note}")
            for ed in ex.edits:
                print(f"  - {ed.file}: EDIT({ed.kind}) {ed.why}")
        return
    mirrors = {k: Path(v) for k, v in (m.split("=", 1) for m in args.mirror)}
    args.scratch.mkdir(parents=True, exist_ok=True)
    deps = args.scratch / "_deps"
    ensure_deps({d for ex in chosen for d in ex.deps}, deps, not args.no_install)
    if args.names:
        for ex in chosen:
            dest = args.scratch / f"{ex.name}-names"
            extract(ex, git_dir_for(ex.repo, mirrors, args.scratch), dest)
            found = missing_names(dest)
            print(f"{ex.name}: {len(found)} SMP name(s) used that do not resolve")
            for name, error in sorted(found.items()):
                print(f"  {name}: {error}")
        return
    rows = []
    for ex in chosen:
        git_dir = git_dir_for(ex.repo, mirrors, args.scratch)
        for variant in args.variant or VARIANTS:
            print(f"--- {ex.name} [{variant}]", flush=True)
            run = functools.partial(run_example, ex, variant, git_dir, args.scratch, deps,
                                    args.timeout)
            try:
                result, edits, log = run()
                if args.compare_one_process and ex.one_process and result.startswith("pass"):
                    compared = compare_with_one_process(ex, variant, log, run)
                    print(f"    {compared}", flush=True)
                    result = compared if compared.startswith("FAIL") else f"{result}; {compared}"
            except (SystemExit, subprocess.CalledProcessError) as e:  # an edit no longer applies
                result, edits = f"ERROR (runner): {e}", "?"
            print(f"    {result}", flush=True)
            rows.append((ex.name, f"{ex.repo}@{ex.commit[:9]}", edits, variant, result))
    print("\n| script | commit | edits | variant | result |\n|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(r.replace("|", "\\|") for r in row) + " |")


if __name__ == "__main__":
    main()
