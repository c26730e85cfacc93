"""Parse one Python file for the SMP v1 / SMP v2 / SMDDP names it uses (helper of
smp_public_names.py): imported module paths and aliases, attribute chains through them, keyword
arguments of SMP calls, attributes used on instances of SMP classes, and the "smddp" backend."""

from __future__ import annotations

import ast
import re
from collections import defaultdict

ROOTS = ("torch.sagemaker", "smdistributed.modelparallel", "smdistributed.dataparallel")
# TensorFlow flavours are out of scope (modelparallel is PyTorch only).
EXCLUDED = ("smdistributed.modelparallel.tensorflow", "smdistributed.dataparallel.tensorflow")
MENTION = re.compile(r"smdistributed|torch\.sagemaker|torch_smddp|smddp")
# Module paths reached by attribute access only (never imported by name in the scanned code), so the
# parser cannot tell them from attributes; taken from the SMP package layout (../shared/smp-api.md).
EXTRA_MODULES = {
    "smdistributed.modelparallel.torch.nn",
    "smdistributed.modelparallel.torch.nn.huggingface",
    "smdistributed.modelparallel.torch.nn.huggingface.gpt2",
    "smdistributed.modelparallel.torch.nn.huggingface.gptj",
    "smdistributed.modelparallel.torch.nn.huggingface.gptneo",
    "smdistributed.modelparallel.torch.nn.huggingface.gptneox",
    "smdistributed.modelparallel.torch.nn.huggingface.bert",
    "smdistributed.modelparallel.torch.nn.huggingface.roberta",
    "smdistributed.modelparallel.torch.nn.huggingface.t5",
    "smdistributed.modelparallel.torch.optimizers",
    "smdistributed.modelparallel.torch.amp",
    "smdistributed.modelparallel.torch.patches",
    "smdistributed.modelparallel.torch.patches.checkpoint",
    "smdistributed.dataparallel.torch",
    "smdistributed.dataparallel.torch.distributed",
    "torch.sagemaker.utils",
    "torch.sagemaker.distributed",
    "torch.sagemaker.distributed.checkpoint",
}
INIT_CALLS = ("init_process_group", "init_distributed")
# Imported but never called in the scanned code (decorators, callbacks, imports kept for later use):
# callables all the same, per ../shared/smp-api.md and their use.
CALLABLES = {
    "step",
    "dump_model",
    "verify",
    "rmsg",
    "retry_with_jitter",
    "register_tp_processing_pre_comm_hook",
}
# A typo in one public version, fixed by the next commit (that script could not run): not SMP.
NOT_SMP = ("smdistributed.modelparallel.torch.nn.huggingface.j",)


def is_smp(dotted: str) -> bool:
    """Whether a dotted path lies under an SMP/SMDDP PyTorch package."""
    hit = any(dotted == r or dotted.startswith(r + ".") for r in ROOTS)
    return hit and not any(dotted == e or dotted.startswith(e + ".") for e in EXCLUDED + NOT_SMP)


class FileScan:
    """Names one parsed file uses: raw chains, calls with keyword arguments, instance attributes."""

    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.alias: dict[str, str] = {}
        self.modules: set[str] = set()
        self.chains: dict[str, set[str]] = defaultdict(set)  # chain -> {"read","write","call"}
        self.kwargs: set[tuple[str, str]] = set()
        self.instance: set[tuple[str, str]] = set()  # (class path, attribute)
        self.instance_kwargs: set[tuple[str, str, str]] = set()
        self.backend = False
        self._imports()

    def _imports(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if is_smp(a.name):
                        self.modules.add(a.name)
                    if a.asname:
                        self.alias[a.asname] = a.name
                    else:
                        root = a.name.split(".")[0]
                        self.alias[root] = root
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                if is_smp(node.module):
                    self.modules.add(node.module)
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if is_smp(full) or node.module in ("torch", "smdistributed"):
                        self.alias[a.asname or a.name] = full

    def resolve(self, node: ast.AST) -> str | None:
        """The dotted path an expression names through imported aliases, or None."""
        if isinstance(node, ast.Name):
            return self.alias.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def scan(self) -> None:
        parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                parents[child] = node
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.Name, ast.Attribute)):
                up = parents.get(node)
                if isinstance(up, ast.Attribute) and up.value is node:
                    continue  # only the longest chain
                dotted = self.resolve(node)
                if not dotted or not is_smp(dotted):
                    continue
                if isinstance(up, ast.Call) and up.func is node:
                    how = "call"
                elif isinstance(getattr(node, "ctx", None), ast.Store):
                    how = "write"
                else:
                    how = "read"
                self.chains[dotted].add(how)
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and is_smp(node.value)
                and re.fullmatch(r"[A-Za-z_][\w.]*", node.value)
            ):
                self.chains[node.value].add(
                    "read"
                )  # mock.patch("torch.sagemaker.state.X") in tests
            if isinstance(node, ast.Call):
                dotted = self.resolve(node.func)
                if dotted and is_smp(dotted):
                    for kw in node.keywords:
                        if kw.arg:
                            self.kwargs.add((dotted, kw.arg))
                name = (
                    node.func.attr
                    if isinstance(node.func, ast.Attribute)
                    else getattr(node.func, "id", "")
                )
                if name in INIT_CALLS and _mentions_smddp(node):
                    self.backend = True
        if self.backend is False and _file_has_smddp_constant(self.tree) and _calls_init(self.tree):
            self.backend = True  # backend chosen by a variable compared with "smddp" (v2 train_lib)
        InstanceTracker(self).run()


