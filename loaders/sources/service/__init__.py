"""The consumer of a `shardkit serve` data service: `ServiceSource` and its feed."""
