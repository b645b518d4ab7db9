"""Build flash_attn_ext._C with setuptools + torch.utils.cpp_extension.

Build switches (all optional): FLASH_ATTN_EXT_CUDA_ARCHS, FLASH_ATTN_EXT_HEAD_DIMS,
FLASH_ATTN_EXT_DTYPES, FLASH_ATTN_EXT_FORCE_CPU, FLASH_ATTN_EXT_NVCC_EXTRA, and torch's
MAX_JOBS. What each does, with the run-time switches: the "Environment switches" table of
docs/API.md, the one place they are documented. The build's first line says what it compiles
(build_banner).

Before compiling, the build checks the C++ compiler (CXX, default c++) against the libstdc++
that torch loaded into this process, and stops when the compiler's libstdc++ is newer (see
check_libstdcxx).
"""
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import (CUDA_HOME, BuildExtension, CppExtension,
                                           CUDAExtension)
except ImportError as e:  # pragma: no cover - exercised only on broken installs
    sys.exit(
        f"flash_attn_ext: could not import torch ({e}).\n"
        "PyTorch must be installed (and importable) before building this package.\n"
        "  pip install torch            # then\n"
        "  pip install --no-build-isolation .\n"
        "(--no-build-isolation lets the build see the torch you already have.)")

HERE = os.path.dirname(os.path.abspath(__file__))
ALL_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
ALL_DTYPES = ("fp16", "bf16")


def _env_list(name, default):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return list(default)
    return [x.strip() for x in re.split(r"[;,\s]+", raw) if x.strip()]


def _cpu_only_reason():
    """Why this build leaves the CUDA kernels out, or None when it builds them."""
    if os.environ.get("FLASH_ATTN_EXT_FORCE_CPU", "0") not in ("", "0"):
        return "FLASH_ATTN_EXT_FORCE_CPU is set"
    if torch.version.cuda is None:
        return "this torch is not a CUDA build"
    if CUDA_HOME is None or shutil.which("nvcc", path=os.path.join(CUDA_HOME, "bin")) is None:
        return "no CUDA toolkit (nvcc) found"
    return None


# ---- compiler vs run-time libstdc++ -------------------------------------------------------
# An extension compiled by a GCC newer than the libstdc++ the process loads (torch's, found by
# the dynamic loader first) needs symbols or ABI details that library lacks: it fails at
# import, or worse, runs until a C++ exception is thrown. On the GPU image the default CXX
# (an /opt/gcc wrapper) built an extension whose every error path segfaulted; /usr/bin/g++
# (the system libstdc++'s own compiler) works.

_GLIBCXX_VERSION = re.compile(rb"GLIBCXX_(3\.4(?:\.[0-9]+)?)(?![0-9.])")


def version_key(version):
    """"3.4.30" -> (3, 4, 30): numeric order ("3.4.9" < "3.4.10")."""
    return tuple(int(x) for x in version.split("."))


def libstdcxx_mismatch(compiler_lib, compiler_version, runtime_lib, runtime_version,
                       compiler="c++"):
    """The message to stop the build with, or None when the build may go on.

    compiler_lib: the libstdc++ the compiler links (`compiler -print-file-name=libstdc++.so.6`,
    real path), compiler_version: the highest GLIBCXX symbol version it defines ("3.4.33");
    runtime_lib / runtime_version: the same for the libstdc++ loaded in this process after
    `import torch`. Stops only when the compiler's library is a different file AND newer: an
    older or equal one gives an extension the run-time library can serve."""
    if compiler_lib == runtime_lib or version_key(compiler_version) <= version_key(runtime_version):
        return None
    return (
        f"flash_attn_ext: the C++ compiler '{compiler}' builds against\n"
        f"  {compiler_lib} (GLIBCXX_{compiler_version}),\n"
        f"newer than the libstdc++ that torch loads at run time:\n"
        f"  {runtime_lib} (GLIBCXX_{runtime_version}).\n"
        "An extension built this way fails at import or crashes in its C++ error paths.\n"
        "Build with the compiler of the run-time library, e.g.\n"
        "  CXX=/usr/bin/g++ CC=/usr/bin/gcc pip install --no-build-isolation .")


def glibcxx_version(path):
    """The highest GLIBCXX_3.4[.N] symbol version named in the library file, or None."""
    try:
        with open(path, "rb") as f:
            versions = {v.decode() for v in _GLIBCXX_VERSION.findall(f.read())}
    except OSError:
        return None
    return max(versions, key=version_key) if versions else None


