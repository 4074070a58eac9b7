import ast
import operator
import re

from moe_lab.data.synthetic import synthetic_math_rows

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _eval(node):
    """Evaluate a +,-,* integer expression from its AST (independent of the generator)."""
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    raise AssertionError(f"unexpected node {ast.dump(node)}")


def test_rows_have_fields_and_correct_answers():
    rows = synthetic_math_rows(300, seed=3)
    assert len(rows) == 300
    n_ops_seen = set()
    for row in rows:
        assert set(row) >= {"instruction", "input", "output", "answer"}
        assert row["input"] == ""
        gold = _eval(ast.parse(row["expression"], mode="eval"))
        assert row["answer"] == str(gold)
        assert row["output"].endswith(f"The answer is {gold}.")
        # every written step "a op b = c" is right, and the last one gives the answer
        steps = re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)", row["output"])
        assert steps
        for a, op, b, c in steps:
            assert {"+": operator.add, "-": operator.sub, "*": operator.mul}[op](int(a), int(b)) == int(c)
        assert int(steps[-1][3]) == gold
        # the operands in the expression are numbers stated in the question
        operands = re.findall(r"\d+", row["expression"])
        assert all(re.search(rf"\b{x}\b", row["instruction"]) for x in operands)
        n_ops = len(re.findall(r"[-+*]", row["expression"]))
        assert 1 <= n_ops <= 3 and len(steps) == n_ops
        n_ops_seen.add(n_ops)
        assert gold >= 0
    assert n_ops_seen == {1, 2, 3}
    assert len({r["instruction"] for r in rows}) > 250


def test_deterministic_per_seed():
    assert synthetic_math_rows(50, seed=7) == synthetic_math_rows(50, seed=7)
    assert synthetic_math_rows(50, seed=7) != synthetic_math_rows(50, seed=8)
    assert synthetic_math_rows(20, seed=7) == synthetic_math_rows(50, seed=7)[:20]
