"""Module cache: key stability, atomic publish, corrupt entries, concurrent builds (CPU only)."""

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from cute_attn.families.spec import Spec
from cute_attn.runtime import cache


def _spec(**kw):
    params = dict(dtype="bf16", head_dim=128)
    params.update(kw)
    return Spec.make("merge_states", "sm_90a", **params)


def test_key_is_stable_and_order_independent():
    a = Spec.make("merge_states", "sm_90a", dtype="bf16", head_dim=128)
    b = Spec.make("merge_states", "sm_90a", head_dim=128, dtype="bf16")
    assert a.key == b.key
    # Same key in a fresh interpreter (no dependence on hash seeds or import order).
    code = "from cute_attn.families.spec import Spec; print(Spec.make('merge_states','sm_90a',head_dim=128,dtype='bf16').key)"  # noqa: E501
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, PYTHONHASHSEED="123"),
    ).stdout.strip()
    assert out == a.key


@pytest.mark.parametrize("change", [dict(dtype="f16"), dict(head_dim=64), dict(extra=1)])
def test_key_changes_with_params(change):
    assert _spec(**change).key != _spec().key


def test_key_changes_with_arch_and_family():
    s = _spec()
    assert Spec.make("merge_states", "sm_100a", **s.pdict).key != s.key
    assert Spec.make("merge_pair", "sm_90a", masked=False, **s.pdict).key != s.key


def test_spec_cli_roundtrip():
    s = Spec.make("merge_pair", "sm_90a", dtype="bf16", head_dim=128, masked=True)
    assert Spec.parse(s.cli(), "sm_90a") == s


def test_bad_arch_and_params():
    with pytest.raises(ValueError, match="unsupported arch"):
        Spec.make("merge_states", "sm_80", dtype="bf16")
    with pytest.raises(TypeError, match="not allowed"):
        Spec.make("merge_states", "sm_90a", dtype=object())


def _fake_build(payload: bytes):
    def build(tmp: Path):
        (tmp / "module.so").write_bytes(payload)
        (tmp / "kernel.ptx").write_text("ptx")
        return {
            "build_id": uuid.uuid4().hex,
            "dsl_version": cache.installed_dsl_version(),
            "spec": {"family": "merge_states"},
            "abi": [],
            "symbols": {"init": "i", "load": "l", "launch": "x", "num_args": 2},
        }

    return build


def test_publish_and_lookup(tmp_cache):
    s = _spec()
    assert cache.lookup(s).problem == "missing"
    with cache.key_lock(s):
        found = cache.publish(s, _fake_build(b"\x7fELF" + os.urandom(1000)))
    assert found.meta is not None and found.path == cache.entry_dir(s)
    assert cache.lookup(s).meta["build_id"] == found.meta["build_id"]
    assert found.path.parent == tmp_cache / "sm_90a"


def test_failed_build_leaves_nothing(tmp_cache):
    s = _spec()

    def broken(tmp):
        (tmp / "module.so").write_bytes(b"partial")
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        cache.publish(s, broken)
    assert cache.lookup(s).problem == "missing"
    assert [p.name for p in (tmp_cache / "sm_90a").iterdir() if p.name != ".locks"] == []


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "meta"])
def test_corrupt_entry_is_detected_and_replaced(tmp_cache, damage):
    s = _spec()
    first = cache.publish(s, _fake_build(os.urandom(4096)))
    so = first.path / "module.so"
    if damage == "truncate":
        so.write_bytes(so.read_bytes()[:100])
    elif damage == "flip":
        b = bytearray(so.read_bytes())
        b[2000] ^= 1
        so.write_bytes(bytes(b))
    elif damage == "delete":
        so.unlink()
    else:
        (first.path / cache.META).write_text("{not json")
    found = cache.lookup(s)
    assert found.meta is None and found.problem.startswith("corrupt"), found.problem
    again = cache.publish(s, _fake_build(os.urandom(4096)))
    assert again.meta is not None and again.meta["build_id"] != first.meta["build_id"]
    assert cache.lookup(s).meta["build_id"] == again.meta["build_id"]


def test_stale_dsl_version_is_rebuilt_only_with_dsl(tmp_cache, monkeypatch):
    s = _spec()

    def old_build(tmp):
        return dict(_fake_build(b"x")(tmp), dsl_version="0.0.1")

    cache.publish(s, old_build)
    monkeypatch.setattr(cache, "installed_dsl_version", lambda: "9.9.9")
    assert cache.lookup(s).problem.startswith("stale")
    monkeypatch.setattr(cache, "installed_dsl_version", lambda: None)  # run-only machine
    assert cache.lookup(s).meta is not None


