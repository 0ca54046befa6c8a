"""Build accounting: counters, rejected-document examples, the progress bar, the report and summary table.

The report (`build_report.json`, next to the manifest) holds everything that is not deterministic
(timings, throughput, worker count) plus the full accounting of inputs: documents in = documents
written + documents rejected, with the rejections counted by reason and the first examples listed
with their file and line (or row / paragraph).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from shardkit import metrics
from shardkit.options import format_size
from shardkit.text.documents import reason_category
from shardkit.text.inputs import InputFile


@dataclass
class BuildStats:
    """Counters over the documents read so far (saved in checkpoints, so a resumed build counts all)."""

    documents_in: int = 0
    documents_written: int = 0
    documents_rejected: int = 0
    text_chars: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    examples: list[dict[str, Any]] = field(default_factory=list)
    file_errors: list[dict[str, Any]] = field(default_factory=list)
    max_examples: int = 20
    input_bytes: int = 0
    bytes_reached: dict[str, int] = field(default_factory=dict)
    unreadable_bytes: int = 0

    def reject(self, file: str, label: str, record: int, reason: str) -> None:
        self.documents_rejected += 1
        category = reason_category(reason)
        self.rejected_by_reason[category] = self.rejected_by_reason.get(category, 0) + 1
        metrics.inc("shardkit_build_documents_rejected_total", reason=category)
        if len(self.examples) < self.max_examples:
            self.examples.append({"file": file, label: record + 1, "reason": reason})

    def file_error(self, file: str, reason: str, *, unread_bytes: int) -> None:
        """A file that could not be read to its end: the documents in its `unread_bytes` cannot be counted,
        so its bytes are (the report's byte check: bytes in = bytes read + bytes unreadable)."""
        self.file_errors.append({"file": file, "reason": reason, "unread_bytes": unread_bytes})
        self.unreadable_bytes += unread_bytes

    def reached(self, source: int, offset: int) -> None:
        """Input bytes of file `source` read so far (as far as its units say)."""
        key = str(source)  # a JSON key in checkpoints
        self.bytes_reached[key] = max(self.bytes_reached.get(key, 0), offset)

    @property
    def bytes_read(self) -> int:
        return sum(self.bytes_reached.values())

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BuildStats:
        return cls(**data)


class Progress:
    """A tqdm bar over input bytes, with documents, tokens and tokens/s in its postfix."""

    def __init__(self, files: list[InputFile], *, enabled: bool, initial_bytes: int = 0):
        from tqdm import tqdm

        self.starts = []
        offset = 0
        for f in files:
            self.starts.append(offset)
            offset += f.size
        self.bar = tqdm(total=offset or None, initial=initial_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                        desc="build", disable=not enabled, file=sys.stderr, dynamic_ncols=True, smoothing=0.1)
        self.position = initial_bytes
        self.began = time.perf_counter()
        self.tokens = 0

    def update(self, source: int, offset: int, documents: int, tokens: int) -> None:
        position = self.starts[source] + offset if source < len(self.starts) else self.position
        if position > self.position:
            self.bar.update(position - self.position)
            metrics.inc("shardkit_build_input_bytes_total", position - self.position)
            self.position = position
        self.tokens = tokens
        elapsed = max(time.perf_counter() - self.began, 1e-9)
        self.bar.set_postfix_str(f"{documents:,} docs, {tokens:,} tokens, {tokens / elapsed / 1e6:.2f}M tok/s",
                                 refresh=False)

    def close(self) -> None:
        self.bar.close()


def summary_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    totals, docs, packing, timing = report["totals"], report["documents"], report["packing"], report["timing"]
    ratio = totals["raw_bytes"] / totals["compressed_bytes"] if totals["compressed_bytes"] else 0.0
    rows = [
        ("documents in", f"{docs['in']:,}"),
        ("documents written", f"{docs['written']:,}"),
        ("documents rejected", f"{docs['rejected']:,}" + (
            " (" + ", ".join(f"{k}: {v:,}" for k, v in sorted(docs["rejected_by_reason"].items())) + ")"
            if docs["rejected_by_reason"] else "")),
        ("unreadable files", f"{len(report['file_errors'])}" + (
            f" ({format_size(report['bytes']['unreadable'])} unread)" if report["file_errors"] else "")),
        ("document tokens", f"{packing['document_tokens']:,}"),
        ("samples", f"{totals['samples']:,}"),
        ("shards", f"{totals['shards']:,}"),
        ("bytes (stored)", format_size(totals["compressed_bytes"])),
        ("bytes (raw)", format_size(totals["raw_bytes"])),
        ("compression ratio", f"{ratio:.2f}x"),
        ("padding", f"{packing['padding_tokens']:,} tokens ({100 * packing['padding_fraction']:.2f}%)"),
        ("split documents", f"{packing['split_documents']:,}"),
        ("shards reused", f"{report['shards_from_before_resume']:,} (resumed)" if report.get("resumed") else "0"),
        ("wall time", f"{timing['seconds']:.1f} s" + (" (resumed)" if report.get("resumed") else "")),
        ("tokens/s", f"{timing['tokens_per_second'] / 1e6:.2f}M"),
    ]
    return rows


def summary_table(report: dict[str, Any]) -> str:
    rows = summary_rows(report)
    width = max(len(k) for k, _ in rows)
    lines = [f"{report.get('tool', 'shardkit build')}: {report['output']}"]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    if report["documents"]["examples"]:
        lines.append("  rejected (first examples):")
        for example in report["documents"]["examples"][:10]:
            where = ", ".join(f"{k} {v}" for k, v in example.items() if k not in ("file", "reason"))
            lines.append(f"    {example['file']} {where}: {example['reason']}")
    for error in report["file_errors"][:10]:
        lines.append(f"  unreadable: {error['file']}: {error['reason']}")
    nodes = report["timing"].get("units_per_node") or {}
    if len(nodes) > 1:  # a Ray cluster: which node tokenized how many units
        lines.append("  units per node: " + ", ".join(f"{node} {units:,}" for node, units in sorted(nodes.items())))
    lines.append(f"  check: documents in {report['documents']['in']:,} = written {report['documents']['written']:,}"
                 f" + rejected {report['documents']['rejected']:,}"
                 f" ({'holds' if report['documents']['balanced'] else 'DOES NOT HOLD'});"
                 f" input bytes {report['bytes']['in']:,} = read {report['bytes']['read']:,}"
                 f" + unreadable {report['bytes']['unreadable']:,}"
                 f" ({'holds' if report['bytes']['balanced'] else 'DOES NOT HOLD'})")
    return "\n".join(lines)


def report_json(report: dict[str, Any]) -> bytes:
    return (json.dumps(report, indent=1, sort_keys=True) + "\n").encode()
