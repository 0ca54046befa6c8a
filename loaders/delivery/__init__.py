"""How batches reach the training loop: topology, tensors, worker processes, framework guards."""
