"""Programmatic dependent launch (ds4.kernels.dispatch.PDL) is only safe if every kernel launched with
launch_pdl waits for the previous kernel before it reads anything the previous kernels write: its first
statement must be pdl_wait(), except in the kernels of PREWAIT, which may load the static weights named
there before it (dispatch.PDL_EARLY; no stores, no loads reaching any other pointer argument, which the
kernels name *_ptr). Checked on the source of every kernel module (the GPU run of the kernel tests with
DS4_PDL=1 checks the numbers: tools/gpu/session5.sh)."""

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


# kernel -> the parameters (static weights) its statements before pdl_wait() may load from
PREWAIT = {"_q8_mv1_kernel": {"qs", "dsc"}, "_q8_int_kernel": {"qs", "dsc"}, "_hmv_kernel": {"w_ptr"}}
PREWAIT["_q8_flat_kernel"] = {"qs", "dsc"}
PREWAIT["_q8_tma_kernel"] = {"qs_desc", "dsc"}  # qs_desc.load: a TMA copy of the quants


def _is_wait(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and ast.unparse(node.value) == "pdl_wait()"


def _waits_first(fn: ast.FunctionDef) -> bool:
    return _is_wait(_first_statement(fn))


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _reach(expr: ast.AST, params: set[str], deps: dict[str, set[str]]) -> set[str]:
    """The parameters an expression's value is computed from (through the locals assigned so far)."""
    src = _names(expr)
    return (src & params).union(*(deps.get(n, set()) for n in src))


def _prewait_problems(fn: ast.FunctionDef, static: set[str]) -> list[str]:
    """What the statements before fn's top-level pdl_wait() do that PREWAIT does not allow."""
    body = [st for st in fn.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
    waits = [i for i, st in enumerate(body) if _is_wait(st)]
    if not waits:
        return ["no top-level pdl_wait()"]
    params = {a.arg for a in fn.args.args}
    deps: dict[str, set[str]] = {}  # local name -> the parameters its value was computed from
    problems = []
    for st in body[: waits[0]]:
        for node in ast.walk(st):
            if isinstance(node, ast.Assign | ast.AugAssign):
                reach = _reach(node.value, params, deps)
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for name in set().union(*(_names(t) for t in targets)):
                    deps[name] = reach | (deps.get(name, set()) if isinstance(node, ast.AugAssign) else set())
            if isinstance(node, ast.Call):
                fname = ast.unparse(node.func)
                if fname.startswith(("tl.store", "tl.atomic")):
                    problems.append(f"{fname} before pdl_wait()")
                desc = isinstance(node.func, ast.Attribute) and fname.endswith(".load") and fname != "tl.load"
                if fname == "tl.load" or desc:  # desc: a tensor descriptor's load, desc.load([offsets])
                    src = node.func.value if desc else node.args[0]
                    reach = _reach(src, params, deps)
                    if not reach & static or any(p.endswith("_ptr") for p in reach - static):
                        problems.append(f"load of {ast.unparse(src)} (reaches {sorted(reach)})")
    return problems


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
        if kernel in PREWAIT:
            problems = _prewait_problems(kernels[kernel], PREWAIT[kernel])
            assert not problems, f"{module}:{line}: {kernel} before its pdl_wait(): {problems}"
        else:
            assert _waits_first(kernels[kernel]), (
                f"{module}:{line}: {kernel} is launched with launch_pdl but does not begin with pdl_wait()"
            )


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


def test_the_check_sees_a_dynamic_load_before_the_wait():
    """The pre-wait rule itself: a static weight load passes; a load reaching an activation pointer (also
    through a local) or a store before the wait is reported."""
    head = "import triton\n@triton.jit\ndef _k(x_ptr, w, out_ptr, K):\n"
    bad = head + "    p = w + K\n    a = tl.load(p)\n    q = x_ptr + K\n    b = tl.load(q + p)\n"
    bad += "    tl.store(out_ptr, a)\n    pdl_wait()\n"
    problems = _prewait_problems(_kernels({"m.py": ast.parse(bad)})["_k"], {"w"})
    assert len(problems) == 2 and "q + p" in problems[0] and "tl.store" in problems[1], problems
    ok = head + "    p = w + K\n    a = tl.load(p)\n    pdl_wait()\n    b = tl.load(x_ptr)\n"
    assert _prewait_problems(_kernels({"m.py": ast.parse(ok)})["_k"], {"w"}) == []
    # tensor descriptors: w_desc.load of the static weights passes, x_desc.load of an activation does not
    dhead = "import triton\n@triton.jit\ndef _k(x_desc, w_desc, out_ptr, K):\n"
    good = dhead + "    a = w_desc.load([0, K])\n    pdl_wait()\n"
    assert _prewait_problems(_kernels({"m.py": ast.parse(good)})["_k"], {"w_desc"}) == []
    bad = dhead + "    a = w_desc.load([0, K])\n    b = x_desc.load([0, 0])\n    pdl_wait()\n"
    problems = _prewait_problems(_kernels({"m.py": ast.parse(bad)})["_k"], {"w_desc"})
    assert len(problems) == 1 and "x_desc" in problems[0], problems


def test_pdl_is_off_under_the_interpreter_and_by_default():
    import os

    from ds4.kernels import dispatch

    assert not dispatch.PDL or (
        os.environ.get("DS4_PDL") == "1" and os.environ.get("TRITON_INTERPRET") != "1"
    )
