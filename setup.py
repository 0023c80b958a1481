"""Build script for the llm_datadist Cython core.

Set LLM_DATADIST_DEBUG=1 to build with bounds checks, wraparound checks and line tracing back on
(and the C macro LLM_DATADIST_DEBUG=1, reported by ``llm_datadist._core.DEBUG_BUILD``).

``build_ext`` also writes ``llm_datadist/_build_info.py`` next to the extensions: the compiler
command line the extensions were compiled with, their extra arguments, macros and Cython
directives (shown by ``python -m llm_datadist info``). It is a build product, not in git.

Every build first checks the status table: the mirrors generated from
``include/llm_datadist/dd_status.h`` (``_status_codes.py``, ``_status.pxd``) must match it, and
``status.py`` must name only codes it defines; otherwise the build stops and says to run
``python tools/status_table.py`` (``make status``).

Wheels target glibc 2.28 and later (manylinux_2_28, ``tools/build_wheels.py``) whatever glibc builds
them: ``include/llm_datadist/dd_glibc.h`` binds dlopen, dlsym, dlclose and dlerror to the symbol
versions every glibc exports, and on glibc 2.34 or later, where ``-ldl`` finds only an empty
libdl.a, ``_core`` is linked against libdl.so.2 by file name so that it names it as a needed
library, as a build on glibc 2.28 does: before 2.34 those functions live in libdl.so.2.
"""

import importlib.util
import os
import sys

import Cython
import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def load_status_table():
    """tools/status_table.py, loaded by path (it is no package and not installed)."""
    spec = importlib.util.spec_from_file_location("llm_datadist_status_table",
                                                  os.path.join(HERE, "tools", "status_table.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_status_problems = load_status_table().check()
if _status_problems:
    sys.exit("llm_datadist: the status table mirrors disagree with include/llm_datadist/dd_status.h:\n  "
             + "\n  ".join(_status_problems))

DEBUG = os.environ.get("LLM_DATADIST_DEBUG", "0") not in ("", "0")

directives = {
    "language_level": 3,
    "embedsignature": True,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": not DEBUG,
    "linetrace": DEBUG,
    "auto_pickle": False,
}
macros = [
    ("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
    ("LLM_DATADIST_DEBUG", "1" if DEBUG else "0"),
    ("LLM_DATADIST_CYTHON_VERSION", f'"{Cython.__version__}"'),
]
if DEBUG:
    macros.append(("CYTHON_TRACE_NOGIL", "1"))
    compile_args = ["-O0", "-g"]
else:
    compile_args = ["-O3"]


def libdl_link_args():
    """On glibc 2.34 or later: libdl.so.2 by file name, needed even if unused (module docstring)."""
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""  # "glibc 2.36"
    except (AttributeError, ValueError, OSError):  # not Linux
        return []
    name, _, version = libc.partition(" ")
    if name != "glibc" or tuple(int(part) for part in version.split(".")[:2]) < (2, 34):
        return []
    return ["-Wl,--push-state,--no-as-needed", "-l:libdl.so.2", "-Wl,--pop-state"]


extensions = [
    Extension(
        "llm_datadist._core",
        ["llm_datadist/_core.pyx"],
        include_dirs=["include", numpy.get_include()],
        define_macros=macros,
        extra_compile_args=compile_args,
        libraries=["dl"],
        extra_link_args=libdl_link_args(),
    ),
    Extension(
        "llm_datadist._io",
        ["llm_datadist/_io.pyx"],
        include_dirs=["include", numpy.get_include()],
        define_macros=macros,
        extra_compile_args=compile_args,
    ),
]

BUILD_INFO = "_build_info.py"


class build_ext_recording(build_ext):
    """``build_ext`` that records how the extensions were compiled (``_build_info.py``)."""

    def build_extensions(self):
        super().build_extensions()
        # The command the compiler was run with: the interpreter's own flags (sysconfig CC,
        # CFLAGS, CCSHARED, as distutils assembles them) followed by each extension's.
        compiler = getattr(self.compiler, "compiler_so", None) or [type(self.compiler).__name__]
        self._build_info = {
            "COMPILER_COMMAND": list(compiler),
            "EXTRA_COMPILE_ARGS": {ext.name: list(ext.extra_compile_args) for ext in self.extensions},
            "DEFINE_MACROS": {ext.name: [f"{k}={v}" if v is not None else k for k, v in ext.define_macros]
                              for ext in self.extensions},
            "CYTHON_DIRECTIVES": dict(directives),
            "CYTHON_VERSION": Cython.__version__,
            "NUMPY_BUILD_VERSION": numpy.__version__,
            "PYTHON_BUILD_VERSION": sys.version.split()[0],
            "DEBUG": DEBUG,
        }

    def run(self):
        super().run()
        info = getattr(self, "_build_info", None)
        if info is None:
            return
        text = ['"""How the extensions of this installation were compiled: written by setup.py\'s\n'
                'build_ext (not in git, do not edit)."""\n']
        text += [f"{name} = {value!r}\n" for name, value in info.items()]
        targets = [os.path.join(self.build_lib, "llm_datadist", BUILD_INFO)]
        if self.inplace:
            targets.append(os.path.join(HERE, "llm_datadist", BUILD_INFO))
        for target in targets:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "w") as f:
                f.write("".join(text))


setup(ext_modules=cythonize(extensions, compiler_directives=directives, include_path=["."]),
      cmdclass={"build_ext": build_ext_recording})
