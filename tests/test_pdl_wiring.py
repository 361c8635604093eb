"""Programmatic dependent launch (ds4.kernels.dispatch.PDL) is only safe if every kernel launched with
launch_pdl waits for the previous kernel before it reads anything: its first statement must be pdl_wait().
Checked on the source of every kernel module (the GPU run of the kernel tests with DS4_PDL=1 checks the
numbers: tools/gpu/session5.sh)."""

from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "ds4" / "kernels"


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any(ast.unparse(d).endswith("jit") for d in fn.decorator_list)


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):  # the docstring
        return body[1]
    return body[0]


def _waits_first(fn: ast.FunctionDef) -> bool:
    first = _first_statement(fn)
    return isinstance(first, ast.Expr) and ast.unparse(first.value) == "pdl_wait()"


def _modules() -> dict[str, ast.Module]:
    return {p.name: ast.parse(p.read_text()) for p in sorted(KERNELS.glob("*.py"))}


def _kernels(mods: dict[str, ast.Module]) -> dict[str, ast.FunctionDef]:
    out: dict[str, ast.FunctionDef] = {}
    for tree in mods.values():
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and _is_jit(node):
                assert node.name not in out, f"two jit functions named {node.name}"
                out[node.name] = node
    return out


def _pdl_launches(mods: dict[str, ast.Module]) -> list[tuple[str, str, int]]:
    """(module, kernel, line) of every kernel[grid](..., launch_pdl=...) call."""
    found = []
    for name, tree in mods.items():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Subscript)
                and isinstance(node.func.value, ast.Name)
            ):
                keys = {k.arg for k in node.keywords}
                kw_dicts = [k.value for k in node.keywords if k.arg is None]  # **kw: look the dict up
                if "launch_pdl" in keys or any(_dict_has_pdl(tree, d) for d in kw_dicts):
                    found.append((name, node.func.value.id, node.lineno))
    return found


def _dict_has_pdl(tree: ast.Module, expr: ast.expr) -> bool:
    """Whether **expr is a name bound somewhere in the module to dict(..., launch_pdl=...)."""
    if not isinstance(expr, ast.Name):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == expr.id for t in node.targets
        ):
            v = node.value
            if isinstance(v, ast.Call) and any(k.arg == "launch_pdl" for k in v.keywords):
                return True
    return False


def test_every_pdl_launch_waits_first():
    mods = _modules()
    kernels = _kernels(mods)
    launches = _pdl_launches(mods)
    assert len(launches) >= 20, launches  # the decode step's kernels (a lost keyword shrinks this)
    for module, kernel, line in launches:
        assert kernel in kernels, f"{module}:{line}: {kernel} is not a jit kernel of ds4.kernels"
        assert _waits_first(kernels[kernel]), (
            f"{module}:{line}: {kernel} is launched with launch_pdl but does "
        )
        "not begin with pdl_wait()"


def test_the_check_sees_a_missing_wait():
    """The checker itself: a kernel without the wait, launched with launch_pdl, is reported."""
    src = (
        "import triton\n@triton.jit\ndef _k(x):\n    '''doc'''\n    y = x\n\n"
        "def run(x):\n    _k[(1,)](x, launch_pdl=PDL)\n"
    )
    tree = ast.parse(src)
    kernels = _kernels({"m.py": tree})
    launches = _pdl_launches({"m.py": tree})
    assert launches == [("m.py", "_k", 8)] and not _waits_first(kernels["_k"])


def test_pdl_is_off_under_the_interpreter_and_by_default():
    import os

    from ds4.kernels import dispatch

    assert not dispatch.PDL or (
        os.environ.get("DS4_PDL") == "1" and os.environ.get("TRITON_INTERPRET") != "1"
    )
