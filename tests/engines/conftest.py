"""The engine tier: tests against the real engine packages, run by ci/engine_tier.sh in its own virtual
environment (.venv-engines). Where an engine is not installed (the main test environment) its directory
is not collected; the tier's script installs it, so there it always runs."""
import importlib.util

collect_ignore_glob = [f"{engine}/*" for engine in ("vllm", "sglang") if importlib.util.find_spec(engine) is None]
