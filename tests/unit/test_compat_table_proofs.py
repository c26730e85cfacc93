"""Every name docs/smp-compatibility.md marks "works" is named by the test its row cites.

The static guard of the table: a row's Test column must name files that exist and use
the name (the last component of the dotted name, or the keyword of ``f(arg=)``) in code,
outside imports, comments, docstrings and the tests that only import names; the effect
itself is checked by that test. A script the test runs (a ``.py`` file it names, next to
it or under examples/) counts as its code. A name reached through ``getattr(module, "name")`` in a
loop does not count: its call must be written out.
"""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "smp-compatibility.md"
FOLDERS = {"u": "unit", "d": "distributed", "e": "e2e"}
ROW = re.compile(r"^\| `([^`]+)` \| (\w[\w ,]*?) \|.*\|([^|]*)\|$")

# Tests that resolve names without running them: citing them proves nothing.
IMPORT_ONLY_FILES = {"tests/unit/test_smp_names.py"}
IMPORT_ONLY_FUNCTIONS = {
    "tests/unit/test_smp_compat.py": {"test_import_line_paths_resolve_under_modelparallel",
                                      "test_every_table_target_is_a_module_modelparallel_has",
                                      "test_resolve_maps_whole_subtrees_and_only_in_"
                                      "sagemaker_mode"},
}
IMPORT_LINE = re.compile(r"^\s*(import \S|from \S+ import )")


def checked_word(name: str) -> str:
    """The word a test must use: ``arg`` for ``f(arg=)``, else the last component."""
    base, _, keyword = name.partition("(")
    return keyword.rstrip("=)") if keyword else base.rsplit(".", 1)[-1]


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def words_used(path: Path, skipped_functions: set[str]) -> set[str]:
    """Identifiers a test file's code uses: names, attributes, keywords, and the words
    of the scripts it runs (multi-line strings, their import lines dropped)."""
    tree = ast.parse(path.read_text())
    docstrings = _docstrings(tree)
    words: set[str] = set()
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.FunctionDef) and node.name in skipped_functions:
            continue
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            words.add(node.arg)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and "\n" in node.value and id(node) not in docstrings):
            code = [ln for ln in node.value.splitlines() if not IMPORT_LINE.match(ln)]
            words.update(re.findall(r"\w+", "\n".join(code)))
        pending.extend(ast.iter_child_nodes(node))
    return words


def scripts_run_by(path: Path) -> list[Path]:
    """The ``.py`` files a test names (``Path(__file__).with_name("x.py")``, an
    example it runs): next to the test, or under examples/."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and re.fullmatch(r"\w+\.py", node.value)):
            beside = path.with_name(node.value)
            found += [beside] if beside.exists() else sorted(
                (REPO / "examples").rglob(node.value))
    return found


def words_of_test(path: Path, skipped_functions: set[str]) -> set[str]:
    """The words of a test file's code and of the scripts it runs."""
    words = words_used(path, skipped_functions)
    for script in scripts_run_by(path):
        words |= words_used(script, set())
    return words


def works_rows() -> list[tuple[str, list[str]]]:
    rows = []
    for line in DOC.read_text().splitlines():
        found = ROW.match(line)
        if found and found.group(2) == "works":
            cited = [c.strip() for c in found.group(3).split(",") if c.strip()]
            rows.append((found.group(1), cited))
    return rows


def cited_path(cite: str) -> str:
    folder, _, name = cite.partition("/")
    return f"tests/{FOLDERS.get(folder, folder)}/{name}"


def unproven(rows: list[tuple[str, list[str]]]) -> list[str]:
    """One line per "works" row whose cited tests do not use its name."""
    cache: dict[str, set[str]] = {}
    wrong = []
    for name, cites in rows:
        word = checked_word(name)
        if not cites:
            wrong.append(f"{name}: works, but its row cites no test")
            continue
        users = []
        for cite in cites:
            path = cited_path(cite)
            if not (REPO / path).exists():
                wrong.append(f"{name}: cites {cite}, which does not exist")
                continue
            if path in IMPORT_ONLY_FILES:
                continue
            if path not in cache:
                cache[path] = words_of_test(REPO / path, IMPORT_ONLY_FUNCTIONS.get(path, set()))
            if word in cache[path]:
                users.append(cite)
        if not users:
            wrong.append(f"{name}: works, but {', '.join(cites)} never use(s) {word!r}")
    return wrong


def test_the_table_has_works_rows_with_tests():
    rows = works_rows()
    assert len(rows) > 150, "the table's rows were not read"


def test_every_works_row_cites_a_test_that_uses_the_name():
    wrong = unproven(works_rows())
    assert not wrong, f"{len(wrong)} rows:\n" + "\n".join(wrong)


def test_the_guard_sees_through_getattr_loops_imports_and_comments(tmp_path):
    probe = tmp_path / "test_probe.py"
    probe.write_text('"""get_doc is only in the docstring."""\n'
                     "from x import get_imported\n"
                     "# get_comment\n"
                     "def test_a():\n"
                     "    for n in ('get_looped',):\n"
                     "        getattr(mp, n)()\n"
                     "    mp.get_called(flag=1)\n"
                     "    run('''import get_script_import\\nmp.get_in_script()''')\n")
    words = words_used(probe, set())
    assert {"get_called", "flag", "get_in_script"} <= words
    assert not words & {"get_doc", "get_imported", "get_comment", "get_looped",
                        "get_script_import"}
