# vllm-repro: make cpu-repro (the main job) and make test. Every target sets itself up.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
REPRO := $(BIN)/vllm-repro
SCENARIO ?= scenarios/vllm-23347-priority-preempt-scheduled.yaml
CATALOG ?=
# CATALOG=all also runs every entry on the newest release (it must be clean there); make test
# runs `vllm-repro doctor` on it. The lab's setting (settings.py NEWEST_RELEASE), read from there
NEWEST ?= $(or $(VLLM_REPRO_NEWEST),$(shell sed -n 's/^NEWEST_RELEASE = "\(.*\)"$$/\1/p' src/vllm_repro/settings.py))
JOBS ?=
REPORTS ?= reports
# Torch source (docs/settings.md): a local wheelhouse, or PyTorch's CPU index.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
TORCH_WHEEL_DIR ?=
export TORCH_VERSION TORCH_INDEX_URL TORCH_WHEEL_DIR
# Images (docs/images.md): the CPU image stands in for the CUDA one everywhere but a GPU host.
CPU_IMAGE ?= vllm-repro-cpu:latest
# the CPU image's title label (images/cpu/Dockerfile): after a build, the untagged earlier builds
# carrying it are removed (each held up to ~10 GB of the disk; only untagged images, never a tag)
CPU_IMAGE_LABEL = org.opencontainers.image.title=vllm-repro (CPU)
# what every stage of the CPU image's build carries (images/cpu/Dockerfile): the legacy builder
# keeps each stage that the image is not built on (the catalog stage) as an untagged image of its
# own (637 MB measured), which the title label above misses; removed after a build too
CPU_STAGE_LABEL = vllm-repro.stage
CUDA_IMAGE ?= vllm-repro-cuda:$(VLLM_VERSION)
VLLM_VERSION ?= 0.10.1.1
VLLM_VERSIONS ?= catalog
# the flagship image: only the releases SCENARIO names (#23347: 0.10.1.1 and 0.10.2, as slices)
FLAGSHIP_IMAGE ?= vllm-repro-cpu:flagship
# what rebuilds CPU_IMAGE when it is missing or stale: the flagship's releases for that tag
IMAGE_TARGET = $(if $(filter $(FLAGSHIP_IMAGE),$(CPU_IMAGE)),image-flagship,image-cpu)
BASE_IMAGE ?=
EXTRA_CA_CERT ?=
DOCKER ?= docker
DOCKER_BUILD_FLAGS ?=
# cpu-repro runs in the CPU image when it exists (make images), else here; RUNNER=docker|native
RUNNER ?= auto
# gpu-verify (docs/gpu-verify.md): BUNDLE= ships a `vllm-repro verify` bundle as it is;
# ACCEPT_NEW_HOST_KEY=1 trusts and records a host key ssh has never seen (never a changed one)
REMOTE ?=
PATCH ?=
BUNDLE ?=
ACCEPT_NEW_HOST_KEY ?=
GPU_IMAGE ?=
GPU ?=
GPU_MODEL ?=
VLLM ?=

.PHONY: venv lock docs docs-pictures compose-up lint cpu-repro cpu-repro-native cpu-repro-docker ensure-image test test-unit bench clean help \
	images image-cpu image-flagship image-cuda stage-images lint-images bench-image gpu-verify

help:
	@echo "make cpu-repro   reproduce the default catalog bug (vLLM #23347) on its releases"
	@echo "make cpu-repro CATALOG=all   the whole catalog (each entry also on NEWEST=$(NEWEST))"
	@echo "make test        ruff, the docs build, unit tests and the real-release scenario tests"
	@echo "make docs        the documentation into $(REPORTS)/site/ (make docs-pictures: its pictures from real runs)"
	@echo "make images      the CPU image (Docker); make cpu-repro RUNNER=docker|native"
	@echo "make compose-up  docker compose up (or docker-compose up): the catalog, then its pages on 127.0.0.1:8080"
	@echo "make gpu-verify REMOTE=host PATCH=fix.diff SCENARIO=...   confirm a fix on a GPU host"
	@echo "                 (BUNDLE=reports/verify/<id> ships a verified bundle; ACCEPT_NEW_HOST_KEY=1 trusts a new host)"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# the lab's own dependencies at the versions of requirements.lock (make lock writes it): the
# same on every machine, as each vLLM environment is pinned by its release's date
$(VENV)/.installed: pyproject.toml requirements.lock $(BIN)/python
	$(BIN)/python -m pip install -q -c requirements.lock -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

