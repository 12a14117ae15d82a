# The README's commands. Each creates .venv (and installs the project into it) when missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
UV     := $(VENV)/bin/uv

.PHONY: install data demo test lint docs browser nginx simulate deploy compose-demo compose-twin compose-test compose-tools device-check arm64-device clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# uv installs the packages pip would (benchmarks/install_time.py checks), downloading in parallel and linking its
	# cache's files: 1.9x faster than pip with nothing cached, 3.9x once it is (CI's setup 56 s against 161 s with pip,
	# BENCHMARKS "CI's time"). Bytecode compiled, since processes here may not write it (PYTHONDONTWRITEBYTECODE): each
	# would compile what it imports. uv does not read pip's config: a package mirror is UV_DEFAULT_INDEX.
	$(PY) -m pip install --quiet uv==0.13.9
	$(UV) pip install --quiet --python $(PY) --compile-bytecode -e '.[test]'
	# Animal-MNIST's data ships in its wheel; its declared deps (tensorflow, ...) are not needed to read it.
	$(UV) pip install --quiet --python $(PY) --no-deps animal-mnist==0.4
	touch $(STAMP)

install: $(STAMP)

# Fashion-MNIST, the papers' dataset (configs/feddle-fmnist): Debian's package puts the original idx files in
# /usr/share/datasets/fashion-mnist/, where the loader looks when data-root lacks them.
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
data:
	@if [ -f $(FMNIST) ]; then echo "Fashion-MNIST: $(dir $(FMNIST))"; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		apt-get install -y dataset-fashion-mnist || { apt-get update && apt-get install -y dataset-fashion-mnist; }; \
	else echo "Fashion-MNIST: run 'sudo apt-get install dataset-fashion-mnist' (Debian/Ubuntu), or download the four" \
		"idx files from https://github.com/zalandoresearch/fashion-mnist (data/fashion) into data/fashion-mnist/"; \
		exit 1; fi

# (1) the main job: Feddle-ID on digits with `flwr run .` (local simulation); ARGS='num-rounds=5 ...'
demo: $(STAMP)
	$(VENV)/bin/hybridfl run --mode simulation $(ARGS)

# (2) the whole test suite (unit + end-to-end), on TEST_WORKERS processes (pytest-xdist; one torch thread each:
# tests/conftest.py; the tests of one xdist_group on one worker); PYTEST_ARGS='-m "not e2e"' for the fast part
# only, TEST_WORKERS=0 for one process
TEST_WORKERS ?= 3
# ruff, configured in pyproject.toml ([tool.ruff]); CI runs it before the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP) browser nginx
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# Debian's Chromium, for the test that opens the documentation site in a real browser (tests/test_site.py): installed
# as root where apt is; elsewhere that test skips (CI sets HYBRIDFL_REQUIRE_BROWSER=1: it fails instead)
browser:
	@command -v chromium >/dev/null || ! { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; } || \
		apt-get install -y chromium || { apt-get update && apt-get install -y chromium; }

# Debian's nginx, the edge proxy that the deployment tutorial's test and the compose twin run natively
# (tests/test_tutorial.py, tests/test_compose.py): installed as root where apt is; elsewhere those tests skip (CI fails)
nginx:
	@test -e /usr/lib/nginx/modules/ngx_stream_module.so || ! { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; } || \
		apt-get install -y nginx libnginx-mod-stream || { apt-get update && apt-get install -y nginx libnginx-mod-stream; }

# The documentation site (mkdocs.yml) into site/, every warning an error: a broken link or a page missing fails
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# Local deployment: one SuperLink and N SuperNodes on loopback, TLS and SuperNode authentication (ARGS=--plain-http
# drops them, and warns); ARGS='--supernodes 3 num-rounds=5'
deploy: $(STAMP)
	$(VENV)/bin/hybridfl run --mode deployment $(ARGS)

# Docker: docker/compose.yml up (app image built), the main job run through it, outputs copied to
# outputs/compose/. Secure by default (TLS, SuperNode authentication, the Runtime APIs' secrets, made in
# docker/certs/); PLAIN_HTTP=1 drops TLS and node authentication (it warns), GPU=1 adds the CUDA ServerApp,
# HOST=1 host networking (docker/host-network.yml), FLOWER_DEVICES=1 Flower's own device processes instead of the
# warm ones (docker/flower-devices.yml). Needs a Docker engine.
compose-demo: $(STAMP)
	$(PY) -m hybridfl.launch.compose demo $(if $(PLAIN_HTTP),--plain-http) $(if $(GPU),--gpu) $(if $(HOST),--host-network) $(if $(FLOWER_DEVICES),--flower-devices) $(ARGS)

