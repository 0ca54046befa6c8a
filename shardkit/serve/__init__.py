"""`shardkit serve`: a data service. A dispatcher routes consumers to workers; each worker builds the loader of
a consumer's rank and streams its batches over Arrow Flight (see docs/SERVICE.md). The consumer is a source of the
loaders (`shardkit.loaders.sources.service`); this package uses the loaders' public API only."""
