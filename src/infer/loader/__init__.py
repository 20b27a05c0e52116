"""A checkpoint read, below the models that it knows nothing of: the config record and its reader
(`config`), the `WeightSource` Protocol every format implements (`source`), safetensors files
(`weights`) and the tokenizer (`tokenizer`). The model is assembled from them by `infer.assembly`;
the whole load path is `infer.loading`. Nothing is imported here."""
