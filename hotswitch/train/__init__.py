"""Mixed-length training with hot switching: `trainer` (hs.Trainer), `data` (buckets, packing,
micro-batches, datasets, the seeded sample order), `cost_model` (measured time and memory per
config and length), `loop` (one Trainer over a dataset, as the CLI and benchmarks run it)."""
