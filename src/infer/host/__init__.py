"""What infer asks of the machine, without torch's models: matrix products in free shapes or fixed row
tiles (`rows`), memory handed back to the system (`pages`), file mappings as tensors (`filemap`) and
OpenMP worker pools (`threads`). Nothing is imported here: each module by its own name."""
