"""The tiny_tools calculator (grpo.agents.calculator): exact arithmetic on numbers only, every other
input refused with a short ValueError at once, and a schema transformers can build from its docstring."""

import time

import pytest
from transformers.utils import get_json_schema

from grpo.agents.calculator import calculator


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("347*28", "9716"),
        ("23*45+12*67", "1839"),
        (" (12 + 5) * 3 ", "51"),
        ("683*25-266", "16809"),
        ("10/4", "2.5"),
        ("10/2", "5"),
        ("1/3", "0.3333333333"),
        ("0.1+0.2", "0.3"),  # exact: no float rounding
        ("-7//2", "-4"),
        ("-7%3", "2"),
        ("2**10", "1024"),
        ("2**-2", "0.25"),
        ("2**0.5", "1.4142135624"),
        ("-3.5*2", "-7"),
        ("1e3", "1000"),
    ],
)
def test_arithmetic_is_evaluated_exactly(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ('__import__("os").system("echo hi")', "unsupported element Call"),
        ("x + 1", "unsupported element Name"),
        ("(1).real", "unsupported element Attribute"),
        ("[1, 2]", "unsupported element List"),
        ("1 < 2", "unsupported element Compare"),
        ("1 if 1 else 2", "unsupported element IfExp"),
        ("lambda: 1", "unsupported element Lambda"),
        ("'12' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("1j * 2", "only numbers"),
        ("1 +", "not an arithmetic expression"),
        ("1; 2", "not an arithmetic expression"),
        ("", "empty expression"),
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0**-1", "division by zero"),
        ("9**9**9", "exponent 387420489 too large"),
        ("2**1000", "exponent 1000 too large"),
        ("10**40", "result too large"),
        ("99999999999999999*99999999999999999", "result too large"),
        ("1e400", "not a finite number"),
        ("(-8)**0.5", "not a real number"),
        ("1+" * 150 + "1", "expression too long"),
    ],
)
def test_anything_but_arithmetic_is_refused_with_a_short_message(expression, message):
    with pytest.raises(ValueError, match=message):
        calculator(expression)


def test_huge_powers_are_refused_before_they_are_computed():
    start = time.perf_counter()
    for expression in ("9**9**9", "99**99", "(10**20)**5", "0.1**-31"):
        with pytest.raises(ValueError, match="too large"):
            calculator(expression)
    assert time.perf_counter() - start < 0.1


def test_a_non_string_is_refused():
    with pytest.raises(ValueError, match="expression must be a string, got int"):
        calculator(12)


def test_transformers_builds_the_tool_schema_from_the_docstring():
    schema = get_json_schema(calculator)["function"]
    assert schema["name"] == "calculator"
    assert schema["description"].startswith("Evaluate an arithmetic expression")
    assert schema["parameters"]["required"] == ["expression"]
    expression = schema["parameters"]["properties"]["expression"]
    assert expression["type"] == "string" and "347*28" in expression["description"]


def test_the_offline_control_shows_the_same_tool_and_never_answers():
    import pytest
    from transformers.utils import get_json_schema

    from grpo.agents.calculator import calculator, offline_calculator

    assert get_json_schema(offline_calculator) == get_json_schema(calculator)
    with pytest.raises(RuntimeError, match="offline"):
        offline_calculator("2+2")
