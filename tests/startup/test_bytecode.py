"""startup/bytecode.py: children byte-compile a package's sources into a cache directory, and this
process's imports then load that bytecode instead of compiling the sources."""
import os
import subprocess
import sys

SCRIPT = r"""
import os, sys
site, cache = sys.argv[1], sys.argv[2]
sys.path.insert(0, site)
from splitserve.startup.bytecode import start_bytecode_warmup
warm = start_bytecode_warmup(site=site, cache_dir=cache, packages=("pkg_a",))
warm.wait(timeout=60)
print("codes", [p.exitcode for p in warm.procs], "files", warm.num_files)
import pkg_a.mod_1
print("cached", pkg_a.mod_1.__cached__, os.path.exists(pkg_a.mod_1.__cached__))
print("second", start_bytecode_warmup(site=site, cache_dir=cache, packages=("pkg_a",)))
"""


def test_children_byte_compile_what_this_process_then_imports(tmp_path):
    site, cache = tmp_path / "site", tmp_path / "cache"
    pkg = site / "pkg_a"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for i in range(5):
        (pkg / f"mod_{i}.py").write_text(f"VALUE = {i}\n")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=os.getcwd())
    env.pop("PYTHONPYCACHEPREFIX", None)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(site), str(cache)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "files 6" in out.stdout, out.stdout  # __init__ and five modules
    cached_line = next(line for line in out.stdout.splitlines() if line.startswith("cached"))
    assert cached_line.startswith(f"cached {cache}") and cached_line.endswith("True"), out.stdout
    assert sorted(p.name for p in cache.rglob("*.pyc"))[:2] == sorted(
        f"{n}.{sys.implementation.cache_tag}.pyc" for n in ("__init__", "mod_0"))
    assert len(list(cache.rglob("*.pyc"))) == 6
    # Once a prefix is set (here: by the first call), the user's or ours, nothing more is done.
    assert "second None" in out.stdout
    assert not list(pkg.rglob("__pycache__"))  # nothing written next to the sources


def test_environments_with_bytecode_are_left_alone(tmp_path):
    site = tmp_path / "site"
    pkg = site / "pkg_a"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    import py_compile
    py_compile.compile(str(pkg / "__init__.py"))  # bytecode next to the source, as pip installs it
    script = ("import sys; from splitserve.startup.bytecode import start_bytecode_warmup; "
              f"print(start_bytecode_warmup(site={str(site)!r}, cache_dir={str(tmp_path / 'c')!r}, packages=('pkg_a',)), "
              "sys.pycache_prefix)")
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    env.pop("PYTHONPYCACHEPREFIX", None)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["None", "None"], (out.stdout, out.stderr)


def test_no_fork_leaves_imports_as_they_were(tmp_path, monkeypatch):
    import multiprocessing

    from splitserve.startup import bytecode
    site = tmp_path / "site"
    (site / "pkg_b").mkdir(parents=True)
    (site / "pkg_b" / "__init__.py").write_text("")

    def no_fork(method):
        raise ValueError(f"cannot find context for {method!r}")
    monkeypatch.setattr(multiprocessing, "get_context", no_fork)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    assert bytecode.start_bytecode_warmup(site=str(site), cache_dir=str(tmp_path / "c"), packages=("pkg_b",)) is None
    assert sys.pycache_prefix is None and "PYTHONPYCACHEPREFIX" not in os.environ
