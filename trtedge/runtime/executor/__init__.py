"""Everything that owns the device: the model runner, CUDA graphs, the sampler, state rows, tensor parallelism."""
