"""What the engine drives: one generation step, eager, compiled or from a package (`step`).
Nothing is imported here: each module is imported by its own name."""
