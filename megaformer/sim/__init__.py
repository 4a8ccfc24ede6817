"""The training step without its device: recorded from the real code on tensors that hold no data, then priced.

``ops`` records a step's aten operators (FLOPs, bytes, kernels, host reads); ``step`` runs the
Trainer's step functions on a config's model; ``roofline`` prices the record on a device and
lays host and device on one timeline; ``calibrate`` measures this CPU's constants.
``benchmarks/gpu_sim.py`` is the command.
"""
