"""Models larger than one device: accelerate's layer placement (device_map) and tensor parallelism over
torch.distributed (parallel). Both load a checkpoint into a Transformer; neither knows the layers above."""