# requirements.lock from pyproject.toml: every dependency and extra (dev pulls them all), for
# every platform and Python from 3.10 on (uv pip compile --universal); run it after editing
# pyproject.toml's dependencies, and commit both. UV_LOCK_FLAGS: e.g. --upgrade.
UV_LOCK_FLAGS ?=
lock: $(BIN)/python
	[ -x $(BIN)/uv ] || $(BIN)/python -m pip install -q 'uv>=0.5'
	$(BIN)/uv pip compile pyproject.toml --extra dev --universal --python-version 3.10 \
	  --native-tls --quiet $(UV_LOCK_FLAGS) -o requirements.lock

REPRO_ARGS = $(if $(filter all,$(CATALOG)),catalog run --also-on $(NEWEST),run $(SCENARIO)) \
  $(if $(JOBS),--jobs $(JOBS)) --reports $(abspath $(REPORTS))

# RUNNER=auto picks once, and says so: docker when an engine answers and the CPU image exists
# (or `make images` is among the goals), else native; it never builds an image on its own.
cpu-repro:
	@runner="$(RUNNER)"; why=""; \
	if [ "$$runner" = auto ]; then \
	  if ! $(DOCKER) info >/dev/null 2>&1; then runner=native; why="no Docker engine answers"; \
	  elif $(DOCKER) image inspect $(CPU_IMAGE) >/dev/null 2>&1; then runner=docker; why="the image exists"; \
	  elif [ -n "$(filter images image-cpu image-flagship,$(MAKECMDGOALS))" ]; then runner=docker; why="make images was asked for"; \
	  else runner=native; why="no image $(CPU_IMAGE): make images builds it"; fi; \
	  why="RUNNER=auto: $$why; "; \
	fi; \
	case "$$runner" in \
	  docker) echo "cpu-repro: runner docker, image $(CPU_IMAGE) ($${why}RUNNER=native runs it here)" >&2; \
	          exec $(MAKE) --no-print-directory cpu-repro-docker;; \
	  native) echo "cpu-repro: runner native ($${why}RUNNER=docker runs it in $(CPU_IMAGE))" >&2; \
	          exec $(MAKE) --no-print-directory cpu-repro-native;; \
	  *) echo "cpu-repro: RUNNER=$$runner: expected docker, native or auto" >&2; exit 2;; \
	esac

# make turns any failing recipe into its own exit 2: name the tool's code (README, exit codes)
SAY_EXIT = case $$rc in 0) ;; 1) echo "cpu-repro: exit 1 (mismatch: an observation differs from its expectation)" >&2;; \
  2) echo "cpu-repro: exit 2 (input error)" >&2;; *) echo "cpu-repro: exit $$rc (environment or lab error)" >&2;; esac

cpu-repro-native: venv
	@start=$$(date +%s); $(REPRO) $(REPRO_ARGS); rc=$$?; \
	echo "cpu-repro: $$(( $$(date +%s) - start ))s wall"; $(SAY_EXIT); exit $$rc

# The image's lab and releases, this checkout's scenarios (mounted read-only at the same path,
# so paths and the table read as they do natively), a SCENARIO outside the checkout too (read-only,
# at its own path, when it exists: a missing one is the tool's exit 2); reports owned by the caller
# (VLLM_REPRO_UID too: started as root, the entrypoint would otherwise pick the image's user).
OUTSIDE_SCENARIOS = $(if $(filter all,$(CATALOG)),,$(foreach s,$(abspath $(SCENARIO)),$(if $(filter $(CURDIR)/%,$(s)),,$(s))))
cpu-repro-docker:
	@$(MAKE) --no-print-directory ensure-image || { echo "cpu-repro: exit 3 (environment or lab error)" >&2; exit 3; }
	@mkdir -p $(REPORTS); start=$$(date +%s); mounts=(); \
	for s in $(OUTSIDE_SCENARIOS); do [ -f "$$s" ] && mounts+=(-v "$$s:$$s:ro"); done; \
	$(DOCKER) run --rm $$([ -t 1 ] && echo -t) --user "$$(id -u):$$(id -g)" --network none \
	  -e VLLM_REPRO_UID="$$(id -u)" -e VLLM_REPRO_GID="$$(id -g)" \
	  -v "$(CURDIR):$(CURDIR):ro" "$${mounts[@]}" -v "$(abspath $(REPORTS)):$(abspath $(REPORTS))" -w "$(CURDIR)" \
	  $(CPU_IMAGE) $(REPRO_ARGS); rc=$$?; \
	echo "cpu-repro: $$(( $$(date +%s) - start ))s wall (in $(CPU_IMAGE))"; $(SAY_EXIT); exit $$rc

