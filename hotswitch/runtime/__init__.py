"""The compiled model at run time: `CompiledModel` (ExecGraphs per config and input shape, local
shards, switching, gradient accumulation) and `pipeline` (stage programs, GPipe and 1F1B)."""