# The same compose files without Docker: every service's command started natively on loopback
compose-twin: $(STAMP)
	$(PY) -m tools.compose_twin $(if $(PLAIN_HTTP),--plain-http) $(if $(FLOWER_DEVICES),--flower-devices) $(ARGS)

# docker/ on a real Docker engine of its own (root; installs docker.io, debootstrap and the Compose v2 plugin from
# Debian's packages, builds every image offline): the main job, a SuperLink restart, TLS + node auth. Skips where
# no engine can start; COMPOSE_TEST_ARGS=--require (CI) fails instead.
compose-test: $(STAMP)
	$(PY) -m tools.compose_engine $(COMPOSE_TEST_ARGS)

# The tools compose-test installs (docker.io, debootstrap, the Compose v2 plugin), alone
compose-tools: $(STAMP)
	$(PY) -m tools.compose_engine --tools-only

# A device's install (requirements/device.txt: a SuperNode running the ClientApp) resolved for Linux DEVICE_ARCH by uv
# (pip evaluates environment markers on this machine's, so it cannot resolve for another), then every wheel of that
# resolution downloaded, binary only, into DEVICE_WHEELS/DEVICE_ARCH: fails when one has no wheel there. Prints their
# count and size. uv comes in a venv of its own (DEVICE_CHECK_VENV), not the project's.
DEVICE_CHECK_VENV ?= /tmp/hybridfl-device-check-venv
DEVICE_WHEELS     ?= /tmp/hybridfl-device-wheels
# the device's machine and its glibc's minor version, the newest manylinux_2_N its wheels may need (28: torch's; Debian
# 11+, Ubuntu 20.04+). uv takes the newest, pip every one it may pick (it does not go down from the one it is given).
DEVICE_ARCH       ?= aarch64
DEVICE_GLIBC      ?= 28
device-check:
	test -x $(DEVICE_CHECK_VENV)/bin/uv || { $(PYTHON) -m venv $(DEVICE_CHECK_VENV) && \
		$(DEVICE_CHECK_VENV)/bin/pip install --quiet uv; }
	mkdir -p $(DEVICE_WHEELS)/$(DEVICE_ARCH)
	$(DEVICE_CHECK_VENV)/bin/uv pip compile --quiet --no-header --only-binary :all: --python-version 3.11 \
		--python-platform $(DEVICE_ARCH)-manylinux_2_$(DEVICE_GLIBC) requirements/device.txt \
		-o $(DEVICE_WHEELS)/$(DEVICE_ARCH)/device.lock
	$(DEVICE_CHECK_VENV)/bin/pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
		--implementation cp $(foreach n,$(shell seq 17 $(DEVICE_GLIBC)),--platform manylinux_2_$(n)_$(DEVICE_ARCH)) \
		--platform manylinux2014_$(DEVICE_ARCH) -d $(DEVICE_WHEELS)/$(DEVICE_ARCH) \
		-r $(DEVICE_WHEELS)/$(DEVICE_ARCH)/device.lock
	@cd $(DEVICE_WHEELS)/$(DEVICE_ARCH) && echo "$(DEVICE_ARCH) (manylinux_2_$(DEVICE_GLIBC)):" \
		"$$(grep -c '^[a-z0-9]' device.lock) packages resolved, $$(ls *.whl | wc -l) wheels," \
		"$$(du -ch *.whl | tail -1 | cut -f1) in $(DEVICE_WHEELS)/$(DEVICE_ARCH)"

# A device of another architecture: a SuperNode in a Debian arm64 userland (debootstrap; run under qemu-user-static
# through binfmt_misc) joins a SuperLink on this machine beside a native one, and both train a short run to the end,
# per model; their peak RSS and install size (benchmarks/arm64_device.py, rows appended to
# benchmarks/results/arm64_device.jsonl). Root, Debian/Ubuntu (apt-get install qemu-user-static binfmt-support
# debootstrap dataset-fashion-mnist). The userland, its venv and the wheels (~13 GB) are cached in
# /var/cache/hybridfl-arm64: the first build takes ~15 min on 2 cores, then ~5 min per model. ARGS='--models digits'
arm64-device: $(STAMP)
	$(PY) -m benchmarks.arm64_device $(ARGS)

clean:
	rm -rf $(VENV) .flwr outputs .pytest_cache site
