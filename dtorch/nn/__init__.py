"""dtorch.nn: modules mirroring torch.nn."""