def _compiler_libstdcxx(compiler):
    """Real path of the libstdc++ `compiler` links, or None."""
    for name in ("libstdc++.so.6", "libstdc++.so"):
        try:
            out = subprocess.run(shlex.split(compiler) + [f"-print-file-name={name}"],
                                 capture_output=True, text=True, timeout=60).stdout.strip()
        except (OSError, ValueError, subprocess.SubprocessError):
            return None
        if os.path.isabs(out) and os.path.exists(out):  # else the bare name: not found
            return os.path.realpath(out)
    return None


def _loaded_libstdcxx():
    """Real path of the libstdc++ mapped into this process (torch's), or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith("libstdc++.so"):
                    return os.path.realpath(fields[5].strip())
    except OSError:
        pass
    return None


def check_libstdcxx():
    """sys.exit with libstdcxx_mismatch's message when the compiler's libstdc++ is newer
    than the one loaded with torch; a note, and on with the build, when either library or
    its version cannot be determined (not Linux, no /proc, a compiler without
    -print-file-name, a static libstdc++)."""
    if not sys.platform.startswith("linux"):
        return
    compiler = os.environ.get("CXX") or "c++"
    compiler_lib, runtime_lib = _compiler_libstdcxx(compiler), _loaded_libstdcxx()
    if compiler_lib is not None and compiler_lib == runtime_lib:
        return
    versions = (glibcxx_version(compiler_lib) if compiler_lib else None,
                glibcxx_version(runtime_lib) if runtime_lib else None)
    if None in versions:
        print(f"flash_attn_ext: note: libstdc++ check skipped (compiler '{compiler}': "
              f"{compiler_lib or 'not found'}, loaded with torch: {runtime_lib or 'not found'})")
        return
    message = libstdcxx_mismatch(compiler_lib, versions[0], runtime_lib, versions[1], compiler)
    if message:
        sys.exit(message)


# ---- CUDA targets and sources ---------------------------------------------------------------
def _cuda_archs():
    return _env_list("FLASH_ATTN_EXT_CUDA_ARCHS", ["80", "90a"])


def _has_sm90a():
    return any(a.endswith("90a") for a in _cuda_archs())


def _gencode_flags():
    flags = []
    for arch in _cuda_archs():
        arch = arch.replace("sm_", "").replace(".", "")
        if arch.startswith("compute_"):
            flags.append(f"-gencode=arch={arch},code={arch}")
        else:
            flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    return flags


def _selected_cuda_sources():
    """All .cu/.cpp under csrc/cuda, minus generated instantiations that the
    head-dim / dtype filters exclude. Returns (sources, defines)."""
    head_dims = [int(d) for d in _env_list("FLASH_ATTN_EXT_HEAD_DIMS", ALL_HEAD_DIMS)]
    dtypes = _env_list("FLASH_ATTN_EXT_DTYPES", ALL_DTYPES)
    for d in head_dims:
        if d not in ALL_HEAD_DIMS:
            sys.exit(f"flash_attn_ext: FLASH_ATTN_EXT_HEAD_DIMS has {d}; choose from {ALL_HEAD_DIMS}")
    for t in dtypes:
        if t not in ALL_DTYPES:
            sys.exit(f"flash_attn_ext: FLASH_ATTN_EXT_DTYPES has {t}; choose from {ALL_DTYPES}")
    sources = []
    pattern = re.compile(r"_(fp16|bf16)_hdim(\d+)_")
    for path in sorted(glob.glob(os.path.join("csrc", "cuda", "**", "*.c*"), recursive=True)):
        if not path.endswith((".cu", ".cpp")):
            continue
        m = pattern.search(os.path.basename(path))
        if os.path.basename(path).startswith(("fwd_sm90_", "bwd_sm90_", "sm90_")) and not _has_sm90a():
            continue
        if m and (m.group(1) not in dtypes or int(m.group(2)) not in head_dims):
            continue
        sources.append(path)
    defines = [f"-DFAE_HAS_HDIM_{d}" for d in head_dims] + [f"-DFAE_HAS_{t.upper()}" for t in dtypes]
    if _has_sm90a():
        defines.append("-DFAE_HAS_SM90A")
    return sources, defines


# ---- the build's first line ------------------------------------------------------------------
# The full CUDA build (80;90a, every head dim and dtype): ~25 min on 2 cores (a fresh install
# took 1480 s there, torch's download included; issue 47), 5-10 min on 16. PTX-only targets
# (compute_80;compute_90a, as CI builds) skip ptxas and take less.
FULL_BUILD_TIME = "~25 min on 2 cores, 5-10 min on 16"
_BUILD_COMMANDS = ("bdist_wheel", "build_ext", "build", "develop", "install", "editable_wheel")


def build_banner(cpu_only_reason, units, full_units, archs, head_dims, dtypes):
    """The one line the build prints first: what it compiles, how long that takes, how to
    narrow it."""
    jobs = os.environ.get("MAX_JOBS") or "unset (ninja's default)"
    if cpu_only_reason:
        return (f"flash_attn_ext: building the CPU-only extension ({cpu_only_reason}): {units} "
                f"translation units, ~30 s on 2 cores; the CUDA kernels need nvcc and a CUDA "
                f"build of torch.")
    of_full = f" of the full build's {full_units}" if units != full_units else ""
    return (f"flash_attn_ext: compiling {units} translation units{of_full} "
            f"for CUDA archs {';'.join(archs)}, head dims {','.join(str(d) for d in head_dims)}, "
            f"{'+'.join(dtypes)}, MAX_JOBS {jobs}, {os.cpu_count()} cores here; the full build takes "
            f"{FULL_BUILD_TIME}; narrow it with FLASH_ATTN_EXT_CUDA_ARCHS (e.g. 90a) and "
            f"FLASH_ATTN_EXT_HEAD_DIMS (e.g. 64,128).")


def print_banner(line):
    """Print the banner; during the build itself also on the terminal, which pip's default
    (and -q) output would otherwise hide: pip shows a build's output only with -v or when it
    fails."""
    print(line, flush=True)
    if not any(command in sys.argv[1:] for command in _BUILD_COMMANDS):
        return  # pip's metadata steps run this file too: one terminal line per install
    try:
        with open("/dev/tty", "w") as tty:  # no terminal (CI, a pipe): nothing to do
            tty.write("\n" + line + "\n")
    except OSError:
        pass


def build_extension():
    os.chdir(HERE)
    cpu_only_reason = _cpu_only_reason()
    common_sources = ["csrc/module.cpp", "csrc/ops.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    cuda_sources = [] if cpu_only_reason else _selected_cuda_sources()[0]
    all_cuda = [p for p in glob.glob(os.path.join("csrc", "cuda", "**", "*.c*"), recursive=True)
                if p.endswith((".cu", ".cpp"))]
    full_units = len(common_sources) + len(all_cuda)
    print_banner(build_banner(cpu_only_reason, len(common_sources) + len(cuda_sources), full_units,
                              _cuda_archs(), _env_list("FLASH_ATTN_EXT_HEAD_DIMS", ALL_HEAD_DIMS),
                              _env_list("FLASH_ATTN_EXT_DTYPES", ALL_DTYPES)))
    check_libstdcxx()
    # No -std flag: torch.utils.cpp_extension picks the standard its headers need
    # (C++17 for torch <= 2.11, C++20 for newer releases).
    cxx_flags = ["-O3"]
    if sys.platform.startswith("linux"):
        cxx_flags.append("-fopenmp")
    include_dirs = [os.path.join(HERE, "csrc")]
    if cpu_only_reason:
        return CppExtension("flash_attn_ext._C", common_sources, include_dirs=include_dirs,
                            extra_compile_args={"cxx": cxx_flags},
                            extra_link_args=["-fopenmp"] if "-fopenmp" in cxx_flags else [],
                            py_limited_api=True)
    cuda_sources, defines = _selected_cuda_sources()
    nvcc_flags = ["-O3", "--use_fast_math", "--expt-relaxed-constexpr",
                  "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                  "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                  "-lineinfo", "--threads", "2"] + defines + _gencode_flags()
    # Extra nvcc flags: the tile-tuning defines of bench/tune_tiles.sh, -Xptxas=-v
    # (register / spill report per kernel, as bench/gpu_check.sh build passes), ...
    nvcc_flags += os.environ.get("FLASH_ATTN_EXT_NVCC_EXTRA", "").split()
    print(f"flash_attn_ext: building with CUDA {torch.version.cuda}, nvcc flags {nvcc_flags}")
    return CUDAExtension("flash_attn_ext._C", common_sources + cuda_sources,
                         include_dirs=include_dirs,
                         extra_compile_args={"cxx": cxx_flags + ["-DFAE_WITH_CUDA"] + defines,
                                             "nvcc": nvcc_flags},
                         extra_link_args=["-fopenmp"],
                         py_limited_api=True)


# Package metadata lives in pyproject.toml; this file only adds the extension. (pip and
# setuptools run this file as __main__; tests/test_build.py imports it for its functions.)
if __name__ == "__main__":
    setup(
        ext_modules=[build_extension()],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
        options={"bdist_wheel": {"py_limited_api": "cp39"}},
    )
