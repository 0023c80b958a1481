.PHONY: build debug status kernel test test-quick gpu-check wheels bench lint clean

build:        ## compile the Cython core in place
	python setup.py build_ext --inplace

debug:        ## build with bounds checks and line tracing (LLM_DATADIST_DEBUG=1)
	LLM_DATADIST_DEBUG=1 python setup.py build_ext --inplace --force

status:       ## regenerate the status table mirrors (_status_codes.py, _status.pxd) from dd_status.h
	python tools/status_table.py

kernel:       ## regenerate include/llm_datadist/dd_copy_kernel.h (the copy kernel's PTX) from llm_datadist/runtimes/dd_copy.cu; needs nvcc
	python tools/copy_kernel.py

test:         ## the test suite (same command as the README and CI)
	python -m pytest

test-quick:   ## the quick tier: the core, API and engine tests, the layering check and the documents' links (well under a minute on 2 cores)
	python -m pytest -q tests/core tests/api tests/engine tests/test_layering.py tests/test_doc_links.py

gpu-check:    ## on a GPU machine: facts, build, GPU tests, vLLM's GPU views, GPU bench -> gpu-check/report.md (GPU_CHECK_FLAGS=--stub: without a GPU)
	python tools/gpu_check.py --out gpu-check $(GPU_CHECK_FLAGS)

wheels:       ## manylinux_2_28 wheels for CPython 3.10-3.13 in wheelhouse/, each installed without a compiler and run through the quick tier
	python tools/build_wheels.py

bench:        ## pytest-benchmark suites
	python -m pytest bench/ --benchmark-only

lint:         ## ruff and cython-lint (pip install ruff cython-lint); .ci/run runs this target
	ruff check setup.py tools llm_datadist tests bench
	cython-lint llm_datadist/*.pyx llm_datadist/*.pxd llm_datadist/runtimes/*.pxd llm_datadist/runtimes/*.pxi

clean:
	rm -rf build dist wheelhouse *.egg-info llm_datadist/_core.c llm_datadist/_io.c llm_datadist/*.so