# The CPU image, built if missing or built from other lab sources than the checkout's: the image
# carries the content hash of what it was built from (label LAB_HASH_LABEL, images/lab-hash.sh),
# compared by content, not mtime, so a fresh clone of the same lab uses it as it is (exit 3 when
# it cannot be built).
# The hash covers only the slices of the releases the image bakes (its label RELEASES_LABEL:
# the VLLM_VERSIONS it was built with), so slicing another release leaves it current.
LAB_HASH_LABEL = vllm-repro.lab-hash
RELEASES_LABEL = vllm-repro.releases
ensure-image:
	@$(DOCKER) info >/dev/null 2>&1 || { echo "cpu-repro: no Docker engine answers ($(DOCKER) info failed); RUNNER=native runs it here" >&2; exit 3; }
	@have=$$($(DOCKER) image inspect -f '{{index .Config.Labels "$(LAB_HASH_LABEL)"}}' $(CPU_IMAGE) 2>/dev/null); \
	scope=$$($(DOCKER) image inspect -f '{{index .Config.Labels "$(RELEASES_LABEL)"}}' $(CPU_IMAGE) 2>/dev/null); \
	if [ -z "$$have" ]; then \
	  echo "cpu-repro: building $(CPU_IMAGE) first (once; make images)" >&2; \
	  $(MAKE) --no-print-directory $(IMAGE_TARGET) >&2 || { echo "cpu-repro: the CPU image did not build; RUNNER=native runs it here" >&2; exit 3; }; \
	elif [ "$$have" != "$$(sh images/lab-hash.sh $$scope)" ]; then \
	  echo "cpu-repro: the lab differs from the one $(CPU_IMAGE) was built from ($(LAB_HASH_LABEL) $$have); updating it (make images)" >&2; \
	  $(MAKE) --no-print-directory $(IMAGE_TARGET) >&2 || { echo "cpu-repro: the CPU image did not build; RUNNER=native runs it here" >&2; exit 3; }; \
	fi

# ---- images -------------------------------------------------------------------------------
images: image-cpu

