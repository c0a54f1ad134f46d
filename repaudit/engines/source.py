"""Whether a model's Python code is a canonical form repaudit knows the arithmetic of.

Several fast paths (the engine's head, the kernel modes' fused norm and rotary) apply only where
a family's code is, operation for operation, a form whose bits they reproduce. The test is the
code itself, not the family's name: a family that copies Llama's code qualifies, one that adds
a scale or a soft cap anywhere does not.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def same_code(func, canonical: str) -> bool:
    """Whether a function's code (decorators, docstring, comments and layout aside: its AST,
    the signature's annotations and defaults included) is the canonical source's."""
    import ast
    import inspect
    import textwrap

    def body(source: str) -> str:
        fn = ast.parse(source).body[0]
        doc = fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant)
        return ast.dump(ast.Module(body=fn.body[1:] if doc else fn.body, type_ignores=[])) + ast.dump(fn.args)

    try:
        return body(textwrap.dedent(inspect.getsource(inspect.unwrap(func)))) == body(canonical)
    except (OSError, TypeError, SyntaxError):
        return False
