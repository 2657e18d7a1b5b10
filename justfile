# maxsim maintainer recipes. `just --list` shows them.

py := ".venv/bin/python"

# Build the kernels-hub variant for this machine (cpu or cuda) into build/
build backend="":
    MAXSIM_BACKEND={{backend}} bash scripts/setup.sh

# Run the whole test suite (sets itself up)
test *args:
    bash scripts/test.sh {{args}}

# Build the CUDA variant and run the suite; meant for a GPU machine
gpu-test *args:
    MAXSIM_BACKEND=cuda bash scripts/test.sh {{args}}

# Compile every CUDA source with nvcc for sm_80 and sm_90a (no GPU needed)
cuda-compile-check:
    MAXSIM_CUDA_ARCHS="8.0;9.0a" {{py}} tools/build.py --check-cuda-compile

# Metal backend on a Mac: offline shader compile check, then the suite on MPS (matrix and scalar paths)
metal-test *args:
    mkdir -p .cache
    xcrun -sdk macosx metal -std=metal3.0 -Wall -c maxsim-metal/maxsim.metal -o .cache/maxsim.air
    xcrun -sdk macosx metallib .cache/maxsim.air -o .cache/maxsim.metallib
    MAXSIM_BACKEND=metal bash scripts/test.sh {{args}}
    MAXSIM_METAL_PATH=simt {{py}} -m pytest tests -q -p no:cacheprovider -k mps {{args}}

# Run example NN (01 quickstart, ...)
example NN:
    bash scripts/setup.sh && {{py}} examples/{{NN}}_*.py

# Benchmarks: CPU vs einsum / maxsim-cpu, or the GPU matrix when a GPU is present
bench:
    bash scripts/setup.sh && {{py}} benchmarks/bench_cpu.py

# Render bench_results/*.json into the tables of README.md, docs/performance.md and docs/search.md, and the charts
bench-render:
    {{py}} benchmarks/render.py

# GPU benchmark matrix on Hugging Face Jobs (needs an account with Jobs access and
# the `hf` CLI); MAXSIM_SRC is the git URL of this repository.
cuda-bench-matrix FLAVOR="h100":
    hf jobs run --flavor {{FLAVOR}} --timeout 1h pytorch/pytorch:2.9.1-cuda12.8-cudnn9-devel \
      bash -c "git clone ${MAXSIM_SRC:?set MAXSIM_SRC} maxsim && cd maxsim && \
               pip install -q kernels pytest hypothesis late-interaction-kernels==0.4.5 flash-maxsim==0.3.0 && \
               OUT=/tmp/out bash scripts/gpu_session.sh build test bench cold && cat /tmp/out/bench.json"

# Release build and upload with kernel-builder (needs Nix and Hub access)
upload:
    nix run .#build-and-upload