# A build argument cannot read a host path: the CA bundle is staged into images/stage/ca and
# passed as a folder of the build context. The torch wheel of TORCH_WHEEL_DIR is staged (hardlinked
# when possible) into images/stage/index/torch, outside the build context: image-cpu serves that
# folder on 127.0.0.1 as a package index for the build (--network host), so the wheel is read by
# the step that installs it and never lands in a layer of its own (a COPY of it stayed in the
# image: 192 MB). The Dockerfile still takes a wheel from images/stage/wheels (a folder of the
# context, for `docker build` by hand); make images leaves it empty.
STAGED_INDEX = images/stage/index
# a fixed port keeps the build argument, and so the releases layer's cache, the same from one
# build to the next; a random free one when something listens on it (a port in TIME_WAIT after
# the last build's downloads is reused, as http.server does)
# A failed build leaves no container (--force-rm) and no catalog stage image (pruned by its
# label); the image of its last good step stays, as the cache of the next build, which removes
# it (the image's label) when it is not reused.
STAGED_INDEX_PORT ?= 47615
stage-images:
	@rm -f images/stage/ca/*.pem images/stage/wheels/*.whl $(STAGED_INDEX)/torch/*.whl
	@if [ -n "$(EXTRA_CA_CERT)" ]; then \
	  [ -f "$(EXTRA_CA_CERT)" ] || { echo "images: EXTRA_CA_CERT=$(EXTRA_CA_CERT): no such file" >&2; exit 2; }; \
	  cp "$(EXTRA_CA_CERT)" images/stage/ca/extra-ca.pem; echo "images: trusting $(EXTRA_CA_CERT)"; fi
	@if [ -n "$(TORCH_WHEEL_DIR)" ]; then \
	  for w in "$(TORCH_WHEEL_DIR)"/torch-$(TORCH_VERSION)+cpu-*.whl; do [ -f "$$w" ] || continue; \
	    mkdir -p $(STAGED_INDEX)/torch; \
	    ln -f "$$w" $(STAGED_INDEX)/torch/ 2>/dev/null || cp "$$w" $(STAGED_INDEX)/torch/; \
	    echo "images: torch from $$w (served to the build on 127.0.0.1)"; done; fi

image-cpu: stage-images
	@start=$$(date +%s); build_index=; net=; \
	if ls $(STAGED_INDEX)/torch/torch-*.whl >/dev/null 2>&1; then \
	  port=$(STAGED_INDEX_PORT); \
	  python3 -c 'import socket, sys; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", int(sys.argv[1])))' $$port 2>/dev/null || \
	    port=$$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'); \
	  python3 -m http.server --bind 127.0.0.1 --directory $(STAGED_INDEX) $$port >$(STAGED_INDEX)/.server.log 2>&1 & server=$$!; \
	  trap 'kill $$server 2>/dev/null' EXIT; \
	  up=0; for i in $$(seq 50); do \
	    python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1)' http://127.0.0.1:$$port/torch/ 2>/dev/null && { up=1; break; }; \
	    sleep 0.1; done; \
	  if [ "$$up" != 1 ]; then \
	    echo "images: the torch wheel's index on 127.0.0.1:$$port did not answer:" >&2; tail -5 $(STAGED_INDEX)/.server.log >&2; exit 3; fi; \
	  build_index="--build-arg TORCH_BUILD_INDEX_URL=http://127.0.0.1:$$port"; net="--network host"; \
	fi; \
	$(DOCKER) build --force-rm $(DOCKER_BUILD_FLAGS) $$net $$build_index -f images/cpu/Dockerfile -t $(CPU_IMAGE) \
	  --label $(LAB_HASH_LABEL)=$$(sh images/lab-hash.sh $(VLLM_VERSIONS)) --label "$(RELEASES_LABEL)=$(VLLM_VERSIONS)" \
	  $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) \
	  --build-arg TORCH_VERSION=$(TORCH_VERSION) --build-arg TORCH_INDEX_URL=$(TORCH_INDEX_URL) \
	  --build-arg VLLM_VERSIONS="$(VLLM_VERSIONS)" . || { \
	  $(DOCKER) image prune -f --filter "label=$(CPU_STAGE_LABEL)" >/dev/null 2>&1; exit 3; }; \
	echo "images: $(CPU_IMAGE) built in $$(( $$(date +%s) - start ))s, $$($(DOCKER) image inspect -f '{{.Size}}' $(CPU_IMAGE) | awk '{printf "%.2f GB", $$1/1e9}')"; \
	$(DOCKER) image prune -f --filter "label=$(CPU_IMAGE_LABEL)" 2>/dev/null | sed -n 's/^Total reclaimed space: \(.*[1-9].*\)/images: removed the untagged earlier builds of this image (\1)/p'; \
	$(DOCKER) image prune -f --filter "label=$(CPU_STAGE_LABEL)" 2>/dev/null | sed -n 's/^Total reclaimed space: \(.*[1-9].*\)/images: removed the untagged build stages (\1)/p'

# The CPU image with only SCENARIO's releases baked (docs/images.md: the flagship image);
# make cpu-repro RUNNER=docker CPU_IMAGE=$(FLAGSHIP_IMAGE) runs in it.
image-flagship:
	@$(MAKE) --no-print-directory image-cpu CPU_IMAGE=$(FLAGSHIP_IMAGE) VLLM_VERSIONS="$(SCENARIO)"

# The CUDA image of VLLM_VERSION (docs/images.md). Default base: vLLM's own image,
# vllm/vllm-openai:v$(VLLM_VERSION) (a GPU host pulls it, several GB). BASE_IMAGE=<a Python base>:
# full vLLM installed from the index with the dependencies of the release's day (EXCLUDE_NEWER,
# default: the release's upload time + 1 h from the index, as the CPU environments use; ~9 GB).
EXCLUDE_NEWER ?=
# The CUDA image takes torch from its base or with vLLM: no CPU torch wheel is staged or served
image-cuda: override TORCH_WHEEL_DIR =
image-cuda: stage-images $(if $(BASE_IMAGE),venv)
	@start=$$(date +%s); cutoff="$(EXCLUDE_NEWER)"; \
	if [ -n "$(BASE_IMAGE)" ] && [ -z "$$cutoff" ]; then \
	  cutoff=$$($(BIN)/python images/cuda/exclude_newer.py $(VLLM_VERSION)) || exit $$?; fi; \
	echo "image-cuda: vLLM $(VLLM_VERSION) on $(or $(BASE_IMAGE),vllm/vllm-openai:v$(VLLM_VERSION))$${cutoff:+, if installed there: dependencies as of $$cutoff}"; \
	$(DOCKER) build $(DOCKER_BUILD_FLAGS) -f images/cuda/Dockerfile -t $(CUDA_IMAGE) \
	  --build-arg VLLM_VERSION=$(VLLM_VERSION) $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) \
	  $${cutoff:+--build-arg EXCLUDE_NEWER=$$cutoff} \
	  $(if $(EXTRA_CA_CERT),--build-arg EXTRA_CA_CERT=images/stage/ca) . || exit 3; \
	echo "images: $(CUDA_IMAGE) built in $$(( $$(date +%s) - start ))s, $$($(DOCKER) image inspect -f '{{.Size}}' $(CUDA_IMAGE) | awk '{printf "%.2f GB", $$1/1e9}')"

# size, build time cold/warm, cpu-repro wall time in the image and natively (COLD=1: no-cache build)
bench-image: venv
	$(BIN)/python bench/image.py $(if $(COLD),--cold)

lint-images: venv
	$(BIN)/hadolint images/cpu/Dockerfile images/cuda/Dockerfile

# ---- GPU verification ---------------------------------------------------------------------
gpu-verify: venv
	@[ -n "$(REMOTE)" ] && [ -n "$(PATCH)$(BUNDLE)" ] || { echo "gpu-verify: give REMOTE=host PATCH=fix.diff [SCENARIO=... VLLM=... GPU_IMAGE=... GPU=none ACCEPT_NEW_HOST_KEY=1], or REMOTE=host BUNDLE=reports/verify/<bundle>" >&2; exit 2; }
	@case "$(ACCEPT_NEW_HOST_KEY)" in ""|0|1) ;; *) echo "gpu-verify: ACCEPT_NEW_HOST_KEY=$(ACCEPT_NEW_HOST_KEY): expected 1 (or nothing)" >&2; exit 2;; esac
	$(REPRO) gpu-verify $(if $(BUNDLE),--bundle $(BUNDLE),$(SCENARIO) --patch $(PATCH)) --remote $(REMOTE) --reports $(REPORTS) \
	  $(if $(VLLM),--vllm $(VLLM)) $(if $(GPU_IMAGE),--gpu-image $(GPU_IMAGE)) $(if $(GPU),--gpu $(GPU)) \
	  $(if $(GPU_MODEL),--model $(GPU_MODEL)) $(if $(filter 1,$(ACCEPT_NEW_HOST_KEY)),--accept-new-host-key)

# ruff (pyproject.toml [tool.ruff]) over everything the lab ships and tests
lint: venv
	$(BIN)/ruff check src tests bench images scripts

# doctor first: a release that breaks one of the lab's seams fails CI here, in a minute or two
test: venv lint docs
	$(REPRO) doctor $(NEWEST) --reports $(abspath $(REPORTS))/doctor
	$(BIN)/python -m pytest -q --junitxml=$(REPORTS)/junit.xml tests

# the documentation (mkdocs.yml, docs/), strict: a broken link or anchor fails; served beside
# the reports by `docker compose up` (reports/site/). No --quiet: it hides the warnings strict counts.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d $(abspath $(REPORTS))/site

# the pictures the docs show (docs/img/), from real runs: scripts/docs-pictures.sh
docs-pictures: venv
	scripts/docs-pictures.sh

# docker compose up (v2) or docker-compose up (v1), whichever is installed, as this user's own
# compose project (vllm-repro-<user>: two clones named alike on one host stay apart)
COMPOSE ?= $(shell if $(DOCKER) compose version >/dev/null 2>&1; then echo "$(DOCKER) compose"; elif command -v docker-compose >/dev/null; then echo docker-compose; fi)
compose-up:
	@[ -n "$(COMPOSE)" ] || { echo "compose-up: neither docker compose (v2) nor docker-compose (v1) is installed" >&2; exit 3; }
	COMPOSE_PROJECT_NAME=$${COMPOSE_PROJECT_NAME:-vllm-repro-$$(id -un)} $(COMPOSE) up

test-unit: venv
	$(BIN)/python -m pytest -q tests/unit

clean:
	rm -rf $(REPORTS) .pytest_cache
