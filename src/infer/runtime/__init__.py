"""What the engine drives: one generation step, eager, compiled or from a package (`step`), and
the static-batch loop of free functions the parity tests and benchmarks run (`generate`). Nothing
is imported here: each module is imported by its own name."""
