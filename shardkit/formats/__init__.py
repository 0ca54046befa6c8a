"""Shard formats (tar and Arrow IPC, both zstd), the decoded cache file, and shard reading/writing."""

from shardkit.formats.shard_bytes import SHARD_EXTENSIONS, EncodedShard, check_shard_bytes, decode_shard, encode_shard
from shardkit.formats.decoded import open_decoded, write_decoded
from shardkit.formats.fetch import SHARD_READS, read_shard
from shardkit.formats.reader import ShardReader, check_decoded
from shardkit.formats.sample import Sample, ShardArrays, arrays_from_samples, numpy_token_dtype
from shardkit.formats.tar_blocks import wds_samples
from shardkit.formats.tar_format import wds_decode_hook
from shardkit.formats.writer import ShardWriter, write_dataset

__all__ = [
    "SHARD_EXTENSIONS", "EncodedShard", "Sample", "ShardArrays", "ShardReader", "ShardWriter",
    "SHARD_READS", "arrays_from_samples", "check_decoded", "check_shard_bytes", "decode_shard", "encode_shard",
    "numpy_token_dtype", "open_decoded", "read_shard", "wds_decode_hook", "wds_samples", "write_dataset", "write_decoded",
]
