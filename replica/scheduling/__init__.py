"""Who runs in the next step: request objects, the continuous-batching scheduler and its batching
policies, the slot table and the paged block manager. Pure Python: no torch, no Ray, so the same
objects run in the engine and in the simulator."""
