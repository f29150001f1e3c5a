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
    missing = [b.what for b in mod._bars() if mod.evaluate(records, b, "H200")[0] is None]
    assert not missing, f"bars without an H200 record in benchmarks/results.json: {missing}"


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


def test_bars_read_their_device_only():
    """A newer run on another GPU (an H100 visit) neither moves a bar nor pairs with the bar's
    run in a ratio."""
    mod = _bars_module()
    ref = ("case/x", "cute_attn", "ratio")
    rec = lambda v, date, device: dict(  # noqa: E731
        case=ref[0], impl=ref[1], metric=ref[2], value=v, device=device, commit="abc", date=date
    )
    bar = mod.Bar(0, "x", ref, ">=", 1.05)
    records = [rec(1.06, "2026-01-01", "NVIDIA H200"), rec(0.9, "2026-01-02", "NVIDIA H100 80GB HBM3")]
    value, got, met = mod.evaluate(records, bar, "H200")
    assert (value, got["device"], met) == (1.06, "NVIDIA H200", True)
    assert mod.evaluate(records, bar)[0] == 0.9  # no device named: the newest of any
    assert mod.evaluate(records, bar, "B200") == (None, None, None)
    den = ("case/y", "cute_attn", "us")
    over = mod.Bar(0, "x", ref, ">=", 1.0, den)
    h100_den = dict(case=den[0], impl=den[1], metric=den[2], value=2.0, device="NVIDIA H100 80GB HBM3")
    h100_den.update(commit="abc", date="2026-01-01")
    assert mod.evaluate(records + [h100_den], over, "H200")[0] is None


def test_merge_keeps_another_devices_records(tmp_path):
    """``Results.merge_into``: a run replaces its own device's records of a (case, impl,
    metric) and leaves another device's."""
    from cute_attn.bench.common import Results

    path = tmp_path / "results.json"
    row = lambda v, device, date: dict(  # noqa: E731
        case="c", impl="cute_attn", metric="us", value=v, device=device, commit="abc", date=date
    )
    first = Results.__new__(Results)
    first.records = [row(1.0, "NVIDIA H200", "2026-01-01")]
    first.merge_into(str(path))
    h100 = Results.__new__(Results)
    h100.records = [row(2.0, "NVIDIA H100 80GB HBM3", "2026-01-02")]
    h100.merge_into(str(path))
    assert sorted(r["value"] for r in json.loads(path.read_text())) == [1.0, 2.0]
    again = Results.__new__(Results)
    again.records = [row(3.0, "NVIDIA H200", "2026-01-03")]
    again.merge_into(str(path))
    assert sorted(r["value"] for r in json.loads(path.read_text())) == [2.0, 3.0]
