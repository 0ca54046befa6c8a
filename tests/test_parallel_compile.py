"""`--compile-mode`: the mode reaches torch.compile for every block, and CUDA graph modes are refused with a
one-line reason wherever they cannot run (by the options at once, by the resolved device and layout when the
model is built, and through the CLI as exit 2)."""

from __future__ import annotations

import pytest

from shardkit.train.config import ModelConfig, ParallelConfig, config_from_dict
from shardkit.train.model import Transformer
from shardkit.train.parallel import init_runtime, parallelize
from shardkit.train.parallel.compile import apply_compile, cuda_graph_refusal
from shardkit.train.parallel.mesh import ParallelDims

MODEL = ModelConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=16)


@pytest.mark.parametrize("mode, autotune, cudagraphs", [
    ("default", False, False), ("reduce-overhead", False, True), ("max-autotune", True, True),
    ("max-autotune-no-cudagraphs", True, False),
])
def test_the_mode_reaches_torch_compile_for_every_block(mode, autotune, cudagraphs):
    model = Transformer(MODEL)
    names = list(model.state_dict())
    apply_compile(model, mode)
    for block in model.blocks:
        options = block._compiled_call_impl.get_compiler_config()  # what inductor will compile the block with
        assert (options["max_autotune"], options["triton.cudagraphs"]) == (autotune, cudagraphs)
    assert list(model.state_dict()) == names


SINGLE = ParallelDims()


@pytest.mark.parametrize("device, dims, extra, reason", [
    ("cpu", SINGLE, {}, "CUDA graphs need a CUDA device, this run uses cpu"),
    ("cuda", ParallelDims(pp=2, pp_microbatches=2), {}, "the pipeline schedule"),
    ("cuda", ParallelDims(dp_shard=2), {}, "FSDP gathers"),
    ("cuda", ParallelDims(tp=2), {}, "tensor-parallel blocks"),
    ("cuda", SINGLE, {"activation_checkpointing": True}, "activation checkpointing replays"),
    ("cuda", SINGLE, {"document_mask": True}, "document block mask"),
])
def test_cuda_graphs_are_refused_with_the_reason(device, dims, extra, reason):
    flags = {"activation_checkpointing": False, "document_mask": False, **extra}
    for mode in ("reduce-overhead", "max-autotune"):
        refusal = cuda_graph_refusal(mode, device_type=device, dims=dims, **flags)
        assert refusal is not None and reason in refusal and f"--compile-mode {mode}" in refusal
        assert "\n" not in refusal
    for mode in ("default", "max-autotune-no-cudagraphs"):
        assert cuda_graph_refusal(mode, device_type=device, dims=dims, **flags) is None


@pytest.mark.parametrize("dims", [SINGLE, ParallelDims(dp_replicate=4)])
def test_cuda_graphs_are_allowed_on_one_gpu_and_with_ddp(dims):
    assert cuda_graph_refusal("reduce-overhead", device_type="cuda", dims=dims, activation_checkpointing=False,
                              document_mask=False) is None


def test_building_on_cpu_refuses_a_cuda_graph_mode(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    runtime = init_runtime(ParallelConfig(), device="cpu")
    with pytest.raises(ValueError, match="--compile-mode reduce-overhead captures CUDA graphs.*uses cpu"):
        parallelize(Transformer(MODEL), runtime, ParallelConfig(), param_dtype=None, compile=True,
                    activation_checkpointing=False, compile_mode="reduce-overhead")


@pytest.mark.parametrize("values, message", [
    ({"compile_mode": "max-autotune"}, "--compile-mode max-autotune needs --compile"),
    ({"compile": True, "compile_mode": "fast"}, "--compile-mode must be one of"),
    ({"compile": True, "compile_mode": "reduce-overhead", "grad_accum": 2}, "lose gradients accumulated"),
    ({"compile": True, "compile_mode": "reduce-overhead", "data": {"max_tokens": 256}}, "--max-tokens"),
])
def test_options_that_rule_out_the_mode_are_refused_naming_it(values, message):
    with pytest.raises(ValueError, match=message):
        config_from_dict(values)


def test_allowed_combinations_build_a_config():
    for values in ({"compile": True, "compile_mode": "reduce-overhead"},
                   {"compile": True, "compile_mode": "max-autotune-no-cudagraphs", "grad_accum": 4}):
        assert config_from_dict(values).compile.compile_mode == values["compile_mode"]


def test_the_cli_refuses_with_exit_2(tmp_path, capsys):
    from shardkit.cli import main

    assert main(["train", "--data", str(tmp_path), "--compile-mode", "reduce-overhead"]) == 2
    assert "--compile-mode reduce-overhead needs --compile" in capsys.readouterr().err
