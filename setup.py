"""Build the compiled core, ``kvpush._core``, from ``csrc/``.

Metadata and dependencies live in ``pyproject.toml``; this file only declares the
extension and reads two build flags:

* ``KVPUSH_DEBUG=1``    -- assertions on, ``-O0 -g``.
* ``KVPUSH_SANITIZE=1`` -- AddressSanitizer + UBSan (load with ``LD_PRELOAD=$(gcc -print-file-name=libasan.so)``).
"""

import os
from glob import glob

import pybind11
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

# csrc/bindings.cpp uses py::native_enum, new in pybind11 3 (pyproject.toml says so too).
if int(pybind11.__version__.split(".")[0]) < 3:
    raise SystemExit(f"kvpush needs pybind11 >= 3 to build, found {pybind11.__version__}")

debug = os.environ.get("KVPUSH_DEBUG") == "1"
sanitize = os.environ.get("KVPUSH_SANITIZE") == "1"

compile_args = ["-Wall", "-Wextra", "-Wno-unused-parameter"]
link_args: list[str] = []
macros = []
if debug:
    compile_args += ["-O0", "-g"]
    macros.append(("KVPUSH_DEBUG", "1"))
else:
    compile_args += ["-O3"]
    macros.append(("NDEBUG", "1"))
if sanitize:
    compile_args += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
    link_args += ["-fsanitize=address,undefined"]

core = Pybind11Extension(
    "kvpush._core",
    sorted(glob("csrc/kvpush/*.cpp")) + ["csrc/bindings.cpp"],
    include_dirs=["csrc"],
    cxx_std=17,
    define_macros=macros,
    extra_compile_args=compile_args,
    extra_link_args=link_args,
)

# kvpush._nixlc: a NIXL agent over NIXL's C API without the GIL (TransportConfig.nixl_api =
# "c"); it opens libnixl_capi.so at run time, so it builds without NIXL installed.
nixlc = Pybind11Extension(
    "kvpush._nixlc",
    ["csrc/nixl_path.cpp"],
    include_dirs=["csrc"],
    cxx_std=17,
    define_macros=macros,
    extra_compile_args=compile_args,
    extra_link_args=link_args,
    libraries=["dl"],
)

setup(ext_modules=[core, nixlc], cmdclass={"build_ext": build_ext})
