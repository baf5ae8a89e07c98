# The images of PAT: one Dockerfile, three targets. The last path segment of an image repository is the target that
# builds it:
#   docker build --target pat-operator    -t ghcr.io/pat-rlhf/pat-operator:0.1.0 .     # the control plane, no torch
#   docker build --target pat-worker      -t ghcr.io/pat-rlhf/pat-worker:0.1.0 .       # trainer / generator pods, CUDA
#   docker build --target pat-worker-vllm -t ghcr.io/pat-rlhf/pat-worker-vllm:0.1.0 .  # generator pods of engine vllm
# All run as UID 1000 (the pods' runAsUser: pat_operator.builders.RUN_AS and the chart's podSecurityContext), with
# a read-only root filesystem and HOME=/tmp; every pod sets its command (`pat-operator`, `pat`), so there is no
# ENTRYPOINT. tests/unit/test_images.py checks this file's targets, users, pins and commands without a Docker engine.

ARG VERSION=0.1.0
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
# The CUDA base only for the container toolkit's environment (NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES)
# and cuda-compat: the CUDA libraries (cuBLAS, cuDNN, NCCL) come with torch as nvidia-* wheels, so a runtime or
# cudnn base would only hold a second copy of them.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
# The torch the tests run (Makefile), built for CUDA 12.8 (drivers >= 570; Hopper and Blackwell).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# The vLLM the tests run (its CPU build there, scripts/vllm-venv.sh); PyPI's vllm wheel is the CUDA build and pins
# its own torch (a CUDA build from PyPI too).
ARG VLLM_VERSION=0.32.0

# wheel: the pat-rlhf wheel (pure Python), built once for both images; the build backend stays in this stage.
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY workers ./workers
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# operator-venv: the control plane's dependencies (kopf, kubernetes, pydantic, aiohttp), without the workers
# extra, in a venv that the final stage copies whole (pip's caches and the wheels stay behind).
FROM ${PYTHON_IMAGE} AS operator-venv
COPY --from=wheel /wheels /wheels
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --prefer-binary /wheels/pat_rlhf-*.whl

# pat-operator: the base (the same interpreter path the venv points at) plus the venv and a numeric user.
FROM ${PYTHON_IMAGE} AS pat-operator
ARG VERSION
LABEL org.opencontainers.image.title="pat-operator" \
      org.opencontainers.image.description="PAT: the RLHFJob operator" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/pat-rlhf/pat-rlhf" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 1000 pat \
 && useradd --uid 1000 --gid 1000 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin pat
COPY --from=operator-venv /opt/venv /opt/venv
# No .pyc writes at run time (the root filesystem is read-only; pip compiled them at install).
ENV PATH="/opt/venv/bin:${PATH}" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 1000:1000
CMD ["pat-operator", "--help"]

# worker-venv: torch from the CUDA wheel index first (so that the workers extra's torch>=2.5 is already met and
# nothing pulls another build), then the package with the workers extra. On the CUDA base itself, so that the
# venv's interpreter (the base's python3, 3.12 on Ubuntu 24.04) is at the same path in pat-worker.
FROM ${CUDA_IMAGE} AS worker-venv
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
# Unpinned apt packages: Ubuntu's archive keeps only a release's current version, so a pin breaks rebuilds; the
# base's exact tag fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
COPY --from=wheel /wheels /wheels
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && /opt/venv/bin/pip install --no-cache-dir --prefer-binary "$(ls /wheels/pat_rlhf-*.whl)[workers]" \
 && /opt/venv/bin/python -c "import torch; assert torch.version.cuda, 'torch has no CUDA'; print(torch.__version__)"

# pat-worker: `pat trainer`, `pat generator`, `pat prepare`. The runtime interpreter only (no venv module, no pip
# of the system, no compilers), the venv, and a numeric user; Ubuntu's own user 1000 (ubuntu) makes way for it.
FROM ${CUDA_IMAGE} AS pat-worker
ARG VERSION
LABEL org.opencontainers.image.title="pat-worker" \
      org.opencontainers.image.description="PAT: trainer and generator pods (torch, CUDA 12.8)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/pat-rlhf/pat-rlhf" \
      org.opencontainers.image.licenses="Apache-2.0"
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && (userdel --remove ubuntu 2>/dev/null || true) \
 && groupadd --gid 1000 pat \
 && useradd --uid 1000 --gid 1000 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin pat
COPY --from=worker-venv /opt/venv /opt/venv
ENV PATH="/opt/venv/bin:${PATH}" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 1000:1000
CMD ["pat"]

# worker-vllm-venv: vLLM first, with the torch it pins, then the package with the workers extra constrained to that
# torch (so that nothing replaces it). On the CUDA base, as worker-venv, for the same interpreter path.
FROM ${CUDA_IMAGE} AS worker-vllm-venv
ARG VLLM_VERSION
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
COPY --from=wheel /wheels /wheels
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir "vllm==${VLLM_VERSION}" \
 && /opt/venv/bin/pip freeze | grep -i '^torch==' > /tmp/torch.txt \
 && /opt/venv/bin/pip install --no-cache-dir --prefer-binary --constraint /tmp/torch.txt \
      "$(ls /wheels/pat_rlhf-*.whl)[workers]" \
 && /opt/venv/bin/python -c "import torch, vllm; assert torch.version.cuda, 'no CUDA'; print(vllm.__version__)"

# pat-worker-vllm: the generator pods of engine vllm (`pat generator --engine vllm`, and `pat prepare`), laid out as
# pat-worker. Beside the runtime interpreter it has what Triton and torch.compile need at run time to build their
# kernel launchers, a C compiler and the Python headers (vLLM compiles its model at start): the one final stage
# with them, and nothing else of a toolchain (tests/unit/test_images.py allows exactly these here).
FROM ${CUDA_IMAGE} AS pat-worker-vllm
ARG VERSION
ARG VLLM_VERSION
LABEL org.opencontainers.image.title="pat-worker-vllm" \
      org.opencontainers.image.description="PAT: generator pods with vLLM ${VLLM_VERSION} (engine vllm; CUDA)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/pat-rlhf/pat-rlhf" \
      org.opencontainers.image.licenses="Apache-2.0"
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 gcc libc6-dev python3-dev \
 && rm -rf /var/lib/apt/lists/* \
 && (userdel --remove ubuntu 2>/dev/null || true) \
 && groupadd --gid 1000 pat \
 && useradd --uid 1000 --gid 1000 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin pat
COPY --from=worker-vllm-venv /opt/venv /opt/venv
ENV PATH="/opt/venv/bin:${PATH}" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 1000:1000
CMD ["pat"]
