"""A model assembled from a checkpoint's stored tensors: their names mapped to our parameters
(`names`), each module filled (`place`), the one walk over a model skeleton and its resident
destination (`build`), what a load was asked (`options`), GGUF matrices kept converted on disk
(`repack_cache`), and the Phase 1a weight maps (`weight_map`). Above the models and GGUF; below
the streamed and parallel builds, which walk the same builder. Nothing is imported here."""
