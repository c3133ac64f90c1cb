# Two commands on a fresh machine of this kind (Debian 12, root, Python 3.12 via pyenv):
#   make run    runs the main job on the embedded defaults (local sandbox, scripted policy)
#   make test   runs the test suite
# Both set the machine up first (apt packages, the Python env); that step is cached.

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Real agents, pinned, for the tests that run them offline in sandboxes through the relay (each
# npm package ships a native binary): Codex speaks Responses, Claude Code Anthropic Messages.
# tests/test_relay_agents.py names the same folder.
AGENTS := $(VENV)/agents/codex-0.171.0+claude-code-2.1.197
AGENT_PACKAGES := @openai/codex@0.171.0 @anthropic-ai/claude-code@2.1.197

.PHONY: setup run test lint bench

# The base root filesystem of local sandboxes is built once (about a minute), then cached.
setup: $(STAMP) $(AGENTS)
	$(PY) -m backends.sandbox.rootfs

$(AGENTS):
	@command -v npm >/dev/null || { apt-get update -q \
	  && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends npm; }
	rm -rf $(AGENTS).part
	npm install -q --no-audit --no-fund --prefix $(AGENTS).part $(AGENT_PACKAGES)
	mv $(AGENTS).part $(AGENTS)

$(STAMP): pyproject.toml
	@command -v bwrap >/dev/null && command -v debootstrap >/dev/null && command -v socat >/dev/null \
	  && command -v mkfs.ext4 >/dev/null && command -v slirp4netns >/dev/null \
	  && command -v cc >/dev/null && test -f "$$(cc -print-file-name=libc.a)" \
	  && command -v chromium >/dev/null && fc-list | grep -q DejaVuSans \
	  && ldconfig -p | grep -q 'libseccomp\.so\.2 ' || \
	  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	      bubblewrap debootstrap socat e2fsprogs slirp4netns libseccomp2 gcc libc6-dev \
	      chromium fonts-dejavu-core; }
	@test -x $(PY) || python3.12 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade uv
	$(VENV)/bin/uv pip install -q --python $(PY) -e '.[dev,strands,openai-agents,parquet]'
	@touch $(STAMP)

run: setup
	$(VENV)/bin/backends run

test: setup
	$(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff format --check backends tests tasks
	$(VENV)/bin/ruff check backends tests tasks
	$(VENV)/bin/mypy

bench: setup
	for bench in tests/benchmarks/bench_*.py; do $(PY) $$bench || exit 1; done
