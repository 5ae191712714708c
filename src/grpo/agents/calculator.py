"""`calculator`: the tool of the bundled `tiny_tools` task, safe to hand to a model.

It evaluates one arithmetic expression and nothing else: the text is parsed with `ast` and only number
literals, + - * / // % ** and unary signs are accepted (names, calls, attributes, strings, comparisons
are refused). Arithmetic is exact (`fractions.Fraction`: `0.1+0.2` is `0.3`), and every operand and result
is bounded, so `9**9**9` or a thousand-digit literal is refused at once instead of running for hours. It
sees only the expression, never the problem or its answer, so it cannot leak the reward.
"""

from __future__ import annotations

import ast
import math
from fractions import Fraction

MAX_LENGTH = 200  # characters in an expression
MAX_DIGITS = 30  # |value| < 10**30 for every literal, intermediate and result
MAX_EXPONENT = 100  # |exponent| in a ** b
DECIMALS = 10  # places shown for a non-integer result

_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: lambda a, b: a % b,
}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % ** and parentheses) and return its value.

    Args:
        expression: The arithmetic expression to evaluate, e.g. "347*28" or "(12+5)*3".

    Returns:
        The value of the expression as a string, e.g. "9716".
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise ValueError("empty expression")
    if len(text) > MAX_LENGTH:
        raise ValueError(f"expression too long ({len(text)} characters, at most {MAX_LENGTH})")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):
        raise ValueError(f"not an arithmetic expression: {text!r}") from None
    return _format(_evaluate(tree.body))


def _evaluate(node: ast.AST) -> Fraction | float:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"only numbers are allowed, not {value!r}")
        return _bounded(Fraction(value) if math.isfinite(value) else value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and (type(node.op) in _BINARY or isinstance(node.op, ast.Pow)):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _bounded(_power(left, right))
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise ValueError("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right))
    raise ValueError(f"unsupported element {type(node).__name__}: only numbers, + - * / // % ** and ( )")


def _power(base: Fraction | float, exponent: Fraction | float) -> Fraction | float:
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"exponent {_format(exponent)} too large (at most {MAX_EXPONENT})")
    if base == 0 and exponent < 0:
        raise ValueError("division by zero")
    # Refuse before computing: |base|**exponent must stay below 10**MAX_DIGITS.
    if base != 0 and exponent * math.log10(abs(base)) >= MAX_DIGITS:
        raise ValueError(f"result too large (at most {MAX_DIGITS} digits)")
    if isinstance(exponent, Fraction) and exponent.denominator == 1:
        return Fraction(base) ** int(exponent)
    if base < 0:
        raise ValueError("a negative number to a fractional power is not a real number")
    return float(base) ** float(exponent)


def _bounded(value: Fraction | float) -> Fraction | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result is not a finite number")
    if abs(value) >= 10**MAX_DIGITS:
        raise ValueError(f"result too large (at most {MAX_DIGITS} digits)")
    if isinstance(value, Fraction) and value.denominator >= 10**MAX_DIGITS:
        raise ValueError(f"result too precise (denominator over {MAX_DIGITS} digits)")
    return value


def _format(value: Fraction | float) -> str:
    """An integer as its digits; anything else rounded to DECIMALS places, trailing zeros dropped."""
    rounded = round(Fraction(value), DECIMALS)
    if rounded.denominator == 1:
        return str(rounded.numerator)
    sign = "-" if rounded < 0 else ""
    whole, frac = divmod(int(abs(rounded) * 10**DECIMALS), 10**DECIMALS)  # exact: rounded to DECIMALS places
    return f"{sign}{whole}.{str(frac).rjust(DECIMALS, '0').rstrip('0')}"


def offline_calculator(expression: str) -> str:
    """The control for the tiny_tools demo: the same tool, as the prompt shows it, that never answers
    (`--tools grpo.agents.calculator:offline_calculator`). A model that learns with it learns without a tool.

    Args:
        expression: The arithmetic expression to evaluate, e.g. "347*28" or "(12+5)*3".
    """
    raise RuntimeError(f"the calculator is offline; {expression!r} was not evaluated")


# The prompt must show the same tool as with `calculator`: its name and description.
offline_calculator.__name__ = offline_calculator.__qualname__ = "calculator"
offline_calculator.__doc__ = calculator.__doc__
