"""What infer asks of the machine, without torch's models: matrix products in free shapes or in the
deterministic mode's fixed row tiles (`rows`), memory handed back to the system (`pages`), and the
OpenMP workers a thread frees when it hands its model work on (`threads`). Nothing is imported
here: each module is imported by its own name."""
