"""`shardkit inspect`, `shardkit verify` and `shardkit cat`: look at a dataset from the command line.

Each command's options are the fields of its dataclass (`InspectOptions`, `VerifyOptions`, `CatOptions`). Only
light modules are imported at module level: the CLI builds its parser from this module on every start, and
`inspect` must answer in well under a second, so numpy, fsspec and the shard formats load inside the
commands (and torch never).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

from shardkit.options import (Namespace, add_command, format_size, given_values, option, parse_storage_options,
                              storage_options_option)


@dataclass(frozen=True, kw_only=True)
class DatasetOptions:
    """The dataset every one of these commands reads."""

    url: str = option(help="dataset prefix: a local path or any fsspec URL (file://, memory://, s3://bucket/prefix, "
                           "...)", positional=True, metavar="URL")
    storage_options: str | None = storage_options_option()


@dataclass(frozen=True, kw_only=True)
class InspectOptions(DatasetOptions):
    json: bool = option(False, "print one JSON object instead of a table")
    shards: bool = option(False, "also list every shard (name, samples, tokens, bytes)")
    plot: str | None = option(None, "also draw the sample-length histogram and tokens per source into PNG (reads "
                                    "shards)", metavar="PNG")
    plot_shards: int = option(64, "with --plot: read at most N shards, spread evenly over the dataset", metavar="N")


@dataclass(frozen=True, kw_only=True)
class VerifyOptions(DatasetOptions):
    jobs: int = option(4, "shards checked at once (threads)", flags=("--jobs", "-j"), metavar="N")
    progress: bool = option(True, "show a progress bar on stderr")
    quarantine_list: str | None = option(
        None, "also write the bad shards (name, SHA-256, URL, reason) to FILE as JSON, an empty list when all are "
              "good: a run leaves them out of its order with --quarantine-list FILE", metavar="FILE")


@dataclass(frozen=True, kw_only=True)
class CatOptions(DatasetOptions):
    index: int = option(help="global sample index", flags=("--index", "-i"), metavar="N")
    decode: bool = option(False, "print text (needs the tokenizer; see --tokenizer)")
    tokenizer: str | None = option(None, "tokenizer spec for --decode (default: the manifest's tokenizer name), e.g. "
                                         "byte, a tokenizer.json path or tiktoken:cl100k_base", metavar="SPEC")
    force: bool = option(False, "decode even with a tokenizer whose identity (name, vocab size, vocab SHA-256) "
                                "differs from the manifest's (the text is then likely wrong)")
    json: bool = option(False, "print one JSON object")


# name, options, help, description of each command (it runs `run_NAME`)
COMMANDS = (
    ("inspect", InspectOptions, "summarise a dataset from its manifest (shards, samples, tokens, sizes, tokenizer)",
     "Print what a dataset holds, from its manifest alone (no shard is read): shards, samples, tokens, compressed "
     "and raw bytes, compression ratio, token dtype, sequence length, packing and tokenizer."),
    ("verify", VerifyOptions, "re-read every shard and check it against the manifest",
     "Re-read every shard and check its size and SHA-256 against the manifest, then decode it and check its "
     "sample/token counts, token ids (< vocab_size) and sample lengths. Exit status 0 when every shard is good, 1 "
     "when any is bad (each bad shard is listed with the reason), 2 when the manifest itself cannot be read."),
    ("cat", CatOptions, "print one sample as token ids, or as text with --decode",
     "Print sample N of the dataset (global index over all shards in manifest order; negative counts from the end) "
     "as token ids, or as text with --decode, with its document segments when the shards store them. The shard is "
     "verified (SHA-256) before anything is printed."),
)


def register(subparsers: Any) -> None:
    """Add the inspect, verify and cat subcommands to the `shardkit` parser."""
    runs = {"inspect": run_inspect, "verify": run_verify, "cat": run_cat}
    for name, options, help_text, description in COMMANDS:
        # Plain flags (`--json`, `--no-progress`): a `--flag [BOOL]` would swallow a following URL.
        add_command(subparsers, name, runs[name], options=[options], bool_values=False, help=help_text,
                    description=description)


def _fail(command: str, message: str, status: int = 2) -> int:
    print(f"shardkit {command}: error: {message}", file=sys.stderr)
    return status


def _open(options: DatasetOptions):
    """(storage, manifest) of the dataset, or raise ValueError/OSError with a clear message."""
    from shardkit.manifest import load_manifest
    from shardkit.storage import Storage

    storage = Storage(options.url, parse_storage_options(options.storage_options))
    return storage, load_manifest(storage)


# -- inspect --------------------------------------------------------------------------------------

def describe(manifest, url: str, *, shards: bool = False) -> dict[str, Any]:
    """The facts `inspect` shows, as a JSON-ready dict."""
    totals = manifest.totals()
    with_docs = sum(s.has_doc_boundaries for s in manifest.shards)
    info: dict[str, Any] = {
        "url": url,
        "format_version": manifest.format_version,
        "shardkit_version": manifest.shardkit_version,
        "shard_format": manifest.shard_format,
        "token_dtype": manifest.token_dtype,
        "seq_len": "variable" if manifest.seq_len is None else manifest.seq_len,
        "sample_length": manifest.sample_length,
        "max_sample_tokens": manifest.max_sample_tokens,
        "packing": manifest.packing,
        "tokenizer": {**vars(manifest.tokenizer), "special_ids": dict(manifest.tokenizer.special_ids)},
        "compression": dict(manifest.compression),
        "totals": totals,
        "compression_ratio": round(totals["raw_bytes"] / totals["compressed_bytes"], 4) if totals["compressed_bytes"] else None,
        "shards_with_doc_boundaries": with_docs,
        "sources": list(manifest.sources),
        "build": manifest.build,
    }
    if shards:
        info["shards"] = [vars(s).copy() for s in manifest.shards]
    return info


def format_table(info: dict[str, Any]) -> str:
    """Human-readable rendering of `describe`'s dict."""
    t, tok = info["totals"], info["tokenizer"]
    if info["seq_len"] == "variable":
        seq = f"variable (at most {info['max_sample_tokens']:,} tokens per sample)" if info["max_sample_tokens"] else "variable"
    else:
        seq = f"{info['seq_len']:,}" + (f" (samples of {info['sample_length']:,} tokens)" if info["sample_length"] else "")
    specials = [f"{k}={tok[k]}" for k in ("eos_id", "bos_id", "pad_id") if tok[k] is not None]
    specials += [f"{k}={v}" for k, v in sorted(tok["special_ids"].items())]
    level = info["compression"].get("level")
    ratio = f"{info['compression_ratio']:.2f}x" if info["compression_ratio"] else "n/a"
    rows = [
        ("dataset", info["url"]),
        ("shard format", f"{info['shard_format']} (manifest v{info['format_version']}, written by shardkit {info['shardkit_version']})"),
        ("shards", f"{t['shards']:,}"),
        ("samples", f"{t['samples']:,}"),
        ("tokens", f"{t['tokens']:,}"),
        ("compressed", format_size(t["compressed_bytes"], exact=True)),
        ("raw", format_size(t["raw_bytes"], exact=True)),
        ("compression", f"{ratio} (zstd{'' if level is None else f' level {level}'})"),
        ("token dtype", info["token_dtype"]),
        ("seq_len", seq),
        ("packing", info["packing"]),
        ("tokenizer", f"{tok['kind']} {tok['name']!r}, vocab {tok['vocab_size']:,}"),
        ("special ids", ", ".join(specials) or "none"),
        ("vocab sha256", tok["vocab_sha256"] or "n/a (built-in)"),
        ("doc boundaries", f"stored in {info['shards_with_doc_boundaries']:,} of {t['shards']:,} shards"),
        ("sources", f"{len(info['sources']):,}" + (f": {', '.join(info['sources'][:5])}" + (", ..." if len(info["sources"]) > 5 else "")
                                                   if info["sources"] else "")),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if "shards" in info:
        lines.append("")
        header = ("shard", "samples", "tokens", "compressed", "raw", "docs")
        body = [(s["name"], f"{s['samples']:,}", f"{s['tokens']:,}", f"{s['compressed_bytes']:,}", f"{s['raw_bytes']:,}",
                 "yes" if s["has_doc_boundaries"] else "no") for s in info["shards"]]
        widths = [max(len(r[c]) for r in [header, *body]) for c in range(len(header))]
        for row in [header, *body]:
            lines.append("  ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def run_inspect(namespace: Namespace) -> int:
    try:
        args = InspectOptions(**given_values(namespace, InspectOptions))
        storage, manifest = _open(args)
    except (ValueError, OSError) as err:
        return _fail("inspect", str(err))
    info = describe(manifest, storage.display_url, shards=args.shards)
    print(json.dumps(info, indent=1, sort_keys=True) if args.json else format_table(info))
    if args.plot:
        return _plot_dataset(args, storage, manifest)
    return 0


def _plot_dataset(args: InspectOptions, storage, manifest) -> int:
    from shardkit.formats import ShardReader
    from shardkit.train.plot import plot_dataset

    if args.plot_shards < 1:
        return _fail("inspect", f"--plot-shards must be >= 1, got {args.plot_shards}")
    count = len(manifest.shards)
    chosen = sorted({i * count // min(count, args.plot_shards) for i in range(min(count, args.plot_shards))})
    arrays = (ShardReader.from_bytes(storage.read_bytes(manifest.shards[i].name, size=manifest.shards[i].compressed_bytes),
                                     shard=manifest.shards[i], manifest=manifest).arrays for i in chosen)
    try:
        drawn = plot_dataset(arrays, sources=tuple(manifest.sources), title=storage.display_url, output=args.plot)
    except (ValueError, OSError) as err:
        return _fail("inspect", str(err), status=1)
    print(f"wrote {args.plot} ({drawn['samples']:,} samples of {drawn['shards']} of {count} shards)", file=sys.stderr)
    return 0


# -- verify ---------------------------------------------------------------------------------------

def run_verify(namespace: Namespace) -> int:
    try:
        args = VerifyOptions(**given_values(namespace, VerifyOptions))
        if args.jobs < 1:
            return _fail("verify", f"--jobs must be >= 1, got {args.jobs}")
        storage, manifest = _open(args)
    except (ValueError, OSError) as err:
        return _fail("verify", str(err))
    from tqdm import tqdm

    from shardkit.verify import verify_dataset

    bad = 0
    with tqdm(total=len(manifest.shards), unit="shard", desc="verify", file=sys.stderr,
              disable=not args.progress, dynamic_ncols=True) as bar:
        def advance(shard, reason) -> None:
            nonlocal bad
            bad += reason is not None
            bar.set_postfix(bad=bad, refresh=False)
            bar.update(1)
        problems = verify_dataset(storage, manifest, jobs=args.jobs, on_shard_checked=advance)
    totals = manifest.totals()
    if args.quarantine_list is not None:
        from shardkit.verify import write_quarantine_list

        try:
            write_quarantine_list(args.quarantine_list, storage, manifest, problems)
        except OSError as err:
            return _fail("verify", f"cannot write --quarantine-list {args.quarantine_list}: {err.strerror or err}")
        print(f"wrote {args.quarantine_list} ({len(problems)} bad shards)", file=sys.stderr)
    if not problems:
        print(f"OK: {totals['shards']:,} shards, {totals['samples']:,} samples, {totals['tokens']:,} tokens "
              f"match the manifest of {storage.display_url}")
        return 0
    for problem in problems:
        print(f"BAD {problem.shard}: {problem.reason}")
    print(f"FAILED: {len(problems):,} of {totals['shards']:,} shards of {storage.display_url} are bad", file=sys.stderr)
    return 1


# -- cat ------------------------------------------------------------------------------------------

def locate(manifest, index: int) -> tuple[int, int]:
    """(shard position, index within the shard) of global sample `index` (negative counts from the end)."""
    from shardkit.lineage import locate_samples

    total = manifest.num_samples
    if not -total <= index < total:
        raise IndexError(f"sample {index} is out of range: the dataset holds {total:,} samples")
    [(position, local)] = locate_samples(manifest, [index % total])
    return position, local


def _load_tokenizer(spec: str):
    try:
        from shardkit.text.tokenizers import load_tokenizer
    except ImportError as err:
        raise RuntimeError(f"--decode needs shardkit's tokenizer module (shardkit.text.tokenizers) and the tokenizers "
                           f"extra: pip install 'shardkit[tokenizers]' ({err})") from err
    try:
        return load_tokenizer(spec)
    except (OSError, ValueError) as err:
        raise RuntimeError(f"cannot load tokenizer {spec!r} ({err}); pass --tokenizer SPEC") from err


def tokenizer_differences(info, expected) -> list[str]:
    """How a loaded tokenizer's identity differs from the manifest's, as 'field: tokenizer X, dataset Y'.

    The vocabulary hash decides where both sides have one; built-in tokenizers (no vocabulary file)
    are compared by kind and name. The vocabulary size must always agree.
    """
    if info is None:
        return ["the tokenizer states no identity"]
    fields = ["vocab_size"]
    fields += ["vocab_sha256"] if info.vocab_sha256 and expected.vocab_sha256 else ["kind", "name"]
    return [f"{name}: tokenizer {getattr(info, name)!r}, dataset {getattr(expected, name)!r}"
            for name in fields if getattr(info, name) != getattr(expected, name)]


def run_cat(namespace: Namespace) -> int:
    try:
        args = CatOptions(**given_values(namespace, CatOptions))
        storage, manifest = _open(args)
        position, local = locate(manifest, args.index)
    except (ValueError, OSError, IndexError) as err:
        return _fail("cat", str(err))
    from shardkit.formats.fetch import read_shard
    from shardkit.formats.reader import ShardReader

    shard = manifest.shards[position]
    try:
        reader = read_shard(storage, shard, decode=lambda data: ShardReader.from_bytes(
            data, shard=shard, manifest=manifest, verify=False))
    except (ValueError, OSError) as err:
        return _fail("cat", str(err), status=1)
    from shardkit.lineage import sample_segments

    tokens = [int(t) for t in reader.sample(local).tokens]
    segments = [{"start": s.start, "end": s.end, "source": s.source, "source_name": s.source_name, "document": s.doc}
                for s in sample_segments(manifest, reader.arrays, local)]
    texts = None
    if args.decode:
        spec = args.tokenizer or manifest.tokenizer.name
        try:
            tokenizer = _load_tokenizer(spec)
        except RuntimeError as err:
            return _fail("cat", str(err))
        differences = tokenizer_differences(getattr(tokenizer, "info", None), manifest.tokenizer)
        if differences and not args.force:
            return _fail("cat", f"tokenizer {spec!r} is not the one the dataset was built with ("
                                f"{'; '.join(differences)}): its text would be wrong. Pass the dataset's tokenizer "
                                "with --tokenizer, or --force to decode anyway")
        if differences:
            print(f"shardkit cat: warning: decoding with a different tokenizer ({'; '.join(differences)})",
                  file=sys.stderr)
        pieces = segments or [{"start": 0, "end": len(tokens)}]
        texts = [tokenizer.decode(tokens[p["start"]:p["end"]]) for p in pieces]
    if args.json:
        out: dict[str, Any] = {"index": args.index % manifest.num_samples, "shard": shard.name, "shard_index": local,
                               "num_tokens": len(tokens), "tokens": tokens, "segments": segments}
        if texts is not None:
            out["text"] = "".join(texts)
            if segments:
                out["segment_texts"] = texts
        print(json.dumps(out, ensure_ascii=False))
        return 0
    print(f"# sample {args.index % manifest.num_samples:,}: shard {shard.name}, sample {local:,} of {shard.samples:,}, "
          f"{len(tokens):,} tokens")
    for j, seg in enumerate(segments):
        where = seg["source_name"] or ("padding" if seg["source"] == -1 else f"source {seg['source']}")
        print(f"# segment {j}: tokens [{seg['start']}, {seg['end']}) from {where}, document {seg['document']}")
    if texts is None:
        print(" ".join(map(str, tokens)))
    elif segments:
        for j, text in enumerate(texts):
            print(f"--- segment {j} ---")
            print(text)
    else:
        print(texts[0])
    return 0
