"""Build script for the llm_datadist Cython core.

Set LLM_DATADIST_DEBUG=1 to build with bounds checks, wraparound checks and line tracing back on
(and the C macro LLM_DATADIST_DEBUG=1, reported by ``llm_datadist._core.DEBUG_BUILD``).
"""

import os

import Cython
import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

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

extensions = [
    Extension(
        "llm_datadist._core",
        ["llm_datadist/_core.pyx"],
        include_dirs=["include", numpy.get_include()],
        define_macros=macros,
        extra_compile_args=compile_args,
        libraries=["dl"],
    ),
    Extension(
        "llm_datadist._planes",
        ["llm_datadist/_planes.pyx"],
        include_dirs=["include", numpy.get_include()],
        define_macros=macros,
        extra_compile_args=compile_args,
    ),
]

setup(ext_modules=cythonize(extensions, compiler_directives=directives, include_path=["."]))
