"""The engine tier: tests against the real engine packages, run by ci/engine_tier.sh in its own virtual
environment (.venv-engines). Each engine's tests live in ``with_<engine>/`` (a directory named after the
engine itself would shadow the package); where the engine is not installed (the main test environment)
that directory is not collected. The tier's script installs the engine, so there they always run."""
import importlib.util

collect_ignore = [f"with_{engine}" for engine in ("vllm", "sglang") if importlib.util.find_spec(engine) is None]
