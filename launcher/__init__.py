"""Turn each launch environment (SLURM, torchrun, the DeepSpeed launcher, one plain process,
local multi-process on a laptop) into one rank description, and start the job."""