def _race_worker(root, barrier, q):
    os.environ["CUTE_ATTN_CACHE_DIR"] = root
    s = _spec()
    barrier.wait()
    with cache.key_lock(s):
        found = cache.lookup(s)
        built = found.meta is None
        if built:
            time.sleep(0.2)  # widen the window a racing process would hit
            found = cache.publish(s, _fake_build(os.urandom(2048)))
    q.put((built, found.meta["build_id"]))


def test_concurrent_publish_builds_once(tmp_cache):
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_race_worker, args=(str(tmp_cache), barrier, q)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sum(b for b, _ in results) == 1
    assert len({bid for _, bid in results}) == 1


@pytest.mark.compile
def test_concurrent_compile_from_two_processes(tmp_cache):
    """Two processes compile the same spec at once: one compiles, both load one valid entry."""
    spec_text = "merge_states:dtype=f16,head_dim=64,load_batch=4"
    code = (
        "import json,sys; from cute_attn.runtime.build import build; from cute_attn.families.spec import Spec;"
        f"e=build(Spec.parse('{spec_text}','sm_90a')); print(json.dumps([e.meta['created'], e.meta['files']]))"
    )
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_o, e) in zip(procs, outs):
        assert p.returncode == 0, e
    metas = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert metas[0] == metas[1]
    entries = [d for d in (tmp_cache / "sm_90a").iterdir() if not d.name.startswith(".")]
    assert len(entries) == 1
    assert cache.lookup(Spec.parse(spec_text, "sm_90a")).meta is not None


def test_instruction_checks_match_and_count():
    """The family expectations the compile test asserts: plain regexes on PTX / SASS, and the
    ratio form (``sass%A/B>=R``) that catches ptxas serializing wgmma (one arrive per HGMMA)."""
    from cute_attn.families.prefill import BATCH_PREFILL_SM90
    from cute_attn.runtime.build import check_instructions

    batched = "WARPGROUP.ARRIVE\n" + "HGMMA.64x112x16\n" * 8 + "WARPGROUP.ARRIVE\n" + "HGMMA.64x128x16\n" * 7
    serialized = "WARPGROUP.ARRIVE\nHGMMA.64x112x16\n" * 15
    expect = {
        "wgmma": r"ptx:wgmma\.mma_async",
        "hgmma": r"sass:HGMMA\.64x",
        "async": r"sass%HGMMA/WARPGROUP\.ARRIVE>=3",
    }
    assert check_instructions(expect, "wgmma.mma_async.sync", batched) == {"wgmma": True, "hgmma": True, "async": True}
    assert check_instructions(expect, "mma.sync", serialized) == {"wgmma": False, "hgmma": True, "async": False}
    assert check_instructions(expect, "wgmma.mma_async", None) == {"wgmma": True, "hgmma": None, "async": None}
    # no WARPGROUP.ARRIVE at all (an empty or renamed disassembly): nothing was checked, not a pass
    assert check_instructions(expect, "", "NOP\n")["async"] is False
    with pytest.raises(ValueError, match="not ptx:REGEX"):
        check_instructions({"bad": "PTX:wgmma"}, "", "")
    # the prefill family's own ratio check is the counting form, not a bare regex
    found = check_instructions(BATCH_PREFILL_SM90.expect["sm_90a"], "wgmma.mma_async setmaxnreg", serialized)
    assert found["wgmma async (SASS)"] is False
    # the must-not-match form: descriptors moved from per-thread registers inside a wgmma batch
    # (between its arrive and its gsb0 commit), not R2UR elsewhere
    uniform = "R2UR UR4, R2 ;\nWARPGROUP.ARRIVE ;\n" + "HGMMA.64x128x16 R24, gdesc[UR20], R24 ;\n" * 7
    uniform += "HGMMA.64x128x16 R24, gdesc[UR20], R24, gsb0 ;\nR2UR UR5, R3 ;\n"
    hgmma = "HGMMA.64x128x16 R24, gdesc[UR20], R24 ;\n"
    per_thread = uniform.replace(hgmma, hgmma + "R2UR UR20, R22 ;\n", 1)
    label = "uniform descriptors (SASS)"
    assert check_instructions({label: BATCH_PREFILL_SM90.expect["sm_90a"][label]}, "", uniform) == {label: True}
    assert check_instructions({label: BATCH_PREFILL_SM90.expect["sm_90a"][label]}, "", per_thread) == {label: False}
    assert check_instructions({"x": "sass!R2UR"}, "", None) == {"x": None}


