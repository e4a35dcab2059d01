"""Build attn_ext's compiled library, attn_ext._C.

CPU sources are always built. The CUDA sources are added, as in torchvision and
other PyTorch extensions, when torch sees a GPU or when asked (FORCE_CUDA=1, or
a TORCH_CUDA_ARCH_LIST), provided torch is a CUDA build and nvcc is found. A
machine without a GPU then skips minutes of nvcc unless told otherwise;
FORCE_CUDA=1 without a usable toolkit is an error.

Environment switches:
  ATTN_EXT_CPU_ONLY=1     build the CPU kernels only (fast iteration)
  FORCE_CUDA=1            build the CUDA kernels even where torch sees no GPU (CI does)
  TORCH_CUDA_ARCH_LIST    CUDA archs to build for (default "8.0;9.0"); setting it also asks for them
  MAX_JOBS                parallel compile jobs (honoured by torch's ninja build)
  ATTN_EXT_DEBUG_INFO=1   keep debug info (-g); by default -g0 overrides the -g of Python's CFLAGS,
                          which costs 40% of the C++ compile time and most of the library's size
  ATTN_EXT_SANITIZE=1     the C++ sources with AddressSanitizer + UndefinedBehaviorSanitizer (-O1 -g;
                          `make sanitize`: Python then needs libasan preloaded)
  CUDA_HOME               the CUDA toolkit; found from nvcc itself when unset
"""

import glob
import os
import platform
import re
import shutil
import subprocess

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _version():
    """The version, from pyproject.toml (its one place; CMakeLists.txt reads it there too)."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        return re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)


VERSION = _version()


def _nvcc_toolkit():
    """The toolkit folder nvcc really uses (nvcc may be a wrapper script)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        dry = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"^#\$ TOP=(.*)$", dry.stdout + dry.stderr, re.M)
    return os.path.realpath(m.group(1).strip()) if m else os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


CPU_ONLY = os.environ.get("ATTN_EXT_CPU_ONLY", "0") not in ("", "0")
if not CPU_ONLY and "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ:
    toolkit = _nvcc_toolkit()
    if toolkit:
        os.environ["CUDA_HOME"] = toolkit  # torch reads it when cpp_extension is imported

import torch  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

X86 = platform.machine().lower() in ("x86_64", "amd64")


def _isa_flags():
    """{isa: flags} for the kernel files csrc/cpu/attention_kernel_<isa>.cpp (x86-64 only).
    csrc/cpu/isa_flags.txt is the one list; CMakeLists.txt reads it too."""
    flags = {}
    with open(os.path.join(ROOT, "csrc", "cpu", "isa_flags.txt")) as f:
        for line in f:
            words = line.split("#", 1)[0].split()
            if words:
                flags[words[0]] = words[1:]
    return flags


ISA_FLAGS = _isa_flags()
cpu_sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
if not X86:  # only the portable variant elsewhere
    cpu_sources = [s for s in cpu_sources if not any(s.endswith(f"_{isa}.cpp") for isa in ISA_FLAGS)]
    ISA_FLAGS = {}
cuda_sources = sorted(glob.glob("csrc/cuda/*.cu") + glob.glob("csrc/cuda/*.cpp"))


