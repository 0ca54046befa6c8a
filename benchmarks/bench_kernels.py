"""The trainer's kernels, measured alone: the loss and document-masked attention (issue 31, item 4).

    python benchmarks/bench_kernels.py [--device cpu|cuda] [--runs 5] [--out bench_out/kernels.json]

loss: forward + backward of the output projection and cross-entropy for one micro-batch, today's path
(`lm_head`, then `F.cross_entropy(logits.float())`) against `shardkit.train.loss.linear_cross_entropy`:
median time over --runs and peak tensor memory above the inputs (CUDA: `torch.cuda.max_memory_allocated`;
CPU: torch's profiler's allocation timeline, tests/memory_peak.py). Defaults: gpt2-124m's head (d_model 768,
50304 rows) over 16 x 1024 tokens on CUDA in bf16 autocast; on CPU, in fp32, 1024 tokens and d_model 256
(the vocabulary, which sets the logits' size, stays 50304).

attention (CUDA only): one training step (forward, backward) of gpt2-124m at T = 2048, compiled blocks,
bf16, plain causal attention against document masking through flex_attention, documents of 1-1024 tokens
(median time over --runs); and the check that plain causal attention is eligible for SDPA's flash kernel:
a forward with only FLASH_ATTENTION allowed raises if it is not. On CPU the attention rows are skipped
(flex_attention has no backward there; the trainer keeps the dense mask on CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from memory_peak import peak_tensor_bytes  # noqa: E402  (torch's own allocation events, CPU)

from shardkit.train.config import ModelConfig, config_from_dict  # noqa: E402
from shardkit.train.loss import linear_cross_entropy  # noqa: E402
from shardkit.train.model import Transformer  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: torch.device, runs: int) -> float:
    fn()  # warm-up (and compilation)
    times = []
    for _ in range(runs):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak tensor bytes while `fn` runs, above what was allocated before it."""
    if device.type != "cuda":
        before = peak_tensor_bytes(lambda: None)
        return peak_tensor_bytes(fn) - before
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def bench_loss(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    tokens = args.tokens or (16 * 1024 if device.type == "cuda" else 1024)
    d_model = args.d_model or (768 if device.type == "cuda" else 256)
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(tokens, d_model, device=device, generator=gen).requires_grad_()
    weight = (torch.randn(args.vocab, d_model, device=device, generator=gen) * 0.02).requires_grad_()
    targets = torch.randint(0, args.vocab, (tokens,), device=device, generator=gen)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step(path: str) -> Callable[[], None]:
        def run() -> None:
            hidden.grad = weight.grad = None
            with autocast:
                if path == "plain":
                    loss = F.cross_entropy(F.linear(hidden, weight).float(), targets)
                else:
                    loss = linear_cross_entropy(hidden, weight, targets)
            loss.backward()
        return run

    rows = []
    for path in ("plain", "chunked"):
        rows.append({"kernel": "loss", "path": path, "device": device.type, "tokens": tokens,
                     "vocab": args.vocab, "d_model": d_model, "dtype": "bf16" if device.type == "cuda" else "fp32",
                     "time_ms": 1000 * timed(step(path), device, args.runs),
                     "peak_mib": peak_bytes(step(path), device) / 2**20})
    return rows


def _segments(batch: int, seq: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(batch):
        lengths = []
        while sum(lengths) < seq:
            lengths.append(int(torch.randint(1, 1025, (1,), generator=gen)))
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:seq])
    return torch.stack(rows).to(device)


def check_flash(model: Transformer, tokens: torch.Tensor) -> str:
    """'flash' when a forward with only the flash backend allowed runs, else why not."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            model(tokens)
    except RuntimeError as err:
        return f"not flash: {str(err).splitlines()[0]}"
    return "flash"


def bench_attention(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    seq, batch = 2048, args.attention_batch
    preset = config_from_dict({"preset": "gpt2-124m"}).model
    rows = []
    tokens = torch.randint(0, 50257, (batch, seq + 1), device=device)
    segments = _segments(batch, seq, device)
    for name, document_mask in (("causal", False), ("document_mask", True)):
        torch.manual_seed(0)
        config = ModelConfig(**{**preset.__dict__, "vocab_size": 50257, "seq_len": seq, "document_mask": document_mask})
        model = Transformer(config).to(device)
        flash = check_flash(model, tokens[:, :-1]) if not document_mask else "flex_attention"
        for block in model.blocks:
            block.compile()

        def step(model=model, document_mask=document_mask) -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(tokens[:, :-1], segments if document_mask else None, targets=tokens[:, 1:])
            loss.backward()
            model.zero_grad(set_to_none=True)

        rows.append({"kernel": "attention", "path": name, "device": device.type, "seq_len": seq, "batch": batch,
                     "attention": flash, "time_ms": 1000 * timed(step, device, args.runs),
                     "peak_mib": peak_bytes(step, device) / 2**20})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=None, help="loss: tokens per micro-batch")
    parser.add_argument("--d-model", type=int, default=None, help="loss: default 768 (CUDA), 256 (CPU)")
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--attention-batch", type=int, default=8, help="attention: samples of 2048 tokens")
    parser.add_argument("--out", default="bench_out/kernels.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = bench_loss(args, device)
    if device.type == "cuda":
        rows += bench_attention(args, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{torch.get_num_threads()} threads"
    print(f"device: {name}, torch {torch.__version__}")
    print(f"{'kernel':10} {'path':14} {'time ms':>9} {'peak MiB':>9}  notes")
    for row in rows:
        notes = {k: v for k, v in row.items() if k not in ("kernel", "path", "time_ms", "peak_mib", "device")}
        print(f"{row['kernel']:10} {row['path']:14} {row['time_ms']:9.1f} {row['peak_mib']:9.1f}  {notes}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": name, "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
