"""Scale-out on one engine: tensor parallelism (a group of ranks, each holding a slice of the model
and of the KV cache) and the executors that start those ranks (processes, Ray actors, torchrun)."""