def _cuda_decision():
    """(build the CUDA kernels?, why not: a phrase for `python -m attn_ext info`, without ';' or '"')."""
    force = os.environ.get("FORCE_CUDA", "0") not in ("", "0")
    asked = force or bool(os.environ.get("TORCH_CUDA_ARCH_LIST"))
    if CPU_ONLY:
        return False, "ATTN_EXT_CPU_ONLY was set"
    if not (asked or torch.cuda.is_available()):
        return False, "torch sees no GPU here (FORCE_CUDA=1 builds them anyway)"
    missing = None
    if torch.version.cuda is None:
        missing = f"torch {torch.__version__} is a CPU-only build"
    elif cpp_extension.CUDA_HOME is None or not os.path.exists(os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")):
        missing = "no CUDA toolkit (nvcc) was found: put nvcc on PATH or set CUDA_HOME"
    elif not cuda_sources:
        missing = "csrc/cuda holds no sources"
    if missing and force:
        raise SystemExit(f"attn_ext: FORCE_CUDA=1 asks for the CUDA kernels, but {missing}")
    return (False, missing) if missing else (True, "")


with_cuda, cuda_skipped = _cuda_decision()
arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0;9.0") if with_cuda else ""
if with_cuda:
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list

SANITIZE = os.environ.get("ATTN_EXT_SANITIZE", "0") not in ("", "0")
build_info = ";".join(
    [
        f"version={VERSION}",
        f"torch={torch.__version__}",
        f"cuda={torch.version.cuda if with_cuda else 'none'}",
        f"cuda_archs={arch_list.replace(';', ' ') or 'none'}",
    ]
    + (["sanitize=address undefined"] if SANITIZE else [])
)
# The Python side reads what the build was made for without loading the library.
with open(os.path.join(ROOT, "attn_ext", "_build_info.py"), "w") as f:
    f.write(f'"""Written by setup.py: what attn_ext._C was built against."""\n'
            f'BUILD_INFO = "{build_info};cuda_skipped={cuda_skipped}"\n')

# -fopenmp: at::parallel_for is inline and runs serially without it. The
# library then needs libgomp.so.1, which is the one torch ships and has loaded.
DEBUG_INFO = os.environ.get("ATTN_EXT_DEBUG_INFO", "0") not in ("", "0")
cxx_flags = ["-O3", "-g" if DEBUG_INFO else "-g0", "-fopenmp", "-fvisibility=hidden",
             f'-DATTN_EXT_BUILD_INFO="{build_info}"']
# Every report stops the process (no recovery), so that a test run cannot pass over one.
SANITIZER_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
if SANITIZE:
    cxx_flags = ["-O1", "-g"] + SANITIZER_FLAGS + cxx_flags[2:]
extra_compile_args = {"cxx": cxx_flags}
include_dirs = [os.path.join(ROOT, "csrc")]
define_macros = []


def _libstdcxx_link_args():
    """Link the libstdc++.so.6 that this process (torch) runs with, by its path.

    Some g++ toolchains link libstdc++ into shared libraries statically (a
    -static-libstdc++ spec, or no libstdc++.so beside the compiler; the GPU
    machines' /opt/gcc/bin/g++ with torch 2.11 is one). _C.so then carries a
    second libstdc++ whose iostreams crash (SIGSEGV in ostream::operator<<) on
    the process's locale the first time an error message is formatted. Naming
    the loaded shared library ahead of the driver's own -lstdc++ resolves every
    libstdc++ symbol to it; elsewhere this is what -lstdc++ does anyway."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libstdc++.so" in line}
    except OSError:  # not Linux
        return []
    for path in sorted(paths):
        if os.path.isfile(path):
            return [path]
    return []


link_args = ["-fopenmp"] + (SANITIZER_FLAGS if SANITIZE else []) + _libstdcxx_link_args()

if with_cuda:
    extra_compile_args["nvcc"] = ["-O3", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"]
    define_macros.append(("ATTN_EXT_WITH_CUDA", None))
    # torch's CUDA headers include cuBLAS/cuSPARSE headers that a bare toolkit may lack:
    # the pip package `nvidia` (installed with torch's CUDA build) carries them.
    for sp in {os.path.dirname(os.path.dirname(torch.__file__))}:
        for inc in glob.glob(os.path.join(sp, "nvidia", "cu*", "include")):
            include_dirs.append(inc)
    ext = CUDAExtension(
        "attn_ext._C", cpu_sources + cuda_sources, include_dirs=include_dirs, define_macros=define_macros,
        extra_compile_args=extra_compile_args, extra_link_args=link_args, py_limited_api=True,
    )
else:
    ext = CppExtension(
        "attn_ext._C", cpu_sources, include_dirs=include_dirs, define_macros=define_macros,
        extra_compile_args=extra_compile_args, extra_link_args=link_args, py_limited_api=True,
    )


class BuildExtensionPerIsa(BuildExtension):
    """torch's BuildExtension, plus per-file flags for the *_<isa>.cpp kernel files.

    The same kernel source is compiled once per instruction set and the library
    picks one at run time, so no -march=native is needed in a distributable build.
    torch writes one build.ninja with one set of flags for every file; this adds
    each kernel file's flags to its own build statement (a ninja variable bound
    per statement), so that all files compile in one ninja run, MAX_JOBS at a
    time, and no core idles while one long file compiles alone.
    """

    def run(self):
        if self.inplace:  # an older in-place build under the version-specific name would shadow the abi3 one
            for stale in glob.glob(os.path.join(ROOT, "attn_ext", "_C.cpython-*.so")):
                os.remove(stale)
        super().run()

    def build_extension(self, ext):
        # Each kernel file holds its own copy of every inline function and template it uses from
        # the shared headers (AttnParams' constructor, std::vector's members), compiled with its
        # flags; the linker keeps the first copy of each and drops the others, which then call the
        # one kept. setuptools links the objects sorted by name (amx first), so that the AVX-512
        # copies were kept and the avx2 and default kernels stopped with SIGILL on an AVX2-only
        # CPU (an AMD EPYC, family 23). The kernel files go last, in isa_flags.txt's order,
        # narrowest first: the copy kept is then the narrowest unit's that uses it, which every CPU
        # that runs its callers can run. tests/test_build.py reads the library's code for wider copies.
        isa_rank = {f"attention_kernel_{isa}": rank for rank, isa in enumerate(ISA_FLAGS)}
        link_shared_object = self.compiler.link_shared_object

        def isa_rank_of(obj):  # -1 (first) for every file compiled with the baseline flags
            return isa_rank.get(os.path.splitext(os.path.basename(obj))[0], -1)

        def link_isa_units_last(objects, *args, **kwargs):
            return link_shared_object(sorted(objects, key=isa_rank_of), *args, **kwargs)  # a stable sort

        self.compiler.link_shared_object = link_isa_units_last
        write_ninja_file = cpp_extension._write_ninja_file

        def write_with_isa_flags(path, *args, **kwargs):
            write_ninja_file(path, *args, **kwargs)
            with open(path) as f:
                lines = f.read().split("\n")
            out, flagged = [], set()
            for line in lines:
                out.append(line)
                for isa, flags in ISA_FLAGS.items():
                    if line.startswith("build ") and " compile " in line and line.endswith(f"_{isa}.cpp"):
                        out.append("  post_cflags = $post_cflags " + " ".join(flags).replace("$", "$$"))
                        flagged.add(isa)
            wanted = {isa for isa in ISA_FLAGS if any(s.endswith(f"_{isa}.cpp") for s in kwargs.get("sources", ()))}
            if flagged != wanted:  # torch wrote its build statements in a form not met before
                raise SystemExit(f"attn_ext: could not add the per-ISA flags to {path} for {sorted(wanted - flagged)}")
            with open(path, "w") as f:
                f.write("\n".join(out))

        cpp_extension._write_ninja_file = write_with_isa_flags
        try:
            super().build_extension(ext)
        finally:
            cpp_extension._write_ninja_file = write_ninja_file
            self.compiler.link_shared_object = link_shared_object


setup(
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtensionPerIsa},
    # One wheel for every CPython >= 3.10: attn_ext._C holds no Python functions (the operators
    # are reached through torch.ops), so it needs only the limited C API; torch defines
    # Py_LIMITED_API for py_limited_api extensions and leaves libtorch_python out of the link.
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
