"""Which sample goes where: pure functions and small objects (orders, partitions, mixtures, steps)."""
