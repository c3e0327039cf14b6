# GPU CI image for flash_mla on Hopper runners.
#
#   docker build -t flash-mla-ci .
#   docker run --rm --gpus all flash-mla-ci            # runs scripts/gpu_ci.sh; needs an sm_90 GPU
#
# The image holds the CUDA toolkit (nvcc), a CUDA build of PyTorch, the test dependencies and flash_mla installed
# from this source tree with its CUDA extension compiled for sm_90a, so running it needs no network access.
# `docker build` sees no GPU: that is fine, because setup.py decides to build from torch.version.cuda and nvcc
# alone and passes an explicit -gencode for sm_90a (PyTorch then never asks a device for its architecture).
#
# nvcc and PyTorch must agree on the CUDA major version (PyTorch's extension builder refuses a mismatch), so
# CUDA_VERSION and TORCH_INDEX_URL change together, e.g. for CUDA 13:
#   --build-arg CUDA_VERSION=13.0.0 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG CUDA_VERSION=12.8.1
ARG UBUNTU_VERSION=22.04
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION}

# PyTorch wheel: the version and the index that has it built for the CUDA above.
ARG TORCH_VERSION=2.9.1
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# CUTLASS headers come from third_party/cutlass when the submodule is checked out in the build context, else from
# this nvidia-cutlass wheel (setup.py picks); the wheel is installed either way so the fallback always works.
ARG CUTLASS_VERSION=4.2.0.0
# setup.py compiles for sm_90a explicitly; the arch list keeps any other PyTorch extension build on Hopper too.
ARG TORCH_CUDA_ARCH_LIST=9.0a
# Parallel nvcc jobs: each CUTLASS kernel file takes a few GB of host memory to compile.
ARG MAX_JOBS=4

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    CUDA_HOME=/usr/local/cuda \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    MAX_JOBS=${MAX_JOBS} \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Python from the distribution; a virtual environment keeps pip away from the system packages (PEP 668 on 24.04).
# The apt packages are deliberately not pinned: the exact Ubuntu versions change with every security update of the
# base image, and a pin would break the build as soon as the archive drops the pinned version.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates python3 python3-dev python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --shell /bin/bash --uid 10001 --user-group ci \
    && mkdir -p /opt/venv /workspace/flash_mla \
    && chown 10001:10001 /opt/venv /workspace/flash_mla

# Everything below runs as the unprivileged user `ci` (uid 10001, numeric so no host lookup is needed), so the
# files it creates are its own without a chown layer.
USER 10001:10001
WORKDIR /workspace/flash_mla

RUN python3 -m venv /opt/venv \
    && python -m pip install --upgrade "pip>=24" "setuptools>=64" "wheel>=0.40" "ninja>=1.11" \
    && python -m pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
    && python -m pip install --no-deps "nvidia-cutlass==${CUTLASS_VERSION}" \
    && python -c "import torch; assert torch.version.cuda, 'PyTorch ' + torch.__version__ + ' has no CUDA'; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"

# The build inputs first, so that editing tests or scripts does not recompile the kernels.
COPY --chown=10001:10001 pyproject.toml setup.py README.md ./
COPY --chown=10001:10001 csrc csrc
COPY --chown=10001:10001 flash_mla flash_mla
COPY --chown=10001:10001 third_party third_party

# Build the extension and pre-install the test, Triton and benchmark extras (pytest, triton, linters, matplotlib):
# nothing is fetched at run time. The build must produce flash_mla._cuda: setup.py leaves _build_note.txt when it
# skipped it.
RUN python -m pip install --no-build-isolation -v -e ".[test,triton,bench]" \
    && if [ -e flash_mla/_build_note.txt ]; then cat flash_mla/_build_note.txt; exit 1; fi \
    && ls -l flash_mla/_cuda*.so

COPY --chown=10001:10001 tests tests
COPY --chown=10001:10001 benchmarks benchmarks
COPY --chown=10001:10001 scripts scripts
COPY --chown=10001:10001 Dockerfile .dockerignore ./

# The extension was built above: gpu_ci.sh keeps it (FLASH_MLA_CI_SKIP_BUILD=1) and, if asked to rebuild, installs
# without the network (FLASH_MLA_OFFLINE=1). Logs go to $OUT_DIR; mount a writable folder there to keep them.
ENV FLASH_MLA_CI_SKIP_BUILD=1 \
    FLASH_MLA_OFFLINE=1 \
    PYTHON=python \
    OUT_DIR=/workspace/flash_mla/ci-logs

ENTRYPOINT ["/workspace/flash_mla/scripts/gpu_ci.sh"]