def _mentions_smddp(call: ast.Call) -> bool:
    values = list(call.args) + [k.value for k in call.keywords]
    return any(isinstance(v, ast.Constant) and v.value == "smddp" for v in values)


def _file_has_smddp_constant(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.Constant) and n.value == "smddp" for n in ast.walk(tree))


def _calls_init(tree: ast.Module) -> bool:
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in INIT_CALLS:
                return True
    return False


class InstanceTracker:
    """Attributes used on instances of SMP classes, following a variable in source order within a
    function and into local functions it is passed to (positionally or by keyword)."""

    def __init__(self, scan: FileScan) -> None:
        self.scan = scan
        self.funcs = {f.name: f for f in ast.walk(scan.tree) if isinstance(f, ast.FunctionDef)}
        self.param_types: dict[str, dict[str, str]] = defaultdict(dict)
        self.step_funcs = {
            n for n, f in self.funcs.items() if any(self._is_step(d) for d in f.decorator_list)
        }

    def _is_step(self, deco: ast.AST) -> bool:
        target = deco.func if isinstance(deco, ast.Call) else deco
        dotted = self.scan.resolve(target)
        return bool(dotted and is_smp(dotted) and dotted.endswith(".step"))

    def _class_of_call(self, value: ast.AST) -> str | None:
        if not isinstance(value, ast.Call):
            return None
        if isinstance(value.func, ast.Name) and value.func.id in self.step_funcs:
            step_mod = next(
                iter(d for d in self.scan.modules if d.endswith("modelparallel.torch")), None
            )
            return f"{step_mod or 'smdistributed.modelparallel.torch'}.StepOutput"
        dotted = self.scan.resolve(value.func)
        if dotted and is_smp(dotted):
            leaf = dotted.rsplit(".", 1)[-1]
            if leaf[:1].isupper() and not leaf.isupper():
                return dotted
        return None

    def run(self) -> None:
        bodies: list[ast.Module | ast.FunctionDef] = [self.scan.tree, *self.funcs.values()]
        for _ in range(4):  # fixpoint over local calls
            before = sum(len(v) for v in self.param_types.values())
            for body in bodies:
                self._walk(body)
            if sum(len(v) for v in self.param_types.values()) == before:
                break

    def _self_types(self) -> dict[str, str]:
        # self.x = SMPClass(...) in one method, self.x.attr in another
        out = {}
        for node in ast.walk(self.scan.tree):
            if isinstance(node, ast.Assign):
                cls = self._class_of_call(node.value)
                for tgt in node.targets:
                    key = _target_key(tgt)
                    if cls and key and key.startswith("self."):
                        out[key] = cls
        return out

    def _walk(self, body: ast.Module | ast.FunctionDef) -> None:
        types: dict[str, str] = dict(self._self_types())
        if isinstance(body, ast.FunctionDef):
            types.update(self.param_types.get(body.name, {}))
            nodes = [n for stmt in body.body for n in ast.walk(stmt)]
        else:
            nodes = [
                n
                for stmt in body.body
                if not isinstance(stmt, ast.FunctionDef)
                for n in ast.walk(stmt)
            ]
        for node in sorted(
            nodes, key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0))
        ):
            if isinstance(node, ast.Assign):
                cls = self._class_of_call(node.value)
                if isinstance(node.value, ast.Subscript):  # out["loss"] of a dict StepOutput
                    held = types.get(_target_key(node.value.value) or "")
                    cls = held if held and held.endswith(".StepOutput") else cls
                for tgt in node.targets:
                    key = _target_key(tgt)
                    if key is None:
                        continue
                    if cls:
                        types[key] = cls
                    else:
                        types.pop(key, None)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                key = _target_key(node.value)
                if key in types:
                    self.scan.instance.add((types[key], node.attr))
                elif (held := self._class_of_call(node.value)) and held.endswith(".StepOutput"):
                    self.scan.instance.add((held, node.attr))  # step_fn(...).reduce_mean()
            elif isinstance(node, ast.Call):
                self._call(node, types)

    def _call(self, node: ast.Call, types: dict[str, str]) -> None:
        f = node.func
        if isinstance(f, ast.Attribute) and _target_key(f.value) in types:
            cls = types[_target_key(f.value)]  # type: ignore[index]
            for kw in node.keywords:
                if kw.arg:
                    self.scan.instance_kwargs.add((cls, f.attr, kw.arg))
        if isinstance(f, ast.Name) and f.id in self.funcs:
            callee = self.funcs[f.id]
            params = [a.arg for a in callee.args.args]
            for i, arg in enumerate(node.args):
                if i < len(params) and _target_key(arg) in types:
                    self.param_types[f.id][params[i]] = types[_target_key(arg)]  # type: ignore[index]
            for kw in node.keywords:
                if kw.arg in params and _target_key(kw.value) in types:
                    self.param_types[f.id][kw.arg] = types[_target_key(kw.value)]  # type: ignore[index]


def _target_key(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    ):
        return f"self.{node.attr}"
    return None
