"""Capacity planning: the real Scheduler and KVCacheManager driven by a step-time cost model
instead of a model forward (`pagedserve simulate`)."""
