"""List every SMP v1 / SMP v2 / SMDDP name that public code uses.

Reads git mirrors of the public repositories (the SageMaker examples,
awsome-distributed-training and the HyperPod NeMo adapter), parses every stored version of
every Python file that mentions `smdistributed`, `torch.sagemaker` or `smddp`, and writes
tests/data/smp_public_names.json:

    [{"name": "torch.sagemaker.delayed_param.DelayedParamIniter", "kind": "class",
      "used_by": ["aws/amazon-sagemaker-examples@a39b68fa5:<path>", ...]}, ...]

kind is module, class, function, attribute (a module-level object, or with "instance": true
a method/attribute used on an instance of that SMP class), state_attribute (`tsm.state.X`,
`smp.state.X`, `smp.state.cfg.X`, `tsm.state.ranker.X`), kwarg (one entry per keyword argument
passed to an SMP callable, with "kwarg") or backend (a file passing backend "smddp" to
`torch.distributed.init_process_group`, or choosing it from a variable it compares with
"smddp"; named after the module whose import registers it). `used_by` names, for each path,
the newest stored version using the name. Nothing is imported or run: files are only parsed.

    python scripts/smp_public_names.py --mirror aws/amazon-sagemaker-examples=/path/to/git-dir \
        --mirror aws-samples/awsome-distributed-training=... \
        --mirror aws/sagemaker-hyperpod-training-adapter-for-nemo=... [--out FILE]
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
from collections import defaultdict
from pathlib import Path

from smp_name_scan import CALLABLES, EXTRA_MODULES, MENTION, FileScan, is_smp


def versions(git_dir: Path) -> list[tuple[str, int, str, str]]:
    """(commit, time, path, text) of every stored version of a .py file that mentions SMP/SMDDP."""
    log = subprocess.run(
        [
            "git",
            "--git-dir",
            str(git_dir),
            "log",
            "--all",
            "--no-renames",
            "--format=C %H %ct",
            "--name-only",
        ],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    pairs: list[tuple[str, int, str]] = []
    commit, when = "", 0
    for line in log.split("\n"):
        if line.startswith("C "):
            _, commit, stamp = line.split(" ")
            when = int(stamp)
        elif line.endswith(".py"):
            pairs.append((commit, when, line))
    specs = "".join(f"{c}:{p}\n" for c, _, p in pairs)
    check = subprocess.run(
        ["git", "--git-dir", str(git_dir), "cat-file", "--batch-check"],
        input=specs,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split("\n")
    blob_of = [
        ln.split(" ")[0] if ln.endswith("blob " + ln.split(" ")[-1]) else ""
        for ln in check[: len(pairs)]
    ]
    wanted = sorted({b for b in blob_of if b})
    texts = _read_blobs(git_dir, wanted)
    out: list[tuple[str, int, str, str]] = []
    for (c, t, p), b in zip(pairs, blob_of, strict=True):
        text = texts.get(b)
        if text and MENTION.search(text):
            out.append((c, t, p, text))
    return out


def _read_blobs(git_dir: Path, blobs: list[str]) -> dict[str, str]:
    raw = subprocess.run(
        ["git", "--git-dir", str(git_dir), "cat-file", "--batch"],
        input="".join(b + "\n" for b in blobs).encode(),
        capture_output=True,
        check=False,
    ).stdout
    texts, pos = {}, 0
    for b in blobs:
        end = raw.index(b"\n", pos)
        header = raw[pos:end].decode().split(" ")
        if len(header) < 3 or header[1] != "blob":
            pos = end + 1
            continue
        size = int(header[2])
        texts[b] = raw[end + 1 : end + 1 + size].decode("utf-8", "replace")
        pos = end + 1 + size + 1
    return texts


def classify(scans: list[tuple[str, FileScan]]) -> list[dict]:
    """Turn raw chains into (name, kind) entries with the locations that use them."""
    modules = set(EXTRA_MODULES)
    for _, s in scans:
        modules |= s.modules
    chains: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for loc, s in scans:
        for c, how in s.chains.items():
            chains[c][loc] |= how
        for full in [*s.alias.values(), *s.modules]:  # imported, used or not
            if is_smp(full):
                chains[full][loc].add("import")
    changed = True
    while changed:  # a lowercase name used as a namespace is a module (tsm_utils.timeit, smp.nn.X)
        changed = False
        for c in chains:
            parts = c.split(".")
            for i in range(2, len(parts) - 1):
                pre, seg = ".".join(parts[:i]), parts[i]
                name = f"{pre}.{seg}"
                if (
                    pre in modules
                    and seg not in ("state", "cfg")
                    and seg.islower()
                    and name not in modules
                    and _only_namespace(name, chains)
                ):
                    modules.add(name)
                    changed = True
    entries: dict[tuple, dict] = {}

    def add(name: str, kind: str, loc: str, how: set[str] | None = None, **extra: str) -> None:
        key = (name, kind, tuple(sorted(extra.items())))
        e = entries.setdefault(
            key, {"name": name, "kind": kind, **extra, "used_by": set(), "access": set()}
        )
        e["used_by"].add(loc)
        if how and kind == "state_attribute":
            e["access"] |= {h for h in how if h in ("read", "write", "call")}

    called = {c for c, locs in chains.items() if any("call" in h for h in locs.values())}
    for c, locs in chains.items():
        for loc, how in locs.items():
            for name, kind, h in split_chain(c, modules, called, how):
                add(name, kind, loc, h)
    for loc, s in scans:
        for dotted, kw in s.kwargs:
            target = next(
                (n for n, _, _ in reversed(split_chain(dotted, modules, called, {"call"}))), dotted
            )
            add(target, "kwarg", loc, kwarg=kw)
        for cls, attr in s.instance:
            add(f"{cls}.{attr}", "attribute", loc, instance="true")
        for cls, meth, kw in s.instance_kwargs:
            add(f"{cls}.{meth}", "kwarg", loc, kwarg=kw, instance="true")
        if s.backend:
            # the module whose import registers the backend names the entry
            add(
                "smdistributed.dataparallel.torch.torch_smddp",
                "backend",
                loc,
                backend="smddp",
                call="torch.distributed.init_process_group",
            )
    return _finish(entries.values())


def _only_namespace(path: str, chains: dict) -> bool:
    uses = [c for c in chains if c == path or c.startswith(path + ".")]
    return any(c != path for c in uses) and not any(
        c == path and any("call" in h for h in chains[c].values()) for c in uses
    )


def split_chain(
    chain: str, modules: set[str], called: set[str], how: set[str]
) -> list[tuple[str, str, set]]:
    """(name, kind, access) for a chain like torch.sagemaker.state.cp_size."""
    parts = chain.split(".")
    cut = max((i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules), default=0)
    if cut == 0:
        return []
    mod, rest = ".".join(parts[:cut]), parts[cut:]
    out: list[tuple[str, str, set]] = [(mod, "module", set())]
    if not rest:
        return out
    obj = f"{mod}.{rest[0]}"
    if rest[0] == "state":
        out.append((obj, "attribute", set()))
        if len(rest) > 1:
            out.append((f"{obj}.{rest[1]}", "state_attribute", how if len(rest) == 2 else {"read"}))
        if len(rest) > 2:  # smp.state.cfg.fp16, tsm.state.ranker.get_rep_rank
            out.append(
                (
                    f"{obj}.{rest[1]}.{rest[2]}",
                    "state_attribute",
                    how if len(rest) == 3 else {"read"},
                )
            )
        return out
    leaf = rest[0].lstrip("_")
    if leaf[:1].isupper() and not leaf.isupper():
        kind = "class"
    elif leaf.isupper():
        kind = "attribute"
    elif obj in called or leaf in CALLABLES or leaf.startswith("translate_"):
        kind = "function"
    else:
        kind = "attribute"
    out.append((obj, kind, set()))
    if len(rest) > 1 and kind == "class":
        out.append((f"{obj}.{rest[1]}", "attribute", set()))
    return out


def _finish(entries) -> list[dict]:
    result = []
    for e in entries:
        newest: dict[str, tuple[int, str]] = {}
        for loc in e["used_by"]:
            when, rest = loc.split("|", 1)
            key = rest.split("@")[0] + ":" + rest.split(":", 1)[1]
            if key not in newest or int(when) > newest[key][0]:
                newest[key] = (int(when), rest)
        e["used_by"] = sorted(v for _, v in newest.values())
        if e.get("instance") == "true":
            e["instance"] = True  # a method/attribute used on an instance of that class
        if not e["access"]:
            del e["access"]
        else:
            e["access"] = sorted(e["access"])
        result.append(e)
    order = {
        "module": 0,
        "class": 1,
        "function": 2,
        "attribute": 3,
        "state_attribute": 4,
        "kwarg": 5,
        "backend": 6,
    }
    return sorted(result, key=lambda e: (order[e["kind"]], e["name"], e.get("kwarg", "")))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mirror", action="append", required=True, metavar="OWNER/NAME=GIT_DIR")
    ap.add_argument(
        "--out",
        default=str(Path(__file__).resolve().parents[1] / "tests/data/smp_public_names.json"),
    )
    args = ap.parse_args()
    scans: list[tuple[str, FileScan]] = []
    for spec in args.mirror:
        repo, git_dir = spec.split("=", 1)
        seen: dict[str, FileScan] = {}
        for commit, when, path, text in versions(Path(git_dir)):
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue  # Python 2 files of the old examples
            s = seen.get(text)
            if s is None:
                s = seen[text] = FileScan(tree)
                s.scan()
            scans.append((f"{when}|{repo}@{commit[:9]}:{path}", s))
        print(f"{repo}: {len(scans)} file versions so far")
    result = classify(scans)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    # one entry a line: compact, and a diff shows which names changed
    Path(args.out).write_text("[\n" + ",\n".join(json.dumps(e) for e in result) + "\n]\n")
    kinds: dict[str, int] = defaultdict(int)
    for e in result:
        kinds[e["kind"]] += 1
    print(f"{len(result)} entries -> {args.out}: {dict(kinds)}")


if __name__ == "__main__":
    main()