def _published(s):
    with cache.key_lock(s):
        return cache.publish(s, _fake_build(b"\x7fELF" + os.urandom(64)))


def test_compile_cli_fails_on_a_kernel_lacking_a_promised_instruction():
    """``python -m cute_attn compile`` exits 1 and names the kernel where the PTX / SASS lacks
    what its family promises (a kernel whose wgmmas ptxas serialized runs correct and slow);
    unchecked (None, no SASS tool) and failed builds are not counted as lacking."""
    from cute_attn.__main__ import _lacking

    ok = dict(ok=True, spec="a@sm_90a", instructions={"wgmma": True, "wgmma async (SASS)": True})
    slow = dict(ok=True, spec="b@sm_90a", instructions={"wgmma": True, "wgmma async (SASS)": False})
    unchecked = dict(ok=True, spec="c@sm_90a", instructions={"wgmma": True, "wgmma async (SASS)": None})
    broken = dict(ok=False, spec="d@sm_90a", error="x")
    assert _lacking([ok, slow, unchecked, broken]) == [("b@sm_90a", ["wgmma async (SASS)"])]
    assert _lacking([ok, unchecked]) == []


@pytest.mark.parametrize(
    "damage",
    [
        lambda m: dict(m, files=list(m["files"])),  # "files" a list
        lambda m: {k: v for k, v in m.items() if k != "symbols"},  # "symbols" missing
        lambda m: dict(m, symbols={"init": "i"}),  # symbols incomplete
        lambda m: dict(m, abi="not a list"),
        lambda m: [m],  # not an object at all
        lambda m: dict(m, files={"../module.so": "0" * 64}),  # a path outside the entry
    ],
)
def test_meta_of_the_wrong_shape_is_corrupt_and_rebuilt(tmp_cache, damage):
    """A meta.json that parses but has the wrong shape counts as corrupt (never an
    AttributeError / KeyError in the loader), and the next build replaces it."""
    s = _spec(damage=str(uuid.uuid4()))
    found = _published(s)
    meta_path = found.path / cache.META
    meta_path.write_text(json.dumps(damage(json.loads(meta_path.read_text()))))
    look = cache.lookup(s)
    assert look.meta is None and look.problem.startswith("corrupt"), look.problem
    assert _published(s).meta is not None


def test_lock_times_out_naming_its_holder(tmp_cache):
    s = _spec(lock=str(uuid.uuid4()))
    with cache.key_lock(s):
        t0 = time.monotonic()
        with pytest.raises(cache.CacheError, match=f"held by pid {os.getpid()}"):
            with cache.key_lock(s, timeout=0.3):
                pass
        assert 0.25 < time.monotonic() - t0 < 5
    with cache.key_lock(s, timeout=0.3):  # released: taken at once
        pass


def test_leftovers_of_killed_builds_are_removed(tmp_cache):
    s = _spec(left=str(uuid.uuid4()))
    parent = cache.entry_dir(s).parent
    parent.mkdir(parents=True, exist_ok=True)
    stale = [parent / f".tmp-{s.key}-dead", parent / f".trash-{s.key}-1-2"]
    other = parent / ".tmp-someotherkey-x"
    for p in stale + [other]:
        p.mkdir()
        (p / "module.so").write_bytes(b"half")
    _published(s)
    assert not any(p.exists() for p in stale)
    assert other.exists()  # another key's build may still be running


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_cache_gives_a_clear_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(cache.CacheError, match="CUTE_ATTN_CACHE_DIR"):
            with cache.key_lock(_spec(), root=ro):
                pass
    finally:
        ro.chmod(0o755)


def test_unwritable_cache_gives_a_clear_error(tmp_path):
    """A cache root that is a file (so nothing can be created under it, even as root)."""
    blocked = tmp_path / "file"
    blocked.write_text("x")
    with pytest.raises(cache.CacheError, match="writable"):
        with cache.key_lock(_spec(), root=blocked):
            pass


@pytest.mark.compile
def test_compile_with_a_space_in_tmpdir(tmp_path):
    """The DSL's dump directory lives under TMPDIR and is passed in its option string."""
    tmpdir = tmp_path / "with space"
    tmpdir.mkdir()
    spec = "merge_states:dtype=bf16,head_dim=64,load_batch=2"
    env = dict(os.environ, TMPDIR=str(tmpdir), CUTE_ATTN_CACHE_DIR=str(tmp_path / "c"))
    out = subprocess.run(
        [sys.executable, "-m", "cute_attn", "compile", "--arch", "sm_90a", "--spec", spec],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert cache.lookup(Spec.parse(spec, "sm_90a"), tmp_path / "c").meta is not None
