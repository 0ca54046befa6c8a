"""Built shards: the source, the loader's feed of epochs, standalone iteration, streams and reading."""
