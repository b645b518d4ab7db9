"""setup.py's check of the C++ compiler's libstdc++ against the one torch loads (CPU only;
setup.py is imported for its functions, nothing is built)."""
import importlib.util
import os
import stat

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30"
NEWER = "/opt/gcc/lib64/libstdc++.so.6.0.33"


@pytest.fixture(scope="module")
def setup_py():
    path = os.path.join(ROOT, "setup.py")
    if not os.path.exists(path):
        pytest.skip("no setup.py next to tests/ (not a source checkout)")
    spec = importlib.util.spec_from_file_location("flash_attn_ext_setup", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: defines the functions, builds nothing
    return module


def test_version_order(setup_py):
    key = setup_py.version_key
    assert key("3.4") < key("3.4.9") < key("3.4.10") < key("3.4.30")


def test_newer_compiler_library_stops_the_build(setup_py):
    message = setup_py.libstdcxx_mismatch(NEWER, "3.4.33", SYSTEM, "3.4.30", "/opt/gcc/bin/g++")
    assert NEWER in message and SYSTEM in message and "/opt/gcc/bin/g++" in message
    assert "CXX=/usr/bin/g++ CC=/usr/bin/gcc" in message


@pytest.mark.parametrize("compiler_lib,compiler_version,runtime_lib,runtime_version", [
    (SYSTEM, "3.4.30", SYSTEM, "3.4.30"),          # the same library
    ("/usr/lib/gcc/x86_64-linux-gnu/11/libstdc++.so", "3.4.29", SYSTEM, "3.4.30"),  # older
    ("/other/libstdc++.so.6.0.30", "3.4.30", SYSTEM, "3.4.30"),  # another copy, same version
    ("/opt/conda/lib/libstdc++.so.6.0.9", "3.4.9", SYSTEM, "3.4.10"),  # numeric, not text, order
])
def test_same_or_older_compiler_library_builds(setup_py, compiler_lib, compiler_version,
                                               runtime_lib, runtime_version):
    assert setup_py.libstdcxx_mismatch(compiler_lib, compiler_version, runtime_lib,
                                       runtime_version) is None


def test_glibcxx_version_of_a_library_file(setup_py, tmp_path):
    lib = tmp_path / "libstdc++.so.6"
    lib.write_bytes(b"\x7fELF\0GLIBCXX_3.4\0GLIBCXX_3.4.9\0GLIBCXX_3.4.30\0GLIBCXX_TUNABLES\0"
                    b"CXXABI_1.3.13\0GLIBCXX_3.4.21\0")
    assert setup_py.glibcxx_version(str(lib)) == "3.4.30"
    assert setup_py.glibcxx_version(str(tmp_path / "missing.so")) is None


def fake_compiler(tmp_path, lib):
    """A CXX that answers -print-file-name=... with `lib`."""
    script = tmp_path / "fake-g++"
    script.write_text(f"#!/bin/sh\necho {lib}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc (Linux)")
def test_check_against_this_process(setup_py, tmp_path, monkeypatch, capsys):
    loaded = setup_py._loaded_libstdcxx()
    if loaded is None or setup_py.glibcxx_version(loaded) is None:
        pytest.skip("no libstdc++ with GLIBCXX versions loaded in this process")
    # A compiler whose libstdc++ is newer than the loaded one: the build stops, naming both.
    newer = tmp_path / "libstdc++.so.6"
    newer.write_bytes(b"\0GLIBCXX_3.4.999\0")
    monkeypatch.setenv("CXX", fake_compiler(tmp_path, newer))
    with pytest.raises(SystemExit) as exc:
        setup_py.check_libstdcxx()
    assert str(newer) in str(exc.value) and loaded in str(exc.value)
    # The loaded library itself: nothing to say.
    monkeypatch.setenv("CXX", fake_compiler(tmp_path, loaded))
    setup_py.check_libstdcxx()
    # A compiler that cannot be run: a note, and the build goes on.
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    setup_py.check_libstdcxx()
    assert "libstdc++ check skipped" in capsys.readouterr().out
