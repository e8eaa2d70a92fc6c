"""Distributed torch.nn layers whose tensors are partitioned over a ProcessGrid."""
