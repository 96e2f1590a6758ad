"""Planning: the model registry, unit building, conversion, attach checks, summaries."""
