"""``scripts/issue_bars.py`` reads every bar of the open issues from ``benchmarks/results.json``:
each bar names a case / impl / metric the bench records (a renamed case would otherwise show
as "not measured" without anyone noticing), and the verdict follows the bound."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bars_module():
    spec = importlib.util.spec_from_file_location("issue_bars", ROOT / "scripts" / "issue_bars.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["issue_bars"] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_every_bar_has_a_record():
    mod = _bars_module()
    records = json.loads((ROOT / "benchmarks" / "results.json").read_text())
    missing = [b.what for b in mod._bars() if mod.evaluate(records, b)[0] is None]
    assert not missing, f"bars without a record in benchmarks/results.json: {missing}"


def test_verdict_follows_the_bound_and_the_newest_record():
    mod = _bars_module()
    ref = ("case/x", "cute_attn", "ratio")
    rec = lambda v, date, commit="abc": dict(  # noqa: E731
        case=ref[0], impl=ref[1], metric=ref[2], value=v, device="d", commit=commit, date=date
    )
    at_least = mod.Bar(0, "x", ref, ">=", 1.05)
    at_most = mod.Bar(0, "x", ref, "<=", 1.05)
    assert mod.evaluate([rec(1.2, "2026-01-01"), rec(1.0, "2026-01-02")], at_least)[2] is False  # newest wins
    assert mod.evaluate([rec(1.0, "2026-01-02"), rec(1.2, "2026-01-01")], at_least)[2] is False
    assert mod.evaluate([rec(1.06, "2026-01-01")], at_least)[2] is True
    assert mod.evaluate([rec(1.06, "2026-01-01")], at_most)[2] is False
    # a ratio of two records counts only when both come from one run
    den = ("case/y", "cute_attn", "us")
    over = mod.Bar(0, "x", ref, ">=", 1.0, den)
    other = dict(case=den[0], impl=den[1], metric=den[2], value=2.0, device="d", commit="zzz", date="2026-01-01")
    assert mod.evaluate([rec(3.0, "2026-01-01"), other], over)[0] is None
    same = dict(other, commit="abc")
    assert mod.evaluate([rec(3.0, "2026-01-01"), same], over)[:1] == (1.5,)
