"""Engine adapters: how a serving engine switches its DeepSeek-V4 attention onto dsv4_rocm through the
engine's own extension points. One subpackage per engine; each imports its engine lazily (the engine is an
optional dependency) and holds no kernels and no math: it translates the engine's metadata objects into
``dsv4_rocm.step.StepMetadata`` and calls the public ops (docs/integration.md says what a user types).
"""
